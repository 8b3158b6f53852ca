#!/usr/bin/env bash
# Quick start, part 2: installs what is missing, builds, and runs the whole test
# suite — Catch2 unit tests and the pytest system tests (crashes, corruption,
# full disks, concurrency) — through CTest. Exits non-zero on any failure.
#
# The build shows its progress (a line per step) and prints nothing when everything is built already.
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
# No dry run first: with CMake's CONFIGURE_DEPENDS globs, `ninja -n` always
# stops at "Re-running CMake". The build runs; its glob check and "no work to
# do" are dropped, so a build with nothing to do prints nothing.
NINJA_STATUS="[%f/%t %p] " cmake --build build 2>&1 | awk -v who="run.sh" '
  /^ninja: no work to do/ || /Re-checking globbed directories/ || /^ninja: Entering directory/ { next }
  !shown { print who ": building (a few minutes the first time) ..." > "/dev/stderr"; shown = 1 }
  { print; fflush() }'
ctest --test-dir build --output-on-failure -j2 "$@"
