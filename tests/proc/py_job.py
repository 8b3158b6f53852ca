"""A Python/numpy job for the whole-process snapshot tests (tests/proc).

The Python counterpart of dvr-test-job (tests/helpers/proc_job.cpp), with the
same status line and signals:

    python3 py_job.py run --mib M --status FILE [--tick-ms 10] [--report-ms 100]
    python3 py_job.py expect --mib M --gen G     # the sum a correct array has

It holds a numpy uint64 array of M MiB with deterministic content and a counter
incremented every tick, and every report writes, atomically (temporary file,
then rename; never kept open),

    count=C sum=X gen=G seq=S id=I mib=M

where X is a BLAKE2b-64 of the array recomputed from memory at every report.
SIGUSR1 rewrites 1% of the array's 4 KiB pages (as a function of the new
generation); SIGUSR2 follows FILE.redirect (a path) and reports at once.
"""

import argparse
import hashlib
import os
import signal
import sys
import time

import numpy as np

PAGE_WORDS = 4096 // 8
MIB_WORDS = (1 << 20) // 8
GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x):
    """splitmix64's finalizer on a uint64 array (wrapping arithmetic)."""
    x = x + GOLDEN
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def initial(mib):
    with np.errstate(over="ignore"):
        return _mix(np.arange(mib * MIB_WORDS, dtype=np.uint64))


def mutate(a, gen):
    """Mutation number `gen` (>= 1): rewrites 1% of the pages (at least one)."""
    pages = a.size // PAGE_WORDS
    n = max(pages // 100, 1)
    rng = np.random.default_rng(gen)
    with np.errstate(over="ignore"):
        for page in rng.integers(0, pages, size=n):
            start = int(page) * PAGE_WORDS
            seed = np.uint64((gen << 40) ^ int(page))
            a[start:start + PAGE_WORDS] = _mix(np.arange(PAGE_WORDS, dtype=np.uint64) + seed)


def checksum(a):
    return hashlib.blake2b(memoryview(a).cast("B"), digest_size=8).hexdigest()


def expected_sum(mib, gen):
    a = initial(mib)
    for g in range(1, gen + 1):
        mutate(a, g)
    return checksum(a)


def write_status(path, text):
    tmp = f"{path}.tmp-{os.urandom(8).hex()}"  # from the kernel: a clone picks another name
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        print(f"py_job: cannot write {path}: {e}", file=sys.stderr)


def run(args):
    a = initial(args.mib)  # every page written: resident
    pending = {"usr1": 0, "usr2": 0}

    def on_signal(signum, _frame):
        pending["usr1" if signum == signal.SIGUSR1 else "usr2"] += 1

    signal.signal(signal.SIGUSR1, on_signal)
    signal.signal(signal.SIGUSR2, on_signal)

    job_id = os.urandom(8).hex()
    status_path = args.status
    count = gen = seq = 0
    next_report = 0.0
    while True:
        report_now = False
        if pending["usr1"]:
            pending["usr1"] = 0
            gen += 1
            mutate(a, gen)
            report_now = True
        if pending["usr2"]:
            pending["usr2"] = 0
            try:
                with open(args.status + ".redirect") as f:
                    to = f.readline().strip()
                if to:
                    status_path = to
            except OSError:
                pass
            report_now = True
        now = time.monotonic()
        if report_now or now >= next_report:
            seq += 1
            write_status(status_path, f"count={count} sum={checksum(a)} gen={gen} seq={seq} id={job_id} mib={args.mib}\n")
            next_report = now + args.report_ms / 1000
        time.sleep(args.tick_ms / 1000)
        count += 1


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["run", "expect"])
    p.add_argument("--mib", type=int, required=True)
    p.add_argument("--status")
    p.add_argument("--gen", type=int, default=0)
    p.add_argument("--tick-ms", type=int, default=10)
    p.add_argument("--report-ms", type=int, default=100)
    args = p.parse_args()
    if args.mib < 1:
        p.error("--mib must be at least 1")
    if args.mode == "expect":
        print(expected_sum(args.mib, args.gen))
        return 0
    if not args.status:
        p.error("run needs --status FILE")
    run(args)


if __name__ == "__main__":
    sys.exit(main())
