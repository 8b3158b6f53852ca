"""What the pytest suites (tests/system, tests/proc, tests/migration,
tests/mpi) share: finding the built binaries, running commands, a store
driven through the `dvr` command and `dvr-test-worker`, preconditions
(root, CRIU), watching and killing processes, the whole-process test jobs
(`dvr-test-job`, tests/proc/py_job.py) with their status files, and MPI jobs
of the heat example.

A plain module: each suite's conftest.py puts this directory on sys.path and
imports from here; test modules import from here too (`from dvrtest import
describe, run`), never from a conftest. The conftests keep only their
folder's own fixtures (and what only those fixtures use), so the suites can
also be collected together in one pytest run. The
binaries come from the environment CTest sets (tests/CMakeLists.txt):

    DVR_BIN=BUILD/dvr DVR_WORKER=BUILD/dvr-test-worker \
    DVR_TEST_JOB=BUILD/dvr-test-job /usr/bin/python3 -m pytest tests/system
"""

import contextlib
import functools
import hashlib
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

TESTS = Path(__file__).resolve().parent.parent
PROC_DIR = TESTS / "proc"
PY_JOB = PROC_DIR / "py_job.py"
PYTHON = "/usr/bin/python3"
MIB = 1024 * 1024


# --- the built binaries

# The variable CTest sets for each binary, and the binary's name in the build tree.
BINARIES = {
    "DVR_BIN": "dvr",
    "DVR_WORKER": "dvr-test-worker",
    "DVR_TEST_JOB": "dvr-test-job",
    "DVR_MPI_HEAT": "dvr-example-mpi-heat",
    "DVR_MPI_FIRST": "dvr-test-mpi-first",
}


def binary(var):
    """The executable $VAR names; fails the test (not skips: the suite was run
    wrongly) when it is unset or not executable."""
    path = os.environ.get(var)
    if not path or not os.access(path, os.X_OK):
        pytest.fail(f"${var} must name the built binary (got {path!r}); run the suite through CTest, or set "
                    f"{var}=BUILD/{BINARIES.get(var, '...')}")
    return path


@pytest.fixture(scope="session")
def dvr_bin():
    return binary("DVR_BIN")


@pytest.fixture(scope="session")
def worker_bin():
    return binary("DVR_WORKER")


@pytest.fixture(scope="session")
def job_bin():
    return binary("DVR_TEST_JOB")


# --- running commands

def describe(proc):
    """The command, exit status and output of a finished process, for assertion messages."""
    args = proc.args if isinstance(proc.args, str) else " ".join(str(a) for a in proc.args)
    out, err = proc.stdout, proc.stderr
    if isinstance(out, bytes):
        out = f"({len(out)} bytes of binary output)" if out else ""
    if isinstance(err, bytes):
        err = err.decode(errors="replace")
    return f"$ {args}\n-> exit {proc.returncode}\n--- stdout\n{out}\n--- stderr\n{err}"


def check_exit(proc, expect):
    """Asserts the exit status: `expect` an int, "nonzero", or None (anything)."""
    if expect == "nonzero":
        assert proc.returncode != 0, describe(proc)
    elif expect is not None:
        assert proc.returncode == expect, describe(proc)
    return proc


def run(args, expect=None, timeout=120, input=None, stdin=subprocess.DEVNULL, env=None, binary=False,
        new_session=False, **kwargs):
    """Runs a command to completion and returns the CompletedProcess; checks its
    exit status if `expect` is given (see check_exit). stdout and stderr are
    text, stdout bytes with binary=True. `input` (bytes) is written to its
    stdin, else stdin is /dev/null. `env` adds to (overrides) this process's
    environment. After `timeout` s the command is SIGKILLed — with everything
    it started when new_session=True (it then leads a process group of its
    own) — and subprocess.TimeoutExpired is raised. Other keyword arguments go
    to subprocess.Popen (cwd, preexec_fn, ...)."""
    args = [str(a) for a in args]
    full_env = {**os.environ, **{k: str(v) for k, v in env.items()}} if env else None
    if input is not None:
        stdin = subprocess.PIPE
    p = subprocess.Popen(args, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=full_env,
                         start_new_session=new_session, **kwargs)
    try:
        out, err = p.communicate(input=input, timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_popen(p, group=new_session)
        out, err = p.communicate()
        raise subprocess.TimeoutExpired(args, timeout, out, err)
    except BaseException:
        _kill_popen(p, group=new_session)
        p.wait()
        raise
    proc = subprocess.CompletedProcess(args, p.returncode, out if binary else out.decode(errors="replace"),
                                       err.decode(errors="replace"))
    return check_exit(proc, expect)


def _kill_group(pgid):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_popen(p, group=False):
    if group:
        _kill_group(p.pid)
    if p.poll() is None:
        p.kill()


def kill(proc):
    """SIGKILLs a Popen'ed process (if still running) and reaps it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


def parse_json(text, what, proc=None):
    """The JSON object in `text`: all of it, or else its last line that parses
    (stderr may hold warnings before a summary)."""
    text = text.strip()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    pytest.fail(f"{what} is not JSON:\n" + (describe(proc) if proc is not None else text))


def json_stdout(proc):
    """The whole stdout of `proc` as JSON (fails the test, showing the command, when it is not)."""
    try:
        return json.loads(proc.stdout)
    except json.JSONDecodeError as e:
        pytest.fail(f"output is not JSON ({e}):\n{describe(proc)}")


def assert_failed(proc, *patterns, context=""):
    """A refused command: non-zero exit and a stderr message matching every
    regex in `patterns` (case-insensitive). Returns the message."""
    assert proc.returncode != 0, f"{context}: expected a failure\n{describe(proc)}"
    err = proc.stderr.strip()
    assert err, f"{context}: failed without a message on stderr\n{describe(proc)}"
    for pattern in patterns:
        assert re.search(pattern, err, re.IGNORECASE), (
            f"{context}: the message does not match {pattern!r}\n{describe(proc)}")
    return err


# --- preconditions (a reason string, or None when the test can run)

def not_root(what):
    """Why `what` cannot run as this user ("... needs root"), or None as root."""
    return None if os.geteuid() == 0 else f"{what} needs root"


def skip_unless_root(what):
    """Skips the test, saying why, unless it runs as root."""
    reason = not_root(what)
    if reason:
        pytest.skip(reason)


CRIU_PATH = os.environ.get("PATH", "") + ":/usr/local/sbin:/usr/sbin:/sbin"


def criu_binary():
    return shutil.which("criu", path=CRIU_PATH)


@functools.lru_cache(maxsize=None)
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


def criu_unavailable():
    """Why whole-process snapshots (real CRIU 4.x, as root) cannot run here, or None."""
    reason = not_root("whole-process snapshots (CRIU dumps and restores as root)")
    if reason:
        return reason
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


# --- processes

def wait_until(predicate, timeout=30, interval=0.02):
    """Polls predicate() until it returns something true (returned) or
    `timeout` s pass (then its last value, false, is returned)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


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


def data_extents(path, start=0):
    """The data runs of a sparse file from byte `start` on: [(offset, end)] (SEEK_DATA / SEEK_HOLE)."""
    out = []
    with open(path, "rb") as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        pos = start
        while pos < size:
            try:
                begin = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:  # ENXIO: no data past pos
                break
            end = os.lseek(fd, begin, os.SEEK_HOLE)
            out.append((begin, end))
            pos = end
    return out


def flip_byte(path, offset, mask=0xFF):
    """XORs the byte at `offset` of `path` with `mask` (damage on purpose)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def threads_left(pid):
    """Threads still listed in /proc/PID/task (0 once the process is gone)."""
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def wait_gone(pid, timeout=20):
    """True once PID is gone, or a zombie whose other threads are gone too (a
    zombie thread-group leader's threads still hold its files and sockets
    while they tear down its memory); False if it still runs after `timeout` s."""
    return wait_until(lambda: not alive(pid) and threads_left(pid) <= 1, timeout=timeout)


@contextlib.contextmanager
def popen_killed_at_end(*args, **kwargs):
    """subprocess.Popen(*args, **kwargs) for a with block: SIGKILLed and
    reaped at its end if it still runs (a failed assertion leaves nothing)."""
    proc = subprocess.Popen(*args, **kwargs)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def kill9(pid, timeout=20):
    """SIGKILL, then wait_gone (asserted)."""
    os.kill(pid, 9)
    assert wait_gone(pid, timeout), f"pid {pid} survived SIGKILL"


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


def kill_pids(find, rounds=3):
    """SIGKILLs the PIDs find() returns and waits for them, until it returns
    none (processes may start others while they are being killed)."""
    for _ in range(rounds):
        victims = find()
        if not victims:
            return
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in victims:
            wait_gone(pid, timeout=10)


def kill_naming(token):
    """SIGKILLs every process whose command line names `token` (a scratch directory)."""
    kill_pids(lambda: processes_naming(token))


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


def scratch_dir(prefix):
    """A new directory under /dev/shm (else the default temporary directory)."""
    return Path(tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None, prefix=prefix))


# --- stores, through the dvr command and dvr-test-worker

# dvr-test-worker's exit codes (see the usage text in tests/helpers/snapshot_worker.cpp).
OK, FAILED, USAGE, DVR_ERROR = 0, 1, 2, 3
# The worker's regions with --mib 1 (its default), the bytes of one of its
# snapshots, and its content unit (the chunk size of the stores it creates).
WORKER_REGION_SIZES = {"r0": MIB + 4097, "r1": 300001, "r2": 5 * MIB - 3}
WORKER_BYTES = sum(WORKER_REGION_SIZES.values())
WORKER_UNIT = 64 * 1024
# Blocks a file system may spend on a pack's own metadata (extent trees).
PACK_METADATA_SLACK = 64 * 1024


def worker_error(proc):
    """The worker's "error ERRC: MESSAGE" line from stderr ("" if none)."""
    return next((l for l in proc.stderr.splitlines() if l.startswith("error ")), "")


class Store:
    """One store directory, with the dvr command and the worker pointed at it.
    The worker's snapshot content is a pure function of (region, snapshot
    name), so `check` verifies any snapshot from any process, in any store."""

    def __init__(self, path, dvr_bin, worker_bin=None):
        self.path = Path(path)
        self.dvr_bin, self.worker_bin = dvr_bin, worker_bin

    def __repr__(self):
        return f"Store({self.path})"

    # --- the dvr command
    def argv(self, *args):
        return [self.dvr_bin, "--store", self.path, *args]

    def dvr(self, *args, expect=0, timeout=180, **kwargs):
        return run(self.argv(*args), expect=expect, timeout=timeout, **kwargs)

    def dvr_json(self, *args, expect=0, **kwargs):
        """`dvr ARGS --json`: its stdout, which must be all JSON."""
        return json_stdout(self.dvr(*args, "--json", expect=expect, **kwargs))

    def ls(self, session=None, missing_ok=False):
        """`dvr ls [SESSION] --json`: its list of snapshot objects. An unknown
        session is an error (exit 1), or, with missing_ok, an empty list (a
        crash test's worker may be killed before its first snapshot)."""
        if session and missing_ok:
            proc = self.dvr("ls", session, "--json", expect=None)
            if proc.returncode == 1 and f"no session '{session}'" in proc.stderr:
                return []
            check_exit(proc, 0)
            doc = json_stdout(proc)
            assert doc["schema_version"] == 1 and doc["session"] == session, doc
            return doc["snapshots"]
        doc = self.dvr_json("ls", *([session] if session else []))
        assert doc["schema_version"] == 1 and doc["session"] == session, doc
        return doc["snapshots"]

    def names(self, session):
        """The names of a session's snapshots (none for an unknown session)."""
        return {s["name"] for s in self.ls(session, missing_ok=True)}

    def refs(self):
        return {f"{s['session']}/{s['name']}" for s in self.ls()}

    def info(self, ref):
        return self.dvr_json("info", ref)

    def stat(self):
        return self.dvr_json("stat")

    def verify(self, expect=0):
        """`dvr verify --json`; with expect=0 (the default) it must find everything intact."""
        out = self.dvr_json("verify", expect=expect)
        if expect == 0:
            assert out.get("ok") is True and not out.get("damaged_snapshots"), f"verify of {self.path} found damage: {out}"
        return out

    def gc(self):
        return self.dvr_json("gc")

    # --- the worker
    def worker_args(self, mode, session, *args):
        return [self.worker_bin, mode, self.path, session, *args]

    def worker(self, mode, session, *args, expect=OK, timeout=120, **kwargs):
        return run(self.worker_args(mode, session, *args), expect=expect, timeout=timeout, **kwargs)

    def snap(self, session, *names_and_options, **kwargs):
        """`dvr-test-worker snap STORE SESSION NAME... [OPTIONS]`."""
        return self.worker("snap", session, *names_and_options, **kwargs)

    def check(self, session, *names, expect=OK, timeout=300):
        """Restores each name (every snapshot of the session when none is given)
        and compares it byte for byte with the content its name implies."""
        proc = self.worker("check", session, *names, expect=None, timeout=timeout)
        if expect == OK:
            assert proc.returncode == OK, (
                f"snapshots {names or '(all)'} of {session} do not restore bit-exact in {self.path}:\n" + describe(proc))
            # A check that checked nothing would pass silently.
            checked = [l for l in proc.stdout.splitlines() if l.startswith("ok ")]
            assert checked and (not names or len(checked) == len(names)), describe(proc)
        else:
            check_exit(proc, expect)
        return proc

    def units(self, name):
        """[(region, unit, kind, offset, length, first 32 bytes)] of snapshot
        `name`'s content, as `dvr-test-worker describe` reports it."""
        proc = run([self.worker_bin, "describe", name], expect=0)
        out = []
        for line in proc.stdout.splitlines():
            region, unit, kind, offset, length, head = line.split()
            out.append((region, int(unit), kind, int(offset), int(length), bytes.fromhex(head)))
        return out

    def content_keys(self, name):
        """{chunk identity: length} of the non-zero chunks of `name`; base chunks
        are shared by every snapshot, fresh ones belong to the name."""
        return {(("fresh", name) if kind == "fresh" else ("base",)) + (region, unit): length
                for region, unit, kind, _, length, _ in self.units(name) if kind != "zero"}

    # --- the directory
    def tmp_files(self):
        tmp = self.path / "tmp"
        return sorted(os.listdir(tmp)) if tmp.is_dir() else []

    def assert_space_matches_live_data(self, session=None, context=""):
        """After gc, the packs hold about what the listed snapshots added (sum of
        stored_bytes): one header page per pack plus file-system metadata (ext4
        counts extent-tree blocks of punched files) is the allowed slack."""
        live = sum(s["stored_bytes"] for s in self.ls(session))
        stat = self.stat()
        slack = stat["pack_files"] * (4096 + PACK_METADATA_SLACK)
        assert live <= stat["pack_bytes"] <= live + slack, f"{context} packs hold {stat['pack_bytes']} bytes, live data {live}: {stat}"

    def state(self):
        """Everything a refused operation must leave as it was: the listing, every
        file under sessions/, heaps/ and tmp/ and at the top level (size and
        content; the lock, gc's epoch token and the change counter aside), and what `verify` counts
        (and that it finds nothing damaged)."""
        files = {}
        for entry in os.scandir(self.path):  # the top level: its regular files (no stray manifest)
            if entry.is_file(follow_symlinks=False) and entry.name not in ("lock", "epoch", "changes"):
                with open(entry.path, "rb") as f:
                    files[entry.name] = (entry.stat().st_size, hashlib.sha256(f.read()).hexdigest())
        for sub in ("sessions", "heaps", "tmp"):
            root = self.path / sub
            for dirpath, dirnames, filenames in os.walk(root):
                for name in dirnames:
                    files[os.path.relpath(os.path.join(dirpath, name), self.path) + "/"] = "dir"
                for name in filenames:
                    p = os.path.join(dirpath, name)
                    with open(p, "rb") as f:
                        digest = hashlib.sha256(f.read()).hexdigest()
                    files[os.path.relpath(p, self.path)] = (os.path.getsize(p), digest)
        v = self.verify()
        return {
            "ls": sorted(self.ls(), key=lambda s: (s.get("session", ""), s.get("name", ""))),
            "files": files,
            "verify": {k: v.get(k) for k in ("ok", "snapshots", "chunks", "bytes", "damaged")},
        }

    def assert_unchanged(self, before, context):
        """Fails, listing every difference, when state() is no longer `before`."""
        after = self.state()
        if after == before:
            return
        lines = [f"{context}: store {self.path} changed"]
        if after["ls"] != before["ls"]:
            lines.append(f"  ls before: {[(s.get('session'), s.get('name')) for s in before['ls']]}")
            lines.append(f"  ls after:  {[(s.get('session'), s.get('name')) for s in after['ls']]}")
        for f in sorted(set(before["files"]) | set(after["files"])):
            if before["files"].get(f) != after["files"].get(f):
                lines.append(f"  {f}: {before['files'].get(f)} -> {after['files'].get(f)}")
        if after["verify"] != before["verify"]:
            lines.append(f"  verify: {before['verify']} -> {after['verify']}")
        pytest.fail("\n".join(lines))


# --- whole-process test jobs and their status files
#
# dvr-test-job (tests/helpers/proc_job.cpp) and py_job.py write a status line
#
#     count=C sum=X gen=G seq=S id=I mib=M
#
# to a file: C a counter ticking every 10 ms, X a checksum of the job's buffer
# recomputed from memory at every report, G the number of SIGUSR1 mutations
# (each rewrites 1% of the buffer's pages), S the report number, I a random id
# chosen at the job's start. The checksum the buffer must have after G
# mutations is known independently (expected_sum), so a restored job proves its
# memory intact, and its id proves it is the dumped process, not a new one.

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
        if str(PROC_DIR) not in sys.path:
            sys.path.insert(0, str(PROC_DIR))
        import py_job
        return py_job.expected_sum(mib, gen)
    return run([binary("DVR_TEST_JOB"), "expect", "--mib", mib, "--gen", gen], expect=0).stdout.strip()


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
        last = None

        def ready():
            nonlocal last
            last = read_status(path)
            return last if last is not None and pred(last) else None

        found = wait_until(ready, timeout=timeout)
        if found is None:
            pytest.fail(f"timed out after {timeout} s waiting for {what} in {path}; last status {last}; "
                        f"pid {self.pid} state {proc_state(self.pid) if self.pid else None}\n{self.output_text()}")
        return found

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
    """One test's scratch directory, store and processes (jobs started with
    `dvr run`, dumped and restored with `dvr proc`). Every process it started,
    and every process whose command line names the scratch directory (restored
    and half-restored ones included), is killed by kill_all()."""

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
        return run([self.dvr_bin, "--store", self.store, *args], expect=expect, timeout=timeout, env=env)

    def dvr_json(self, *args, expect=0, env=None, timeout=180):
        return json_stdout(self.dvr(*args, "--json", expect=expect, env=env, timeout=timeout))

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
        """`dvr proc ls --json`: its list of process snapshot objects."""
        return self.dvr_json("proc", "ls")["processes"]

    # --- jobs
    def path(self, name):
        return self.root / name

    def dvr_run(self, argv, output, env=None):
        """`dvr run --output OUTPUT -- ARGV`: the job's PID."""
        return self._started(self.dvr_unstored("run", "--output", output, "--", *argv, env=env))

    def dvr_unstored(self, *args, expect=0, env=None, timeout=60):
        return run([self.dvr_bin, *args], expect=expect, timeout=timeout, env=env)

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
        kill_pids(self.running)
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


# --- MPI jobs (tests/mpi): mpirun and the heat example

MPI_DIR = TESTS / "mpi"
RANKS = 4


def mpirun_command(scratch):
    """The launcher ($MPIEXEC, else mpirun on PATH) and, for OpenMPI's: any
    number of ranks on this machine (--oversubscribe), as root too
    (containers; harmless otherwise), shared memory only (no network probing),
    every rank's help messages, and the shared-memory segments in `scratch`
    (a killed job leaves its segments behind; not in /dev/shm, then)."""
    exe = os.environ.get("MPIEXEC") or shutil.which("mpirun")
    if not exe:
        return None
    try:
        version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    if "Open MPI" in version or "OpenRTE" in version:
        return [exe, "--oversubscribe", "--allow-run-as-root", "--mca", "btl", "self,vader",
                "--mca", "btl_vader_backing_directory", str(scratch),
                "--mca", "orte_base_help_aggregate", "0"]
    return [exe]


# The small job the tests run: 256x256, 200 steps, a global snapshot every 20.
HEAT_ARGS = ["--nx", "256", "--ny", "256", "--steps", "200", "--every", "20"]
JOB_TIMEOUT = 120


def run_group(args, expect=0, timeout=JOB_TIMEOUT, env=None):
    """run() in a process group of its own: after `timeout` s the whole group
    (every rank) is SIGKILLed and the test fails. expect: an exit status,
    "nonzero", or None (anything)."""
    try:
        return run(args, expect=expect, timeout=timeout, env=env, new_session=True)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace")
        err = (e.stderr or b"").decode(errors="replace")
        pytest.fail(f"timed out after {timeout} s (a rank hung?):\n$ {' '.join(map(str, args))}\n--- stdout\n{out}"
                    f"\n--- stderr\n{err}")


def last_json(proc):
    """The last line of stdout that is a JSON object (rank 0's report)."""
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError as e:
                pytest.fail(f"bad JSON line ({e}): {line}\n{describe(proc)}")
    pytest.fail(f"no JSON report on stdout:\n{describe(proc)}")


class Heat:
    """The heat example as an MPI job over the stores ROOT/node-R."""

    def __init__(self, mpirun, heat_bin, root):
        self.mpirun = mpirun
        self.bin = heat_bin
        self.root = Path(root)

    def node(self, rank):
        return self.root / f"node-{rank}"

    def run(self, *args, np=RANKS, expect=0, json_report=True):
        """Runs the job (HEAT_ARGS, then args). A successful run with
        json_report returns (report dict, proc); otherwise (None, proc)."""
        extra = ["--json"] if json_report else []
        proc = self.mpirun([self.bin, "--store-root", self.root, *HEAT_ARGS, *args, *extra], np=np, expect=expect)
        if json_report and proc.returncode == 0:
            return last_json(proc), proc
        return None, proc

    def crash(self, *args, np=RANKS):
        """Runs the job with failure options (--abort-at ...) that must kill it."""
        _, proc = self.run(*args, np=np, expect="nonzero", json_report=False)
        assert "checksum" not in proc.stdout, describe(proc)
        return proc


