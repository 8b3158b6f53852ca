#!/usr/bin/python3
"""The Python job bench/proc_bench.py dumps, with and without `dvr run --heap`.

    /usr/bin/python3 bench/heap_bench_fill.py --size BYTES --status FILE

It holds a numpy array of --size bytes (uint64, every page written with
distinct values), writes "ready 0" to --status, then idles touching nothing.
SIGUSR1 rewrites 1% of the array (one contiguous slice, the next one each
time) and writes "ready GEN". An unmodified program: under `dvr run --heap`
numpy's malloc puts the array into the DVR persistent heap.
"""

import argparse
import os
import signal

import numpy as np


def ready(status, gen):
    tmp = f"{status}.tmp"
    with open(tmp, "w") as f:
        f.write(f"ready {gen}\n")
    os.rename(tmp, status)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--status", required=True)
    args = ap.parse_args()
    data = np.arange(max(1, args.size // 8), dtype=np.uint64)
    data *= np.uint64(0x9E3779B97F4A7C15)  # distinct, incompressible-looking pages
    # SIGUSR1 is blocked and taken with sigwait: none is lost between two.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    ready(args.status, 0)
    n = max(1, len(data) // 100)
    gen = 0
    while True:
        signal.sigwait({signal.SIGUSR1})
        start = (gen * n) % max(1, len(data) - n + 1)
        data[start:start + n] += np.uint64(1)
        gen += 1
        ready(args.status, gen)


if __name__ == "__main__":
    main()
