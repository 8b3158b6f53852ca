"""Fixtures for the MPI tests: coordinated snapshots across ranks with partner
copies (dvr::mpi, issue #8).

The tests start real MPI jobs with OpenMPI's `mpirun` (4 ranks on this one
machine, oversubscribed; shared memory between them): the example
`dvr-example-mpi-heat` ($DVR_MPI_HEAT, examples/mpi_heat/heat.cpp) and the
Python script py_heat.py (memdvr.mpi over mpi4py). Each rank R of a job uses
its own store ROOT/node-R, standing for one node's memory, so "a node is lost"
is `rm -rf ROOT/node-R`. The stores are inspected with the dvr command
($DVR_BIN).

Every job runs in a process group of its own and is SIGKILLed (with its
ranks) when it outlives its timeout, so a hung collective fails the test
instead of hanging the suite.

$MPIEXEC names the launcher (CMake's MPIEXEC_EXECUTABLE under CTest; else
`mpirun` on PATH). What the suites share is in tests/support/dvrtest.py.

Run: DVR_MPI_HEAT=build/dvr-example-mpi-heat DVR_BIN=build/dvr PYTHONPATH=build/python \
     /usr/bin/python3 -m pytest tests/mpi
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "support"))
from dvrtest import (JOB_TIMEOUT, RANKS, Heat, binary, describe, dvr_bin, json_stdout,  # noqa: E402,F401  (fixtures)
                     mpirun_command, run_group)


@pytest.fixture(scope="session")
def mpirun(tmp_path_factory):
    """mpirun(args, np=4, expect=0) -> CompletedProcess of `mpirun ... -np N args`."""
    launcher = mpirun_command(tmp_path_factory.mktemp("mpi-shm"))
    if launcher is None:
        pytest.fail("mpirun not found (install openmpi-bin), and $MPIEXEC not set")

    def go(args, np=RANKS, expect=0, timeout=JOB_TIMEOUT, env=None):
        return run_group([*launcher, "-np", str(np), *args], expect=expect, timeout=timeout, env=env)

    return go


@pytest.fixture(scope="session")
def heat_bin():
    return binary("DVR_MPI_HEAT")


@pytest.fixture
def heat(mpirun, heat_bin, tmp_path):
    """A Heat job with its stores under this test's tmp_path/root."""
    return Heat(mpirun, heat_bin, tmp_path / "root")


@pytest.fixture(scope="session")
def reference(mpirun, heat_bin, tmp_path_factory):
    """The report of one uninterrupted 4-rank run of HEAT_ARGS: its checksum is C."""
    report, proc = Heat(mpirun, heat_bin, tmp_path_factory.mktemp("reference") / "root").run()
    assert report["resumed_from"] is None, describe(proc)
    assert report["failed"] == [], describe(proc)
    return report


@pytest.fixture(scope="session")
def dvr_ls(dvr_bin):
    """dvr_ls(store_dir) -> {session: [snapshot names, oldest first]} from `dvr ls --json`."""

    def ls(store):
        rows = json_stdout(run_group([dvr_bin, "--store", store, "ls", "--json"]))["snapshots"]
        out = {}
        for row in sorted(rows, key=lambda r: (r["session"], r["time_ns"], r["name"])):
            assert not row["damaged"], f"{store}: {row['session']}/{row['name']} damaged: {row['damage']}"
            out.setdefault(row["session"], []).append(row["name"])
        return out

    return ls


@pytest.fixture(scope="session")
def python_env():
    """The environment for memdvr scripts: skips unless `import memdvr.mpi` works."""
    env = dict(os.environ)
    probe = subprocess.run([sys.executable, "-c", "import memdvr.mpi, mpi4py"], capture_output=True, text=True,
                           env=env, timeout=60)
    if probe.returncode != 0:
        why = (probe.stderr.strip().splitlines() or ["?"])[-1]
        pytest.skip(f"import memdvr.mpi fails (PYTHONPATH={env.get('PYTHONPATH')!r}): {why}")
    return env
