#!/usr/bin/env bash
# An unmodified redis-server whose heap lives in a DVR persistent heap
# (docs/criu.md, "Unmodified programs"), end to end:
#   start it with `dvr run --heap`, load keys, dump it (the heap is sealed:
#   linked into the store as it is, nothing copied), rewrite 1% of the keys,
#   dump again (only the pages written since), kill it, restore it and check
#   every key, then clone it beside the restored one in a network of its own:
#   the clone maps the same sealed heap copy-on-write.
#
#   sudo bash examples/heap_redis.sh [--keys N] [--dvr PATH]
#
# Needs root, CRIU 4.2 (`dvr proc check`) and redis-server; uses a throw-away
# store in /dev/shm.
set -euo pipefail
cd "$(dirname "$0")/.."
KEYS=200000
DVR=build/dvr
while [ $# -gt 0 ]; do
  case "$1" in
    --keys) KEYS=$2; shift 2 ;;
    --dvr) DVR=$2; shift 2 ;;
    *) echo "usage: $0 [--keys N] [--dvr PATH]" >&2; exit 2 ;;
  esac
done
[ "$(id -u)" -eq 0 ] || { echo "heap_redis: needs root (CRIU does)" >&2; exit 77; }
[ -x "$DVR" ] || { echo "heap_redis: $DVR not found; build first (cmake --build build)" >&2; exit 2; }
command -v redis-server >/dev/null || { echo "heap_redis: redis-server is not installed (bash install-deps.sh)" >&2; exit 77; }
PY=/usr/bin/python3

WORK=$(mktemp -d /dev/shm/dvr-heap-redis-XXXXXX)
STORE=$WORK/store
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT
PORT=$($PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cli() { redis-cli -p "$PORT" "$@"; }
# SET key:I to a 1000-byte value made of CHAR for I in [FROM, TO) with STEP.
load() {
  $PY - "$@" <<'PY' | redis-cli -p "$PORT" --pipe | tail -1
import sys
lo, hi, step, ch = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
v = ch * 1000
out = sys.stdout.buffer
for i in range(lo, hi, step):
    k = "key:%d" % i
    out.write(("*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (len(k), k, len(v), v)).encode())
PY
}
wait_pong() { for _ in $(seq 1 200); do [ "$(cli ping 2>/dev/null)" = PONG ] && return 0; sleep 0.05; done; echo "no PONG" >&2; exit 1; }
seconds() { $PY -c 'import json,sys; print(json.load(sys.stdin)["seconds"])'; }
stored() { $PY -c 'import json,sys; print(json.load(sys.stdin)["stored_bytes"])'; }

echo "== start redis-server with its heap in the store ($STORE)"
PID=$("$DVR" --store "$STORE" run --heap 4G --heap-session redis --output "$WORK/redis.log" -- \
  redis-server --port "$PORT" --bind 127.0.0.1 --save "" --appendonly no)
PIDS+=("$PID")
wait_pong
echo "== load $KEYS keys of 1000 bytes"
load 0 "$KEYS" 1 a
cli info memory | grep '^used_memory_human'
grep 'heaps/redis/heap' "/proc/$PID/maps"

echo "== dump 1 (the heap is sealed and linked into the store: hashed, not copied)"
J=$("$DVR" --store "$STORE" proc dump "$PID" --name r1 --leave-running --json)
echo "   $(echo "$J" | seconds) s, stored $(echo "$J" | stored) bytes"
grep 'heaps/redis/heap' "/proc/$PID/maps"
ls -li "$STORE"/heaps/redis/heap "$STORE"/packs/*.heap
echo "== rewrite 1% of the keys, dump 2"
load 0 "$KEYS" 100 b
J=$("$DVR" --store "$STORE" proc dump "$PID" --name r2 --leave-running --json)
echo "   $(echo "$J" | seconds) s, stored $(echo "$J" | stored) bytes (only the pages written since dump 1)"

echo "== kill -9, restore r2"
kill -9 "$PID"
while kill -0 "$PID" 2>/dev/null; do sleep 0.05; done
"$DVR" --store "$STORE" proc restore r2 --detach --pidfile "$WORK/pid"
PIDS+=("$(cat "$WORK/pid")")
wait_pong
N=$(cli dbsize)
V0=$(cli get key:0 | head -c 3)
V1=$(cli get key:1 | head -c 3)
echo "   dbsize $N, key:0 = $V0..., key:1 = $V1..."
[ "$N" = "$KEYS" ] && [ "$V0" = bbb ] && [ "$V1" = aaa ] || { echo "heap_redis: wrong data after restore" >&2; exit 1; }

if command -v ip >/dev/null && command -v nsenter >/dev/null; then
  echo "== clone r2 beside it, in a network of its own"
  CLONE=$("$DVR" --store "$STORE" proc clone r2 --net new --pidfile "$WORK/clone.pid" >/dev/null && cat "$WORK/clone.pid")
  PIDS+=("$CLONE")
  for _ in $(seq 1 200); do [ "$(nsenter -t "$CLONE" -n redis-cli -p "$PORT" ping 2>/dev/null)" = PONG ] && break; sleep 0.05; done
  C0=$(nsenter -t "$CLONE" -n redis-cli -p "$PORT" get key:0 | head -c 3)
  ANON=$(awk '/^Anonymous:/ {print $2}' "/proc/$CLONE/smaps_rollup")
  HEAP=$(du -k "$STORE"/heaps/redis/heap | cut -f1)
  echo "   the clone says key:0 = $C0...; its own memory $((ANON / 1024)) MiB, the heap it shares $((HEAP / 1024)) MiB"
  [ "$C0" = bbb ] || { echo "heap_redis: wrong data in the clone" >&2; exit 1; }
fi
echo "heap_redis: ok"
