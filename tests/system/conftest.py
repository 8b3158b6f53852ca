"""Fixtures for the Memory DVR system tests.

The tests drive real processes: the `dvr` command ($DVR_BIN) and the
`dvr-test-worker` helper ($DVR_WORKER, tests/helpers/snapshot_worker.cpp), each
against its own store directory (dvrtest.Store). The worker's snapshot content
is a pure function of (region, snapshot name), so `check` can verify any
snapshot from any process. What the suites share is in tests/support/dvrtest.py.

Run: DVR_BIN=build/dvr DVR_WORKER=build/dvr-test-worker /usr/bin/python3 -m pytest tests/system
"""

import os
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "support"))
from dvrtest import Store, dvr_bin, worker_bin  # noqa: E402,F401  (fixtures)


@pytest.fixture
def make_store(tmp_path, dvr_bin, worker_bin):
    """make_store(name="store", parent=tmp_path) -> Store at parent/name (not created yet)."""

    def make(name="store", parent=None):
        return Store(Path(parent or tmp_path) / name, dvr_bin, worker_bin)

    return make


@pytest.fixture
def store(make_store):
    return make_store()


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
