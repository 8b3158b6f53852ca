#!/usr/bin/env bash
# Quick start, part 2: installs what is missing, builds, and runs the whole test
# suite — Catch2 unit tests and the pytest system tests (crashes, corruption,
# full disks, concurrency) — through CTest. Exits non-zero on any failure.
#
# The build shows its progress (ninja's status line on a terminal, a line per
# step otherwise) and prints nothing when everything is built already.
set -euo pipefail
cd "$(dirname "$0")/.."
./install-deps.sh
mkdir -p build
# Configured every time (the options may differ from an earlier build's);
# CMake's chatter goes to a log that only a failure shows.
if [[ ! -f build/build.ninja ]]; then
  echo "run.sh: configuring the build in build/ ..." >&2
fi
if ! cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDVR_WERROR=${DVR_WERROR:-ON} >build/configure.log 2>&1; then
  tail -n 40 build/configure.log >&2
  echo "run.sh: configuring the build failed (the whole log: build/configure.log)" >&2
  exit 1
fi
rm -f build/configure.log
if ! ninja -C build -n 2>/dev/null | grep -q '^ninja: no work to do'; then
  echo "run.sh: building (a few minutes the first time) ..." >&2
  NINJA_STATUS="[%f/%t %p] " cmake --build build
fi
ctest --test-dir build --output-on-failure -j2 "$@"
