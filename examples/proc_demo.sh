#!/usr/bin/env bash
# Whole-process snapshots of a numpy job (docs/criu.md), end to end:
#   start it with `dvr run`, dump it twice (the second dump stores only what
#   changed), kill it, restore it, and start a clone beside the restored job.
#
#   sudo bash examples/proc_demo.sh [--mib N] [--dvr PATH]
#
# Needs root and CRIU 4.x (`dvr proc check`); uses a throw-away store in /dev/shm.
set -euo pipefail
cd "$(dirname "$0")/.."
MIB=256
DVR=build/dvr
while [ $# -gt 0 ]; do
  case "$1" in
    --mib) MIB=$2; shift 2 ;;
    --dvr) DVR=$2; shift 2 ;;
    *) echo "usage: $0 [--mib N] [--dvr PATH]" >&2; exit 2 ;;
  esac
done
[ "$(id -u)" -eq 0 ] || { echo "proc_demo: needs root (CRIU does)" >&2; exit 77; }
[ -x "$DVR" ] || { echo "proc_demo: $DVR not found; build first (cmake --build build)" >&2; exit 2; }
"$DVR" proc check >/dev/null || { "$DVR" proc check; exit 1; }

WORK=$(mktemp -d /dev/shm/dvr-proc-demo-XXXXXX)
STORE=$WORK/store
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT
[ -n "${KEEP:-}" ] && trap - EXIT  # KEEP=1: leave the jobs and files for a look

# The job: a numpy array of $MIB MiB and a counter ticking every 10 ms. It has
# no file open while it runs (CRIU reopens open files by path, so a temporary
# file open at dump time would have to exist at restore): it writes
# "count sum" to its status file only when asked with SIGUSR2. SIGUSR1 changes
# 1% of its pages.
cat > "$WORK/job.py" <<'PY'
import os, signal, sys, time
import numpy as np
status, mib = sys.argv[1], int(sys.argv[2])
data = np.random.default_rng(1).random(mib * 2**20 // 8)
count = 0
def change(sig, frame):
    data[:: 100 * 512] += 1.0
def report(sig, frame):
    tmp = f"{status}.{os.urandom(6).hex()}"  # clones share our memory, not the kernel's randomness
    with open(tmp, "w") as f:
        f.write(f"{count} {data.sum():.6f}\n")
    os.replace(tmp, status)
signal.signal(signal.SIGUSR1, change)
signal.signal(signal.SIGUSR2, report)
while True:
    count += 1
    time.sleep(0.01)
PY
# ask PID: its "count sum" now.
ask() {
  rm -f "$WORK/status"
  kill -USR2 "$1"
  for _ in $(seq 600); do [ -s "$WORK/status" ] && { cat "$WORK/status"; return 0; }; sleep 0.02; done
  echo "process $1 did not answer" >&2; exit 1
}

echo "== start a ${MIB} MiB numpy job in its own PID namespace"
PID=$("$DVR" run --output "$WORK/job.log" -- /usr/bin/python3 "$WORK/job.py" "$WORK/status" "$MIB")
PIDS+=("$PID")
sleep 1
echo "   pid $PID, (count sum): $(ask "$PID")"

echo "== dump it, leaving it running"
AT_DUMP=$(ask "$PID")
"$DVR" --store "$STORE" proc dump "$PID" --name first --leave-running

echo "== change 1% of its pages, dump again: only the change is stored"
kill -USR1 "$PID"
AT_SECOND=$(ask "$PID")
"$DVR" --store "$STORE" proc dump "$PID" --name second --leave-running
"$DVR" --store "$STORE" proc ls

echo "== kill it and restore 'second'"
BEFORE=$(ask "$PID")
kill -9 "$PID"; sleep 0.2
R=$("$DVR" --store "$STORE" proc restore second --detach)
PIDS+=("$R")
sleep 0.5
RESTORED=$(ask "$R")
echo "   before the second dump: $AT_SECOND   when killed: $BEFORE   restored (pid $R) now: $RESTORED"

echo "== clone 'first' beside it (its own PID namespace)"
C=$("$DVR" --store "$STORE" proc clone first)
PIDS+=("$C")
sleep 0.5
CLONED=$(ask "$C")
echo "   before the first dump: $AT_DUMP   clone (pid $C) now: $CLONED"
echo "   the restored job goes on: $(ask "$R")"
SUM_FIRST=${AT_DUMP#* }
SUM_CLONE=${CLONED#* }
SUM_SECOND=${AT_SECOND#* }
SUM_NOW=${RESTORED#* }
if [ "$SUM_FIRST" = "$SUM_CLONE" ] && [ "$SUM_SECOND" = "$SUM_NOW" ]; then
  echo "== both carry exactly their dump's data (array sums match)"
else
  echo "proc_demo: sums differ: first $SUM_FIRST / clone $SUM_CLONE, second $SUM_SECOND / restored $SUM_NOW" >&2
  exit 1
fi
