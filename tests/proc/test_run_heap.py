"""`dvr run --heap`: an unmodified, dynamically linked program whose heap lives
in a DVR persistent heap (preload/dvr_heap.c). Its malloc family, C++ new and
its own anonymous mmap are served from the heap file STORE/heaps/SESSION/heap,
mapped MAP_SHARED at 0x200000000000; `dvr proc dump` snapshots that file (only
what was written since the last dump), `dvr proc restore` puts it back.

The programs are heap_probe.c beside this file (compiled here with cc; it
prints what it got, one "KEY VALUE..." line at a time, and waits for the test
between steps), redis-server (its RDB child forks off the heap) and memcached.
The test reads the heap file itself to see what reached it.

Needs root, CRIU 4.x, cc; redis-server / redis-cli and memcached for their
tests (install-deps.sh installs them); skips with the reason otherwise.

Run: DVR_BIN=build/dvr DVR_TEST_JOB=build/dvr-test-job /usr/bin/python3 -m pytest tests/proc/test_run_heap.py
"""

import hashlib
import os
import random
import re
import shutil
import socket
import stat
import subprocess
import time
from pathlib import Path

import pytest
from dvrtest import MIB, alive, data_extents, flip_byte, kill9, assert_failed, criu_dumps_inet_sockets, describe, run, wait_gone, wait_until
from test_tcp_servers import (MEMCACHED, REDIS_CLI, REDIS_SERVER, free_port, listening, memcached_set_all, needs,
                              redis_cli, resp, wait_redis, wait_until_listening)

HEAP_BASE = 0x200000000000
PYTHON_BIN = "/usr/bin/python3"


def _preload():
    # Where dvr looks first (libdvr/src/proc/run.cpp heap_preload()).
    if os.environ.get("DVR_HEAP_PRELOAD"):
        return Path(os.environ["DVR_HEAP_PRELOAD"])
    return Path(os.environ.get("DVR_BIN", "build/dvr")).resolve().parent / "preload" / "libdvr_heap.so"


pytestmark = pytest.mark.skipif(not _preload().is_file(),
                                reason=f"{_preload()} is not built (it needs libjemalloc-dev: bash install-deps.sh)")
PROBE_SRC = Path(__file__).resolve().parent / "heap_probe.c"
GIB = 1024 * MIB


# --- the probe program

def compile_probe(out_dir, *extra):
    cc = shutil.which("cc")
    if not cc:
        pytest.skip("no C compiler (cc) to build tests/proc/heap_probe.c")
    exe = Path(out_dir) / ("heap_probe" + ("-static" if "-static" in extra else ""))
    run([cc, "-O1", "-pthread", *extra, "-o", exe, PROBE_SRC, "-ldl"], expect=0)
    return exe


@pytest.fixture(scope="module")
def probe_bin(tmp_path_factory):
    return compile_probe(tmp_path_factory.mktemp("heap-probe"))


def heap_file(work, session):
    return work.store / "heaps" / session / "heap"


def start_heap_job(work, argv, output, heap="1G", session="job", env=None):
    """`dvr --store STORE run --heap HEAP --heap-session SESSION --output OUTPUT -- ARGV`:
    the job's PID (killed when the test ends)."""
    proc = work.dvr("run", "--heap", heap, "--heap-session", session, "--output", output, "--", *argv, env=env)
    line = proc.stdout.strip()
    assert re.fullmatch(r"\d+", line), f"expected a PID alone on stdout:\n{describe(proc)}"
    pid = int(line)
    work.pids.add(pid)
    assert alive(pid), f"pid {pid} printed, but no such process runs:\n{describe(proc)}"
    assert str(heap_file(work, session)) in proc.stderr, f"dvr run does not name the heap file:\n{describe(proc)}"
    status = heap_file(work, session).parent / ".heap.status"
    assert status.read_text().splitlines()[0] == "ok", status.read_text()
    return pid


class Probe:
    """heap_probe MODE CTL ARGS... under `dvr run --heap`."""

    def __init__(self, work, exe, mode, *args, heap="1G", session="probe"):
        self.work, self.session = work, session
        self.heap_bytes = parse_size(heap)
        self.ctl = work.path(f"ctl-{session}")
        self.ctl.mkdir()
        self.output = work.path(f"{session}.out")
        self.pid = start_heap_job(work, [exe, mode, self.ctl, *args], self.output, heap=heap, session=session)
        self.heap = heap_file(work, session)

    def text(self):
        try:
            return self.output.read_text()
        except FileNotFoundError:
            return ""

    def lines(self):
        return self.text().splitlines()

    def wait_line(self, prefix, timeout=60):
        """The first complete output line starting with `prefix` (waits for it)."""
        def find():
            text = self.text()
            complete = text[:text.rfind("\n") + 1]
            return next((l for l in complete.splitlines() if l.startswith(prefix)), None)
        line = wait_until(find, timeout=timeout)
        if line is None:
            pytest.fail(f"heap_probe printed no line starting with {prefix!r} within {timeout} s; pid {self.pid} "
                        f"alive={alive(self.pid)}\n--- its output\n{self.text()[-4000:]}")
        return line

    def fields(self, prefix, timeout=60):
        """The key=value fields of the line starting with `prefix`, as ints where they are numbers."""
        out = {}
        for word in self.wait_line(prefix, timeout).split():
            if "=" in word:
                k, v = word.split("=", 1)
                out[k] = int(v, 0) if re.fullmatch(r"-?(0x[0-9a-f]+|\d+)", v) else v
        return out

    def go(self, name):
        (self.ctl / name).touch()

    def step(self, name):
        """Waits until the probe waits for `name`, then lets it go on."""
        self.wait_line(f"wait {name}")
        self.go(name)

    def regions(self):
        """{name: (address, size, tag or None)} of the "region" lines so far."""
        out = {}
        for line in self.lines():
            w = line.split()
            if len(w) == 5 and w[0] == "region":
                out[w[1]] = (int(w[2], 16), int(w[3]), None if w[4] == "-" else w[4])
        return out

    def in_heap(self, addr, size):
        return HEAP_BASE <= addr and addr + size <= HEAP_BASE + self.heap_bytes


def parse_size(text):
    m = re.fullmatch(r"(\d+)([KMG]?)", text)
    return int(m.group(1)) * {"": 1, "K": 1024, "M": MIB, "G": GIB}[m.group(2)]


def pattern(tag, length, phase=0):
    """The bytes heap_probe's fill() writes: the tag padded to 16 with '.', repeated."""
    unit = tag.encode()[:16].ljust(16, b".")
    reps = (length + phase) // 16 + 2
    return (unit * reps)[phase:phase + length]


def assert_file_holds(path, addr, size, tag, context=""):
    """The heap file holds `tag`'s pattern over [addr, addr + size) of the heap."""
    step = 8 * MIB
    with open(path, "rb") as f:
        for off in range(0, size, step):
            n = min(step, size - off)
            f.seek(addr - HEAP_BASE + off)
            data = f.read(n)
            want = pattern(tag, n)
            if data != want:
                if len(data) < n:
                    pytest.fail(f"{context}: the heap file {path} ends before heap address {addr + off + len(data):#x}")
                page = next(i for i in range(0, n, 4096) if data[i:i + 4096] != want[i:i + 4096])
                bad = next(i for i in range(page, page + 4096) if data[i] != want[i])
                pytest.fail(f"{context}: the heap file {path} does not hold {tag!r} at heap address "
                            f"{addr + off + bad:#x} (block {addr:#x}+{size}): {data[bad:bad + 32]!r}")


def file_range(path, offset, size):
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(size)


def file_data(path):
    """The data extents of a sparse file: [(offset, bytes)]."""
    out = []
    with open(path, "rb") as f:
        for start, end in data_extents(path):
            f.seek(start)
            out.append((start, f.read(end - start)))
    return out


def file_contains(path, needle):
    return any(needle in data for _, data in file_data(path))


def allocated(path):
    return os.stat(path).st_blocks * 512


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(16 * MIB), b""):
            h.update(block)
    return h.hexdigest()


def smaps_rollup(pid):
    """/proc/PID/smaps_rollup in bytes, by field."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            words = line.split()
            if len(words) == 3 and words[2] == "kB":
                out[words[0].rstrip(":")] = int(words[1]) * 1024
    return out


def read_memory(pid, addr, size):
    """`size` bytes of process `pid`'s memory at `addr` (/proc/PID/mem)."""
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as f:
        f.seek(addr)
        return f.read(size)


def heap_mappings(pid, heap):
    """The lines of /proc/PID/maps that map the heap file."""
    with open(f"/proc/{pid}/maps") as f:
        return [l.rstrip("\n") for l in f if l.rstrip("\n").endswith(str(heap))]


def heap_mode(pid, heap):
    """'rw-s' / 'rw-p' (each distinct permission string of the heap's mappings, joined by ',')."""
    return ",".join(sorted({l.split()[1] for l in heap_mappings(pid, heap)}))


def wait_shared(pid, heap, timeout=10):
    ok = wait_until(lambda: heap_mode(pid, heap) == "rw-s", timeout=timeout)
    assert ok, f"the heap of pid {pid} is not mapped shared again within {timeout} s: {heap_mappings(pid, heap)}"


def children(pid):
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            out += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        except FileNotFoundError:
            pass
    return out


# --- 1. the malloc family, new, mmap, threads

def test_probe_allocations_live_in_the_heap_file(work, probe_bin):
    """Every big block of the malloc family, operator new and an anonymous
    mmap lies inside the heap's range, holds what the program wrote, and that
    content is in the heap file itself; calloc and fresh mmap memory read zero
    (also where a freed dirty block is reused); 4 threads allocate and free at
    once without a wrong byte; PROT_NONE and shared mappings stay the kernel's."""
    p = Probe(work, probe_bin, "alloc", heap="2G")
    maps = heap_mappings(p.pid, p.heap)
    assert len(maps) == 1, maps
    lo, hi = (int(x, 16) for x in maps[0].split()[0].split("-"))
    assert (lo, hi, maps[0].split()[1]) == (HEAP_BASE, HEAP_BASE + 2 * GIB, "rw-s"), maps

    checked = p.fields("checked")
    assert checked["bad"] == 0, p.text()
    assert "operator_new_from none" not in p.text(), "operator new was not found in the program"
    regions = p.regions()
    heap_blocks = ["malloc", "calloc", "calloc2", "realloc_head", "realloc", "posix_memalign",
                   "aligned_alloc", "memalign", "valloc", "new", "new_array", "mmap"]
    assert set(heap_blocks) <= set(regions), f"missing blocks: {set(heap_blocks) - set(regions)}\n{p.text()}"
    outside = {n: f"{regions[n][0]:#x}+{regions[n][1]}" for n in heap_blocks if not p.in_heap(*regions[n][:2])}
    assert not outside, f"blocks outside the heap [{HEAP_BASE:#x}, +2G): {outside}\n{p.text()}"
    assert regions["realloc"][1] >= 256 * MIB
    for name in ("mmap_prot_none", "mmap_shared"):  # the kernel's
        addr, size, _ = regions[name]
        assert not (HEAP_BASE <= addr < HEAP_BASE + 2 * GIB), f"{name} at {addr:#x} is inside the heap"
    # No two live blocks overlap (their patterns were all intact, checked above; and by address).
    live = sorted((regions[n][0], regions[n][0] + regions[n][1], n) for n in heap_blocks
                  if n != "realloc_head")
    for (a0, a1, an), (b0, b1, bn) in zip(live, live[1:]):
        assert a1 <= b0, f"{an} [{a0:#x}, {a1:#x}) overlaps {bn} [{b0:#x}, {b1:#x})"
    # What the program wrote is in the heap file.
    for name in heap_blocks:
        addr, size, tag = regions[name]
        if tag:
            assert_file_holds(p.heap, addr, size, tag, context=name)

    p.go("inspected")
    done = p.fields("done", timeout=120)
    assert done["bad"] == 0, p.text()
    threads = p.fields("threads")
    assert threads["bad"] == 0, f"wrong bytes or failed allocations with 4 threads: {threads}\n{p.text()}"
    assert threads["big"] > 100 and threads["outside_big"] == 0, threads
    regions = p.regions()
    for name in ("realloc_shrunk", "mmap_again"):
        assert p.in_heap(*regions[name][:2]), (name, regions[name])
    assert alive(p.pid)


# --- 2. freed memory goes back to the file system

def test_freed_memory_is_punched_out_of_the_heap_file(work, probe_bin):
    p = Probe(work, probe_bin, "purge", heap="1G")
    assert p.fields("touched")["ok"] == 1, p.text()
    addr, size, _ = p.regions()["big"]
    assert p.in_heap(addr, size)
    used = allocated(p.heap)
    assert used >= 512 * MIB, f"512 MiB touched, the heap file holds {used / MIB:.1f} MiB"
    p.step("free")
    assert p.fields("purged")["rc"] == 0, p.text()
    used_after = wait_until(lambda: (lambda u: u if u < 64 * MIB else None)(allocated(p.heap)), timeout=30)
    assert used_after is not None, (f"after free and arena.0.purge the heap file still holds "
                                    f"{allocated(p.heap) / MIB:.1f} MiB (of {used / MIB:.1f})")
    assert alive(p.pid)


# --- 3. fork: copy-on-write for both sides, the file stays the parent's

def test_fork_child_writes_never_reach_the_file_and_the_heap_is_shared_again(work, probe_bin):
    p = Probe(work, probe_bin, "fork", heap="1G")
    p.wait_line("wait fork")
    regions = p.regions()
    a, b = regions["a"], regions["b"]
    n = a[1]
    assert p.in_heap(*a[:2]) and p.in_heap(*b[:2])
    assert heap_mode(p.pid, p.heap) == "rw-s"
    p.go("fork")

    child_line = p.fields("child wrote")
    assert child_line["ok"] == 1, p.text()
    assert p.fields("child pid")["sees_parent"] == 1, "the child does not see the parent's memory of the fork"
    assert p.fields("parent wrote_during")["ok"] == 1
    p.wait_line("wait child-exit")
    # While the child lives: both sides map the heap privately.
    assert heap_mode(p.pid, p.heap) == "rw-p", f"parent's heap during the fork: {heap_mappings(p.pid, p.heap)}"
    kids = children(p.pid)
    assert len(kids) == 1, kids
    assert heap_mode(kids[0], p.heap) == "rw-p", f"child's heap: {heap_mappings(kids[0], p.heap)}"
    # (The child's own malloc may come from the heap's range: its private copy, its own memory.)
    assert not file_contains(p.heap, b"CHILD-WROTE"), "the child's writes reached the heap file"
    assert_file_holds(p.heap, a[0], n, "PARENT-BEFORE", "a, child alive")
    assert_file_holds(p.heap, b[0], n, "PARENT-B-OLD", "b, child alive (the parent's write waits in private memory)")

    p.go("child-exit")
    assert p.fields("child exited") == {"exited": 1, "status": 0}, p.text()
    intact = p.fields("parent intact")
    assert intact == {"a": 1, "b": 1}, f"the parent's memory changed under the child: {intact}"
    t0 = time.monotonic()
    wait_shared(p.pid, p.heap, timeout=30)
    reshared_after = time.monotonic() - t0
    # The parent's write of the fork's time went into the file; the child's never.
    assert_file_holds(p.heap, b[0], n, "PARENT-DURING", "b after the re-share")
    assert_file_holds(p.heap, a[0], n, "PARENT-BEFORE", "a after the re-share")
    assert not file_contains(p.heap, b"CHILD-WROTE") and not file_contains(p.heap, b"CHILD-OWN")

    p.step("write-after")
    assert p.fields("parent wrote_after")["ok"] == 1
    assert_file_holds(p.heap, a[0], n, "PARENT-AFTER", "a written after the re-share")
    assert heap_mode(p.pid, p.heap) == "rw-s"
    print(f"heap shared again {reshared_after:.2f} s after the child exited")


# --- 4. exec

def test_exec_by_a_child_runs_without_heap_and_exec_by_the_owner_starts_empty(work, probe_bin):
    p = Probe(work, probe_bin, "exec", heap="512M")
    assert p.fields("cat exited")["status"] == 0, p.text()
    a = p.regions()["a"]
    assert p.in_heap(*a[:2])
    child_maps = (p.ctl / "child.maps").read_text()
    assert "bin/cat" in child_maps, f"not the maps of cat:\n{child_maps[:2000]}"
    assert str(p.heap) not in child_maps and "heaps/" not in child_maps, (
        f"the exec'd child maps the heap:\n{child_maps}")
    for line in child_maps.splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        assert hi <= HEAP_BASE or lo >= HEAP_BASE + 512 * MIB, f"the exec'd child has a mapping in the heap's range: {line}"
    assert_file_holds(p.heap, a[0], a[1], "BEFORE-EXEC", "before the owner's exec")

    p.step("reexec")
    assert p.fields("reexec old_data_gone")["old_data_gone"] == 1, (
        f"the owner's exec'd program sees the old program's heap:\n{p.text()}")
    after = wait_until(lambda: p.regions().get("after"), timeout=30)
    assert after and p.in_heap(*after[:2]), p.text()
    assert p.fields("reexec pid")["pid"] == 1
    assert heap_mode(p.pid, p.heap) == "rw-s", heap_mappings(p.pid, p.heap)
    assert not file_contains(p.heap, pattern("BEFORE-EXEC", 64)), "the old program's heap is still in the file"
    assert_file_holds(p.heap, after[0], after[1], "AFTER-EXEC", "after the owner's exec")
    assert allocated(p.heap) < 64 * MIB


# --- 5. out of heap

def test_out_of_heap_malloc_returns_null_and_the_program_goes_on(work, probe_bin):
    p = Probe(work, probe_bin, "enomem", heap="64M")
    big = p.fields("malloc_1g")
    assert big == {"ptr": 0, "errno": 12}, f"malloc(1 GiB) in a 64 MiB heap: {big}"
    assert p.fields("mmap_1g") == {"failed": 1, "errno": 12}, p.text()
    filled = p.fields("filled")
    # The heap holds at most 64 MiB; a few MiB jemalloc had before the heap was in place may serve too.
    assert filled["errno"] == 12 and 40 <= filled["in_heap"] <= 64 and filled["blocks"] <= 64 + 16, filled
    assert p.fields("continues")["ok"] == 1, p.text()
    p.wait_line("idle")
    assert alive(p.pid)
    assert heap_mode(p.pid, p.heap) == "rw-s"


def test_freed_heap_serves_a_block_of_half_its_size(work, probe_bin):
    """After filling a 64 MiB heap with 1 MiB blocks and freeing every one, a
    32 MiB block fits again (right away, or once jemalloc purged)."""
    p = Probe(work, probe_bin, "enomem", "1024", heap="64M")
    assert p.fields("continues")["ok"] == 1, p.text()
    assert p.fields("reuse_half_after_purge")["ok"] == 1, f"malloc(32 MiB) after freeing the whole heap:\n{p.text()}"
    half = p.regions()["half"]
    assert p.in_heap(*half[:2]), half


# --- 6. what cannot be preloaded into

def refused(work, argv, session, tmp_path):
    before = work.running()
    proc = work.dvr("run", "--heap", "64M", "--heap-session", session, "--output", tmp_path / f"{session}.out",
                    "--", *argv, expect=None)
    if proc.returncode == 0 and re.fullmatch(r"\d+", proc.stdout.strip()):
        work.pids.add(int(proc.stdout.strip()))
    work.assert_nothing_new_running(before, f"after refusing {argv[0]}")
    assert not heap_file(work, session).exists(), "a refused run left a heap file"
    return proc


def test_static_binary_is_refused(work, tmp_path):
    if not any(Path(d, "libc.a").exists() for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib")):
        pytest.skip("no libc.a (libc6-dev) to link a static heap_probe")
    exe = compile_probe(tmp_path, "-static")
    out = run(["file", exe], expect=None).stdout if shutil.which("file") else ""
    assert "dynamically linked" not in out, out
    proc = refused(work, [exe, "sleep", work.path("ctl-static")], "static", tmp_path)
    assert_failed(proc, r"^dvr: ", r"statically linked", re.escape(str(exe)), context="static binary")


def test_setuid_program_is_refused(work, tmp_path):
    prog = tmp_path / "true-setuid"
    shutil.copy("/bin/true", prog)
    os.chmod(prog, 0o4755)
    assert os.stat(prog).st_mode & stat.S_ISUID
    proc = refused(work, [prog], "setuid", tmp_path)
    assert_failed(proc, r"^dvr: ", r"setuid", context="setuid program")


# --- redis-server and memcached under --heap

@pytest.fixture
def tcp_dumps():
    if not criu_dumps_inet_sockets():
        pytest.skip("CRIU here cannot dump TCP sockets (CRIU < 4.2 on Linux >= 6.16); run install-deps.sh")


def start_redis_heap(work, session="redis", heap="2G", directory=None, extra=()):
    needs(REDIS_SERVER, REDIS_CLI, what="redis-server and redis-tools")
    port = free_port()
    work.tokens.add(f"127.0.0.1:{port}")  # redis-server renames its command line
    argv = [REDIS_SERVER, "--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--daemonize", "no", "--dir", directory or work.root, *extra]
    pid = start_heap_job(work, argv, work.path(f"{session}.out"), heap=heap, session=session)
    wait_redis(port)
    assert heap_mode(pid, heap_file(work, session)) == "rw-s"
    return pid, port


def read_reply(f):
    line = f.readline()
    assert line.endswith(b"\r\n"), f"redis closed the connection (got {line!r})"
    kind, rest = line[:1], line[1:-2]
    if kind == b"+":
        return rest
    if kind == b"-":
        raise AssertionError(f"redis error: {rest.decode()}")
    if kind == b":":
        return int(rest)
    if kind == b"$":
        n = int(rest)
        if n < 0:
            return None
        data = f.read(n + 2)
        assert len(data) == n + 2, "redis closed the connection in a reply"
        return data[:-2]
    if kind == b"*":
        n = int(rest)
        return None if n < 0 else [read_reply(f) for _ in range(n)]
    raise AssertionError(f"unexpected reply {line!r}")


def redis_pipeline(port, commands):
    """Sends the commands on one connection, then reads their replies (in order)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(b"".join(resp(*c) for c in commands))
        f = s.makefile("rb")
        return [read_reply(f) for _ in commands]


def value(i, gen):
    """Key i's value of generation gen, 1 KiB, starting with the marker <i:gen>."""
    return (f"<{i}:{gen}>" + f"v{i}g{gen}|" * 110).encode()[:1024]


def values_in_file(path, gen):
    """The key numbers i whose value of generation `gen` (its marker) is in the heap file."""
    found = set()
    marker = re.compile(rb"<(\d+):%d>" % gen)
    for _, data in file_data(path):
        found.update(int(m) for m in marker.findall(data))
    return found


def load(port, values):
    """SETs every (key, value) with redis-cli --pipe."""
    out = redis_cli(port, "--pipe", stdin=b"".join(resp("SET", k, v) for k, v in values.items()), timeout=120)
    assert "errors: 0" in out and f"replies: {len(values)}" in out, out


def assert_redis_holds(port, expected, context):
    """redis has exactly the keys of `expected`, each with its value."""
    keys = sorted(expected)
    batches = [keys[k:k + 1000] for k in range(0, len(keys), 1000)]
    replies = redis_pipeline(port, [["DBSIZE"], ["KEYS", "*"], *(["MGET", *b] for b in batches)])
    assert replies[0] == len(expected), f"{context}: DBSIZE {replies[0]}, expected {len(expected)}"
    got_keys = {k.decode() for k in replies[1]}
    assert got_keys == set(expected), (f"{context}: {len(got_keys - set(expected))} unexpected keys "
                                       f"{sorted(got_keys - set(expected))[:5]}, {len(set(expected) - got_keys)} "
                                       f"missing {sorted(set(expected) - got_keys)[:5]}")
    wrong = [k for batch, vals in zip(batches, replies[2:]) for k, v in zip(batch, vals) if v != expected[k]]
    assert not wrong, f"{context}: {len(wrong)} keys with wrong values, e.g. {wrong[:5]}"


def redis_info(port, section):
    text = redis_cli(port, "INFO", section)
    return dict(l.split(":", 1) for l in text.splitlines() if ":" in l)


N_KEYS = 50000


def test_redis_heap_incremental_dumps_kill_and_restore(work, tcp_dumps):
    """redis-server under --heap with 50k keys of 1 KiB: its data is in the
    heap file; a second dump after rewriting 1% of the keys stores far less
    than the first; killed and restored, every key is back with its value."""
    t0 = time.monotonic()
    pid, port = start_redis_heap(work)
    heap = heap_file(work, "redis")
    expected = {f"key:{i}": value(i, 0) for i in range(N_KEYS)}
    load(port, expected)
    # (The first few: jemalloc's slabs from before the heap was in place may hold them.)
    in_file = values_in_file(heap, 0)
    assert len(in_file) >= 0.95 * N_KEYS, f"only {len(in_file)} of {N_KEYS} values are in the heap file"
    assert allocated(heap) >= N_KEYS * 1024, f"the heap file holds only {allocated(heap) / MIB:.1f} MiB"

    first = work.dump(pid, "r1", leave_running=True)
    assert [h["path"] for h in first["heaps"]] == [str(heap)], first
    assert first["stored_bytes"] >= N_KEYS * 1024 / 4, first
    assert first["image_bytes"] < N_KEYS * 1024 / 2, f"the heap went through CRIU's images: {first}"

    # 1% of the keys, anywhere, get new values.
    rewrite = {f"key:{i}": value(i, 1) for i in random.Random(1).sample(range(N_KEYS), N_KEYS // 100)}
    load(port, rewrite)
    expected.update(rewrite)
    second = work.dump(pid, "r2", leave_running=True)
    assert second["stored_bytes"] * 8 < first["stored_bytes"], (
        f"after rewriting 1% of the keys the second dump stored {second['stored_bytes']} bytes, the first "
        f"{first['stored_bytes']}")
    assert_redis_holds(port, expected, "the original after two dumps")

    kill9(pid)
    assert not listening(port)
    restored = work.restore("r2")
    wait_redis(port)
    assert_redis_holds(port, expected, "restored from r2")
    assert redis_cli(port, "SET", "after", "restore") == "OK" and redis_cli(port, "GET", "after") == "restore"
    assert alive(restored)
    print(f"redis --heap: {time.monotonic() - t0:.1f} s; dumps stored {first['stored_bytes'] / MIB:.1f} MiB, "
          f"then {second['stored_bytes'] / MIB:.2f} MiB (images {first['image_bytes'] / MIB:.1f} MiB)")


def test_redis_heap_restore_of_the_middle_of_three_dumps(work, tcp_dumps):
    """Three rounds of writing some keys and dumping (left running); the
    restore of the middle dump has exactly the keys and values of its time:
    neither the third round's writes nor anything lost."""
    pid, port = start_redis_heap(work)
    n = 20000
    state = {f"key:{i}": value(i, 0) for i in range(n)}
    load(port, state)
    states = []
    for r in (1, 2, 3):
        changes = {f"key:{i}": value(i, r) for i in range(r * 3000, r * 3000 + 1000)}
        changes.update({f"round{r}:{i}": value(i, 10 + r) for i in range(500)})
        load(port, changes)
        state = {**state, **changes}
        if r == 2:
            redis_cli(port, "DEL", "key:0", "key:1")  # deletions come back as deletions
            del state["key:0"], state["key:1"]
        work.dump(pid, f"c{r}", leave_running=True)
        states.append(dict(state))
    kill9(pid)
    restored = work.restore("c2")
    wait_redis(port)
    assert_redis_holds(port, states[1], "restored from the middle dump c2")
    assert alive(restored)


@pytest.mark.parametrize("sealed", [False, True], ids=["shared", "sealed"])
def test_redis_heap_bgsave_child_writes_a_consistent_rdb(work, tcp_dumps, sealed):
    """BGSAVE forks redis: while the child writes the RDB, the parent takes
    new keys and rewrites old ones. The RDB (loaded by a plain redis-server)
    has exactly the keys of the fork's time with their old values; the
    original has everything: a shared heap is shared again after the child
    exits, and the heap file holds what it wrote meanwhile; a heap sealed by
    a dump before the BGSAVE stays private and its file as the dump left it
    (a dump and restore shows the original's data either way)."""
    rdb_dir = work.path("rdb")
    rdb_dir.mkdir()
    pid, port = start_redis_heap(work, directory=rdb_dir, extra=("--dbfilename", "bg.rdb"))
    heap = heap_file(work, "redis")
    at_fork = {f"key:{i}": value(i, 0) for i in range(N_KEYS)}
    load(port, at_fork)
    if sealed:
        work.dump(pid, "before-bgsave", leave_running=True)
        sealed_sum = sha256_file(heap)
    # The child takes seconds for the RDB (it sleeps 10 us after every key): the writes
    # below happen while it runs, however slowly a loaded machine runs the parent.
    assert redis_cli(port, "CONFIG", "SET", "rdb-key-save-delay", "10") == "OK"

    during = {f"during:{i}": value(i, 7) for i in range(2000)}
    during.update({f"key:{i}": value(i, 8) for i in range(0, N_KEYS, 25)})
    replies = redis_pipeline(port, [["BGSAVE"], *(["SET", k, v] for k, v in during.items())])
    assert replies[0] == b"Background saving started", replies[0]
    assert all(r == b"OK" for r in replies[1:])
    persistence = redis_info(port, "persistence")
    assert persistence["rdb_bgsave_in_progress"] == "1", f"BGSAVE finished before the writes were checked: {persistence}"
    assert heap_mode(pid, heap) == "rw-p", f"redis's heap while its child saves: {heap_mappings(pid, heap)}"

    def finished():
        info = redis_info(port, "persistence")
        return info if info["rdb_bgsave_in_progress"] == "0" else None
    try:
        info = wait_until(finished, timeout=90, interval=0.1)
    except AssertionError:
        print("redis-server's log:\n" + work.path("redis.out").read_text()[-20000:])
        raise
    assert info, "BGSAVE did not finish within 90 s"
    assert info["rdb_last_bgsave_status"] == "ok", info
    if sealed:
        assert heap_mode(pid, heap) == "rw-p" and sha256_file(heap) == sealed_sum, "the sealed heap changed"
    else:
        wait_shared(pid, heap, timeout=30)
    assert redis_cli(port, "CONFIG", "SET", "rdb-key-save-delay", "0") == "OK"
    now = {**at_fork, **during}
    assert_redis_holds(port, now, "the original after BGSAVE")

    plain_port = free_port()
    work.tokens.add(f"127.0.0.1:{plain_port}")
    plain = work.dvr_run([REDIS_SERVER, "--port", plain_port, "--bind", "127.0.0.1", "--save", "", "--appendonly",
                          "no", "--daemonize", "no", "--dir", rdb_dir, "--dbfilename", "bg.rdb"],
                         work.path("plain-redis.out"))
    wait_redis(plain_port)
    assert_redis_holds(plain_port, at_fork, "a plain redis-server on the BGSAVE's RDB")
    kill9(plain)

    # The parent's writes of the fork's time reached the heap file.
    work.dump(pid, "after-bgsave")
    restored = work.restore("after-bgsave")
    wait_redis(port)
    assert_redis_holds(port, now, "restored after BGSAVE")
    assert alive(restored)


# --- a damaged snapshot

def damaged_refs(work):
    out = work.dvr_json("verify", expect=None)
    return {d if isinstance(d, str) else f"{d.get('session')}/{d.get('name')}" for d in out["damaged_snapshots"]}, out


COPY_HEAP = {"DVR_PROC_HEAP_SEAL": "0"}  # dumps copy the heap into the store's packs instead of sealing it


@pytest.mark.parametrize("heap_change", ["altered", "deleted"])
def test_damaged_heap_snapshot_is_refused_and_the_heap_file_left_alone(work, probe_bin, heap_change):
    """A heap dumped by copy ($DVR_PROC_HEAP_SEAL=0: a snapshot apart from the
    heap file) whose stored copy is damaged: the restore refuses before it
    changes the heap file or starts anything; repaired, it restores."""
    p = Probe(work, probe_bin, "hold", "32", heap="256M", session="held")
    p.wait_line("idle")
    data = p.regions()["data"]
    assert p.in_heap(*data[:2])
    assert [h["sealed"] for h in work.dump(p.pid, "dmg", env=COPY_HEAP)["heaps"]] == [False]
    assert wait_gone(p.pid)
    with open(p.heap, "rb") as f:
        f.seek(data[0] - HEAP_BASE)
        dump_time = hashlib.sha256(f.read(data[1])).hexdigest()

    # A byte of the pack that the heap snapshot (session "held") references.
    packs = work.pack_files()
    assert packs
    target = None
    for pack in packs:
        for start, chunk in file_data(pack):
            if len(chunk) < 64 * 1024:
                continue
            for at in [start + len(chunk) * k // 16 + 1234 for k in range(16)]:
                flip_byte(pack, at, 0x40)
                refs, _ = damaged_refs(work)
                if any(r.startswith("held/") for r in refs):
                    target = (pack, at, refs)
                    break
                flip_byte(pack, at, 0x40)
            if target:
                break
        if target:
            break
    assert target, "found no byte of a pack that the heap snapshot references"
    pack, at, refs = target

    # The heap file differs from the snapshot everywhere, so the restore needs every chunk.
    if heap_change == "altered":
        with open(p.heap, "r+b") as f:
            for off in range(0, 64 * MIB, 64 * 1024):
                f.seek(off)
                f.write(b"\xee" * 512)
        before = sha256_file(p.heap)
    else:
        p.heap.unlink()
    running = work.running()
    proc = work.dvr("proc", "restore", "dmg", "--detach", expect=None)
    assert_failed(proc, r"^dvr: ", r"corrupt|damaged|checksum", context=f"restore of a damaged heap snapshot (heap file {heap_change})")
    work.assert_nothing_new_running(running, "after the refused restore")
    if heap_change == "altered":
        assert sha256_file(p.heap) == before, "the refused restore changed the heap file"
    else:
        assert not p.heap.exists() or not file_data(p.heap), "the refused restore half-wrote a heap file"

    # Repaired, the same snapshot restores with the heap of its time.
    flip_byte(pack, at, 0x40)
    work.verify()
    if heap_change == "altered":
        pid = work.restore("dmg")
    else:
        # The restore says it made the heap file, not that bytes "differed".
        if p.heap.exists():
            p.heap.unlink()
        proc = work.dvr("proc", "restore", "dmg", "--detach")
        pid = work._started(proc)
        assert re.search(rf"dvr: note: heap {re.escape(str(p.heap))}: was missing; created from the dump \(\d+ bytes written", proc.stderr), describe(proc)
        assert "differed" not in proc.stderr, describe(proc)
    with open(p.heap, "rb") as f:
        f.seek(data[0] - HEAP_BASE)
        assert hashlib.sha256(f.read(data[1])).hexdigest() == dump_time, "the restored heap is not that of the dump"
    assert alive(pid)
    assert heap_mode(pid, p.heap) == "rw-s"


# --- memcached

def start_memcached_heap(work, mib=64, heap="512M"):
    needs(MEMCACHED, what="memcached")
    port = free_port()
    argv = [MEMCACHED, "-l", "127.0.0.1", "-p", port, "-U", "0", "-m", mib, "-t", "2",
            "-P", work.path("memcached.pid"), *(["-u", "root"] if os.geteuid() == 0 else [])]
    pid = start_heap_job(work, argv, work.path("memcached.out"), heap=heap, session="memcached")
    assert wait_until_listening(port), "memcached does not listen"
    return pid, port


def test_memcached_heap_keeps_its_keys(work, tcp_dumps):
    """memcached under --heap: its items are in the heap file; dumped (left
    running), SIGKILLed, restored: every key reads back exactly."""
    pymemcache = pytest.importorskip("pymemcache.client.base",
                                     reason="python3-pymemcache is missing (install-deps.sh installs it)")
    pid, port = start_memcached_heap(work)
    heap = heap_file(work, "memcached")
    values = {f"key:{i}": (f"<{i}:0>" + "m" * (i % 300)).encode() for i in range(5000)}
    values["big"] = os.urandom(512 * 1024)
    memcached_set_all(pymemcache, port, values)
    in_file = values_in_file(heap, 0)
    assert len(in_file) >= 0.95 * 5000, f"only {len(in_file)} of 5000 items are in the heap file"

    info = work.dump(pid, "mc", leave_running=True)
    assert [h["path"] for h in info["heaps"]] == [str(heap)], info
    kill9(pid)
    assert not listening(port)
    restored = work.restore("mc")
    assert wait_until_listening(port), "the restored memcached does not listen"
    client = pymemcache.Client(("127.0.0.1", port), connect_timeout=5, timeout=10)
    try:
        got = client.get_many(list(values))
        assert set(got) == set(values), f"{len(set(values) - set(got))} keys missing after restore"
        assert [k for k, v in values.items() if got[k] != v] == []
        assert client.set("after", b"restore") and client.get("after") == b"restore"
    finally:
        client.close()
    assert alive(restored)
    # Sealed at the dump: the restored memcached maps the dumped heap file copy-on-write.
    assert heap_mode(restored, heap) == "rw-p"


def test_dump_returns_after_a_multithreaded_job_closed_its_socket(work, tcp_dumps):
    """`dvr proc dump` (without --leave-running) of memcached (threads) with
    300 MiB of items in its heap: when it returns, the port is free (a
    restore right after must be able to bind it)."""
    pid, port = start_memcached_heap(work, mib=400, heap="1G")
    item = os.urandom(500 * 1024)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        for i in range(600):
            s.sendall(b"set k%d 0 0 %d noreply\r\n" % (i, len(item)) + item + b"\r\n")
        s.sendall(b"get k599\r\n")
        reply = b""
        while not reply.endswith(b"END\r\n"):
            chunk = s.recv(1 << 20)
            assert chunk, "memcached closed the connection"
            reply += chunk
    assert item in reply
    assert allocated(heap_file(work, "memcached")) >= 250 * MIB
    work.dump(pid, "mc")
    still = listening(port)
    freed = wait_until(lambda: not listening(port), timeout=10, interval=0.001)
    assert not still, f"dvr proc dump returned with the job's port still listening (freed later: {bool(freed)})"


# --- clones of a --heap job

def test_redis_heap_clone_in_its_own_network_beside_the_original(work, tcp_dumps):
    """`dvr proc clone --net new` of a --heap redis-server runs beside the
    original: it answers with the dump's data at its own address, and its heap
    is the heap file sealed at the dump, mapped copy-on-write: its private
    memory is what it writes (a fifth of the heap at most here), its writes
    never reach the file or the original, and the original keeps its data."""
    for tool in ("ip", "nsenter"):
        if not shutil.which(tool):
            pytest.skip(f"{tool} is missing (iproute2, util-linux)")
    pid, port = start_redis_heap(work, heap="256M")
    heap = heap_file(work, "redis")
    # redis binds 127.0.0.1: the clone is reached inside its own namespace.
    at_dump = {f"key:{i}": value(i, 0) for i in range(50000)}
    load(port, at_dump)
    work.dump(pid, "cl", leave_running=True)
    sealed = sha256_file(heap)
    assert redis_cli(port, "SET", "key:0", "after-dump") == "OK"

    out = work.dvr_json("proc", "clone", "cl", "--net", "new")
    clone = out["pid"]
    work.pids.add(clone)
    assert out["net"] == "new", out
    assert os.readlink(f"/proc/{clone}/ns/net") != os.readlink(f"/proc/{pid}/ns/net")

    def in_clone(*argv, mounts=False):
        ns = ["-n", "-m"] if mounts else ["-n"]
        p = subprocess.run(["nsenter", "-t", str(clone), *ns, *[str(a) for a in argv]], capture_output=True, timeout=30)
        assert p.returncode == 0, f"nsenter {argv}: {p.stdout[-500:]!r} {p.stderr[-500:]!r}"
        return p.stdout.decode(errors="replace").strip()

    assert wait_until(lambda: in_clone(REDIS_CLI, "-p", port, "PING") == "PONG", timeout=30)
    assert in_clone(REDIS_CLI, "-p", port, "DBSIZE") == str(len(at_dump))
    assert in_clone(REDIS_CLI, "-p", port, "GET", "key:0") == value(0, 0).decode()
    assert in_clone(REDIS_CLI, "-p", port, "GET", "key:49999") == value(49999, 0).decode()
    # Its heap is the sealed file (a heap pack of the store), mapped copy-on-write.
    packs = {p.stat().st_ino for p in (work.store / "packs").glob("*.heap")}
    assert int(in_clone("stat", "-c", "%i", heap, mounts=True)) in packs, f"the clone's heap is no heap pack of the store ({packs})"
    assert heap_mode(clone, heap) == "rw-p", heap_mappings(clone, heap)
    anon = smaps_rollup(clone)["Anonymous"]
    assert anon * 5 < allocated(heap), f"the clone holds {anon >> 20} MiB of its own memory for a heap of {allocated(heap) >> 20} MiB"
    # A write to the clone stays in the clone; the original is untouched.
    marker = "clone-write-" + "x" * 40
    assert in_clone(REDIS_CLI, "-p", port, "SET", "key:1", marker) == "OK"
    assert redis_cli(port, "GET", "key:1") == value(1, 0).decode()
    assert redis_cli(port, "GET", "key:0") == "after-dump"
    assert redis_cli(port, "DBSIZE") == str(len(at_dump))
    print(f"\nthe clone's own memory: {smaps_rollup(clone)['Anonymous'] >> 20} MiB; the sealed heap: {allocated(heap) >> 20} MiB")
    kill9(clone)
    assert alive(pid) and redis_cli(port, "PING") == "PONG"
    # The clone's write is in no byte of the sealed heap file, which is as the dump left it.
    assert marker.encode() not in heap.read_bytes()
    assert sha256_file(heap) == sealed, "the sealed heap file changed"


# --- sealing: the heap file becomes the dump's heap snapshot as it is

def heap_packs(work):
    """The store's heap packs (heap files sealed at a dump), by inode."""
    return {p.stat().st_ino: p for p in (work.store / "packs").glob("*.heap")}


def test_a_dump_seals_the_heap_in_place_and_the_program_goes_on(work, probe_bin):
    """The first dump seals the heap: the heap file becomes a heap pack of the
    store as it is (a link: nothing copied), the program maps it copy-on-write
    and never writes it again, and a second dump reads none of it. After the
    seal the program allocates, callocs, maps and frees six times what its
    heap holds, on 4 threads too: freed heap memory comes back (zeroed where
    calloc and mmap promise it). Killed and restored, the program has its
    memory of the last dump."""
    p = Probe(work, probe_bin, "sealed", heap="256M", session="sealed")
    p.wait_line("wait go")
    kept = p.regions()["kept"]
    assert p.in_heap(*kept[:2])
    first = work.dump(p.pid, "s1", leave_running=True)
    assert [h["sealed"] for h in first["heaps"]] == [True], first
    assert heap_mode(p.pid, p.heap) == "rw-p", heap_mappings(p.pid, p.heap)
    assert p.heap.stat().st_ino in heap_packs(work), f"the heap file is no heap pack of the store: {heap_packs(work)}"
    assert first["stored_bytes"] >= 64 * MIB, f"the sealed heap's data should count as stored: {first}"
    assert first["image_bytes"] < 16 * MIB, f"the heap went through CRIU's images: {first}"
    assert work.dvr_json("info", "sealed/proc.s1")["chunks_read"] > 0
    sealed = sha256_file(p.heap)

    second = work.dump(p.pid, "s2", leave_running=True)
    assert second["stored_bytes"] < MIB, f"nothing was written, yet the second dump stored {second['stored_bytes']} bytes"
    heap_snap = work.dvr_json("info", "sealed/proc.s2")
    assert heap_snap["chunks_read"] == 0 and heap_snap["stored_bytes"] == 0, heap_snap

    p.go("go")
    churn = p.fields("churn")
    assert churn["bad"] == 0 and churn["threads_bad"] == 0 and churn["kept_ok"] == 1, p.text()
    assert churn["mib"] >= 6 * 256 and churn["in_heap"] == churn["rounds"], f"freed heap memory was not handed out again: {churn}"
    assert heap_mode(p.pid, p.heap) in ("rw-p", "rw-p,rw-p"), heap_mappings(p.pid, p.heap)
    assert sha256_file(p.heap) == sealed, "the program wrote into its sealed heap file"
    work.verify()

    third = work.dump(p.pid, "s3", leave_running=True)
    assert third["image_bytes"] < 256 * MIB, third
    kill9(p.pid)
    restored = work.restore("s3")
    assert read_memory(restored, kept[0], kept[1]) == pattern("KEPT-BEFORE", kept[1]), "the restored program lost its kept bytes"
    assert heap_mode(restored, p.heap) == "rw-p" and alive(restored)
    assert sha256_file(p.heap) == sealed


def test_damaged_sealed_heap_is_refused_and_nothing_runs(work, probe_bin):
    """A sealed heap is its snapshot's only copy: a byte changed in it behind
    dvr's back is found by the restore, which refuses before anything runs
    and leaves the file as it is (`dvr verify` names the snapshot too); put
    right, the same snapshot restores."""
    p = Probe(work, probe_bin, "hold", "32", heap="256M", session="held")
    p.wait_line("idle")
    data = p.regions()["data"]
    work.dump(p.pid, "sd")
    assert wait_gone(p.pid)
    assert p.heap.stat().st_ino in heap_packs(work)
    at = data[0] - HEAP_BASE + data[1] // 2
    flip_byte(p.heap, at, 0x40)
    refs, _ = damaged_refs(work)
    assert "held/proc.sd" in refs, refs
    before = sha256_file(p.heap)
    running = work.running()
    proc = work.dvr("proc", "restore", "sd", "--detach", expect=None)
    assert_failed(proc, r"^dvr: ", r"corrupt|damaged|checksum", context="restore of a damaged sealed heap")
    work.assert_nothing_new_running(running, "after the refused restore")
    assert sha256_file(p.heap) == before, "the refused restore changed the heap file"

    flip_byte(p.heap, at, 0x40)
    work.verify()
    pid = work.restore("sd")
    assert read_memory(pid, data[0], data[1]) == file_range(p.heap, data[0] - HEAP_BASE, data[1])
    assert alive(pid)


def test_exec_after_a_seal_leaves_the_sealed_heap_to_its_snapshot(work, probe_bin):
    """The owner exec'ing another program after its heap was sealed gets a new,
    empty heap file; the sealed one stays the dump's, which restores."""
    p = Probe(work, probe_bin, "exec", heap="512M", session="ex")
    assert p.fields("cat exited")["status"] == 0, p.text()
    a = p.regions()["a"]
    p.wait_line("wait reexec")
    work.dump(p.pid, "before", leave_running=True)
    sealed_ino, sealed = p.heap.stat().st_ino, sha256_file(p.heap)
    assert sealed_ino in heap_packs(work)
    p.go("reexec")
    assert p.fields("reexec old_data_gone")["old_data_gone"] == 1, p.text()
    assert wait_until(lambda: p.regions().get("after"), timeout=30)
    assert p.heap.stat().st_ino != sealed_ino, "the exec'd program took the sealed heap file"
    assert heap_mode(p.pid, p.heap) == "rw-s"
    assert sha256_file(heap_packs(work)[sealed_ino]) == sealed, "the sealed heap changed"
    kill9(p.pid)
    (p.ctl / "reexec").unlink()  # the restored program waits there again
    pid = work.restore("before")
    assert read_memory(pid, a[0], a[1]) == pattern("BEFORE-EXEC", a[1])
    assert p.heap.stat().st_ino == sealed_ino and heap_mode(pid, p.heap) == "rw-p"


def test_a_store_given_as_a_relative_path_dumps_restores_and_clones(work, probe_bin):
    """`--store` relative to the working directory: CRIU and its plugin run
    elsewhere, so every path dvr hands them must be absolute (a relative store
    once made `proc restore` fail on CRIU's pidfile)."""
    def dvr_here(*args):
        return run([work.dvr_bin, "--store", "store", *args], expect=0, timeout=180, cwd=work.root)

    assert work.store == work.root / "store"
    output = work.path("rel.out")
    ctl = work.path("ctl-rel")
    ctl.mkdir()
    proc = dvr_here("run", "--heap", "256M", "--heap-session", "rel", "--output", output, "--",
                    probe_bin, "hold", ctl, "32")
    pid = int(proc.stdout.strip())
    work.pids.add(pid)
    heap = heap_file(work, "rel")
    assert str(heap) in proc.stderr, f"dvr run names the heap by its absolute path:\n{describe(proc)}"
    assert wait_until(lambda: "idle" in output.read_text(), timeout=60), output.read_text()
    data = [int(v, 0) for v in next(l for l in output.read_text().splitlines() if l.startswith("region data ")).split()[2:4]]
    expected = read_memory(pid, data[0], data[1])

    dvr_here("proc", "dump", pid, "--name", "rel1")
    assert wait_gone(pid)
    restored = int(dvr_here("proc", "restore", "rel1", "--detach").stdout.strip())
    work.pids.add(restored)
    assert read_memory(restored, data[0], data[1]) == expected, "the restored program's heap differs from the dump's"
    clone = int(dvr_here("proc", "clone", "rel1").stdout.strip())
    work.pids.add(clone)
    assert read_memory(clone, data[0], data[1]) == expected, "the clone's heap differs from the dump's"
    assert alive(restored) and alive(clone)
    dvr_here("verify")


def test_a_heap_job_that_does_not_start_leaves_no_heap_and_default_sessions_differ(work, probe_bin):
    missing = work.path("no-such-dir")
    proc = work.dvr("run", "--heap", "64M", "--heap-session", "hz", "--cwd", missing, "--", probe_bin, expect=None)
    assert proc.returncode != 0 and str(missing) in proc.stderr, describe(proc)
    assert not heap_file(work, "hz").exists(), "the failed start left its heap file"
    # A program that started but could not set its heap up (1 KiB is too small) is ended, and leaves nothing.
    proc = work.dvr("run", "--heap", "1K", "--heap-session", "tiny", "--", probe_bin, expect=None)
    assert proc.returncode != 0 and "could not set its heap up" in proc.stderr, describe(proc)
    assert not (work.store / "heaps" / "tiny").exists(), list((work.store / "heaps" / "tiny").iterdir())
    # The same session again: no "already has a heap".
    ctl = work.path("ctl-hz")
    ctl.mkdir()
    start_heap_job(work, [probe_bin, "hold", ctl, "1"], work.path("hz.out"), heap="64M", session="hz")
    # Two jobs started in the same second without --heap-session get sessions of their own.
    pids = []
    for k in range(2):
        out = work.dvr("run", "--heap", "64M", "--output", work.path(f"d{k}.out"), "--", "/bin/sleep", "600")
        pids.append(int(out.stdout.strip()))
        work.pids.add(pids[-1])
    sessions = sorted(p.name for p in (work.store / "heaps").iterdir() if p.name.startswith("run-sleep-"))
    assert len(sessions) == 2, sessions


@pytest.mark.parametrize("heap", [["--heap", "64M"], ["--heap"]])
def test_heap_right_before_the_program_takes_its_options_as_the_programs(work, heap):
    """`dvr run --heap [MAX] -- CMD -opt` (the example of `dvr run --help`):
    the optional MAX does not swallow the `--`, and CMD's options are not
    read as dvr's."""
    out = work.path("echo.out")
    proc = work.dvr("run", *heap, "--heap-session", "opts", "--output", out, "--", "/bin/sh", "-c", 'printf "%s" "$0"', "-n")
    pid = int(proc.stdout.strip())
    work.pids.add(pid)
    deadline = time.monotonic() + 30
    while out.read_text() != "-n" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert out.read_text() == "-n", describe(proc)
    proc = work.dvr("ls", "--", "x", expect=2)
    assert "only `dvr run` takes a program after --" in proc.stderr, describe(proc)


def test_rm_keeps_a_process_snapshot_and_its_heap_snapshot_together(work, probe_bin):
    """`dvr rm SESSION/proc.NAME` alone would leave proc/NAME unrestorable: it
    is refused; `dvr rm proc/NAME` removes the heap snapshot with it, as
    `dvr proc rm` does."""
    p = Probe(work, probe_bin, "hold", "1", heap="64M", session="pair")
    p.wait_line("idle")
    work.dump(p.pid, "a", leave_running=True)
    refs = {f"{s['session']}/{s['name']}" for s in work.dvr_json("ls")["snapshots"]}
    assert refs == {"proc/a", "pair/proc.a"}, refs
    proc = work.dvr("rm", "pair/proc.a", expect=2)
    assert "is the heap of process snapshot proc/a" in proc.stderr and " proc rm a`" in proc.stderr, describe(proc)
    work.dvr("rm", "proc/a")
    assert work.dvr_json("ls")["snapshots"] == []
    # Python refuses it as dvr does: Store.remove and `python -m memdvr rm`.
    work.dump(p.pid, "b", leave_running=True)
    python_dir = Path(work.dvr_bin).resolve().parent / "python"  # the build's memdvr, beside dvr
    proc = run([PYTHON_BIN, "-c", f"import memdvr; memdvr.Store({str(work.store)!r}).remove('pair', 'proc.b')"], expect=1,
               env={"PYTHONPATH": str(python_dir)})
    assert "InvalidArgument" in proc.stderr and "is the heap of process snapshot proc/b" in proc.stderr, describe(proc)
    proc = run([PYTHON_BIN, "-m", "memdvr", "--store", work.store, "rm", "pair/proc.b"], expect=2, env={"PYTHONPATH": str(python_dir)})
    assert "is the heap of process snapshot proc/b" in proc.stderr, describe(proc)
    # `dvr proc rm` says what it removed: not a heap snapshot that was gone already
    # (its manifest deleted behind dvr's back).
    (work.store / "sessions" / "pair" / "proc.b.snap").unlink()
    out = work.dvr("proc", "rm", "b").stdout
    assert "removed proc/b (its heap snapshot pair/proc.b was gone already)" in out, out
