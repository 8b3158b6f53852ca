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
  dump_peak_rss    peak resident memory of `dvr proc dump` (GNU time) vs the job's size
  restore_peak_rss the same for `dvr proc restore`
  redis_dump       dvr proc dump of a redis-server on TCP holding --size of values (DEBUG POPULATE) vs criu dump
  redis_restore    dvr proc restore --detach of it                             vs criu restore
  redis_first_pong from the start of the restore to the first PONG            vs the same with criu restore
With CRIU >= 4.2, dvr is CRIU's page server at dump and its image streamer at
restore, so page data never passes through image files ($DVR_PROC_PAGE_IMAGES=1
makes dvr use files, to compare). --no-redis leaves the redis figures out.
With --json, one object per line: {"name", "value", "unit", "peer", "peer_value", "ratio" (value/peer), "bytes"}.
Needs root and CRIU 4.x (`dvr proc check`).
"""

import argparse
import json
import os
import shutil
import signal
import socket
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
            log = ""
            if args[0] == "criu" and "-D" in args:
                d = str(args[list(args).index("-D") + 1])
                for name in ("restore.log", "dump.log"):
                    if os.path.exists(os.path.join(d, name)):
                        log += "".join(l for l in open(os.path.join(d, name)) if "Error" in l)[-3000:]
            raise RuntimeError(f"{' '.join(map(str, args))} failed ({p.returncode}):\n{p.stdout}{p.stderr}{log}")
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

    def kill_wait(self, pid, timeout=10):
        """SIGKILL and wait until the process is gone (its port and PID free)."""
        self.pids.append(pid)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        deadline = time.time() + timeout
        while time.time() < deadline and os.path.exists(f"/proc/{pid}"):
            time.sleep(0.01)  # until reaped: its PID namespace and ports are gone then
        time.sleep(0.2)

    def peak_rss(self, *args):
        """Runs args under GNU time; returns its peak resident bytes (also in last_rss)."""
        p = subprocess.run(["/usr/bin/time", "-f", "%M"] + [str(a) for a in args], capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(map(str, args))} failed ({p.returncode}):\n{p.stdout}{p.stderr}")
        self.last_rss = int(p.stderr.strip().splitlines()[-1]) * 1024
        self.last_out = p.stdout
        return self.last_rss

    def kill_all(self):
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def free_port():
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


def redis_ping(port):
    """True when redis answers PING with PONG on 127.0.0.1:port."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sk:
            sk.sendall(b"PING\r\n")
            return sk.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def redis_cmd(port, *words):
    out = subprocess.run(["redis-cli", "-p", str(port)] + list(words), capture_output=True, text=True, check=True)
    return out.stdout.strip()


def until_pong(port, t0, timeout=120):
    """Seconds from t0 (perf_counter) to the first PONG on port."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if redis_ping(port):
            return time.perf_counter() - t0
        time.sleep(0.002)
    raise RuntimeError(f"redis on port {port} did not answer PING")


def redis_figures(b, work, size, repeat):
    """A real redis-server on TCP holding `size` bytes of values: dump, restore
    and restore-to-first-PONG by dvr and by plain CRIU, in this run."""
    if not shutil.which("redis-server") or not shutil.which("redis-cli"):
        print("proc_bench: redis-server/redis-cli missing: no redis figures (install-deps.sh installs them)", file=sys.stderr)
        return []
    port = free_port()
    out, _ = b.run(b.dvr, "run", "--", shutil.which("redis-server"), "--port", port, "--bind", "127.0.0.1", "--save", "",
                   "--appendonly", "no", "--enable-debug-command", "yes", "--daemonize", "no")
    pid = int(out.strip())
    b.pids.append(pid)
    until_pong(port, time.perf_counter())
    keys = max(1, size // 4096)
    redis_cmd(port, "DEBUG", "POPULATE", str(keys), "key", "4096")
    redis_cmd(port, "SET", "canary", "dvr-bench")
    used = int(redis_cmd(port, "INFO", "memory").split("used_memory:")[1].split()[0])

    store = os.path.join(work, "redis-store")
    img = os.path.join(work, "redis-criu")
    criu_dump, dvr_dump = [], []
    for r in range(repeat):
        os.mkdir(img)
        _, took = b.run("criu", "dump", "-t", pid, "-D", img, "--leave-running", "-o", "dump.log")
        criu_dump.append(took)
        if r + 1 < repeat:
            shutil.rmtree(img)
        shutil.rmtree(store, ignore_errors=True)
        _, took = b.dvr_json(store, "proc", "dump", pid, "--name", "redis", "--leave-running")
        dvr_dump.append(took)
    b.kill_wait(pid)

    criu_restore, criu_pong, dvr_restore, dvr_pong = [], [], [], []
    for r in range(repeat):
        pidfile = os.path.join(work, f"redis-{r}.pid")
        t0 = time.perf_counter()
        _, took = b.run("criu", "restore", "-D", img, "-d", "--pidfile", pidfile, "-o", "restore.log")
        criu_pong.append(until_pong(port, t0))
        criu_restore.append(took)
        b.kill_wait(int(open(pidfile).read()))
        t0 = time.perf_counter()
        out, took = b.run(b.dvr, "--store", store, "proc", "restore", "redis", "--detach")
        dvr_pong.append(until_pong(port, t0))
        dvr_restore.append(took)
        if redis_cmd(port, "GET", "canary") != "dvr-bench" or int(redis_cmd(port, "DBSIZE")) != keys + 1:
            raise RuntimeError("the restored redis-server lost data")
        b.kill_wait(int(out.strip()))
    shutil.rmtree(img)
    shutil.rmtree(store, ignore_errors=True)
    print(f"proc_bench: redis-server held {keys} keys of 4 KiB, used_memory {used / 2**30:.2f} GiB", file=sys.stderr)
    return [
        ("redis_dump", min(dvr_dump), "s", "criu dump (tmpfs)", min(criu_dump)),
        ("redis_restore", min(dvr_restore), "s", "criu restore (tmpfs)", min(criu_restore)),
        ("redis_first_pong", min(dvr_pong), "s", "criu restore to PONG", min(criu_pong)),
    ]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1G")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-redis", action="store_true", help="leave out the redis-server figures")
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

        # Restore of the anonymous job: CRIU's own images, then dvr's (best of --repeat each).
        img = os.path.join(work, "criu-restore")
        os.mkdir(img)
        b.run("criu", "dump", "-t", anon, "-D", img, "--leave-running", "-o", "dump.log")
        os.kill(anon, signal.SIGKILL)
        time.sleep(0.2)
        criu_restore, dvr_restore = [], []
        for r in range(repeat):
            pidfile = os.path.join(work, f"criu-{r}.pid")
            _, took = b.run("criu", "restore", "-D", img, "-d", "--pidfile", pidfile, "-o", "restore.log")
            criu_restore.append(took)
            restored = int(open(pidfile).read())
            b.kill_wait(restored)
            out, took = b.run(b.dvr, "--store", store, "proc", "restore", f"a{repeat}", "--detach")
            dvr_restore.append(took)
            b.kill_wait(int(out.strip()))
        shutil.rmtree(img)

        # Peak resident memory of dvr itself (GNU time), against the job's size.
        anon2 = b.start(mib, os.path.join(work, "anon2.status"))
        rss_store = os.path.join(work, "rss-store")
        dump_rss = b.peak_rss(b.dvr, "--store", rss_store, "proc", "dump", anon2, "--name", "m")
        restore_rss = b.peak_rss(b.dvr, "--store", rss_store, "proc", "restore", "m", "--detach")
        b.kill_wait(int(b.last_out.strip()))
        b.kill_all()
        shutil.rmtree(rss_store, ignore_errors=True)

        figures = [
            ("dump_anon", min(first_anon), "s", "criu dump (tmpfs)", min(criu_dump)),
            ("dump_heap", min(first_heap), "s", "dump_anon", min(first_anon)),
            ("dump_heap_hash", min(first_hheap), "s", "dump_anon", min(first_anon)),
            ("redump_anon", min(re_anon), "s", "dump_anon", min(first_anon)),
            ("redump_heap", min(re_heap), "s", "redump_anon", min(re_anon)),
            ("redump_heap_hash", min(re_hheap), "s", "redump_anon", min(re_anon)),
            ("redump_bytes", max(re_bytes), "B", "dump_anon bytes", min(first_bytes)),
            ("redump_heap_bytes", max(re_heap_bytes), "B", "dump_anon bytes", min(first_bytes)),
            ("restore_anon", min(dvr_restore), "s", "criu restore (tmpfs)", min(criu_restore)),
            ("dump_peak_rss", dump_rss, "B", "job size", size),
            ("restore_peak_rss", restore_rss, "B", "job size", size),
        ]
        if not args.no_redis:
            figures += redis_figures(b, work, size, repeat)
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
