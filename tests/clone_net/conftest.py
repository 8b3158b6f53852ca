"""Fixtures for the clone-network tests (`dvr proc clone NAME --net ...`).

They run a real redis-server under the real CRIU (>= 4.2, which dumps TCP
sockets), as root, and make network namespaces and veth pairs; they skip
with the reason otherwise. Each test gets a scratch directory under /dev/shm
(`work`, a dvrtest.Work) with its store, the server's Unix socket and output;
every process it started, restored or cloned is SIGKILLed when it ends.

Run: DVR_BIN=build/dvr DVR_TEST_JOB=build/dvr-test-job /usr/bin/python3 -m pytest -s tests/clone_net
"""

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "support"))
from dvrtest import Work, criu_unavailable, criu_version, dvr_bin, job_bin, scratch_dir  # noqa: E402,F401  (fixtures)

REDIS_SERVER = "/usr/bin/redis-server"
REDIS_CLI = "/usr/bin/redis-cli"


@pytest.fixture(scope="session", autouse=True)
def _needs_root_criu_redis_ip():
    reason = criu_unavailable()
    if not reason and (criu_version() or (0,)) < (4, 2, 0):
        reason = f"CRIU {criu_version()} cannot dump TCP sockets on this kernel; clones with a network need CRIU >= 4.2"
    if not reason and not (os.access(REDIS_SERVER, os.X_OK) and os.access(REDIS_CLI, os.X_OK)):
        reason = f"{REDIS_SERVER} or {REDIS_CLI} is missing (install-deps.sh installs redis-server)"
    if not reason and not shutil.which("ip", path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin"):
        reason = "the ip command (iproute2) is missing (install-deps.sh installs it)"
    if not reason and not shutil.which("nsenter"):
        reason = "nsenter (util-linux) is missing"
    if reason:
        pytest.skip(reason)


@pytest.fixture
def work(dvr_bin, job_bin):
    root = scratch_dir("dvr-clone-net-test-")
    w = Work(root, dvr_bin, job_bin)
    try:
        yield w
    finally:
        w.kill_all()
        shutil.rmtree(root, ignore_errors=True)
