"""Shared fixtures for the whole-process snapshot tests (`dvr run`, `dvr proc ...`).

The tests run real jobs under the real CRIU: `dvr-test-job` ($DVR_TEST_JOB,
tests/helpers/proc_job.cpp), the Python/numpy job py_job.py beside this file,
and redis-server. Both test jobs write a status line

    count=C sum=X gen=G seq=S id=I mib=M

to a file (see proc_job.cpp): C a counter ticking every 10 ms, X a checksum of
the job's buffer recomputed from memory at every report, G the number of
SIGUSR1 mutations (each rewrites 1% of the buffer's pages), S the report
number, I a random id chosen at the job's start. The checksum the buffer must
have after G mutations is known independently (`expected_sum`), so a restored
job proves its memory intact, and its id proves it is the dumped process, not
a new one.

Each test gets a scratch directory under /dev/shm (`work`) holding its store,
status files and job output. Every process the test started, and every process
whose command line names the scratch directory (restored and half-restored
ones included), is SIGKILLed when the test ends, pass or fail.

Needs root and CRIU 4.x; skips with the reason otherwise.

Run: DVR_BIN=build/dvr DVR_TEST_JOB=build/dvr-test-job /usr/bin/python3 -m pytest tests/proc
"""

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PY_JOB = HERE / "py_job.py"
PYTHON = "/usr/bin/python3"
MIB = 1024 * 1024
CRIU_PATH = os.environ.get("PATH", "") + ":/usr/local/sbin:/usr/sbin:/sbin"


def describe(proc):
    """The command, exit status and output of a finished process, for assertion messages."""
    args = proc.args if isinstance(proc.args, str) else " ".join(str(a) for a in proc.args)
    return f"$ {args}\n-> exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"


def run(args, expect=None, timeout=120, **kwargs):
    """Runs a command to completion; checks its exit status if `expect` is given."""
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, **kwargs)
    if expect is not None:
        assert proc.returncode == expect, describe(proc)
    return proc


# --- preconditions

def criu_binary():
    return shutil.which("criu", path=CRIU_PATH)


def criu_version():
    """(major, minor, patch) of the installed criu, or None."""
    criu = criu_binary()
    if not criu:
        return None
    out = subprocess.run([criu, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", out)
    return tuple(int(x or 0) for x in m.groups()) if m else None


def kernel_version():
    m = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def why_not_runnable():
    if os.geteuid() != 0:
        return "whole-process snapshots need root (CRIU dumps and restores as root)"
    if not criu_binary():
        return "criu is not installed (install-deps.sh installs CRIU 4.x from Debian 13)"
    v = criu_version()
    if v is None or v[0] < 4:
        return f"criu {v} is too old: CRIU 4.x is needed (3.x cannot run on kernels >= 6.13)"
    return None


def criu_dumps_inet_sockets():
    """CRIU < 4.2 fails to dump any TCP/UDP socket on Linux >= 6.16
    ("Can't get 1:16 opt: Operation not supported": the kernel restricted
    SO_PASSCRED/SO_PASSSEC to unix and netlink sockets; fixed in CRIU 4.2)."""
    v = criu_version() or (0, 0, 0)
    return v >= (4, 2, 0) or kernel_version() < (6, 16)


@pytest.fixture(scope="session", autouse=True)
def _needs_root_and_criu():
    reason = why_not_runnable()
    if reason:
        pytest.skip(reason)


def _binary(var):
    path = os.environ.get(var)
    if not path or not os.access(path, os.X_OK):
        pytest.fail(f"${var} must name the built binary (got {path!r}); run through CTest, or set "
                    f"DVR_BIN=BUILD/dvr DVR_TEST_JOB=BUILD/dvr-test-job")
    return path


@pytest.fixture(scope="session")
def dvr_bin():
    return _binary("DVR_BIN")


@pytest.fixture(scope="session")
def job_bin():
    return _binary("DVR_TEST_JOB")


# --- processes

def proc_state(pid):
    """The state letter of /proc/PID/stat, or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def alive(pid):
    """True while PID exists and is not a zombie."""
    return proc_state(pid) not in (None, "Z", "X")


def wait_gone(pid, timeout=20):
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def processes_naming(token):
    """Live processes (not zombies) whose command line contains `token`, this one excluded."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid() and token in cmdline(entry) and alive(int(entry)):
            found.add(int(entry))
    return found


def pid_namespace(pid):
    return os.readlink(f"/proc/{pid}/ns/pid")


def ns_pid(pid):
    """The PID chain of NSpid in /proc/PID/status (outermost first)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("NSpid:"):
                return [int(x) for x in line.split()[1:]]
    return []


def free_pid():
    """A PID no process has right now."""
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    for pid in range(pid_max - 1, 300, -1):
        if not os.path.exists(f"/proc/{pid}"):
            return pid
    raise AssertionError("no free pid")


# --- status files

def parse_status(text):
    fields = dict(kv.split("=", 1) for kv in text.split() if "=" in kv)
    if not {"count", "sum", "gen", "seq", "id"} <= set(fields):
        return None
    for key in ("count", "gen", "seq", "mib"):
        if key in fields:
            fields[key] = int(fields[key])
    return fields


def read_status(path):
    try:
        return parse_status(Path(path).read_text())
    except (FileNotFoundError, ValueError):
        return None


@functools.lru_cache(maxsize=None)
def expected_sum(kind, mib, gen):
    """The checksum a correct buffer of `kind` ("c": dvr-test-job, "py": py_job.py) has after `gen` mutations."""
    if kind == "py":
        sys.path.insert(0, str(HERE))
        import py_job
        return py_job.expected_sum(mib, gen)
    return run([_binary("DVR_TEST_JOB"), "expect", "--mib", mib, "--gen", gen], expect=0).stdout.strip()


class Job:
    """A job program and its status file. The job's PID changes with every
    restore; a Job is the program, `pid` is whichever process the test last
    started or restored."""

    def __init__(self, work, kind, mib, status, output, pid=None):
        self.work, self.kind, self.mib = work, kind, mib
        self.status_path, self.output = Path(status), Path(output)
        self.pid = pid

    def status(self, path=None):
        return read_status(path or self.status_path)

    def wait(self, pred=lambda s: True, what="a status report", timeout=30, path=None):
        """Polls the status file (or `path`) until pred(status) holds; returns that status."""
        path = Path(path or self.status_path)
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = read_status(path)
            if last is not None and pred(last):
                return last
            time.sleep(0.02)
        pytest.fail(f"timed out after {timeout} s waiting for {what} in {path}; last status {last}; "
                    f"pid {self.pid} state {proc_state(self.pid) if self.pid else None}\n{self.output_text()}")

    def wait_count(self, at_least, **kwargs):
        return self.wait(lambda s: s["count"] >= at_least, what=f"count >= {at_least}", **kwargs)

    def wait_next(self, after, **kwargs):
        """The first report with the same id and a higher seq than `after`, or a higher count."""
        return self.wait(lambda s: s["id"] == after["id"] and (s["seq"] > after["seq"] or s["count"] > after["count"]),
                         what=f"a report after seq {after['seq']} count {after['count']}", **kwargs)

    def expected(self, gen):
        return expected_sum(self.kind, self.mib, gen)

    def assert_intact(self, s, gen=None):
        """The status shows a buffer that is exactly generation `gen` (default: the one it reports)."""
        gen = s["gen"] if gen is None else gen
        assert s["gen"] == gen, f"job reports generation {s['gen']}, expected {gen}: {s}"
        assert s["sum"] == self.expected(gen), (
            f"buffer checksum {s['sum']} is not that of generation {gen} ({self.expected(gen)}): the memory "
            f"came back wrong; status {s}")

    def mutate(self, pid=None):
        """SIGUSR1: the job rewrites 1% of its pages; returns the report showing the new generation."""
        pid = pid or self.pid
        before = self.status()
        os.kill(pid, signal.SIGUSR1)
        return self.wait(lambda s: s["gen"] == before["gen"] + 1 and s["id"] == before["id"],
                         what=f"generation {before['gen'] + 1}")

    def redirect(self, pid, path):
        """Makes process `pid` (the original or a clone) write its status to `path` from now on."""
        Path(str(self.status_path) + ".redirect").write_text(f"{path}\n")
        os.kill(pid, signal.SIGUSR2)
        s = self.wait(what=f"pid {pid}'s status redirected to {path}", path=path)
        os.unlink(str(self.status_path) + ".redirect")
        return s

    def forget(self):
        """Removes the status file, so that the next report seen is a new process's."""
        try:
            self.status_path.unlink()
        except FileNotFoundError:
            pass

    def output_text(self):
        try:
            return f"--- output of the job ({self.output})\n{self.output.read_text()[-4000:]}"
        except OSError:
            return f"(no output file {self.output})"


class Work:
    """One test's scratch directory, store and processes."""

    def __init__(self, root, dvr_bin, job_bin):
        self.root = Path(root)
        self.store = self.root / "store"
        self.dvr_bin, self.job_bin = dvr_bin, job_bin
        self.pids = set()
        self.children = []  # Popen objects of jobs started without `dvr run`
        self.tokens = {str(self.root)}  # every job's command line names the scratch dir
        self._n = 0

    # --- the dvr command
    def dvr(self, *args, expect=0, timeout=180, env=None):
        full_env = None
        if env:
            full_env = dict(os.environ)
            full_env.update(env)
        return run([self.dvr_bin, "--store", self.store, *args], expect=expect, timeout=timeout, env=full_env)

    def dvr_json(self, *args, expect=0, env=None, timeout=180):
        proc = self.dvr(*args, "--json", expect=expect, env=env, timeout=timeout)
        try:
            return json.loads(proc.stdout)
        except json.JSONDecodeError as e:
            pytest.fail(f"output is not JSON ({e}):\n{describe(proc)}")

    def dump(self, pid, name, *extra, leave_running=False, env=None):
        """`dvr proc dump PID --name NAME --json`; checks the documented fields."""
        args = ["proc", "dump", pid, "--name", name, *(["--leave-running"] if leave_running else []), *extra]
        info = self.dvr_json(*args, env=env)
        for key in ("name", "pid", "seconds", "image_bytes", "stored_bytes", "heaps", "leave_running"):
            assert key in info, f"dump --json lacks {key!r}: {info}"
        assert info["name"] == name and info["pid"] == pid and info["leave_running"] is leave_running, info
        assert info["image_bytes"] > 0 and info["stored_bytes"] >= 0 and info["seconds"] >= 0, info
        if not leave_running:
            assert wait_gone(pid), f"dump without --leave-running left pid {pid} running ({cmdline(pid)})"
        return info

    def restore(self, name, *extra, env=None):
        """`dvr proc restore NAME --detach`: the restored root's PID (killed when the test ends)."""
        return self._started(self.dvr("proc", "restore", name, "--detach", *extra, env=env))

    def clone(self, name, *extra, env=None):
        return self._started(self.dvr("proc", "clone", name, *extra, env=env))

    def _started(self, proc):
        line = proc.stdout.strip()
        assert re.fullmatch(r"\d+", line), f"expected a PID alone on stdout:\n{describe(proc)}"
        pid = int(line)
        self.pids.add(pid)
        assert alive(pid), f"pid {pid} printed, but no such process runs:\n{describe(proc)}"
        return pid

    def verify(self, expect=0):
        return self.dvr("verify", expect=expect)

    def proc_ls(self):
        return self.dvr_json("proc", "ls")

    # --- jobs
    def path(self, name):
        return self.root / name

    def dvr_run(self, argv, output, env=None):
        """`dvr run --output OUTPUT -- ARGV`: the job's PID."""
        pid = self._started(self.dvr_unstored("run", "--output", output, "--", *argv, env=env))
        return pid

    def dvr_unstored(self, *args, expect=0, env=None, timeout=60):
        full_env = None
        if env:
            full_env = dict(os.environ)
            full_env.update(env)
        return run([self.dvr_bin, *args], expect=expect, timeout=timeout, env=full_env)

    def start_job(self, mode="counter", mib=16, extra=(), wait_count=20, plain=False):
        """Starts dvr-test-job (mode counter or heap; heap uses this test's store) or the
        Python job (mode "py") with `dvr run`, and waits for its first reports. With
        plain=True the job is started without `dvr run`: a child of this process
        leading its own session, in the caller's PID namespace (`job.popen`)."""
        self._n += 1
        status = self.path(f"job{self._n}.status")
        output = self.path(f"job{self._n}.out")
        if mode == "py":
            argv = [PYTHON, PY_JOB, "run", "--mib", mib, "--status", status, *extra]
            kind = "py"
        else:
            argv = [self.job_bin, mode, "--mib", mib, "--status", status, *extra]
            if mode == "heap":
                argv += ["--store", self.store]
            kind = "c"
        job = Job(self, kind, mib, status, output)
        if plain:
            with open(output, "ab") as out:
                job.popen = subprocess.Popen([str(a) for a in argv], stdin=subprocess.DEVNULL, stdout=out,
                                             stderr=out, start_new_session=True)
            self.children.append(job.popen)
            job.pid = job.popen.pid
            self.pids.add(job.pid)
        else:
            job.pid = self.dvr_run(argv, output)
        if wait_count:
            first = job.wait_count(wait_count, timeout=60)
            job.assert_intact(first, gen=0)
        return job

    # --- what runs
    def running(self):
        """Live processes of this test: started ones and any naming its scratch dir."""
        found = {p for p in self.pids if alive(p)}
        for token in self.tokens:
            found |= processes_naming(token)
        return found

    def assert_nothing_new_running(self, before, context):
        now = self.running()
        extra = now - set(before)
        assert not extra, f"{context}: processes left running: " + "; ".join(f"{p}: {cmdline(p)}" for p in extra)

    def kill_all(self):
        for _ in range(3):
            victims = self.running()
            if not victims:
                return
            for pid in victims:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for pid in victims:
                wait_gone(pid, timeout=10)
        for child in self.children:
            if child.poll() is None:
                child.kill()
            child.wait(timeout=30)

    # --- the store on disk
    def pack_files(self):
        return sorted((self.store / "packs").glob("*.pack"))

    def assert_private(self):
        """Everything in the store is readable by its owner only."""
        loose = []
        for dirpath, dirnames, filenames in os.walk(self.store):
            for name in dirnames + filenames:
                p = os.path.join(dirpath, name)
                st = os.lstat(p)
                if st.st_mode & 0o077:
                    loose.append(f"{p} {oct(st.st_mode & 0o777)}")
        assert not loose, "store entries readable by others: " + ", ".join(loose)


@pytest.fixture
def work(dvr_bin, job_bin):
    root = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None, prefix="dvr-proc-test-")
    w = Work(root, dvr_bin, job_bin)
    try:
        yield w
    finally:
        w.kill_all()
        shutil.rmtree(root, ignore_errors=True)
