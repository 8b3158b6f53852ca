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
of its own; push and pull talk to it as they would to another server. It
forwards nothing; `sshd_forwarding`, a second one, lets clients connect to unix
sockets on its side (push --keep-ssh's kept receiver). They need root (sshd
must run as root) and /usr/sbin/sshd; tests using them skip with the reason
otherwise.

Region snapshots come from `dvr-test-worker` ($DVR_WORKER,
tests/helpers/snapshot_worker.cpp), whose content is a pure function of the
snapshot name, so `check` proves a received snapshot bit-exact in any store;
and from the `memdvr` Python package (numpy arrays of known content).
Process snapshots come from `dvr-test-job` ($DVR_TEST_JOB) started with
`dvr run` (dvrtest.Work, as in tests/proc). What the suites share (running
commands, dvrtest.Store, process helpers) is in tests/support/dvrtest.py.

Run: DVR_BIN=build/dvr DVR_WORKER=build/dvr-test-worker DVR_TEST_JOB=build/dvr-test-job \
     PYTHONPATH=build/python /usr/bin/python3 -m pytest tests/migration
"""

import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "support"))
from dvrtest import (WORKER_UNIT, Store, Work, criu_unavailable, describe, dvr_bin, job_bin,  # noqa: E402,F401
                     kill_naming, not_root, run, scratch_dir, worker_bin)

HERE = Path(__file__).resolve().parent
SSHD = "/usr/sbin/sshd"
SSH_KEYGEN = "/usr/bin/ssh-keygen"


@pytest.fixture(scope="session")
def memdvr():
    try:
        import memdvr as module
    except ImportError as e:
        pytest.fail(f"cannot import memdvr ({e}); set PYTHONPATH=BUILD/python (CTest does)")
    return module


# --- the per-test scratch directory and its stores

@pytest.fixture
def scratch():
    root = scratch_dir("dvr-migration-test-")
    try:
        yield root
    finally:
        kill_naming(str(root))
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
    reason = not_root("the ssh tests run their own sshd on 127.0.0.1, which")
    if reason:
        return reason
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


def _start_sshd(forwarding):
    """Starts a test sshd (see Sshd); yields it, stops it after."""
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
                # Forwarding: a unix socket of the far side only (the kept
                # receiver of push --keep-ssh), else none.
                "AllowTcpForwarding local" if forwarding else "AllowTcpForwarding no",
                "AllowStreamLocalForwarding local" if forwarding else "AllowStreamLocalForwarding no",
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


@pytest.fixture(scope="session")
def sshd():
    """The test sshd; it forwards nothing (AllowTcpForwarding no,
    AllowStreamLocalForwarding no)."""
    yield from _start_sshd(forwarding=False)


@pytest.fixture(scope="session")
def sshd_forwarding():
    """A second test sshd that lets clients connect to unix sockets on its
    side (AllowStreamLocalForwarding local), as push --keep-ssh's kept
    receiver needs."""
    yield from _start_sshd(forwarding=True)


# --- whole processes (real CRIU; root)

@pytest.fixture
def work(scratch, store_a, dvr_bin, job_bin):
    """A dvrtest.Work (jobs started with `dvr run`, dump/restore helpers) on
    this test's scratch directory, dumping into store A; switch `work.store`
    to restore from another store. Skips without root and CRIU 4.x."""
    reason = criu_unavailable()
    if reason:
        pytest.skip(reason)
    w = Work(scratch, dvr_bin, job_bin)
    w.store = store_a.path
    try:
        yield w
    finally:
        w.kill_all()
