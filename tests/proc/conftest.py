"""Fixtures for the whole-process snapshot tests (`dvr run`, `dvr proc ...`).

The tests run real jobs under the real CRIU: `dvr-test-job` ($DVR_TEST_JOB,
tests/helpers/proc_job.cpp), the Python/numpy job py_job.py beside this file,
and redis-server. Both test jobs write a status line

    count=C sum=X gen=G seq=S id=I mib=M

to a file (see proc_job.cpp and dvrtest.Job): C a counter ticking every
10 ms, X a checksum of the job's buffer recomputed from memory at every
report, G the number of SIGUSR1 mutations (each rewrites 1% of the buffer's
pages), S the report number, I a random id chosen at the job's start. The
checksum the buffer must have after G mutations is known independently
(`expected_sum`), so a restored job proves its memory intact, and its id
proves it is the dumped process, not a new one.

Each test gets a scratch directory under /dev/shm (`work`, a dvrtest.Work)
holding its store, status files and job output. Every process the test
started, and every process whose command line names the scratch directory
(restored and half-restored ones included), is SIGKILLed when the test ends,
pass or fail. What the suites share is in tests/support/dvrtest.py.

Needs root and CRIU 4.x; skips with the reason otherwise.

Run: DVR_BIN=build/dvr DVR_TEST_JOB=build/dvr-test-job /usr/bin/python3 -m pytest tests/proc
"""

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "support"))
from dvrtest import Work, criu_unavailable, dvr_bin, job_bin, scratch_dir  # noqa: E402,F401  (fixtures)


@pytest.fixture(scope="session", autouse=True)
def _needs_root_and_criu():
    reason = criu_unavailable()
    if reason:
        pytest.skip(reason)


@pytest.fixture
def work(dvr_bin, job_bin):
    root = scratch_dir("dvr-proc-test-")
    w = Work(root, dvr_bin, job_bin)
    try:
        yield w
    finally:
        w.kill_all()
        shutil.rmtree(root, ignore_errors=True)
