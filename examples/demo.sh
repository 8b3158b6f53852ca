#!/usr/bin/env bash
# Quick start, part 1: installs what is missing, builds, and runs `dvr demo` on
# the default store ($DVR_STORE, else /dev/shm/dvr-$UID). Extra arguments go to
# the demo, e.g. `bash examples/demo.sh --size 4G`.
#
# The build shows its progress (ninja's status line on a terminal, a line per
# step otherwise) and prints nothing when everything is built already.
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
if ! ninja -C build -n 2>/dev/null | grep -q '^ninja: no work to do'; then
  echo "demo.sh: building (a few minutes the first time) ..." >&2
  NINJA_STATUS="[%f/%t %p] " cmake --build build
fi
exec build/dvr demo "$@"
