"""Tests of memdvr.mpi (python/memdvr/mpi.py over memdvr._mpi, python/src/mpi.cpp):
2 ranks under mpirun take global snapshots and restore the newest one, again
in a new job, and after one rank's store is lost (from its partner's copy).
Skipped where memdvr._mpi (CMake found no MPI), mpi4py or mpirun is missing.

MPI is initialized only in the mpirun children and in subprocesses, never in
the pytest process itself."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest


def _missing():
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (Debian: python3-mpi4py)"
    if importlib.util.find_spec("memdvr._mpi") is None:
        return "memdvr._mpi is not built (CMake found no MPI, or DVR_BUILD_MPI=OFF)"
    if shutil.which("mpirun") is None:
        return "mpirun is not on PATH"
    return None


pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))

# One rank's run: two arrays in the local session, then what `phase` says.
# Every rank writes what it saw to OUT/result-RANK.json (mpirun may interleave
# the ranks' output lines).
SCRIPT = textwrap.dedent("""
    import json, sys, traceback
    import numpy as np
    import memdvr, memdvr.mpi
    from mpi4py import MPI

    def excepthook(*exc):  # a failing rank ends the job at once, not at a timeout
        traceback.print_exception(*exc)
        MPI.COMM_WORLD.Abort(1)
    sys.excepthook = excepthook

    base, phase, results = sys.argv[1], sys.argv[2], sys.argv[3]
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    out = {"rank": rank}
    s = memdvr.mpi.Session(memdvr.Store(f"{base}/rank-{rank}"), "heat", keep=3)
    out.update(size=s.size, partner=s.partner, same_rank=s.rank == rank,
               local_is_session=isinstance(s.local, memdvr.Session), name=s.name)
    u = s.local.array("u", (64, 64), np.float64)       # SDK-owned
    v = s.local.track("v", np.zeros(1000, np.int32))   # tracked in place
    if phase == "first":
        out["fresh"] = s.restore_latest()
        u[:] = rank + 1.5
        v[:] = 10 * rank + 1
        out["info1"] = s.snapshot("step-1")
        u[:] = rank + 2.5
        v[:] = 10 * rank + 2
        out["info2"] = s.snapshot("step-2")
        try:
            s.snapshot("step-2")                       # the name is taken: fails on every rank
            out["dup"] = None
        except memdvr.DvrError as e:
            out["dup"] = type(e).__name__
        u[:] = -1
        v[:] = -1
    out["restored"] = s.restore_latest()
    out["u"] = sorted(set(u.ravel().tolist()))
    out["v"] = sorted(set(v.tolist()))
    out["committed"] = [(c["name"], c["seq"]) for c in s.committed()]
    with s.local.clone(out["restored"]) as c:          # a memdvr.Clone with the array's layout
        out["clone_u"] = [c["u"].shape, float(c["u"][0, 0])]
    del u
    s.close()
    out["closed"] = repr(s)
    with open(f"{results}/result-{rank}.json", "w") as f:
        json.dump(out, f)
""")


def _mpirun(tmp_path, phase, ranks=2):
    script = tmp_path / "mpi_script.py"
    script.write_text(SCRIPT)
    env = dict(os.environ)
    # Containers often forbid the cross-process reads (CMA) of the shared-memory transport.
    env.setdefault("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
    out = tmp_path / f"results-{phase}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    cmd = ["mpirun", "--oversubscribe", "--allow-run-as-root", "-np", str(ranks),
           sys.executable, str(script), str(tmp_path / "stores"), phase, str(out)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    files = sorted(out.glob("result-*.json"))
    assert len(files) == ranks, f"{files}\n{r.stdout}\n{r.stderr}"
    return sorted((json.loads(f.read_text()) for f in files), key=lambda x: x["rank"])


def _check_restored(results, lost=None):
    for x in results:
        rank = x["rank"]
        assert x["restored"] == "step-2"
        assert x["u"] == [rank + 2.5] and x["v"] == [10 * rank + 2], x
        # A rank that lost its store gets back (and records) the restored snapshot only.
        committed = [["step-2", 2]] if rank == lost else [["step-1", 1], ["step-2", 2]]
        assert x["committed"] == committed, x
        assert x["clone_u"] == [[64, 64], rank + 2.5], x
        assert x["closed"] == "memdvr.mpi.Session(closed)"


def test_snapshot_and_restore_latest(tmp_path):
    first = _mpirun(tmp_path, "first")
    for x in first:
        assert x["size"] == 2 and x["partner"] == 1 - x["rank"] and x["same_rank"]
        assert x["local_is_session"] and x["name"] == "heat"
        assert x["fresh"] is None
        assert x["info1"]["name"] == "step-1" and x["info1"]["seq"] == 1
        assert x["info2"]["name"] == "step-2" and x["info2"]["seq"] == 2
        assert set(x["info1"]) == {"name", "seq", "stored_bytes", "partner_bytes", "seconds"}
        assert x["info1"]["stored_bytes"] > 0 and x["info1"]["partner_bytes"] > 0
        assert x["dup"] is not None  # a DvrError subclass, on both ranks
    _check_restored(first)

    # A new job finds the newest global snapshot in the stores.
    _check_restored(_mpirun(tmp_path, "again"))

    # Rank 1's store is lost: its part comes back from its partner, rank 0.
    shutil.rmtree(tmp_path / "stores" / "rank-1")
    _check_restored(_mpirun(tmp_path, "again"), lost=1)


def _import_error(block):
    """The ImportError message of `import memdvr.mpi` with module `block` hidden."""
    code = textwrap.dedent(f"""
        import sys
        sys.modules[{block!r}] = None
        try:
            import memdvr.mpi
        except ImportError as e:
            print("IMPORTERROR", e)
        else:
            print("IMPORTED")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_import_errors_name_what_is_missing():
    out = _import_error("mpi4py")
    assert out.startswith("IMPORTERROR memdvr.mpi needs mpi4py"), out
    out = _import_error("memdvr._mpi")
    assert out.startswith("IMPORTERROR memdvr.mpi needs the extension memdvr._mpi"), out
