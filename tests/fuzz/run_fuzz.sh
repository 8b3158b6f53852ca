#!/usr/bin/env bash
# Runs one libFuzzer target of tests/fuzz for $DVR_FUZZ_SECONDS (default 60)
# from the fuzz build ($DVR_FUZZ_BUILD, default build-fuzz; tests/run.sh makes
# it when clang is installed), starting from the seed corpus kept in the
# repository (tests/fuzz/corpus/TARGET, read only) and a working corpus in
# the build (build-fuzz/corpus/TARGET, which grows from run to run). Exits
# non-zero on any crash, leak, timeout or sanitizer report; the input that
# caused it is kept in build-fuzz/artifacts/TARGET/. Without a fuzz build it
# prints "SKIPPED: ..." (CTest reports the test as skipped).
#   usage: tests/fuzz/run_fuzz.sh TARGET [extra libFuzzer options...]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
target="${1:?usage: run_fuzz.sh TARGET [libFuzzer options]}"
shift
build="${DVR_FUZZ_BUILD:-$root/build-fuzz}"
seconds="${DVR_FUZZ_SECONDS:-60}"
bin="$build/fuzz/$target"
if [[ ! -x "$bin" ]]; then
  if ! command -v clang++ >/dev/null 2>&1; then
    echo "SKIPPED: clang++ is not installed, so there is no fuzz build; install clang (apt-get install clang) and run tests/run.sh"
  else
    echo "SKIPPED: no fuzz build at $build (tests/run.sh builds it: cmake -S . -B build-fuzz -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang -DDVR_FUZZ=ON ...)"
  fi
  exit 0
fi
if [[ ! "$seconds" =~ ^[0-9]+$ ]] || (( seconds < 1 )); then
  echo "run_fuzz.sh: DVR_FUZZ_SECONDS='$seconds' is not a whole number of seconds" >&2
  exit 2
fi
mkdir -p "$build/corpus/$target" "$build/artifacts/$target"
# -timeout: one input taking longer is a failure (a hang); -rss_limit_mb: so
# is one that makes the process grow past 2 GiB.
exec "$bin" -max_total_time="$seconds" -timeout=25 -rss_limit_mb=2048 -print_final_stats=1 \
  -artifact_prefix="$build/artifacts/$target/" "$@" "$build/corpus/$target" "$here/corpus/$target"
