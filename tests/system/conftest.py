"""Shared fixtures for the Memory DVR system tests.

The tests drive real processes: the `dvr` command ($DVR_BIN) and the
`dvr-test-worker` helper ($DVR_WORKER, tests/helpers/snapshot_worker.cpp), each
against its own store directory. The worker's snapshot content is a pure
function of (region, snapshot name), so `check` can verify any snapshot from any
process.

Run: DVR_BIN=build/dvr DVR_WORKER=build/dvr-test-worker /usr/bin/python3 -m pytest tests/system
"""

import json
import os
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

# Worker exit codes (see the usage text in snapshot_worker.cpp).
OK, FAILED, USAGE, DVR_ERROR = 0, 1, 2, 3

# Region sizes the worker uses with --mib 1.
MIB = 1024 * 1024
REGION_SIZES = {"r0": MIB + 4097, "r1": 300001, "r2": 5 * MIB - 3}
SNAPSHOT_BYTES = sum(REGION_SIZES.values())
# Blocks a file system may spend on a pack's own metadata (extent trees).
PACK_METADATA_SLACK = 64 * 1024


def _binary(var):
    path = os.environ.get(var)
    if not path or not os.access(path, os.X_OK):
        pytest.fail(f"${var} must name the built binary (got {path!r}); run through CTest, or set "
                    f"DVR_BIN=BUILD/dvr DVR_WORKER=BUILD/dvr-test-worker")
    return path


def describe(proc):
    """The command, exit status and output of a finished process, for assertion messages."""
    args = proc.args if isinstance(proc.args, str) else " ".join(str(a) for a in proc.args)
    return f"$ {args}\n-> exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"


def worker_error(proc):
    """The worker's "error ERRC: MESSAGE" line from stderr ("" if none)."""
    return next((l for l in proc.stderr.splitlines() if l.startswith("error ")), "")


def run(args, expect=None, timeout=120, **kwargs):
    """Runs a command to completion (killed after `timeout` s); checks its exit status if `expect` is given."""
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, **kwargs)
    if expect is not None:
        assert proc.returncode == expect, describe(proc)
    return proc


class Store:
    """One store directory, with the dvr CLI and the worker pointed at it."""

    def __init__(self, path, dvr_bin, worker_bin):
        self.path = Path(path)
        self.dvr_bin = dvr_bin
        self.worker_bin = worker_bin

    # --- the dvr command
    def dvr(self, *args, expect=0, timeout=120):
        return run([self.dvr_bin, "--store", self.path, *args], expect=expect, timeout=timeout)

    def dvr_json(self, *args, expect=0):
        proc = self.dvr(*args, "--json", expect=expect)
        try:
            return json.loads(proc.stdout)
        except json.JSONDecodeError as e:
            pytest.fail(f"output is not JSON ({e}):\n{describe(proc)}")

    def ls(self, session=None):
        return self.dvr_json("ls", *([session] if session else []))

    def names(self, session):
        return {s["name"] for s in self.ls(session)}

    def stat(self):
        return self.dvr_json("stat")

    def verify(self, expect=0):
        return self.dvr_json("verify", expect=expect)

    def gc(self):
        return self.dvr_json("gc")

    # --- the worker
    def worker_args(self, mode, session, *args):
        return [self.worker_bin, mode, self.path, session, *args]

    def worker(self, mode, session, *args, expect=OK, timeout=120, **kwargs):
        return run(self.worker_args(mode, session, *args), expect=expect, timeout=timeout, **kwargs)

    def snap(self, session, *names, **kwargs):
        return self.worker("snap", session, *names, **kwargs)

    def check(self, session, *names, expect=OK, timeout=300):
        proc = self.worker("check", session, *names, expect=expect, timeout=timeout)
        if expect == OK:
            # A check that checked nothing would pass silently.
            checked = [l for l in proc.stdout.splitlines() if l.startswith("ok ")]
            assert checked and (not names or len(checked) == len(names)), describe(proc)
        return proc

    def assert_space_matches_live_data(self, session=None, context=""):
        """After gc, the packs hold about what the listed snapshots added (sum of
        stored_bytes): one header page per pack plus file-system metadata (ext4
        counts extent-tree blocks of punched files) is the allowed slack."""
        live = sum(s["stored_bytes"] for s in self.ls(session))
        stat = self.stat()
        slack = stat["pack_files"] * (4096 + PACK_METADATA_SLACK)
        assert live <= stat["pack_bytes"] <= live + slack, f"{context} packs hold {stat['pack_bytes']} bytes, live data {live}: {stat}"

    # --- the worker's content, as `dvr-test-worker describe` reports it
    def units(self, name):
        """[(region, unit, kind, offset, length, first 32 bytes)] of snapshot `name`'s content."""
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


@pytest.fixture(scope="session")
def dvr_bin():
    return _binary("DVR_BIN")


@pytest.fixture(scope="session")
def worker_bin():
    return _binary("DVR_WORKER")


@pytest.fixture
def make_store(tmp_path, dvr_bin, worker_bin):
    """make_store(name="store", parent=tmp_path) -> Store at parent/name (not created yet)."""

    def make(name="store", parent=None):
        return Store(Path(parent or tmp_path) / name, dvr_bin, worker_bin)

    return make


@pytest.fixture
def store(make_store):
    return make_store()


def kill(proc):
    """SIGKILLs a Popen'ed process (if still running) and reaps it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.fixture(params=["disk", "dram"])
def crash_store(request, make_store):
    """A store on the test's tmp directory (a disk file system) and one on
    /dev/shm (tmpfs, the default store location)."""
    if request.param == "disk":
        yield make_store()
        return
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="dvr-system-test-") as shm:
        yield make_store(parent=shm)
