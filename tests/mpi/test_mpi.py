"""Coordinated snapshots across MPI ranks (dvr::mpi, issue #8), end to end.

Every job is the heat example (4 ranks, 256x256, 200 steps, a global snapshot
"step-NNNNNN" every 20 steps) or py_heat.py; rank R's store is ROOT/node-R and
its partner is rank (R + 2) mod 4, whose store keeps R's copies as session
"heat.rank-R". The field after 200 steps is a pure function of the grid, so
every way of getting there (crashes, restarts, lost stores, failed commits)
must end with the checksum C of an uninterrupted run.
"""

import shutil
import sys

import pytest

from dvrtest import MPI_DIR, RANKS, Heat, describe, last_json

PARTNER_OFFSET = RANKS // 2  # the library's default: ranks split in two halves ("nodes")


def partner_of(rank):
    return (rank + PARTNER_OFFSET) % RANKS


def step(n):
    return f"step-{n:06d}"


# --- the stencil itself -------------------------------------------------------

def test_checksum_does_not_depend_on_ranks_or_checkpoints(reference, mpirun, heat_bin, tmp_path):
    """Sanity of the example: 2 ranks without checkpoints, and 4 ranks with
    checkpoints, compute the same field (the checksum hashes global rows)."""
    plain, proc = Heat(mpirun, heat_bin, tmp_path / "two").run("--every", "0", np=2)
    assert plain["checksum"] == reference["checksum"], describe(proc)
    assert plain["checkpoints"] == 0 and plain["committed"] == []
    assert reference["checkpoints"] == 10
    assert reference["committed"][-1] == step(200)


def test_text_report(heat, reference):
    """Without --json: the checksum line, and "resumed from" after a restart."""
    _, proc = heat.run(json_report=False)
    assert f"checksum {reference['checksum']} " in proc.stdout, describe(proc)
    assert "resumed from" not in proc.stdout, describe(proc)
    _, proc = heat.run(json_report=False)  # everything done: resumes from the last snapshot
    assert f"resumed from {step(200)}" in proc.stdout, describe(proc)
    assert f"checksum {reference['checksum']} " in proc.stdout, describe(proc)


# --- (a) a crash, then a restart with the same arguments ----------------------

@pytest.mark.parametrize("crash, resumes_at", [
    # every rank dies at step 110, between two checkpoints
    (["--abort-at", "110"], 100),
    # rank 1 dies at step 120 before its checkpoint, while the others may
    # already have taken their part of step-000120 locally: never committed
    (["--abort-at", "120", "--abort-rank", "1"], 100),
    # the same through MPI_Abort from rank 3, one step after a checkpoint
    (["--abort-at", "141", "--abort-rank", "3", "--abort-mpi"], 140),
], ids=["all-ranks-exit", "one-rank-exits-at-checkpoint", "mpi-abort"])
def test_crash_and_restart(heat, reference, crash, resumes_at):
    proc = heat.crash(*crash)
    report, proc = heat.run()
    assert report["resumed_from"] == step(resumes_at), describe(proc)
    assert report["first_step"] == resumes_at, describe(proc)
    assert report["checksum"] == reference["checksum"], describe(proc)
    assert report["failed"] == [], describe(proc)
    # The restarted run took the snapshots after the one it resumed from,
    # including the one the crash interrupted.
    assert report["committed"] == [step(160), step(180), step(200)], describe(proc)
    assert report["checkpoints"] == (200 - resumes_at) // 20, describe(proc)


def test_crash_between_local_snapshots_and_commit(heat, reference, dvr_ls):
    """Every rank has its local part of step-000120, none is committed (the
    job died between the two phases): the restart resumes from step-000100,
    takes step-000120 again without trouble, and the orphan parts do not
    outlive retention."""
    heat.crash("--abort-at", "120", "--abort-rank", "1", "--abort-after-local")
    for r in range(RANKS):
        assert step(120) in dvr_ls(heat.node(r)).get("heat", []), f"node-{r}: the crash left no local part"
    report, proc = heat.run()
    assert report["resumed_from"] == step(100), describe(proc)
    assert report["failed"] == [], describe(proc)
    assert report["checkpoints"] == 5, describe(proc)
    assert report["checksum"] == reference["checksum"], describe(proc)
    want = [step(160), step(180), step(200)]
    assert report["committed"] == want, describe(proc)
    for r in range(RANKS):
        sessions = dvr_ls(heat.node(r))
        assert sessions.get("heat") == want, f"node-{r}: {sessions}"


def test_second_crash_after_restart(heat, reference):
    """A restart that itself crashes resumes from its own newest snapshot."""
    heat.crash("--abort-at", "70")
    heat.crash("--abort-at", "150", "--abort-rank", "2")
    report, proc = heat.run()
    assert report["resumed_from"] == step(140), describe(proc)
    assert report["checksum"] == reference["checksum"], describe(proc)


# --- (b) a node's store lost: its part comes from its partner ------------------

@pytest.mark.parametrize("lost", [2, 0])
def test_lost_store_recovered_from_partner(heat, reference, dvr_ls, lost):
    heat.crash("--abort-at", "110")
    holder = partner_of(lost)
    assert f"heat.rank-{lost}" in dvr_ls(heat.node(holder)), f"node-{holder} keeps no copy of rank {lost}"
    shutil.rmtree(heat.node(lost))

    report, proc = heat.run()
    assert report["resumed_from"] == step(100), describe(proc)
    assert report["checksum"] == reference["checksum"], describe(proc)

    # The lost node is a full member again: its own part from step 120 on...
    sessions = dvr_ls(heat.node(lost))
    assert sessions.get("heat", [])[-1:] == [step(200)], sessions
    # ...and it keeps its partner's copies again.
    keeps = f"heat.rank-{(lost - PARTNER_OFFSET) % RANKS}"
    assert sessions.get(keeps, [])[-1:] == [step(200)], sessions

    # Now the node that held the copy is lost: the recovered node's new
    # copies (sent after the recovery) bring its part back in turn.
    shutil.rmtree(heat.node(holder))
    report, proc = heat.run()
    assert report["resumed_from"] == step(200), describe(proc)
    assert report["checksum"] == reference["checksum"], describe(proc)


def test_lost_store_and_crash_mid_run(heat, reference):
    """A node lost while the job runs (its store wiped after the crash, before
    the restart) with another rank crashing: same answer."""
    heat.crash("--abort-at", "95", "--abort-rank", "0")
    shutil.rmtree(heat.node(3))
    report, proc = heat.run()
    assert report["resumed_from"] == step(80), describe(proc)
    assert report["checksum"] == reference["checksum"], describe(proc)


def test_damaged_parts_of_partners_come_back_from_each_other(heat, mpirun, heat_bin, tmp_path):
    """Ranks 0 and 2 keep each other's copies, and both their own parts of the
    newest snapshot are damaged (cut short): at the restart each takes its part
    back from the other while it sends the other's. Each removes its damaged
    leftover first; removing it while its own send held the store (as it once
    did, in the middle of the exchange) waited for that send, which waited for
    the rank to read what its partner sent: with parts larger than the pipes
    between (a 1024x1024 grid: 2 MiB a rank), both ranks hung."""
    big = ["--nx", "1024", "--ny", "1024"]
    expected, proc = Heat(mpirun, heat_bin, tmp_path / "reference").run(*big)
    assert expected["resumed_from"] is None, describe(proc)

    heat.crash(*big, "--abort-at", "110")
    for r in (0, partner_of(0)):
        manifest = heat.node(r) / "sessions" / "heat" / f"{step(100)}.snap"
        data = manifest.read_bytes()
        manifest.write_bytes(data[: len(data) // 2])

    report, proc = heat.run(*big)
    assert report["resumed_from"] == step(100), describe(proc)
    assert report["checksum"] == expected["checksum"], describe(proc)


# --- (c) a snapshot one rank failed to commit is never chosen ------------------

@pytest.mark.parametrize("fail_rank, crash_at, resumes_at", [
    (2, 130, 100),  # crash before the next checkpoint: back to the one before the failed one
    (0, 150, 140),  # checkpoints after a failed one work and are chosen
])
def test_failed_commit_never_chosen(heat, reference, fail_rank, crash_at, resumes_at):
    proc = heat.crash("--fail-commit-at", "120", "--fail-rank", str(fail_rank), "--abort-at", str(crash_at))
    assert f"checkpoint {step(120)} failed" in proc.stdout, describe(proc)  # rank 0 reports it
    # Every rank got the exception (each reports it on stderr), not only the failing one.
    for r in range(RANKS):
        assert f"rank {r}: checkpoint {step(120)} failed" in proc.stderr, describe(proc)

    report, proc = heat.run()
    assert report["resumed_from"] == step(resumes_at), describe(proc)
    assert report["checksum"] == reference["checksum"], describe(proc)


def test_failed_commit_run_goes_on(heat, reference):
    """A failed global snapshot costs only that snapshot: the run finishes
    with C, and that snapshot is not among the committed ones."""
    report, proc = heat.run("--fail-commit-at", "180", "--fail-rank", "3", "--keep", "0")
    assert report["failed"] == [step(180)], describe(proc)
    assert report["checksum"] == reference["checksum"], describe(proc)
    assert step(180) not in report["committed"], describe(proc)
    assert report["committed"] == [step(n) for n in range(20, 201, 20) if n != 180], describe(proc)
    assert report["checkpoints"] == 9, describe(proc)


# --- (d) retention: only `keep` global snapshots, on both sides ----------------

@pytest.mark.parametrize("keep", [2, None, 0], ids=["keep-2", "default-3", "keep-0-all"])
def test_retention(heat, reference, dvr_ls, keep):
    args = [] if keep is None else ["--keep", str(keep)]
    report, proc = heat.run(*args)
    assert report["checksum"] == reference["checksum"], describe(proc)
    kept = {2: 2, None: 3, 0: 10}[keep]
    want = [step(n) for n in range(20, 201, 20)][-kept:]
    assert report["committed"] == want, describe(proc)
    for r in range(RANKS):
        sessions = dvr_ls(heat.node(r))
        heat_sessions = {k: v for k, v in sessions.items() if k == "heat" or k.startswith("heat.")}
        # Its own part, and the copies of the one rank whose partner it is.
        assert heat_sessions == {"heat": want, f"heat.rank-{(r - PARTNER_OFFSET) % RANKS}": want}, \
            f"node-{r}: {sessions}"


# --- (e) Python: memdvr.mpi over mpi4py ----------------------------------------

def test_python_mpi4py(mpirun, python_env, tmp_path):
    script = MPI_DIR / "py_heat.py"
    root = tmp_path / "pyroot"
    common = [sys.executable, script, "--store-root", root, "--steps", "60", "--every", "10", "--keep", "2"]

    def go(*args, expect=0):
        return mpirun([*common, *args], expect=expect, env=python_env)

    ref = last_json(mpirun([sys.executable, script, "--store-root", tmp_path / "pyref", "--steps", "60",
                            "--every", "0"], np=2, env=python_env))
    assert ref["resumed_from"] is None

    proc = go("--abort-at", "35", "--abort-rank", "1", expect="nonzero")
    assert "checksum" not in proc.stdout, describe(proc)
    proc = go()
    report = last_json(proc)
    assert report["resumed_from"] == "step-30", describe(proc)
    assert report["first_step"] == 30, describe(proc)
    assert report["checksum"] == ref["checksum"], describe(proc)
    assert report["snapshots"] == ["step-50", "step-60"], describe(proc)  # keep=2
    assert report["last_snapshot_is_dict"], describe(proc)

    # The partner copy of rank 1 lives in its partner's store; lose rank 1's.
    shutil.rmtree(root / "node-1")
    report = last_json(go())
    assert report["resumed_from"] == "step-60", report
    assert report["checksum"] == ref["checksum"], report
