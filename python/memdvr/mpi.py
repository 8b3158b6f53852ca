"""memdvr.mpi — coordinated snapshots across the ranks of an MPI program (mpi4py).

    from mpi4py import MPI
    import numpy as np, memdvr, memdvr.mpi

    rank = MPI.COMM_WORLD.Get_rank()
    store = memdvr.Store(f"/dev/shm/heat/node-{rank}")   # each rank its own store
    s = memdvr.mpi.Session(store, "heat")                # collective (MPI.COMM_WORLD)
    u = s.local.array("u", (1024, 1024))                 # this rank's part
    start = 0
    name = s.restore_latest()                            # collective: None on a fresh start
    if name is not None:
        start = int(name.split("-")[1]) + 1              # u is as it was after that step
    for step in range(start, 1000):
        update(u)
        if step % 100 == 0:
            s.snapshot(f"step-{step}")                   # collective

A global snapshot is committed only when every rank took its part; each rank
then sends its part to its partner rank, and restore_latest() restores the
newest snapshot every rank can restore, taking a lost part from the partner
(docs/mpi.md has the protocol, docs/mpi_api.md this binding).

``memdvr.mpi`` needs mpi4py and the extension ``memdvr._mpi``, which the CMake
build makes when it finds MPI; the pip wheel does not have it. Without either,
importing ``memdvr.mpi`` raises ImportError saying which is missing.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Union

from . import InvalidArgument, Session as _LocalSession, Store, _close_after

try:
    from mpi4py import MPI
except ImportError as e:  # pragma: no cover - depends on the installation
    raise ImportError(
        "memdvr.mpi needs mpi4py (Debian: apt install python3-mpi4py; elsewhere: "
        f"pip install mpi4py, built against the same MPI as memdvr): {e}") from e

try:
    from . import _mpi
except ImportError as e:  # pragma: no cover - depends on the build
    raise ImportError(
        "memdvr.mpi needs the extension memdvr._mpi, which only the CMake build makes, "
        "and only when CMake finds MPI (DVR_BUILD_MPI=ON, the default); the pip wheel "
        "does not have it. Build the project with CMake and use its build tree "
        f"(PYTHONPATH=BUILD/python): {e}") from e

if _mpi.mpi_library_version() != MPI.Get_library_version():  # pragma: no cover
    raise ImportError(
        "memdvr._mpi and mpi4py use different MPI libraries: memdvr._mpi was built against "
        f"{_mpi.mpi_library_version().splitlines()[0]!r}, mpi4py runs "
        f"{MPI.Get_library_version().splitlines()[0]!r}; use an mpi4py built against the "
        "same MPI (Debian: python3-mpi4py with libopenmpi-dev)")

__all__ = ["Session"]


class Session:
    """Coordinated snapshots of one session across the ranks of a communicator.

    ``Session(store, name, comm=None, partner_offset=0, keep=3,
    partner_copies=True, level=1)`` is collective over ``comm`` (an mpi4py
    intracommunicator; None means ``MPI.COMM_WORLD``): every rank opens
    session ``name`` in its own ``store`` (a :class:`memdvr.Store`, a path, or
    None for the default store; two ranks must not share a store directory).

    ``partner_offset``: the partner of rank r, which keeps copies of r's
    parts, is rank (r + partner_offset) mod size; 0 means size // 2. ``keep``:
    global snapshots kept (own parts and partner copies; 0 keeps all).
    ``partner_copies``: send partner copies after each global snapshot.
    ``level``: zstd level of the partner copies (0: none).

    Register this rank's memory in :attr:`local` (``track()``, ``array()``, as
    in any :class:`memdvr.Session`), then call :meth:`snapshot` and
    :meth:`restore_latest` on every rank. Collective calls release the GIL.
    The session keeps ``comm`` referenced (it is used, not duplicated).
    """

    def __init__(self, store: Union[Store, str, "os.PathLike[str]", None], name: str, comm: Any = None,
                 partner_offset: int = 0, keep: int = 3, partner_copies: bool = True,
                 level: int = 1):
        if not isinstance(store, Store):
            store = Store(store)
        if comm is None:
            comm = MPI.COMM_WORLD
        if not isinstance(comm, MPI.Comm):
            raise TypeError(f"memdvr.mpi.Session: comm must be an mpi4py communicator "
                            f"(MPI.COMM_WORLD, comm.Split(...)), not a {type(comm).__name__}")
        if comm == MPI.COMM_NULL:
            raise InvalidArgument("memdvr.mpi.Session: comm is MPI.COMM_NULL")
        if comm.Is_inter():
            raise InvalidArgument("memdvr.mpi.Session: comm is an intercommunicator; "
                                  "pass an intracommunicator")
        self._store = store
        self._comm = comm  # referenced while the session lives: mpi4py frees owned comms
        self._core = _mpi.Session(store._core, name, comm.py2f(), partner_offset,
                                  partner_copies, keep, level)
        self._local = _LocalSession._wrap(self._core.local(), store)

    def __repr__(self) -> str:
        if self._core.closed:
            return "memdvr.mpi.Session(closed)"
        return (f"memdvr.mpi.Session({self.name!r}, rank={self.rank}, size={self.size}, "
                f"partner={self.partner})")

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, exc_type: Optional[type], exc: Optional[BaseException], tb: Any) -> None:
        """Closes the session. When the body raised, that exception is what
        propagates: a failure to close is only added to it as a note."""
        _close_after(self.close, exc, f"MPI session '{self.name}'")

    @property
    def local(self) -> _LocalSession:
        """This rank's own session, a :class:`memdvr.Session`: ``track()`` and
        ``array()`` its regions there. It closes with this session (its own
        ``close()`` is refused while this session is open)."""
        return self._local

    @property
    def name(self) -> str:
        """The session's name (the same on every rank)."""
        return self._local.name

    @property
    def store(self) -> Store:
        """This rank's store."""
        return self._store

    @property
    def comm(self) -> Any:
        """The mpi4py communicator the session runs over."""
        return self._comm

    @property
    def rank(self) -> int:
        """This rank's rank in the communicator."""
        return self._core.rank

    @property
    def size(self) -> int:
        """The number of ranks in the communicator."""
        return self._core.size

    @property
    def partner(self) -> int:
        """The rank that keeps copies of this rank's parts."""
        return self._core.partner

    def snapshot(self, name: str) -> Dict[str, Any]:
        """Collective: global snapshot ``name`` of every rank's regions.

        Every rank snapshots its part; the snapshot is committed only if all
        succeeded, then partner copies are sent and retention applied. Returns
        this rank's view as a dict: ``name``, ``seq`` (commit order, 1, 2, ...),
        ``stored_bytes`` (bytes this rank's part added to its store),
        ``partner_bytes`` (bytes sent to the partner) and ``seconds`` (the whole
        call). Raises a :class:`memdvr.DvrError` on every rank if any rank
        failed (the snapshot is then committed nowhere), or if the partner
        copies failed (the snapshot is committed, the copies are not).
        """
        return self._core.snapshot(name)

    def restore_latest(self) -> Optional[str]:
        """Collective: restores the newest global snapshot every rank can restore.

        A rank whose own part is lost or damaged gets it back from its
        partner's copy. Returns the snapshot's name (the same on every rank),
        or None when there is none (a fresh start). Raises a
        :class:`memdvr.DvrError` on every rank if a rank fails. Regions must
        match the snapshot in name and size, as for ``Session.restore`` of a
        snapshot without put() objects.
        """
        return self._core.restore_latest()

    def committed(self) -> List[Dict[str, Any]]:
        """The global snapshots committed, oldest first, as this rank's records
        say: dicts with ``name`` and ``seq`` (the byte counts and ``seconds``
        are 0: they are known only to the snapshot() call). Not collective."""
        return self._core.committed()

    def close(self) -> None:
        """Ends the session on this rank: forgets every local region and
        releases tracked buffers; snapshots stay in the stores. Not collective.

        Raises InvalidArgument while arrays made by ``local.array()`` are
        referenced elsewhere.
        """
        local = self._local
        if self._core.closed:
            return
        names = list(local._arrays)
        local._arrays.clear()
        try:
            self._core.close()
        except InvalidArgument:
            for name in names:
                local._rewrap(name)
            raise
        local._layouts.clear()
