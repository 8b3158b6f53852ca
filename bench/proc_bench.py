#!/usr/bin/python3
"""Whole-process snapshots: `dvr proc dump` against CRIU alone, and a DVR
persistent heap against the same data in anonymous memory.

    sudo /usr/bin/python3 bench/proc_bench.py [--size 1G] [--repeat 3] [--json] [--no-redis] [--no-heap | --heap-only] [--build build]

Three jobs hold --size bytes each, started with `dvr run`: one in anonymous
memory, two in a DVR persistent heap: one that snapshotted its heap once loaded
(as a DVR application does; its session then tracks writes, so the plugin
stores only pages written since), one that never did (the plugin compares
every page by hash). All in one run (best of --repeat):
  dump_anon        dvr proc dump of the anonymous job     vs criu dump of it to tmpfs (CRIU's own cost)
  dump_heap        dvr proc dump of the snapshotting heap job vs dump_anon (target: ratio >= 5)
  dump_heap_hash   the same for the heap job that never snapshotted vs dump_anon
  redump_anon      dump again after 1% of pages changed   vs dump_anon
  redump_heap      the same for the snapshotting heap job vs redump_anon
  redump_heap_hash the same for the other heap job        vs redump_anon
  redump_bytes     bytes the second dump added to the store vs the first's (target: ratio >= 20)
  restore_anon     dvr proc restore --detach of the anonymous job vs criu restore of CRIU's images
                   (dvr writes the job's private memory into it itself, on every CPU)
  restore_anon_pipe the same with $DVR_PROC_PAGE_FILL=0: every page handed to CRIU through a pipe
  dump_peak_rss    peak resident memory of `dvr proc dump` (GNU time) vs the job's size
  restore_peak_rss the same for `dvr proc restore`
  redis_dump       dvr proc dump of a redis-server on TCP holding --size of values (DEBUG POPULATE) vs criu dump
  redis_restore    dvr proc restore --detach of it                             vs criu restore
  redis_first_pong from the start of the restore to the first PONG            vs the same with criu restore
With CRIU >= 4.2, dvr is CRIU's page server at dump and its image streamer at
restore, so page data never passes through image files ($DVR_PROC_PAGE_IMAGES=1
makes dvr use files, to compare).

--heap (the default when redis-server or memcached, and BUILD/preload/libdvr_heap.so exist;
--no-heap leaves it out): unmodified programs under `dvr run --heap`, whose heap
is a file of the store mapped MAP_SHARED, so CRIU copies none of it and the
plugin stores only the pages written since the last dump. Two redis-servers on
TCP hold the same --size of keys (DEBUG POPULATE, 1000-byte values), one with
--heap, one without; each figure's peer comes from the same repeat, and each is
the median of --repeat (fresh servers each repeat):
  heap_redis_dump               dvr proc dump of the --heap redis        vs criu dump of the plain one (target: ratio >= 10)
  heap_redis_redump_time_idle   dumped again at once, nothing changed    vs that criu dump
  heap_redis_redump_time_random again after SET of 1% of the keys at random vs criu dump of the plain one then (<= 0.05x)
  heap_redis_redump_bytes_random bytes that dump stored                  vs heap_redis_dump's (target: ratio >= 50)
  heap_redis_redump_*_contig    the same for 1% of the keys contiguous in insertion order
  heap_redis_restore_pong       kill -9, dvr proc restore (the heap file still there) to the first PONG
                                                                         vs criu restore of the plain one (<= 0.5x)
  heap_redis_clone_pong         dvr proc clone --net new beside the running original, to its first PONG
  heap_redis_clone_private      the clone's private memory once it answers (smaps_rollup's Anonymous: what it
                                wrote, its heap's copy-on-write pages among them; plus its whole heap file when
                                that is a copy of its own, not the store's sealed heap) vs the original's heap
                                file (target: ratio >= 20)
  heap_redis_clone_mapped       smaps_rollup's Private_Clean + Private_Dirty (pages only it maps now, the
                                sealed heap's file pages among them while the original is not using them)
  heap_redis_throughput_set/get redis-benchmark -t set,get -d 1000 on the restored --heap redis
                                vs on the restored plain one (target: ratio >= 0.9)
  heap_memcached_dump           dvr proc dump of a --heap memcached      vs criu dump of a plain one (target: ratio >= 10)
  heap_memcached_redump_time    again after 1% of the keys rewritten (contiguous) vs criu dump of the plain one (<= 0.05x)
  heap_memcached_redump_bytes   bytes that dump stored                   vs heap_memcached_dump's (target: ratio >= 50)
  heap_memcached_restore        kill -9, dvr proc restore to a `get` answered vs criu restore of the plain one (<= 0.5x)
  heap_py_dump, heap_py_redump  a Python job holding a numpy array of --size (bench/heap_bench_fill.py) under
                                --heap: dvr proc dump once loaded, again after 1% of the array was written,
                                vs criu dump of the same program without --heap at the same moments
  heap_py_redump_bytes          bytes the second dump stored             vs the first's
The heap_memcached_* figures (when memcached is installed; --no-redis keeps them): two memcached on TCP (-U 0,
-t 4), one with --heap, loaded with the same --size of 1000-byte items (pipelined `set ... noreply`).
--no-redis leaves every redis figure out (the --heap ones too).
With --json, one object per line: {"name", "value", "unit", "peer", "peer_value", "ratio", "bytes",
and for the --heap figures "target" (where there is one), "samples" and "peer_samples" (each repeat's)}, and
the table goes to stderr. "ratio" is how many times better ours is (docs/performance.md): peer/value for
costs (s, B), value/peer for rates (op/s); above 1, ours is better.
Needs root and CRIU 4.x (`dvr proc check`).
"""

import argparse
import glob
import json
import os
import random
import shutil
import signal
import socket
import statistics
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
        if pid not in self.pids:
            self.pids.append(pid)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            self.pids.remove(pid)
            return
        deadline = time.time() + timeout
        while time.time() < deadline and os.path.exists(f"/proc/{pid}"):
            time.sleep(0.01)  # until reaped: its PID namespace and ports are gone then
        if not os.path.exists(f"/proc/{pid}"):
            self.pids.remove(pid)  # gone: its PID may be another process's from now on
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
        self.pids = []


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
        b.pids.append(int(open(pidfile).read()))  # killed at the end even if it never answers
        criu_pong.append(until_pong(port, t0))
        criu_restore.append(took)
        b.kill_wait(int(open(pidfile).read()))
        t0 = time.perf_counter()
        out, took = b.run(b.dvr, "--store", store, "proc", "restore", "redis", "--detach")
        b.pids.append(int(out.strip()))
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


# ---- --heap: unmodified programs whose heap lives in a DVR persistent heap (`dvr run --heap`)

REDIS_VALUE = 1000  # bytes per value of the --heap redis figures (DEBUG POPULATE)
CLONE_NEWNET = 0x40000000


def heap_preload(build):
    return os.path.join(build, "preload", "libdvr_heap.so")


def heap_max(size):
    """The --heap MAX of the jobs: the default 4G, or twice --size when that is more."""
    return max(4 << 30, 2 * size)


def allocated(path):
    """Bytes a (sparse) file occupies."""
    return os.stat(path).st_blocks * 512


def smaps_rollup(pid):
    """/proc/PID/smaps_rollup in bytes, by field."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            words = line.split()
            if len(words) == 3 and words[2] == "kB":
                fields[words[0].rstrip(":")] = int(words[1]) * 1024
    return fields


def until_pong_in(b, pid, port, t0, timeout=120):
    """until_pong, from inside process `pid`'s network namespace (a forked child enters it)."""
    child = os.fork()
    if child == 0:
        try:
            import ctypes
            fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
            if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
                os._exit(2)
            deadline = time.time() + timeout
            while time.time() < deadline:
                if redis_ping(port):
                    os._exit(0)
                time.sleep(0.002)
            os._exit(1)
        except BaseException:
            os._exit(3)
    b.pids.append(child)
    _, status = os.waitpid(child, 0)
    took = time.perf_counter() - t0
    b.pids.remove(child)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"redis in the network namespace of {pid} did not answer PING on port {port} "
                           f"({os.waitstatus_to_exitcode(status)})")
    return took


def resp(*words):
    out = [b"*%d\r\n" % len(words)]
    for w in words:
        w = w if isinstance(w, bytes) else str(w).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(w), w))
    return b"".join(out)


def redis_rewrite(port, indices, tag):
    """SET key:I (DEBUG POPULATE's names) to a new value of REDIS_VALUE bytes, for each I, through redis-cli --pipe."""
    load = b"".join(resp("SET", f"key:{i}", f"{tag}-{i}-".encode().ljust(REDIS_VALUE, b"r")) for i in indices)
    p = subprocess.run(["redis-cli", "-p", str(port), "--pipe"], input=load, capture_output=True, timeout=300)
    if p.returncode != 0 or b"errors: 0" not in p.stdout:
        raise RuntimeError(f"redis-cli --pipe on port {port} failed: {p.stdout[-500:]!r} {p.stderr[-500:]!r}")


def redis_throughput(port, requests):
    """redis-benchmark -t set,get -d REDIS_VALUE: requests per second of SET and of GET."""
    p = subprocess.run(["redis-benchmark", "-p", str(port), "-t", "set,get", "-n", str(requests), "-d", str(REDIS_VALUE), "-q"],
                       capture_output=True, text=True, timeout=600)
    rates = {}
    for part in p.stdout.replace("\r", "\n").splitlines():
        words = part.split()
        if len(words) >= 4 and words[0] in ("SET:", "GET:") and words[2:4] == ["requests", "per"]:
            rates[words[0][:-1]] = float(words[1])
    if p.returncode != 0 or set(rates) != {"SET", "GET"}:
        raise RuntimeError(f"redis-benchmark on port {port} failed ({p.returncode}): {p.stdout[-500:]}{p.stderr[-500:]}")
    return rates["SET"], rates["GET"]


def start_redis(b, port, store=None, session=None, max_bytes=0):
    """redis-server with `dvr run` on 127.0.0.1:port; with --heap in `store` when `session` is given."""
    args = [b.dvr]
    if session:
        args += ["--store", store, "run", "--heap", f"{max_bytes >> 20}M", "--heap-session", session]
    else:
        args += ["run"]
    out, _ = b.run(*args, "--", shutil.which("redis-server"), "--port", port, "--bind", "127.0.0.1", "--save", "",
                   "--appendonly", "no", "--enable-debug-command", "yes", "--daemonize", "no")
    pid = int(out.strip())
    b.pids.append(pid)
    until_pong(port, time.perf_counter())
    return pid


def criu_dump_into(b, pid, img):
    """Plain `criu dump --leave-running` into a fresh directory: its seconds."""
    shutil.rmtree(img, ignore_errors=True)
    os.mkdir(img)
    _, took = b.run("criu", "dump", "-t", pid, "-D", img, "--leave-running", "-o", "dump.log")
    return took


def fig(f, name, key, unit, peer, peer_key, target=None):
    """A figure of the --heap section: the medians of the samples f[key] and f[peer_key], the samples with it."""
    return (name, statistics.median(f[key]), unit, peer, statistics.median(f[peer_key]), target, (f[key], f[peer_key]))


def heap_redis_figures(b, work, size, repeat):
    """Two redis-servers on TCP holding the same `size` of keys (DEBUG POPULATE, REDIS_VALUE bytes each), one
    under `dvr run --heap`, one without: the --heap one against plain CRIU on the other, every figure's peer
    from the same repeat; the median of --repeat each."""
    missing = [t for t in ("redis-server", "redis-cli", "redis-benchmark") if not shutil.which(t)]
    if missing:
        print(f"proc_bench: {', '.join(missing)} missing: no --heap redis figures (install-deps.sh installs them)",
              file=sys.stderr)
        return []
    keys = max(100, size // REDIS_VALUE)
    rewritten = max(1, keys // 100)
    requests = min(200000, max(20000, size // 5000))
    f = {k: [] for k in ("dump", "criu_dump", "dump_bytes", "redump_idle", "bytes_idle", "redump_random", "criu_random",
                         "bytes_random", "redump_contig", "criu_contig", "bytes_contig", "restore_pong", "criu_pong",
                         "clone_pong", "clone_private", "clone_mapped", "heap_bytes", "set", "set_plain", "get", "get_plain")}
    load = [os.getloadavg()[0]]
    used = 0
    clone_note = None
    for r in range(repeat):
        # Short names: CRIU's image sockets live under the store, and a socket path has 107 bytes at most.
        store = os.path.join(work, f"hr{r}")
        img = os.path.join(work, f"hrc{r}")
        session = f"bench-redis-{r}"
        heap = os.path.join(store, "heaps", session, "heap")
        os.mkdir(store)
        hport, pport = free_port(), free_port()
        while pport == hport:
            pport = free_port()
        hpid = start_redis(b, hport, store, session, heap_max(size))
        ppid = start_redis(b, pport)
        for port in (hport, pport):
            redis_cmd(port, "DEBUG", "POPULATE", str(keys), "key", str(REDIS_VALUE))
            redis_cmd(port, "SET", "canary", "dvr-bench")
        used = int(redis_cmd(hport, "INFO", "memory").split("used_memory:")[1].split()[0])

        # First dumps: plain CRIU of the plain redis, dvr of the --heap one (a fresh store: everything is new).
        f["criu_dump"].append(criu_dump_into(b, ppid, img))
        info, took = b.dvr_json(store, "proc", "dump", hpid, "--name", "first", "--leave-running")
        f["dump"].append(took)
        f["dump_bytes"].append(info["stored_bytes"])
        # Again at once, nothing changed: what a dump costs however little was written.
        info, took = b.dvr_json(store, "proc", "dump", hpid, "--name", "idle", "--leave-running")
        f["redump_idle"].append(took)
        f["bytes_idle"].append(info["stored_bytes"])

        # 1% of the keys rewritten (both servers), then dumped again: at random, then contiguous in insertion order.
        rng = random.Random(r)
        patterns = (("random", sorted(rng.sample(range(keys), rewritten))),
                    ("contig", range(keys // 3, keys // 3 + rewritten)))
        for pattern, indices in patterns:
            for port in (hport, pport):
                redis_rewrite(port, indices, f"{pattern}{r}")
            f[f"criu_{pattern}"].append(criu_dump_into(b, ppid, img))
            info, took = b.dvr_json(store, "proc", "dump", hpid, "--name", pattern[:3], "--leave-running")
            f[f"redump_{pattern}"].append(took)
            f[f"bytes_{pattern}"].append(info["stored_bytes"])
        probe = (f"key:{keys // 3}", f"contig{r}-{keys // 3}-")

        # A clone beside the running original, in a network of its own (its port is the original's).
        f["heap_bytes"].append(allocated(heap))
        if clone_note is None:
            pidfile = os.path.join(work, f"heap-redis-clone-{r}.pid")
            t0 = time.perf_counter()
            try:
                b.run(b.dvr, "--store", store, "proc", "clone", "con", "--net", "new", "--pidfile", pidfile, "--json")
            except RuntimeError as e:
                clone_note = f"dvr proc clone --net new failed, so no clone figures: {e}"
                print(f"proc_bench: {clone_note}", file=sys.stderr)
            else:
                clone = int(open(pidfile).read())
                b.pids.append(clone)
                f["clone_pong"].append(until_pong_in(b, clone, hport, t0))
                # Its private memory: its anonymous pages (those it wrote, the heap's copy-on-write
                # pages among them) plus, when its heap file is a copy of its own (a heap not sealed
                # at the dump: a file in a tmpfs only the clone sees), all of that copy, touched or
                # not. A sealed heap is the store's heap pack, shared with the store and the original.
                roll = smaps_rollup(clone)
                f["clone_mapped"].append(roll["Private_Clean"] + roll["Private_Dirty"])
                clone_heap = f"/proc/{clone}/root{heap}"
                shared = os.stat(clone_heap).st_ino in {os.stat(p).st_ino for p in glob.glob(os.path.join(store, "packs", "*.heap"))}
                f["clone_private"].append(roll["Anonymous"] + (0 if shared else allocated(clone_heap)))
                b.kill_wait(clone)

        # kill -9, then restore to the first PONG: dvr for the --heap one (its heap file is still there), criu for the other.
        b.kill_wait(hpid)
        pidfile = os.path.join(work, f"heap-redis-restore-{r}.pid")
        t0 = time.perf_counter()
        b.run(b.dvr, "--store", store, "proc", "restore", "con", "--detach", "--pidfile", pidfile)
        hpid = int(open(pidfile).read())
        b.pids.append(hpid)
        f["restore_pong"].append(until_pong(hport, t0))
        b.kill_wait(ppid)
        pidfile = os.path.join(work, f"heap-redis-criu-restore-{r}.pid")
        t0 = time.perf_counter()
        b.run("criu", "restore", "-D", img, "-d", "--pidfile", pidfile, "-o", "restore.log")
        ppid = int(open(pidfile).read())
        b.pids.append(ppid)
        f["criu_pong"].append(until_pong(pport, t0))
        for port in (hport, pport):
            if (redis_cmd(port, "GET", "canary") != "dvr-bench" or int(redis_cmd(port, "DBSIZE")) != keys + 1
                    or not redis_cmd(port, "GET", probe[0]).startswith(probe[1])):
                raise RuntimeError(f"the restored redis-server on port {port} lost data")

        # Throughput of the restored servers: the --heap one and the plain one in turn, twice, the
        # first one each repeat in turn (the machine's load drifts).
        turns = ((hport, ""), (pport, "_plain")) if r % 2 == 0 else ((pport, "_plain"), (hport, ""))
        for port, which in turns + turns:
            set_rate, get_rate = redis_throughput(port, requests)
            f["set" + which].append(set_rate)
            f["get" + which].append(get_rate)
        load.append(os.getloadavg()[0])
        b.kill_wait(hpid)
        b.kill_wait(ppid)
        shutil.rmtree(img, ignore_errors=True)
        shutil.rmtree(store, ignore_errors=True)

    print(f"proc_bench: --heap redis-servers held {keys} keys of {REDIS_VALUE} B, used_memory {used / 2**30:.2f} GiB, "
          f"heap {statistics.median(f['heap_bytes']) / 2**30:.2f} GiB; rewrites of {rewritten} keys; "
          f"redis-benchmark -n {requests}; load average {', '.join(f'{x:.1f}' for x in load)}", file=sys.stderr)
    figures = [
        fig(f, "heap_redis_dump", "dump", "s", "criu dump (plain redis)", "criu_dump", ">= 10"),
        fig(f, "heap_redis_redump_time_idle", "redump_idle", "s", "criu dump (plain redis)", "criu_dump", None),
        fig(f, "heap_redis_redump_bytes_idle", "bytes_idle", "B", "heap_redis_dump bytes", "dump_bytes", None),
        fig(f, "heap_redis_redump_time_random", "redump_random", "s", "criu dump (plain redis)", "criu_random", ">= 20"),
        fig(f, "heap_redis_redump_bytes_random", "bytes_random", "B", "heap_redis_dump bytes", "dump_bytes", ">= 50"),
        fig(f, "heap_redis_redump_time_contig", "redump_contig", "s", "criu dump (plain redis)", "criu_contig", ">= 20"),
        fig(f, "heap_redis_redump_bytes_contig", "bytes_contig", "B", "heap_redis_dump bytes", "dump_bytes", ">= 50"),
        fig(f, "heap_redis_restore_pong", "restore_pong", "s", "criu restore to PONG", "criu_pong", ">= 2"),
    ]
    if f["clone_pong"]:
        figures += [
            fig(f, "heap_redis_clone_pong", "clone_pong", "s", "criu restore to PONG", "criu_pong", None),
            fig(f, "heap_redis_clone_private", "clone_private", "B", "original's heap", "heap_bytes", ">= 20"),
            fig(f, "heap_redis_clone_mapped", "clone_mapped", "B", "original's heap", "heap_bytes", None),
        ]
    figures += [
        fig(f, "heap_redis_throughput_set", "set", "op/s", "redis without --heap", "set_plain", ">= 0.9"),
        fig(f, "heap_redis_throughput_get", "get", "op/s", "redis without --heap", "get_plain", ">= 0.9"),
    ]
    return figures


MEMCACHED_VALUE = 1000  # bytes per value of the --heap memcached figures
MEMCACHED_BASE = random.Random(11).randbytes((1 << 20) + MEMCACHED_VALUE)  # what values are cut from (high entropy)


def memcached_value(i, tag):
    """The value of key k:I as written with `tag`: MEMCACHED_VALUE bytes, "TAG-I-" then bytes of MEMCACHED_BASE."""
    head = b"%s-%d-" % (tag.encode(), i)
    off = (i * 4099) % (1 << 20)
    return head + MEMCACHED_BASE[off:off + MEMCACHED_VALUE - len(head)]


def memcached_load(port, indices, tag, timeout=300):
    """`set k:I 0 0 LEN noreply` of memcached_value(I, tag) for each I, pipelined on one connection, then a meta
    no-op (`mn`) whose MN says all of them were processed; anything else the server said is an error."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sk:
        chunk, n = [], 0
        for i in indices:
            v = memcached_value(i, tag)
            chunk.append(b"set k:%d 0 0 %d noreply\r\n%s\r\n" % (i, len(v), v))
            n += len(v) + 40
            if n >= 4 << 20:
                sk.sendall(b"".join(chunk))
                chunk, n = [], 0
        chunk.append(b"mn\r\n")
        sk.sendall(b"".join(chunk))
        reply = b""
        while not reply.endswith(b"MN\r\n"):
            got = sk.recv(65536)
            if not got:
                break
            reply += got
    if reply != b"MN\r\n":
        raise RuntimeError(f"memcached on port {port}: loading {tag} answered {reply[:500]!r}")


def memcached_get(port, key, timeout=2.0):
    """The value of `key` on 127.0.0.1:port (None when it is not there); OSError when nothing answers."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sk:
        sk.sendall(b"get %s\r\n" % key.encode())
        reply = b""
        while not (reply == b"END\r\n" or reply.endswith(b"\r\nEND\r\n") or reply.startswith(b"ERROR")
                   or reply.startswith(b"SERVER_ERROR") or reply.startswith(b"CLIENT_ERROR")):
            got = sk.recv(65536)
            if not got:
                raise OSError(f"memcached on port {port} closed the connection")
            reply += got
    if reply == b"END\r\n":
        return None
    head, _, rest = reply.partition(b"\r\n")
    words = head.split()
    if len(words) != 4 or words[0] != b"VALUE":
        raise RuntimeError(f"memcached on port {port}: get {key} answered {reply[:200]!r}")
    return rest[:int(words[3])]


def memcached_stats(port):
    """`stats` of memcached on 127.0.0.1:port, by name (strings)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sk:
        sk.sendall(b"stats\r\n")
        reply = b""
        while not reply.endswith(b"END\r\n"):
            got = sk.recv(65536)
            if not got:
                break
            reply += got
    return {w[1]: w[2] for w in (l.split() for l in reply.decode().splitlines()) if len(w) == 3 and w[0] == "STAT"}


def until_get(port, key, t0, log=None, timeout=120):
    """Seconds from t0 (perf_counter) to the first answer of memcached on port to `get key` (with its value)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if memcached_get(port, key, timeout=0.5) is not None:
                return time.perf_counter() - t0
        except OSError:
            pass
        time.sleep(0.002)
    said = open(log).read()[-2000:] if log and os.path.exists(log) else ""
    raise RuntimeError(f"memcached on port {port} did not answer get {key}{': ' + said if said else ''}")


def start_memcached(b, port, megabytes, log, store=None, session=None, max_bytes=0):
    """memcached (TCP only, -t 4) with `dvr run --output LOG` on 127.0.0.1:port; with --heap in `store` when
    `session` is given. Waits until it answers."""
    args = [b.dvr]
    if session:
        args += ["--store", store, "run", "--heap", f"{max_bytes >> 20}M", "--heap-session", session]
    else:
        args += ["run"]
    out, _ = b.run(*args, "--output", log, "--", shutil.which("memcached"), "-l", "127.0.0.1", "-p", port, "-U", "0",
                   "-m", megabytes, "-t", "4", "-u", "root")
    pid = int(out.strip())
    b.pids.append(pid)
    deadline = time.time() + 30
    while True:
        try:
            memcached_get(port, "absent", timeout=0.5)
            return pid
        except OSError:
            if time.time() > deadline or not os.path.exists(f"/proc/{pid}"):
                said = open(log).read()[-2000:] if os.path.exists(log) else ""
                raise RuntimeError(f"memcached on port {port} (pid {pid}) did not start: {said}")
            time.sleep(0.01)


def restore_tracked(b, pidfile, *args):
    """b.run(*args) of a restore writing `pidfile`: its seconds and the restored PID, which is tracked (killed at
    the end) even when the restore fails after it wrote the pidfile."""
    pid = None
    try:
        _, took = b.run(*args)
    finally:
        try:
            pid = int(open(pidfile).read())
            b.pids.append(pid)
        except (OSError, ValueError):
            pass
    if pid is None:
        raise RuntimeError(f"{' '.join(map(str, args))} wrote no PID to {pidfile}")
    return took, pid


def heap_memcached_figures(b, work, size, repeat):
    """Two memcached servers on TCP (-U 0, -t 4) loaded with the same `size` of items (MEMCACHED_VALUE bytes each,
    pipelined `set ... noreply`), one under `dvr run --heap`, one without: the --heap one against plain CRIU on the
    other, every figure's peer from the same repeat; the median of --repeat each."""
    if not shutil.which("memcached"):
        print("proc_bench: memcached missing: no --heap memcached figures (apt-get install memcached)", file=sys.stderr)
        return []
    keys = max(100, size // MEMCACHED_VALUE)
    rewritten = max(1, keys // 100)
    megabytes = max(64, (2 * size >> 20) + 64)  # items of a 1000-byte value take ~1.2 KB of slab
    changed = keys // 3  # the first of the rewritten keys
    rewrite = range(changed, changed + rewritten)
    samples = sorted({0, 1, keys // 2, keys - 1, changed - 1, changed, changed + rewritten - 1, changed + rewritten})
    f = {k: [] for k in ("dump", "criu_dump", "dump_bytes", "redump", "criu_redump", "redump_bytes", "restore",
                         "criu_restore", "heap_bytes")}
    load = [os.getloadavg()[0]]
    used = 0
    for r in range(repeat):
        store = os.path.join(work, f"hm{r}")  # short: CRIU's image sockets live under the store (107 bytes a path)
        img = os.path.join(work, f"hmc{r}")
        session = f"bench-mc-{r}"
        heap = os.path.join(store, "heaps", session, "heap")
        os.mkdir(store)
        hport, pport = free_port(), free_port()
        while pport == hport:
            pport = free_port()
        hlog, plog = os.path.join(work, f"mc-heap-{r}.log"), os.path.join(work, f"mc-plain-{r}.log")
        hpid = start_memcached(b, hport, megabytes, hlog, store, session, heap_max(size))
        ppid = start_memcached(b, pport, megabytes, plog)
        for port in (hport, pport):
            memcached_load(port, range(keys), "L")
        expect = {i: memcached_value(i, "L") for i in samples}
        for port in (hport, pport):
            stats = memcached_stats(port)
            if int(stats.get("curr_items", -1)) != keys or int(stats.get("evictions", -1)) != 0:
                raise RuntimeError(f"memcached on port {port} holds {stats.get('curr_items')} items of {keys} "
                                   f"({stats.get('evictions')} evictions)")
            for i, v in expect.items():
                if memcached_get(port, f"k:{i}") != v:
                    raise RuntimeError(f"memcached on port {port}: k:{i} is not what was set")
        used = int(memcached_stats(hport)["bytes"])

        # First dumps: plain CRIU of the plain memcached, dvr of the --heap one (a fresh store: everything is new).
        f["criu_dump"].append(criu_dump_into(b, ppid, img))
        info, took = b.dvr_json(store, "proc", "dump", hpid, "--name", "first", "--leave-running")
        f["dump"].append(took)
        f["dump_bytes"].append(info["stored_bytes"])

        # 1% of the keys rewritten (both servers, contiguous in insertion order), then dumped again.
        tag = f"w{r}"
        for port in (hport, pport):
            memcached_load(port, rewrite, tag)
        expect.update({i: memcached_value(i, tag) for i in samples if i in rewrite})
        f["criu_redump"].append(criu_dump_into(b, ppid, img))
        info, took = b.dvr_json(store, "proc", "dump", hpid, "--name", "second", "--leave-running")
        f["redump"].append(took)
        f["redump_bytes"].append(info["stored_bytes"])
        f["heap_bytes"].append(allocated(heap))

        # kill -9, then restored (the --heap one with its heap file still there) until `get` of a key answers.
        probe = f"k:{changed}"
        b.kill_wait(hpid)
        pidfile = os.path.join(work, f"mc-heap-restore-{r}.pid")
        t0 = time.perf_counter()
        _, hpid = restore_tracked(b, pidfile, b.dvr, "--store", store, "proc", "restore", "second", "--detach",
                                  "--pidfile", pidfile)
        f["restore"].append(until_get(hport, probe, t0, hlog))
        b.kill_wait(ppid)
        pidfile = os.path.join(work, f"mc-criu-restore-{r}.pid")
        t0 = time.perf_counter()
        _, ppid = restore_tracked(b, pidfile, "criu", "restore", "-D", img, "-d", "--pidfile", pidfile,
                                  "-o", "restore.log")
        f["criu_restore"].append(until_get(pport, probe, t0, plog))
        for port in (hport, pport):
            stats = memcached_stats(port)
            if int(stats.get("curr_items", -1)) != keys:
                raise RuntimeError(f"the restored memcached on port {port} holds {stats.get('curr_items')} items "
                                   f"of {keys}")
            for i, v in expect.items():
                if memcached_get(port, f"k:{i}") != v:
                    raise RuntimeError(f"the restored memcached on port {port} lost data: k:{i}")
        load.append(os.getloadavg()[0])
        b.kill_wait(hpid)
        b.kill_wait(ppid)
        shutil.rmtree(img, ignore_errors=True)
        shutil.rmtree(store, ignore_errors=True)

    print(f"proc_bench: --heap memcached servers held {keys} items of {MEMCACHED_VALUE} B (-m {megabytes}, "
          f"stats bytes {used / 2**30:.2f} GiB), heap {statistics.median(f['heap_bytes']) / 2**30:.2f} GiB; "
          f"rewrites of {rewritten} keys; load average {', '.join(f'{x:.1f}' for x in load)}", file=sys.stderr)
    return [
        fig(f, "heap_memcached_dump", "dump", "s", "criu dump (memcached)", "criu_dump", ">= 10"),
        fig(f, "heap_memcached_redump_time", "redump", "s", "criu dump (memcached)", "criu_redump", ">= 20"),
        fig(f, "heap_memcached_redump_bytes", "redump_bytes", "B", "the first dump's bytes", "dump_bytes", ">= 50"),
        fig(f, "heap_memcached_restore", "restore", "s", "criu restore to get", "criu_restore", ">= 2"),
    ]


def heap_python_figures(b, work, size, repeat):
    """A Python process holding a numpy array of `size` (bench/heap_bench_fill.py): under `dvr run --heap`, dumped
    by dvr, once loaded and again after 1% of the array was written, against plain CRIU dumps of the same program
    without --heap, at the same moments. The median of --repeat each."""
    python = "/usr/bin/python3"
    if subprocess.run([python, "-c", "import numpy"], capture_output=True).returncode != 0:
        print(f"proc_bench: {python} has no numpy: no --heap Python figures (install-deps.sh installs python3-numpy)",
              file=sys.stderr)
        return []
    fill = os.path.join(os.path.dirname(os.path.abspath(__file__)), "heap_bench_fill.py")
    f = {k: [] for k in ("dump", "criu_dump", "dump_bytes", "redump", "criu_redump", "redump_bytes")}
    for r in range(repeat):
        store = os.path.join(work, f"hp{r}")
        img = os.path.join(work, f"hpc{r}")
        os.mkdir(store)
        pids = {}
        for which in ("heap", "plain"):
            status = os.path.join(work, f"heap-py-{which}-{r}.status")
            heap_args = ["--store", store, "run", "--heap", f"{heap_max(size) >> 20}M", "--heap-session", f"bench-py-{r}"]
            out, _ = b.run(b.dvr, *(heap_args if which == "heap" else ["run"]), "--", python, fill, "--size", size,
                           "--status", status)
            pids[which] = int(out.strip())
            b.pids.append(pids[which])
        for gen, (dump, criu_peer, stored) in enumerate((("dump", "criu_dump", "dump_bytes"),
                                                        ("redump", "criu_redump", "redump_bytes"))):
            if gen:
                for pid in pids.values():
                    os.kill(pid, signal.SIGUSR1)
            for which in pids:
                b.wait_ready(os.path.join(work, f"heap-py-{which}-{r}.status"), gen)
            f[criu_peer].append(criu_dump_into(b, pids["plain"], img))
            info, took = b.dvr_json(store, "proc", "dump", pids["heap"], "--name", dump, "--leave-running")
            f[dump].append(took)
            f[stored].append(info["stored_bytes"])
        for pid in pids.values():
            b.kill_wait(pid)
        shutil.rmtree(img, ignore_errors=True)
        shutil.rmtree(store, ignore_errors=True)
    return [
        fig(f, "heap_py_dump", "dump", "s", "criu dump (plain python)", "criu_dump", None),
        fig(f, "heap_py_redump", "redump", "s", "criu dump (plain python)", "criu_redump", None),
        fig(f, "heap_py_redump_bytes", "redump_bytes", "B", "heap_py_dump bytes", "dump_bytes", None),
    ]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1G")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-redis", action="store_true", help="leave out the redis-server figures (--heap ones too)")
    ap.add_argument("--heap", dest="heap", action="store_true", default=None,
                    help="the `dvr run --heap` figures (the default when redis-server or memcached, and "
                         "build/preload/libdvr_heap.so exist)")
    ap.add_argument("--no-heap", dest="heap", action="store_false", help="leave out the `dvr run --heap` figures")
    ap.add_argument("--heap-only", action="store_true", help="only the `dvr run --heap` figures")
    ap.add_argument("--build", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build"))
    args = ap.parse_args()
    size = parse_size(args.size)
    mib = max(1, size >> 20)
    repeat = max(1, args.repeat)
    if os.geteuid() != 0:
        print("proc_bench: needs root (CRIU does)", file=sys.stderr)
        return 77
    build = os.path.abspath(args.build)
    if args.heap is None and not args.heap_only:
        args.heap = bool(shutil.which("redis-server") or shutil.which("memcached")) and os.path.exists(heap_preload(build))
    if args.heap_only and args.heap is False:
        print("proc_bench: --heap-only and --no-heap leave nothing to measure", file=sys.stderr)
        return 2
    if args.heap_only:
        args.heap = True
    if args.heap and not os.path.exists(heap_preload(build)):
        print(f"proc_bench: --heap needs {heap_preload(build)} (build with libjemalloc-dev installed)", file=sys.stderr)
        return 2
    # A SIGTERM ends the run through the `finally` below, which kills everything it started.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    work = tempfile.mkdtemp(prefix="dvr-proc-bench-", dir="/dev/shm")
    b = Bench(build, work)
    try:
        figures = []
        if not args.heap_only:
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
            criu_restore, dvr_restore, pipe_restore = [], [], []
            pipe_env = dict(os.environ, DVR_PROC_PAGE_FILL="0")
            for r in range(repeat):
                pidfile = os.path.join(work, f"criu-{r}.pid")
                _, took = b.run("criu", "restore", "-D", img, "-d", "--pidfile", pidfile, "-o", "restore.log")
                criu_restore.append(took)
                restored = int(open(pidfile).read())
                b.kill_wait(restored)
                out, took = b.run(b.dvr, "--store", store, "proc", "restore", f"a{repeat}", "--detach")
                dvr_restore.append(took)
                b.kill_wait(int(out.strip()))
                out, took = b.run(b.dvr, "--store", store, "proc", "restore", f"a{repeat}", "--detach", env=pipe_env)
                pipe_restore.append(took)
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
            shutil.rmtree(store, ignore_errors=True)  # the memory the later figures need
            shutil.rmtree(heap_store, ignore_errors=True)

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
                ("restore_anon_pipe", min(pipe_restore), "s", "criu restore (tmpfs)", min(criu_restore)),
                ("dump_peak_rss", dump_rss, "B", "job size", size),
                ("restore_peak_rss", restore_rss, "B", "job size", size),
            ]
            if not args.no_redis:
                figures += redis_figures(b, work, size, repeat)
            figures = [fig + (None, None) for fig in figures]  # no targets, best of --repeat
        if args.heap:
            if not args.no_redis:
                figures += heap_redis_figures(b, work, size, repeat)
            figures += heap_memcached_figures(b, work, size, repeat)
            figures += heap_python_figures(b, work, size, repeat)

        def ratio(value, peer_value, unit):
            # How many times better ours is (docs/performance.md): peer / value
            # for costs (s, B), value / peer for rates (op/s).
            if not value or not peer_value:
                return None
            return value / peer_value if unit == "op/s" else peer_value / value

        def met(value, peer_value, unit, target):
            if not target:
                return ""
            r = ratio(value, peer_value, unit)
            ok = r is not None and r >= float(target.split()[1])
            return f"{target:>7} {'met' if ok else 'MISSED'}"

        if args.json:
            for name, value, unit, peer, peer_value, target, samples in figures:
                r = ratio(value, peer_value, unit)
                line = {"name": name, "value": value, "unit": unit, "peer": peer,
                        "peer_value": peer_value if r is not None else None, "ratio": r, "bytes": size}
                if target:
                    line["target"] = target
                if samples:
                    line["samples"], line["peer_samples"] = samples
                print(json.dumps(line))
        # With --json the table goes to stderr (stdout stays JSON lines).
        table = sys.stderr if args.json else sys.stdout
        print(f"proc-bench: three jobs of {size / 2**30:.2f} GiB each, store {work} (tmpfs), best of {repeat}"
              f"{f'; heap_* figures: median of {repeat}' if args.heap else ''}\n", file=table)
        print(f"  {'figure':30} {'value':>13}   {'peer':24} {'peer value':>13}   {'ratio':>8}   target", file=table)
        for name, value, unit, peer, peer_value, target, _ in figures:
            fmt = {"s": lambda v: f"{v * 1000:9.1f} ms", "op/s": lambda v: f"{v:8.0f} op/s"}.get(
                unit, lambda v: f"{v / 2**20:8.1f} MiB")
            r = ratio(value, peer_value, unit)
            print(f"  {name:30} {fmt(value):>13}   {peer:24} {fmt(peer_value):>13}   "
                  f"{'-' if r is None else f'{r:.3f}':>8}   {met(value, peer_value, unit, target)}", file=table)
    finally:
        b.kill_all()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
