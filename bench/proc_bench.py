#!/usr/bin/python3
"""Whole-process snapshots: `dvr proc dump` against CRIU alone, and a DVR
persistent heap against the same data in anonymous memory.

    sudo /usr/bin/python3 bench/proc_bench.py [--size 1G] [--repeat 3] [--json] [--build build]

Three jobs hold --size bytes each, started with `dvr run`: one in anonymous
memory, two in a DVR persistent heap: one that snapshotted its heap once loaded
(as a DVR application does; its session then tracks writes, so the plugin
stores only pages written since), one that never did (the plugin compares
every page by hash). All in one run (best of --repeat):
  dump_anon        dvr proc dump of the anonymous job     vs criu dump of it to tmpfs (CRIU's own cost)
  dump_heap        dvr proc dump of the snapshotting heap job vs dump_anon (target: <= 0.2x)
  dump_heap_hash   the same for the heap job that never snapshotted vs dump_anon
  redump_anon      dump again after 1% of pages changed   vs dump_anon
  redump_heap      the same for the snapshotting heap job vs redump_anon
  redump_heap_hash the same for the other heap job        vs redump_anon
  redump_bytes     bytes the second dump added to the store vs the first's (target: <= 5%)
  restore_anon     dvr proc restore --detach of the anonymous job vs criu restore of CRIU's images
With --json, one object per line: {"name", "value", "unit", "peer", "peer_value", "ratio" (value/peer), "bytes"}.
Needs root and CRIU 4.x (`dvr proc check`).
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B").rstrip("I")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1:] in units else int(text)


class Bench:
    def __init__(self, build, work):
        self.dvr = os.path.join(build, "dvr")
        self.job = os.path.join(build, "dvr-bench-job")
        self.work = work
        self.pids = []

    def run(self, *args, env=None):
        t = time.perf_counter()
        p = subprocess.run([str(a) for a in args], capture_output=True, text=True, env=env)
        took = time.perf_counter() - t
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(map(str, args))} failed ({p.returncode}):\n{p.stdout}{p.stderr}")
        return p.stdout, took

    def dvr_json(self, store, *args):
        out, took = self.run(self.dvr, "--store", store, *args, "--json")
        return json.loads(out), took

    def start(self, mib, status, heap=None, snapshot=False):
        args = [self.dvr, "run", "--", self.job, "--mib", mib, "--status", status]
        if heap:
            args += ["--heap", heap, "--snapshot", "1" if snapshot else "0"]
        out, _ = self.run(*args)
        pid = int(out.strip())
        self.pids.append(pid)
        self.wait_ready(status, 0)
        return pid

    def wait_ready(self, status, gen, timeout=300):
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                with open(status) as f:
                    if f.read().strip() == f"ready {gen}":
                        return
            except FileNotFoundError:
                pass
            time.sleep(0.02)
        raise RuntimeError(f"job did not report 'ready {gen}' in {status}")

    def kill_all(self):
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1G")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--build", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build"))
    args = ap.parse_args()
    size = parse_size(args.size)
    mib = max(1, size >> 20)
    repeat = max(1, args.repeat)
    if os.geteuid() != 0:
        print("proc_bench: needs root (CRIU does)", file=sys.stderr)
        return 77
    work = tempfile.mkdtemp(prefix="dvr-proc-bench-", dir="/dev/shm")
    b = Bench(os.path.abspath(args.build), work)
    try:
        heap_store = os.path.join(work, "heap-store")
        anon = b.start(mib, os.path.join(work, "anon.status"))
        heap = b.start(mib, os.path.join(work, "heap.status"), heap=heap_store, snapshot=True)
        hheap = b.start(mib, os.path.join(work, "hheap.status"), heap=heap_store)
        jobs = {"anon": anon, "heap": heap, "hheap": hheap}

        # First dumps, each into a fresh store (nothing to deduplicate against).
        first_anon, first_heap, first_hheap, criu_dump, first_bytes = [], [], [], [], []
        for r in range(repeat):
            img = os.path.join(work, f"criu-{r}")
            os.mkdir(img)
            _, took = b.run("criu", "dump", "-t", anon, "-D", img, "--leave-running", "-o", "dump.log")
            criu_dump.append(took)
            shutil.rmtree(img)
            store = os.path.join(work, f"store-{r}")
            info, took = b.dvr_json(store, "proc", "dump", anon, "--name", "a0", "--leave-running")
            first_anon.append(took)
            first_bytes.append(info["stored_bytes"])
            info, took = b.dvr_json(store, "proc", "dump", heap, "--name", "h0", "--leave-running")
            first_heap.append(took)
            info, took = b.dvr_json(store, "proc", "dump", hheap, "--name", "g0", "--leave-running")
            first_hheap.append(took)
            if r + 1 < repeat:
                shutil.rmtree(store)
                # The heap snapshots live in the heap's own store.
                b.run(b.dvr, "--store", heap_store, "rm", "bench-app/proc.h0", "bench-job/proc.g0")

        # Second dumps into the last store, each after 1% of the pages changed.
        re_anon, re_heap, re_hheap, re_bytes, re_heap_bytes = [], [], [], [], []
        for r in range(repeat):
            for job, pid in jobs.items():
                os.kill(pid, signal.SIGUSR1)
            for job in jobs:
                b.wait_ready(os.path.join(work, f"{job}.status"), r + 1)
            info, took = b.dvr_json(store, "proc", "dump", anon, "--name", f"a{r + 1}", "--leave-running")
            re_anon.append(took)
            re_bytes.append(info["stored_bytes"])
            info, took = b.dvr_json(store, "proc", "dump", heap, "--name", f"h{r + 1}", "--leave-running")
            re_heap.append(took)
            re_heap_bytes.append(info["stored_bytes"])
            info, took = b.dvr_json(store, "proc", "dump", hheap, "--name", f"g{r + 1}", "--leave-running")
            re_hheap.append(took)

        # Restore of the anonymous job: CRIU's own images, then dvr's.
        img = os.path.join(work, "criu-restore")
        os.mkdir(img)
        b.run("criu", "dump", "-t", anon, "-D", img, "--leave-running", "-o", "dump.log")
        os.kill(anon, signal.SIGKILL)
        time.sleep(0.2)
        pidfile = os.path.join(work, "criu.pid")
        _, criu_restore = b.run("criu", "restore", "-D", img, "-d", "--pidfile", pidfile, "-o", "restore.log")
        restored = int(open(pidfile).read())
        b.pids.append(restored)
        os.kill(restored, signal.SIGKILL)
        shutil.rmtree(img)
        time.sleep(0.2)
        out, dvr_restore = b.run(b.dvr, "--store", store, "proc", "restore", f"a{repeat}", "--detach")
        b.pids.append(int(out.strip()))

        figures = [
            ("dump_anon", min(first_anon), "s", "criu dump (tmpfs)", min(criu_dump)),
            ("dump_heap", min(first_heap), "s", "dump_anon", min(first_anon)),
            ("dump_heap_hash", min(first_hheap), "s", "dump_anon", min(first_anon)),
            ("redump_anon", min(re_anon), "s", "dump_anon", min(first_anon)),
            ("redump_heap", min(re_heap), "s", "redump_anon", min(re_anon)),
            ("redump_heap_hash", min(re_hheap), "s", "redump_anon", min(re_anon)),
            ("redump_bytes", max(re_bytes), "B", "dump_anon bytes", min(first_bytes)),
            ("redump_heap_bytes", max(re_heap_bytes), "B", "dump_anon bytes", min(first_bytes)),
            ("restore_anon", dvr_restore, "s", "criu restore (tmpfs)", criu_restore),
        ]
        if args.json:
            for name, value, unit, peer, peer_value in figures:
                print(json.dumps({"name": name, "value": value, "unit": unit, "peer": peer, "peer_value": peer_value,
                                  "ratio": value / peer_value, "bytes": size}))
        else:
            print(f"proc-bench: three jobs of {size / 2**30:.2f} GiB each, store {work} (tmpfs), best of {repeat}\n")
            print(f"  {'figure':18} {'value':>12}   {'peer':22} {'peer value':>12}   ratio (ours / peer)")
            for name, value, unit, peer, peer_value in figures:
                fmt = (lambda v: f"{v * 1000:9.1f} ms") if unit == "s" else (lambda v: f"{v / 2**20:8.1f} MiB")
                print(f"  {name:18} {fmt(value):>12}   {peer:22} {fmt(peer_value):>12}   {value / peer_value:8.3f}")
    finally:
        b.kill_all()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
