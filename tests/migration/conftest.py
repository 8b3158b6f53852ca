"""Fixtures for the migration tests: moving snapshots between stores and servers
(`dvr send/receive/export/import/push/pull`, issue #6).

Every test gets a scratch directory under /dev/shm (`scratch`) holding its
stores (`store_a`, `store_b`, more from `make_store`), stream files, status
files and job output; every process whose command line names that directory
is SIGKILLed when the test ends, pass or fail. Store B starts out holding one
unrelated snapshot (`resident/r1`), so that "B is exactly as before" compares
something.

`sshd` (one per test session) is a real OpenSSH server on 127.0.0.1 with a
throw-away host key, a throw-away client key authorized for root and a config
of its own; push and pull talk to it as they would to another server. It needs
root (sshd must run as root) and /usr/sbin/sshd; tests using it skip with the
reason otherwise.

Region snapshots come from `dvr-test-worker` ($DVR_WORKER,
tests/helpers/snapshot_worker.cpp), whose content is a pure function of the
snapshot name, so `check` proves a received snapshot bit-exact in any store;
and from the `memdvr` Python package (numpy arrays of known content).
Process snapshots come from `dvr-test-job` ($DVR_TEST_JOB) started with
`dvr run`, with the helpers of tests/proc/conftest.py (loaded by path).

Run: DVR_BIN=build/dvr DVR_WORKER=build/dvr-test-worker DVR_TEST_JOB=build/dvr-test-job \
     PYTHONPATH=build/python /usr/bin/python3 -m pytest tests/migration
"""

import hashlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
MIB = 1024 * 1024
SSHD = "/usr/sbin/sshd"
SSH_KEYGEN = "/usr/bin/ssh-keygen"

# The worker's regions with --mib 1 (snapshot_worker.cpp) and its content unit.
WORKER_REGION_SIZES = {"r0": MIB + 4097, "r1": 300001, "r2": 5 * MIB - 3}
WORKER_BYTES = sum(WORKER_REGION_SIZES.values())
WORKER_UNIT = 64 * 1024


def _load_proc_helpers():
    """tests/proc/conftest.py as a plain module (its Job and Work classes and
    process helpers), under a name that cannot clash with this conftest."""
    spec = importlib.util.spec_from_file_location("dvr_proc_test_helpers", HERE.parent / "proc" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


proc_helpers = _load_proc_helpers()


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


def run(args, expect=None, timeout=180, input=None, stdin=subprocess.DEVNULL, env=None, binary=False):
    """Runs a command to completion (killed after `timeout` s); checks its exit
    status if `expect` is given. stdout is bytes with binary=True (stderr always text)."""
    full_env = None
    if env:
        full_env = dict(os.environ)
        full_env.update(env)
    if input is not None:
        stdin = None
    proc = subprocess.run([str(a) for a in args], input=input, stdin=stdin, capture_output=True, timeout=timeout,
                          env=full_env)
    if not binary:
        proc.stdout = proc.stdout.decode(errors="replace")
    proc.stderr = proc.stderr.decode(errors="replace")
    if expect is not None:
        assert proc.returncode == expect, describe(proc)
    return proc


def parse_json(text, what, proc=None):
    """The JSON object in `text`: all of it, or else its last line that parses
    (stderr may hold warnings before the summary)."""
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


def assert_failed(proc, *patterns, context=""):
    """A refused dvr command: non-zero exit and a stderr message matching every
    regex in `patterns` (case-insensitive). Returns the message."""
    assert proc.returncode != 0, f"{context}: expected a failure\n{describe(proc)}"
    err = proc.stderr.strip()
    assert err, f"{context}: failed without a message on stderr\n{describe(proc)}"
    for pattern in patterns:
        assert re.search(pattern, err, re.IGNORECASE), (
            f"{context}: the message does not match {pattern!r}\n{describe(proc)}")
    return err


def _binary(var):
    path = os.environ.get(var)
    if not path or not os.access(path, os.X_OK):
        pytest.fail(f"${var} must name the built binary (got {path!r}); run through CTest, or set "
                    f"DVR_BIN=BUILD/dvr DVR_WORKER=BUILD/dvr-test-worker DVR_TEST_JOB=BUILD/dvr-test-job "
                    f"PYTHONPATH=BUILD/python")
    return path


@pytest.fixture(scope="session")
def dvr_bin():
    return _binary("DVR_BIN")


@pytest.fixture(scope="session")
def worker_bin():
    return _binary("DVR_WORKER")


@pytest.fixture(scope="session")
def job_bin():
    return _binary("DVR_TEST_JOB")


@pytest.fixture(scope="session")
def memdvr():
    try:
        import memdvr as module
    except ImportError as e:
        pytest.fail(f"cannot import memdvr ({e}); set PYTHONPATH=BUILD/python (CTest does)")
    return module


# --- stores

class Store:
    """One store directory, with the dvr CLI and the worker pointed at it."""

    def __init__(self, path, dvr_bin, worker_bin):
        self.path = Path(path)
        self.dvr_bin, self.worker_bin = dvr_bin, worker_bin

    def __repr__(self):
        return f"Store({self.path})"

    def argv(self, *args):
        return [self.dvr_bin, "--store", self.path, *args]

    def dvr(self, *args, expect=0, timeout=180, **kwargs):
        return run(self.argv(*args), expect=expect, timeout=timeout, **kwargs)

    def dvr_json(self, *args, expect=0, **kwargs):
        proc = self.dvr(*args, "--json", expect=expect, **kwargs)
        return parse_json(proc.stdout, f"the stdout of dvr {' '.join(map(str, args))} --json", proc)

    def ls(self, session=None):
        return self.dvr_json("ls", *([session] if session else []))

    def refs(self):
        return {f"{s['session']}/{s['name']}" for s in self.ls()}

    def info(self, ref):
        return self.dvr_json("info", ref)

    def verify(self):
        """`dvr verify --json`, which must find everything intact."""
        out = self.dvr_json("verify")
        assert out.get("ok") is True and not out.get("damaged"), f"verify of {self.path} found damage: {out}"
        return out

    # --- the worker (content a pure function of the name; see snapshot_worker.cpp)
    def snap(self, session, *names, mib=1):
        return run([self.worker_bin, "snap", self.path, session, *names, "--mib", mib], expect=0)

    def check(self, session, *names, mib=1):
        """Restores each name in this store and compares it byte for byte with
        the content its name implies."""
        proc = run([self.worker_bin, "check", self.path, session, *names, "--mib", mib], expect=None, timeout=300)
        assert proc.returncode == 0, f"snapshots {names} of {session} do not restore bit-exact in {self.path}:\n" + \
            describe(proc)
        checked = [l for l in proc.stdout.splitlines() if l.startswith("ok ")]
        assert len(checked) == len(names), describe(proc)
        return proc

    # --- what must not change when a receive is refused
    def state(self):
        """Everything a refused receive must leave as it was: the listing, every
        file under sessions/, heaps/ and tmp/ and at the top level (size and
        content; the lock and gc's epoch token aside), and what `verify` counts
        (and that it finds nothing damaged)."""
        files = {}
        for entry in os.scandir(self.path):  # the top level: its regular files (no stray manifest)
            if entry.is_file(follow_symlinks=False) and entry.name not in ("lock", "epoch"):
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


# --- moving snapshots

def send_to_file(store, ref, path, *opts, expect=0):
    """`dvr send REF OPTS > path`; returns the process (stderr: the summary)."""
    with open(path, "wb") as out:
        proc = subprocess.run([str(a) for a in store.argv("send", ref, *opts)], stdin=subprocess.DEVNULL, stdout=out,
                              stderr=subprocess.PIPE, timeout=180)
    proc.stderr = proc.stderr.decode(errors="replace")
    proc.stdout = ""
    if expect is not None:
        assert proc.returncode == expect, describe(proc)
    return proc


def receive_from_file(store, path, *opts, expect=0):
    """`dvr receive OPTS < path`."""
    with open(path, "rb") as f:
        return store.dvr("receive", *opts, stdin=f, expect=expect)


def pipe(sender, ref, receiver, send_opts=(), receive_opts=("--json",), timeout=180):
    """`dvr --store A send REF SEND_OPTS | dvr --store B receive RECEIVE_OPTS`
    through a real pipe. Returns (send, receive): finished processes with text
    stdout/stderr (the sender's stdout is the pipe)."""
    with tempfile.TemporaryFile() as send_err, tempfile.TemporaryFile() as recv_out, \
            tempfile.TemporaryFile() as recv_err:
        send_argv = [str(a) for a in sender.argv("send", ref, *send_opts)]
        recv_argv = [str(a) for a in receiver.argv("receive", *receive_opts)]
        s = subprocess.Popen(send_argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=send_err)
        try:
            r = subprocess.Popen(recv_argv, stdin=s.stdout, stdout=recv_out, stderr=recv_err)
        except BaseException:
            s.kill()
            s.wait()
            raise
        s.stdout.close()  # the receiver holds the only read end: the sender sees EPIPE if it quits
        try:
            r.wait(timeout=timeout)
            s.wait(timeout=30)
        finally:
            for p in (r, s):
                if p.poll() is None:
                    p.kill()
                    p.wait()
        results = []
        for argv, p, out, err in ((send_argv, s, None, send_err), (recv_argv, r, recv_out, recv_err)):
            err.seek(0)
            text_out = ""
            if out is not None:
                out.seek(0)
                text_out = out.read().decode(errors="replace")
            results.append(subprocess.CompletedProcess(argv, p.returncode, text_out, err.read().decode(errors="replace")))
    return tuple(results)


def pipe_ok(sender, ref, receiver, send_opts=("--json",)):
    """A successful pipe round trip: (send summary, receive summary), both --json."""
    s, r = pipe(sender, ref, receiver, send_opts=send_opts, receive_opts=("--json",))
    assert s.returncode == 0, describe(s) + "\n(receiver)\n" + describe(r)
    assert r.returncode == 0, describe(r) + "\n(sender)\n" + describe(s)
    return parse_json(s.stderr, "the summary send --json prints on stderr", s), \
        parse_json(r.stdout, "the summary receive --json prints on stdout", r)


# --- the per-test scratch directory and its stores

def _kill_naming(token):
    for _ in range(3):
        victims = proc_helpers.processes_naming(token)
        if not victims:
            return
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in victims:
            proc_helpers.wait_gone(pid, timeout=10)


@pytest.fixture
def scratch():
    root = Path(tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None, prefix="dvr-migration-test-"))
    try:
        yield root
    finally:
        _kill_naming(str(root))
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def make_store(scratch, dvr_bin, worker_bin, memdvr):
    """make_store(name, chunk_size=WORKER_UNIT) -> a new, empty store
    scratch/NAME, created through memdvr. The default chunk size is the worker's
    content unit (as in the stores the worker creates itself), so that a
    worker snapshot's chunks are exactly its units; None = the library's default."""

    def make(name, chunk_size=WORKER_UNIT):
        path = scratch / name
        kwargs = {} if chunk_size is None else {"chunk_size": chunk_size}
        memdvr.Store(str(path), **kwargs)
        return Store(path, dvr_bin, worker_bin)

    return make


@pytest.fixture
def store_a(make_store):
    return make_store("A")


@pytest.fixture
def store_b(make_store):
    """Store B, holding one unrelated snapshot (resident/r1)."""
    b = make_store("B")
    b.snap("resident", "r1")
    return b


# --- an OpenSSH server on 127.0.0.1

class Sshd:
    """A running sshd: `ssh` is the client command (a string, as --ssh and
    $DVR_SSH take it), `host` is "root@127.0.0.1:PORT", url(PATH) the
    ssh:// URL of a store at PATH on it."""

    def __init__(self, port, key, popen, log):
        self.port, self.key, self.popen, self.log = port, Path(key), popen, Path(log)
        self.ssh = (f"ssh -p {port} -i {key} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "
                    f"-o BatchMode=yes -o LogLevel=ERROR -o IdentitiesOnly=yes -o ConnectTimeout=20")
        self.host = f"root@127.0.0.1:{port}"

    def url(self, path, user="root", port=True):
        return f"ssh://{user + '@' if user else ''}127.0.0.1{':' + str(self.port) if port else ''}{Path(path)}"

    def run(self, remote_command, input=None, expect=None, timeout=60):
        """Runs REMOTE_COMMAND (a shell command line) on the server as root."""
        return run([*shlex.split(self.ssh), "root@127.0.0.1", remote_command], input=input, expect=expect,
                   timeout=timeout, binary=True)

    def log_text(self):
        try:
            return self.log.read_text(errors="replace")[-4000:]
        except OSError:
            return ""


def _sshd_unavailable():
    if os.geteuid() != 0:
        return "the ssh tests run their own sshd on 127.0.0.1, which needs root"
    for tool in (SSHD, SSH_KEYGEN):
        if not os.access(tool, os.X_OK):
            return f"{tool} is missing (install-deps.sh installs openssh-server and openssh-client)"
    if not shutil.which("ssh"):
        return "the ssh client is missing (install-deps.sh installs openssh-client)"
    return None


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _banner(port, timeout=1.0):
    """True when an SSH server answers on 127.0.0.1:PORT."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.settimeout(timeout)
            return s.recv(64).startswith(b"SSH-")
    except OSError:
        return False


@pytest.fixture(scope="session")
def sshd():
    reason = _sshd_unavailable()
    if reason:
        pytest.skip(reason)
    # Privilege separation directory: sshd refuses to start without it.
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="dvr-migration-sshd-"))
    popen = None
    try:
        host_key, client_key = root / "host_ed25519", root / "client_ed25519"
        for key, comment in ((host_key, "dvr-test-host"), (client_key, "dvr-test-client")):
            run([SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", key], expect=0)
        authorized = root / "authorized_keys"
        authorized.write_text((root / "client_ed25519.pub").read_text())
        authorized.chmod(0o600)
        log = root / "sshd.log"
        for attempt in range(5):
            port = _free_port()
            config = root / "sshd_config"
            config.write_text("\n".join([
                f"Port {port}",
                "ListenAddress 127.0.0.1",
                f"HostKey {host_key}",
                f"PidFile {root / 'sshd.pid'}",
                f"AuthorizedKeysFile {authorized}",
                "PermitRootLogin prohibit-password",
                "PubkeyAuthentication yes",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "UsePAM no",
                "StrictModes no",
                "X11Forwarding no",
                "AllowTcpForwarding no",
                "PrintMotd no",
                "PrintLastLog no",
                "MaxStartups 50",
                "MaxSessions 50",
                "",
            ]))
            test = run([SSHD, "-t", "-f", config])
            assert test.returncode == 0, f"sshd rejects the test config:\n{describe(test)}"
            with open(log, "ab") as out:
                popen = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=out)
            deadline = time.monotonic() + 15
            while popen.poll() is None and time.monotonic() < deadline and not _banner(port):
                time.sleep(0.05)
            if popen.poll() is None and _banner(port):
                break
            if popen.poll() is None:
                popen.kill()
            popen.wait()
            popen = None  # most likely the port was taken meanwhile: another one
        if popen is None:
            pytest.fail(f"sshd did not start on 127.0.0.1; its log:\n{(root / 'sshd.log').read_text(errors='replace')}")
        server = Sshd(port, client_key, popen, log)
        probe = server.run("true", timeout=30)
        assert probe.returncode == 0, f"ssh to the test sshd fails:\n{describe(probe)}\n--- sshd log\n{server.log_text()}"
        yield server
    finally:
        if popen is not None and popen.poll() is None:
            popen.terminate()
            try:
                popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait()
        shutil.rmtree(root, ignore_errors=True)


def ssh_opts(sshd, dvr_bin):
    """The options push and pull need to reach the test sshd and the built dvr."""
    return ["--ssh", sshd.ssh, "--remote-dvr", dvr_bin]


# --- whole processes (real CRIU; root)

@pytest.fixture
def work(scratch, store_a, dvr_bin, job_bin):
    """tests/proc's Work (jobs started with `dvr run`, dump/restore helpers) on
    this test's scratch directory, dumping into store A; switch `work.store`
    to restore from another store. Skips without root and CRIU 4.x."""
    reason = proc_helpers.why_not_runnable()
    if reason:
        pytest.skip(reason)
    w = proc_helpers.Work(scratch, dvr_bin, job_bin)
    w.store = store_a.path
    try:
        yield w
    finally:
        w.kill_all()
