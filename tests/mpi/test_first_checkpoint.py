"""The pipelined first checkpoint of dvr::mpi (docs/mpi.md, "The first
checkpoint"): a rank's partner copy streams from the memory being
snapshotted while its own part is stored.

Each case is one 4-rank job of dvr-test-mpi-first ($DVR_MPI_FIRST,
tests/helpers/mpi_first_checkpoint.cpp), which checks everything itself and
prints "ok MODE" (a failed check aborts the job with its message):
  exact    the copy is bit-exact and restores after the part's store is lost
  fail     a checkpoint one rank fails (first or later, all-new data) leaves
           no part, no copy and no record anywhere; the previous one stays
  partner  a partner whose base differs from the sender's cannot take the
           stream: every rank throws an error naming it and why, the
           checkpoint stays committed, the next copy travels whole
  prepare  a rank lacking its part whose store cannot be opened again still
           joins restore_latest()'s exchange: every rank throws, none hangs,
           and the next restore_latest() brings the part back
"""

import pytest

from dvrtest import binary, describe


@pytest.fixture(scope="session")
def first_bin():
    return binary("DVR_MPI_FIRST")


@pytest.mark.parametrize("mode", ["exact", "fail", "partner", "prepare"])
def test_first_checkpoint(mpirun, first_bin, tmp_path, mode):
    proc = mpirun([first_bin, mode, tmp_path / "root"])
    assert f"ok {mode}" in proc.stdout, describe(proc)
