#!/usr/bin/env bash
# Quick start, part 2: installs what is missing, builds, and runs the whole test
# suite — Catch2 unit tests and the pytest system tests (crashes, corruption,
# full disks, concurrency) — through CTest. Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
./install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDVR_WERROR=${DVR_WERROR:-ON} >/dev/null
cmake --build build
ctest --test-dir build --output-on-failure -j2 "$@"
