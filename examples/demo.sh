#!/usr/bin/env bash
# Quick start, part 1: installs what is missing, builds, and runs `dvr demo` on
# the default store ($DVR_STORE, else /dev/shm/dvr-$UID). Extra arguments go to
# the demo, e.g. `bash examples/demo.sh --size 4G`.
#
# The build shows its progress (a line per step) and prints nothing when everything is built already.
set -euo pipefail
cd "$(dirname "$0")/.."
./install-deps.sh
mkdir -p build
configure() {
  # CMake's own chatter goes to a log; only a failure shows it.
  if ! cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >build/configure.log 2>&1; then
    tail -n 40 build/configure.log >&2
    echo "demo.sh: configuring the build failed (the whole log: build/configure.log)" >&2
    exit 1
  fi
  rm -f build/configure.log
}
if [[ ! -f build/build.ninja ]]; then
  echo "demo.sh: configuring the build in build/ ..." >&2
  configure
fi
# No dry run first: with CMake's CONFIGURE_DEPENDS globs, `ninja -n` always
# stops at "Re-running CMake". The build runs; its glob check and "no work to
# do" are dropped, so a build with nothing to do prints nothing.
NINJA_STATUS="[%f/%t %p] " cmake --build build 2>&1 | awk -v who="demo.sh" '
  /^ninja: no work to do/ || /Re-checking globbed directories/ || /^ninja: Entering directory/ { next }
  !shown { print who ": building (a few minutes the first time) ..." > "/dev/stderr"; shown = 1 }
  { print; fflush() }'
exec build/dvr demo "$@"
