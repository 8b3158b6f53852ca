"""memdvr — numpy-native checkpoint/restore of application memory (Memory DVR).

    import numpy as np, memdvr
    store = memdvr.Store(tmp_dir)              # or memdvr.Store() for the default store
    s = memdvr.Session(store, "sweep")
    data = s.array("data", (1000, 1000), np.float32)   # SDK-owned numpy array
    feats = np.random.rand(10_000)
    s.track("feats", feats)                    # tracked in place, zero-copy
    s.snapshot("loaded", label="after load")
    data *= 2
    s.restore("loaded")                        # data and feats are bit-exact again
    with s.clone("loaded") as c:               # copy-on-write numpy views of a snapshot
        old = c["data"]

Every failure raises a subclass of :class:`DvrError` carrying the C++ message:
:class:`NotFound`, :class:`AlreadyExists`, :class:`Corrupt`, :class:`NoSpace`,
:class:`InvalidArgument`, :class:`DvrIOError`, :class:`Unsupported`,
:class:`PermissionDenied`.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import math
import os
import pickle
import re
import struct
from typing import Any, Dict, List, Literal, Optional, Tuple, Union, overload

import numpy as np

from . import _core
from ._core import (  # noqa: F401  (re-exported)
    AlreadyExists,
    Corrupt,
    DvrError,
    DvrIOError,
    InvalidArgument,
    NoSpace,
    NotFound,
    Cancelled,
    PermissionDenied,
    Unsupported,
)

__version__ = _core.__version__

__all__ = [
    "Store",
    "Session",
    "Clone",
    "SnapshotInfo",
    "SnapshotJob",
    "RegionInfo",
    "default_path",
    "DvrError",
    "NotFound",
    "AlreadyExists",
    "Corrupt",
    "NoSpace",
    "InvalidArgument",
    "DvrIOError",
    "Unsupported",
    "PermissionDenied",
    "Cancelled",
]

# (dtype, shape) of a region, when known.
_Layout = Optional[Tuple[np.dtype, Tuple[int, ...]]]

# Python objects stored with Session.put() live in SDK-owned regions under a
# reserved prefix: "obj.NAME.pickle" holds a header and the pickle stream,
# "obj.NAME.buf.K" the K-th out-of-band buffer (pickle protocol 5). The header
# is _OBJ_MAGIC, the stream length, the buffer count, then each buffer's size
# (buffer regions hold at least one byte, as regions must).
_OBJ_PREFIX = "obj."
_OBJ_MAGIC = b"MDVROBJ1"
_OBJ_NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}")
_OBJ_REGION_RE = re.compile(r"obj\.([A-Za-z0-9_-][A-Za-z0-9._-]*?)\.(?:pickle|buf\.[0-9]+)")


def _check_object_name(name: Any) -> str:
    if not isinstance(name, str) or not _OBJ_NAME_RE.fullmatch(name):
        raise InvalidArgument(
            f"invalid object name {name!r}: use 1-100 characters of [A-Za-z0-9._-], "
            "not starting with '.'")
    return name


def _pickle_region(name: str) -> str:
    return f"{_OBJ_PREFIX}{name}.pickle"


def _buf_region(name: str, k: int) -> str:
    return f"{_OBJ_PREFIX}{name}.buf.{k}"


def _is_object_region(region: str) -> bool:
    return _OBJ_REGION_RE.fullmatch(region) is not None


def _check_not_reserved(name: str) -> None:
    if isinstance(name, str) and name.startswith(_OBJ_PREFIX):
        raise InvalidArgument(
            f"region name '{name}' uses the prefix '{_OBJ_PREFIX}' reserved for put()/get() objects")


@dataclasses.dataclass(frozen=True)
class RegionInfo:
    """One region as recorded in a snapshot (or live in a session/clone)."""

    name: str
    size: int
    sdk_owned: bool


@dataclasses.dataclass(frozen=True)
class SnapshotInfo:
    """One snapshot as recorded in its manifest (see dvr::SnapshotInfo)."""

    session: str
    name: str
    parent: str
    label: str
    time_ns: int
    logical_bytes: int
    stored_bytes: int
    chunks: int
    zero_chunks: int
    regions: Tuple[RegionInfo, ...]
    tracking: str
    chunks_read: int
    damaged: bool
    damage: str

    @property
    def time(self) -> _dt.datetime:
        """The commit time as a timezone-aware datetime (UTC)."""
        return _dt.datetime.fromtimestamp(self.time_ns / 1e9, tz=_dt.timezone.utc)

    @classmethod
    def _from_dict(cls, d: Dict[str, Any]) -> "SnapshotInfo":
        d = dict(d)
        d["regions"] = tuple(RegionInfo(**r) for r in d["regions"])
        return cls(**d)

    def to_dict(self) -> Dict[str, Any]:
        """The fields as a plain dict (JSON-friendly)."""
        return dataclasses.asdict(self)


def _infos(dicts) -> List[SnapshotInfo]:
    return [SnapshotInfo._from_dict(d) for d in dicts]


def default_path() -> str:
    """The default store: $DVR_STORE if set, else /dev/shm/dvr-<uid>, else ~/.local/share/dvr."""
    return _core.Store.default_path()


class Store:
    """A store: a directory holding every snapshot, shared by sessions and processes.

    ``Store(path=None, chunk_size=None, create=True)`` opens (and creates) the
    store in ``path``, or the default store (:func:`default_path`) when ``path``
    is None. ``chunk_size`` applies only when a new store is created.
    """

    def __init__(self, path: Union[str, os.PathLike, None] = None, *,
                 chunk_size: Optional[int] = None, create: bool = True):
        path = default_path() if path is None else os.fspath(path)
        self._core = _core.Store.open(path, chunk_size, create)

    @classmethod
    def _wrap(cls, core: "_core.Store") -> "Store":
        self = cls.__new__(cls)
        self._core = core
        return self

    def __repr__(self) -> str:
        return f"memdvr.Store({self.path!r}, medium={self.medium!r})"

    @property
    def path(self) -> str:
        """The store's directory."""
        return self._core.path

    @property
    def medium(self) -> str:
        """What backs the store: "pmem", "dram" (tmpfs: lost on reboot) or "disk"."""
        return self._core.medium

    @property
    def chunk_size(self) -> int:
        """The store's chunk size in bytes (its unit of deduplication)."""
        return self._core.chunk_size

    def session(self, name: str, tracking: Optional[str] = None) -> "Session":
        """Opens session ``name`` in this store (same as ``Session(store, name)``)."""
        return Session(self, name, tracking=tracking)

    def sessions(self) -> List[str]:
        """Names of the sessions with at least one snapshot, sorted."""
        return list(self._core.sessions())

    def list(self, session: Optional[str] = None) -> List[SnapshotInfo]:
        """Snapshots of ``session`` (or of every session), oldest first; damaged ones are marked."""
        return _infos(self._core.list(session))

    def info(self, session: str, name: str) -> SnapshotInfo:
        """Snapshot ``session/name``. Raises NotFound or Corrupt."""
        return SnapshotInfo._from_dict(self._core.info(session, name))

    def remove(self, session: str, name: str) -> None:
        """Deletes snapshot ``session/name`` (its space is reused; gc() returns it). Raises NotFound."""
        self._core.remove(session, name)

    def gc(self) -> Dict[str, int]:
        """Returns the space of data no snapshot references to the file system.

        Returns bytes_before, bytes_after, packs_removed, temp_files_removed.
        """
        return self._core.gc()

    def verify(self) -> Dict[str, Any]:
        """Re-reads every manifest and re-hashes every chunk; never raises for damage.

        Returns a dict: ok, snapshots, chunks, bytes, problems (list of dicts with
        session, snapshot, what) and damaged_snapshots ("session/name").
        """
        return self._core.verify()

    def stats(self) -> Dict[str, Any]:
        """Path, medium, format version, chunk size, counts and space used."""
        return self._core.stats()

    def diff(self, session_a: str, snapshot_a: str, session_b: str, snapshot_b: str) -> List[Dict[str, Any]]:
        """Per-region differences (bytes and 4 KiB pages) between two snapshots."""
        return self._core.diff(session_a, snapshot_a, session_b, snapshot_b)

    def latest(self, session: str) -> Optional[SnapshotInfo]:
        """The newest intact snapshot of ``session`` (every chunk re-hashed), or None."""
        d = self._core.latest(session)
        return None if d is None else SnapshotInfo._from_dict(d)

    def open_snapshot(self, session: str, name: str, *, verify: bool = True,
                      writeable: bool = True) -> "Clone":
        """A copy-on-write clone of snapshot ``session/name``.

        Its regions come back as uint8 arrays (the store does not know dtypes;
        use ``Clone.array(name, dtype, shape)``, or ``Session.clone`` for the
        session's own layouts). ``verify`` checks every chunk first.
        """
        return Clone(self._core.open_snapshot(session, name, verify), {}, writeable)


class Session:
    """One application's named set of memory regions in a store.

    ``Session(store, name, tracking=None)``: ``store`` is a :class:`Store`, a
    path, or None for the default store. ``tracking`` is "write_protect" (the
    default: the kernel records written pages, so snapshots and restores touch
    only what changed) or "hash". Use from one thread at a time; regions must
    not be written by other threads while a snapshot or restore runs.
    """

    def __init__(self, store: Union[Store, str, os.PathLike, None], name: str,
                 tracking: Optional[str] = None):
        if not isinstance(store, Store):
            store = Store(store)
        self._store = store
        self._core = _core.Session(store._core, name, tracking)
        self._layouts: Dict[str, _Layout] = {}
        self._arrays: Dict[str, np.ndarray] = {}  # SDK-owned arrays made by array()

    @classmethod
    def _wrap(cls, core: Any, store: Store) -> "Session":
        """A Session over a session object made elsewhere: ``core`` offers the
        methods of ``_core.Session`` (memdvr.mpi: the rank's local session)."""
        self = cls.__new__(cls)
        self._store = store
        self._core = core
        self._layouts = {}
        self._arrays = {}
        return self

    def __repr__(self) -> str:
        state = "closed" if self._core.closed else f"regions={list(self._layouts)}"
        return f"memdvr.Session({self.name!r}, {state})"

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def name(self) -> str:
        """The session's name."""
        return self._core.name

    @property
    def store(self) -> Store:
        """The store the session lives in."""
        return self._store

    @property
    def head(self) -> str:
        """The snapshot most recently taken or restored here ("" if none)."""
        return self._core.head

    def track(self, name: str, buffer: Any) -> Any:
        """Tracks ``buffer`` in place as region ``name`` and returns it.

        Zero-copy: snapshots read the buffer's memory and restores write into it,
        so the same object sees restored data. Accepts any writable C-contiguous
        buffer (numpy array, bytearray, memoryview, ...). A reference is held
        while it is tracked. Raises InvalidArgument (a ValueError) for
        read-only or non-contiguous buffers, AlreadyExists for a taken name.
        """
        _check_not_reserved(name)
        self._core.track(name, buffer)
        if isinstance(buffer, np.ndarray):
            self._layouts[name] = (buffer.dtype, tuple(buffer.shape))
        else:
            self._layouts[name] = None
        return buffer

    def array(self, name: str, shape: Union[int, Tuple[int, ...]], dtype: Any = np.float64) -> np.ndarray:
        """Allocates an SDK-owned, page-aligned, zero-filled numpy array as region ``name``.

        The array stays valid as long as it is referenced (it keeps the session
        alive); untrack(name) frees it once no other reference to it remains.
        """
        _check_not_reserved(name)
        dtype = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(n) for n in shape)
        count = math.prod(shape)
        mv = self._core.alloc(name, count * dtype.itemsize)
        arr = np.frombuffer(mv, dtype=dtype, count=count).reshape(shape)
        self._layouts[name] = (dtype, shape)
        self._arrays[name] = arr
        return arr

    def alloc(self, name: str, size: int) -> memoryview:
        """Allocates an SDK-owned, zero-filled region of ``size`` bytes; returns a writable memoryview."""
        _check_not_reserved(name)
        mv = self._core.alloc(name, size)
        self._layouts[name] = None
        return mv

    def __getitem__(self, name: str) -> Any:
        """The tracked object or SDK-owned array (a memoryview for alloc()) called ``name``."""
        if name in self._arrays:
            return self._arrays[name]
        return self._core.buffer(name)

    def __contains__(self, name: str) -> bool:
        return name in self._layouts

    def untrack(self, name: str) -> None:
        """Forgets region ``name`` (freeing it if SDK-owned). Raises NotFound.

        For an SDK-owned region, raises InvalidArgument while arrays or
        memoryviews onto it are still referenced elsewhere.
        """
        had_array = self._arrays.pop(name, None) is not None
        try:
            self._core.untrack(name)
        except InvalidArgument:
            if had_array:
                self._rewrap(name)  # still referenced elsewhere: keep session[name] working
            raise
        self._layouts.pop(name, None)

    def regions(self) -> List[RegionInfo]:
        """The live regions of the session."""
        return [RegionInfo(**r) for r in self._core.regions()]

    @overload
    def snapshot(self, name: str, label: str = ..., replace: bool = ..., *, wait: Literal[True] = ...) -> SnapshotInfo: ...

    @overload
    def snapshot(self, name: str, label: str = ..., replace: bool = ..., *, wait: Literal[False]) -> "SnapshotJob": ...

    def snapshot(self, name: str, label: str = "", replace: bool = False, *, wait: bool = True) -> Union[SnapshotInfo, "SnapshotJob"]:
        """Captures every region as snapshot ``name`` (the GIL is released meanwhile).

        With ``wait=False`` it returns a :class:`SnapshotJob` as soon as the
        regions are write-protected, and the regions are copied into the store
        in the background while the program goes on (its first write to memory
        not yet copied waits until that memory is copied aside, so the
        snapshot is the memory at the call). It is taken at once instead (the
        job says why in ``note``) when little changed, a region is not
        write-tracked, or the process may not use a userfaultfd that catches
        the kernel's writes. restore(), snapshot(), put() and the like wait for
        it; close() cancels it.

        Raises AlreadyExists unless ``replace``; InvalidArgument with no regions.
        Failures while copying in the background (NoSpace, ...) are raised by
        ``SnapshotJob.wait()``.
        """
        if not wait:
            return SnapshotJob(self._core.snapshot_background(name, label, replace))
        return SnapshotInfo._from_dict(self._core.snapshot(name, label, replace))

    def restore(self, name: str) -> None:
        """Puts every region recorded in snapshot ``name`` back, bit-exact, in place.

        Objects stored with put() come back as they were at the snapshot: their
        regions are first re-allocated, created or dropped to match the
        snapshot (objects put since are gone afterwards). Other regions must
        match the snapshot's in name and size. Nothing changes on error
        (NotFound, Corrupt, InvalidArgument when a region is missing or changed
        size). The GIL is released meanwhile.
        """
        info = self.info(name)
        want = {r.name: r.size for r in info.regions if _is_object_region(r.name)}
        have = {r.name: r.size for r in self.regions() if _is_object_region(r.name)}
        others_want = {(r.name, r.size) for r in info.regions if not _is_object_region(r.name)}
        others_have = {(r.name, r.size) for r in self.regions() if not _is_object_region(r.name)}
        if want == have or others_want != others_have:
            # Nothing to reconcile, or the core refuses anyway (its message).
            self._core.restore(name)
            return
        # Regions to drop (not in the snapshot, or of another size) and to add.
        drop = [r for r, size in have.items() if want.get(r) != size]
        add = [r for r, size in want.items() if have.get(r) != size]
        saved = {r: self._read_region(r) for r in drop}  # to undo on failure
        dropped: List[str] = []
        added: List[str] = []
        try:
            for r in drop:
                self._core.untrack(r)
                dropped.append(r)
            for r in add:
                self._core.alloc(r, want[r]).release()
                added.append(r)
            self._core.restore(name)
        except BaseException:
            for r in added:
                self._core.untrack(r)
            for r in dropped:
                self._write_region_new(r, saved[r])
            raise

    # ------------------------------------------------------------ objects

    def put(self, name: str, obj: Any) -> None:
        """Stores any picklable ``obj`` as object ``name`` (replacing one of that name).

        Uses pickle protocol 5 with large buffers (numpy arrays, PickleBuffer)
        kept out of band: the stream and each buffer go into SDK-owned regions
        ``obj.NAME.pickle`` and ``obj.NAME.buf.K``, so they are part of every
        snapshot and unchanged arrays deduplicate across snapshots. ``name`` is
        1-100 characters of [A-Za-z0-9._-] not starting with '.'. Raises
        InvalidArgument for a bad name or an unpicklable object, and NoSpace
        when the regions cannot be allocated; the session is then unchanged.
        """
        _check_object_name(name)
        raws: List[memoryview] = []

        def keep(pb: pickle.PickleBuffer) -> None:
            try:
                raws.append(pb.raw())
            except BufferError:  # not contiguous: store a contiguous copy
                raws.append(memoryview(bytes(pb)))

        try:
            stream = pickle.dumps(obj, protocol=5, buffer_callback=keep)
        except Exception as e:  # PicklingError, TypeError, AttributeError, ...
            raise InvalidArgument(
                f"cannot put object '{name}' into session '{self.name}': "
                f"a {type(obj).__name__} cannot be pickled ({type(e).__name__}: {e})") from e
        sizes = [m.nbytes for m in raws]
        header = (_OBJ_MAGIC + struct.pack("<QQ", len(stream), len(sizes))
                  + struct.pack(f"<{len(sizes)}Q", *sizes))
        live = {r.name: r.size for r in self.regions() if _is_object_region(r.name)}
        targets = [(_pickle_region(name), len(header) + len(stream), [header, stream])]
        targets += [(_buf_region(name, k), max(1, m.nbytes), [m]) for k, m in enumerate(raws)]
        # Every region is allocated before any byte is written, so a failure
        # (NoSpace, say) leaves the object as it was: regions made here are
        # dropped again and resized ones get their old size and bytes back.
        created: List[str] = []
        replaced: List[Tuple[str, bytes]] = []
        try:
            for region, size, _ in targets:
                old = live.get(region)
                if old == size:
                    continue
                if old is not None:
                    with self._core.buffer(region) as mv:
                        saved = bytes(mv)
                    self._core.untrack(region)
                    replaced.append((region, saved))
                self._core.alloc(region, size).release()
                created.append(region)
        except BaseException:
            for region in reversed(created):
                self._core.untrack(region)
            for region, saved in replaced:
                self._core.alloc(region, len(saved)).release()
                with self._core.buffer(region) as mv:
                    mv[:] = saved
            raise
        for region, size, parts in targets:
            with self._core.buffer(region) as mv:
                pos = 0
                for part in parts:
                    n = memoryview(part).nbytes
                    mv[pos:pos + n] = memoryview(part).cast("B")
                    pos += n
        for region in self._object_regions(name):
            if region.startswith(_buf_region(name, "")) and int(region.rsplit(".", 1)[1]) >= len(raws):
                self._core.untrack(region)

    def get(self, name: str) -> Any:
        """Object ``name`` as last put (or restored), rebuilt from a copy of its regions.

        The result shares no memory with the session: later put()/restore()
        calls do not change it. Raises NotFound naming the object.
        """
        _check_object_name(name)
        region = _pickle_region(name)
        if region not in {r.name for r in self.regions()}:
            raise NotFound(f"no object '{name}' in session '{self.name}' (put() it first, "
                           f"or restore a snapshot that has it)")
        with self._core.buffer(region) as mv:
            head = bytes(mv[:len(_OBJ_MAGIC) + 16])
            if head[:len(_OBJ_MAGIC)] != _OBJ_MAGIC:
                raise Corrupt(f"object '{name}' in session '{self.name}': bad header")
            stream_len, count = struct.unpack_from("<QQ", head, len(_OBJ_MAGIC))
            start = len(head) + 8 * count
            sizes = struct.unpack_from(f"<{count}Q", mv, len(head))
            stream = bytes(mv[start:start + stream_len])
        buffers = []
        for k, size in enumerate(sizes):
            with self._core.buffer(_buf_region(name, k)) as mv:
                buffers.append(bytearray(mv[:size]))
        return pickle.loads(stream, buffers=buffers)

    def objects(self) -> List[str]:
        """Names of the objects stored with put(), sorted."""
        suffix = ".pickle"
        return sorted(r.name[len(_OBJ_PREFIX):-len(suffix)] for r in self.regions()
                      if r.name.endswith(suffix) and _is_object_region(r.name))

    def delete(self, name: str) -> None:
        """Removes object ``name`` from the session (snapshots keep it). Raises NotFound."""
        _check_object_name(name)
        regions = self._object_regions(name)
        if _pickle_region(name) not in regions:
            raise NotFound(f"no object '{name}' in session '{self.name}'")
        for region in regions:
            self._core.untrack(region)

    def _object_regions(self, name: str) -> List[str]:
        pattern = re.compile(re.escape(_OBJ_PREFIX + name) + r"\.(?:pickle|buf\.[0-9]+)")
        return [r.name for r in self.regions() if pattern.fullmatch(r.name)]

    def _read_region(self, region: str) -> bytes:
        with self._core.buffer(region) as mv:
            return bytes(mv)

    def _write_region_new(self, region: str, data: bytes) -> None:
        with self._core.alloc(region, len(data)) as mv:
            mv[:] = data

    def list(self) -> List[SnapshotInfo]:
        """This session's snapshots, oldest first."""
        return _infos(self._core.list())

    def info(self, name: str) -> SnapshotInfo:
        """This session's snapshot ``name``. Raises NotFound."""
        return self._store.info(self.name, name)

    def remove(self, name: str) -> None:
        """Deletes this session's snapshot ``name``. Raises NotFound."""
        self._store.remove(self.name, name)

    def gc(self) -> Dict[str, int]:
        """Same as ``store.gc()``."""
        return self._store.gc()

    def verify(self) -> Dict[str, Any]:
        """Same as ``store.verify()`` (checks the whole store)."""
        return self._store.verify()

    def latest(self) -> Optional[SnapshotInfo]:
        """The newest intact snapshot of this session, or None."""
        d = self._core.latest()
        return None if d is None else SnapshotInfo._from_dict(d)

    def clone(self, name: str, *, verify: bool = True, writeable: bool = True) -> "Clone":
        """A copy-on-write clone of snapshot ``name``, beside the live regions.

        ``clone[region]`` is a numpy view with the region's dtype and shape (as
        tracked or created with array(); uint8 otherwise). Writes to the views
        stay private to the clone; ``writeable=False`` gives read-only views.
        """
        return Clone(self._core.clone(name, verify), dict(self._layouts), writeable)

    def tracking(self, region: str) -> str:
        """The change-tracking mechanism in use for ``region``: "write_protect" or "hash"."""
        return self._core.tracking(region)

    def tracking_note(self) -> str:
        """Why write_protect tracking is not in use for some region ("" if it is for all)."""
        return self._core.tracking_note()

    def close(self) -> None:
        """Ends the session: forgets every region and releases tracked buffers.

        Raises InvalidArgument while arrays made by array() are referenced elsewhere.
        """
        names = list(self._arrays)
        self._arrays.clear()
        try:
            self._core.close()
        except InvalidArgument:
            for name in names:
                self._rewrap(name)
            raise
        self._layouts.clear()

    def _rewrap(self, name: str) -> None:
        dtype, shape = self._layouts[name]
        buf = self._core.buffer(name)
        self._arrays[name] = np.frombuffer(buf, dtype=dtype, count=math.prod(shape)).reshape(shape)


class SnapshotJob:
    """A snapshot being taken in the background (``Session.snapshot(..., wait=False)``).

    It stays valid after the session moved on or closed.
    """

    def __init__(self, core: Any) -> None:
        self._core = core

    @property
    def name(self) -> str:
        """The snapshot's name."""
        return str(self._core.name)

    @property
    def background(self) -> bool:
        """False when it was taken at once (``note`` says why)."""
        return bool(self._core.background)

    @property
    def note(self) -> str:
        """Why it was taken at once ("" when it ran in the background)."""
        return str(self._core.note)

    @property
    def stall_seconds(self) -> float:
        """How long the call that started it blocked the caller."""
        return float(self._core.stall_seconds)

    @property
    def bytes_copied_aside(self) -> int:
        """Bytes copied aside because the program wrote them first (known once done)."""
        return int(self._core.bytes_copied_aside)

    @property
    def progress(self) -> Tuple[int, int]:
        """(bytes read into the store so far, bytes to read in all)."""
        done, total, _ = self._core.progress()
        return int(done), int(total)

    @property
    def done(self) -> bool:
        """Published, failed or cancelled."""
        return bool(self._core.done())

    def wait(self, timeout: Optional[float] = None) -> SnapshotInfo:
        """Waits until it is published and returns its info (the GIL is released meanwhile).

        Raises what failed (NoSpace, Cancelled, ...): then nothing was
        published. With ``timeout`` (seconds), raises TimeoutError if it is
        still running by then.
        """
        if timeout is not None and not self._core.wait_for(timeout):
            raise TimeoutError(f"background snapshot '{self.name}' is still running after {timeout} s")
        return SnapshotInfo._from_dict(self._core.wait())

    def cancel(self) -> None:
        """Asks it to stop; unless it has published already, nothing is published."""
        self._core.cancel()

    def __repr__(self) -> str:
        done, total = self.progress
        state = "done" if self.done else f"{done}/{total} bytes"
        return f"<SnapshotJob {self.name!r} {'background' if self.background else 'taken at once'}, {state}>"


class Clone:
    """A copy-on-write view of one snapshot's regions, as numpy arrays.

    ``clone[name]`` gives a region's array; ``clone.arrays()`` all of them. The
    clone's memory lives while the Clone or any of its arrays is referenced.
    """

    def __init__(self, core: "_core.Clone", layouts: Dict[str, _Layout], writeable: bool = True):
        self._core = core
        self._layouts = layouts
        self._writeable = writeable
        self._cache: Dict[str, np.ndarray] = {}

    def __repr__(self) -> str:
        return f"memdvr.Clone({self.session}/{self.snapshot}, regions={self.names()})"

    def __enter__(self) -> "Clone":
        return self

    def __exit__(self, *exc) -> None:
        self._cache.clear()

    @property
    def session(self) -> str:
        """The session of the cloned snapshot."""
        return self._core.session

    @property
    def snapshot(self) -> str:
        """The cloned snapshot's name."""
        return self._core.snapshot

    def regions(self) -> List[RegionInfo]:
        """The clone's regions."""
        return [RegionInfo(**r) for r in self._core.regions()]

    def names(self) -> List[str]:
        """The clone's region names."""
        return [r["name"] for r in self._core.regions()]

    def buffer(self, name: str) -> memoryview:
        """A writable (copy-on-write) memoryview onto region ``name``. Raises NotFound."""
        return self._core.buffer(name)

    def array(self, name: str, dtype: Any = None, shape: Optional[Tuple[int, ...]] = None) -> np.ndarray:
        """Region ``name`` as a numpy array: of ``dtype``/``shape`` if given, else the
        recorded layout (uint8, flat, when none is known or the size differs)."""
        mv = self._core.buffer(name)
        if dtype is None:
            layout = self._layouts.get(name)
            if layout is not None and layout[0].itemsize * math.prod(layout[1]) == mv.nbytes:
                dtype, shape = layout
            else:
                dtype = np.uint8
        dtype = np.dtype(dtype)
        arr = np.frombuffer(mv, dtype=dtype, count=mv.nbytes // dtype.itemsize)
        if shape is not None:
            arr = arr.reshape(shape)
        if not self._writeable:
            arr.flags.writeable = False
        return arr

    def __getitem__(self, name: str) -> np.ndarray:
        """Region ``name`` as a numpy array with its recorded layout (cached)."""
        if name not in self._cache:
            self._cache[name] = self.array(name)
        return self._cache[name]

    def arrays(self) -> Dict[str, np.ndarray]:
        """Every region as a numpy array, by name."""
        return {n: self[n] for n in self.names()}


def load_ipython_extension(ipython) -> None:
    """``%load_ext memdvr``: registers the ``%dvr`` line magic (see memdvr.magics)."""
    from .magics import DvrMagics  # imported here so memdvr alone never imports IPython
    ipython.register_magics(DvrMagics)
