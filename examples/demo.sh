#!/usr/bin/env bash
# Quick start, part 1: installs what is missing, builds, and runs `dvr demo` on
# the default store ($DVR_STORE, else /dev/shm/dvr-$UID). Extra arguments go to
# the demo, e.g. `bash examples/demo.sh --size 4G`.
set -euo pipefail
cd "$(dirname "$0")/.."
./install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build >/dev/null
exec build/dvr demo "$@"
