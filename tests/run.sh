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
build() {  # build DIR WHAT
  NINJA_STATUS="[%f/%t %p] " cmake --build "$1" 2>&1 | awk -v what="$2" '
    /^ninja: no work to do/ || /Re-checking globbed directories/ || /^ninja: Entering directory/ { next }
    !shown { print "run.sh: building " what " (a few minutes the first time) ..." > "/dev/stderr"; shown = 1 }
    { print; fflush() }'
}
build build "in build/"
# Fuzzing (tests/fuzz/README.md): with clang, the libFuzzer targets are built
# in build-fuzz (instrumented, ASan+UBSan), and CTest's fuzz_* tests run each
# for $DVR_FUZZ_SECONDS (default 60) beside the other tests. Without clang
# they are skipped, saying so.
if command -v clang++ >/dev/null 2>&1 && command -v clang >/dev/null 2>&1; then
  mkdir -p build-fuzz
  if ! cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang -DDVR_FUZZ=ON \
      -DDVR_BUILD_TESTS=OFF -DDVR_BUILD_PYTHON=OFF -DDVR_BUILD_CLI=OFF -DDVR_BUILD_BENCH=OFF -DDVR_BUILD_EXAMPLES=OFF -DDVR_BUILD_MPI=OFF \
      >build-fuzz/configure.log 2>&1; then
    tail -n 40 build-fuzz/configure.log >&2
    echo "run.sh: configuring the fuzz build failed (the whole log: build-fuzz/configure.log)" >&2
    exit 1
  fi
  rm -f build-fuzz/configure.log
  build build-fuzz "the fuzz targets in build-fuzz/ (clang)"
else
  echo "run.sh: clang/clang++ not found: the fuzz_* tests are skipped (install clang to run them)" >&2
fi
ctest --test-dir build --output-on-failure -j2 "$@"
