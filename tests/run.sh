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
  if ! ninja -C build-fuzz -n 2>/dev/null | grep -q '^ninja: no work to do'; then
    echo "run.sh: building the fuzz targets in build-fuzz (clang) ..." >&2
    fuzz_start=$SECONDS
    NINJA_STATUS="[fuzz %f/%t %p] " cmake --build build-fuzz
    echo "run.sh: the fuzz build took $((SECONDS - fuzz_start)) s" >&2
  fi
else
  echo "run.sh: clang/clang++ not found: the fuzz_* tests are skipped (install clang to run them)" >&2
fi
ctest --test-dir build --output-on-failure -j2 "$@"
