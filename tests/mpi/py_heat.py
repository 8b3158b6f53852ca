"""A tiny heat-diffusion job over MPI ranks with memdvr.mpi coordinated
snapshots (tests/mpi/test_mpi.py, test_python_mpi4py).

    mpirun -np 4 python3 py_heat.py --store-root DIR [--nx 64] [--ny 64]
        [--steps 60] [--every 10] [--keep 2] [--abort-at STEP [--abort-rank R]]

Rank R keeps its strip of the grid (numpy, halo rows included) in region "u"
of session "pyheat" in its own store DIR/node-R, and the step counter in
region "meta". Every --every steps all ranks take the global snapshot
"step-N"; at start, restore_latest() brings the newest one back. --abort-at
makes rank R (every rank without --abort-rank) die with os._exit(42) at that
step, before its snapshot. Rank 0 prints one JSON line: the field's checksum
(SHA-256 of the gathered grid, independent of the number of ranks), the
snapshot resumed from, and the snapshots in its store.
"""

import argparse
import hashlib
import json
import os
import sys
import traceback

import numpy as np
from mpi4py import MPI

import memdvr
import memdvr.mpi


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--store-root", required=True)
    p.add_argument("--nx", type=int, default=64)
    p.add_argument("--ny", type=int, default=64)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--abort-at", type=int, default=-1)
    p.add_argument("--abort-rank", type=int, default=-1)
    a = p.parse_args()

    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    base, extra = divmod(a.ny, size)
    n = base + (1 if rank < extra else 0)
    row0 = rank * base + min(rank, extra)
    up = rank - 1 if rank > 0 else MPI.PROC_NULL
    down = rank + 1 if rank + 1 < size else MPI.PROC_NULL

    os.makedirs(a.store_root, exist_ok=True)
    store = memdvr.Store(os.path.join(a.store_root, f"node-{rank}"))
    s = memdvr.mpi.Session(store, "pyheat", comm, keep=a.keep)
    assert (s.rank, s.size) == (rank, size), (s.rank, s.size)
    u = s.local.array("u", (n + 2, a.nx), np.float64)
    meta = s.local.array("meta", (1,), np.int64)

    resumed = s.restore_latest()
    if resumed is None:
        g = np.arange(row0, row0 + n, dtype=np.float64)[:, None]
        j = np.arange(a.nx, dtype=np.float64)[None, :]
        u[1:n + 1] = 0.5 + 0.5 * np.sin(0.2 * g + 0.3 * j)
        u[1:n + 1, 0] = 0.0
        u[1:n + 1, -1] = 0.0
        u[0] = 1.0 if rank == 0 else 0.0  # the top edge is hot
        u[n + 1] = 0.0
        meta[0] = 0
    first = int(meta[0])

    last = None
    new = np.empty((n, a.nx))
    for step in range(first + 1, a.steps + 1):
        comm.Sendrecv(u[1], dest=up, sendtag=0, recvbuf=u[n + 1], source=down, recvtag=0)
        comm.Sendrecv(u[n], dest=down, sendtag=1, recvbuf=u[0], source=up, recvtag=1)
        c = u[1:n + 1]
        new[:] = c
        new[:, 1:-1] = c[:, 1:-1] + 0.2 * (u[0:n, 1:-1] + u[2:n + 2, 1:-1] + c[:, :-2] + c[:, 2:] - 4.0 * c[:, 1:-1])
        c[:] = new
        meta[0] = step
        if step == a.abort_at and a.abort_rank in (-1, rank):
            sys.stdout.flush()
            os._exit(42)
        if a.every and step % a.every == 0:
            last = s.snapshot(f"step-{step}")

    field = comm.gather(np.ascontiguousarray(u[1:n + 1]).tobytes(), root=0)
    if rank == 0:
        names = [i.name for i in sorted(store.list("pyheat"), key=lambda i: i.time)]
        print(json.dumps({
            "checksum": hashlib.sha256(b"".join(field)).hexdigest(),
            "resumed_from": resumed,
            "first_step": first,
            "steps": a.steps,
            "ranks": size,
            "snapshots": names,
            "last_snapshot_is_dict": last is None or isinstance(last, dict),
        }), flush=True)


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        # One rank's exception must not leave the others waiting in a collective.
        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
