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
`mpirun` on PATH).

Run: DVR_MPI_HEAT=build/dvr-example-mpi-heat DVR_BIN=build/dvr PYTHONPATH=build/python \
     /usr/bin/python3 -m pytest tests/mpi
"""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
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


def _binary(var):
    path = os.environ.get(var)
    if not path or not os.access(path, os.X_OK):
        pytest.fail(f"${var} must name the built binary (got {path!r}); run through CTest (ctest -R '^mpi$'), "
                    f"or set DVR_MPI_HEAT=BUILD/dvr-example-mpi-heat DVR_BIN=BUILD/dvr")
    return path


def describe(proc):
    """The command, exit status and output of a finished job, for assertion messages."""
    args = " ".join(str(a) for a in proc.args)
    return f"$ {args}\n-> exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"


def run(args, expect=0, timeout=JOB_TIMEOUT, env=None):
    """Runs a command in its own process group to completion; kills the whole
    group after `timeout` s (and fails). expect: an exit status, "nonzero", or
    None (anything)."""
    args = [str(a) for a in args]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout} s (a rank hung?):\n$ {' '.join(args)}\n--- stdout\n{out}\n--- stderr\n{err}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    done = subprocess.CompletedProcess(args, proc.returncode, out, err)
    if expect == "nonzero":
        assert done.returncode != 0, describe(done)
    elif expect is not None:
        assert done.returncode == expect, describe(done)
    return done


def last_json(proc):
    """The last line of stdout that is a JSON object (rank 0's report)."""
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError as e:
                pytest.fail(f"bad JSON line ({e}): {line}\n{describe(proc)}")
    pytest.fail(f"no JSON report on stdout:\n{describe(proc)}")


@pytest.fixture(scope="session")
def mpirun(tmp_path_factory):
    """mpirun(args, np=4, expect=0) -> CompletedProcess of `mpirun ... -np N args`."""
    launcher = mpirun_command(tmp_path_factory.mktemp("mpi-shm"))
    if launcher is None:
        pytest.fail("mpirun not found (install openmpi-bin), and $MPIEXEC not set")

    def go(args, np=RANKS, expect=0, timeout=JOB_TIMEOUT, env=None):
        return run([*launcher, "-np", str(np), *args], expect=expect, timeout=timeout, env=env)

    return go


@pytest.fixture(scope="session")
def heat_bin():
    return _binary("DVR_MPI_HEAT")


@pytest.fixture(scope="session")
def dvr_bin():
    return _binary("DVR_BIN")


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
        proc = run([dvr_bin, "--store", store, "ls", "--json"])
        try:
            rows = json.loads(proc.stdout)
        except json.JSONDecodeError as e:
            pytest.fail(f"dvr ls --json gave no JSON ({e}):\n{describe(proc)}")
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
