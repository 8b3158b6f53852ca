"""memdvr — numpy-native checkpoint/restore of application memory (Memory DVR).

    import numpy as np, memdvr
    store = memdvr.Store(tmp_dir)              # or memdvr.Store() for the default store
    with memdvr.Session(store, "sweep") as s:  # closed at the end, also when the body raises
        data = s.array("data", (1000, 1000), np.float32)   # SDK-owned numpy array
        feats = np.random.rand(10_000)
        s.track("feats", feats)                # tracked in place, zero-copy
        s.snapshot("loaded", label="after load", replace=True)  # replace: re-runs work
        data *= 2
        s.restore("loaded")                    # data and feats are bit-exact again
        with s.clone("loaded") as c:           # copy-on-write numpy views of a snapshot
            old = c["data"]
    report = store.verify(progress=True)       # a VerifyReport; a tqdm bar meanwhile

Results are frozen dataclasses named and shaped as the C++ structs
(:class:`SnapshotInfo`, :class:`VerifyReport`, :class:`GcReport`,
:class:`StoreStats`, :class:`RegionDiff`, :class:`TransferStats`,
:class:`PruneReport`), each with ``to_dict()`` for JSON.

Long calls (snapshot, restore, verify, gc, export, import) take
``progress=`` (see :data:`Progress`); ``Store.prune(session, keep_last=...)``
applies a retention policy; ``set_log_level("info")`` and
``log_to_python()`` route the library's log to the ``logging`` logger
"memdvr".

Every failure raises a subclass of :class:`DvrError` carrying the C++ message:
:class:`NotFound`, :class:`AlreadyExists`, :class:`Corrupt`, :class:`NoSpace`,
:class:`InvalidArgument`, :class:`DvrIOError`, :class:`Unsupported`,
:class:`PermissionDenied`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import difflib
import atexit
import importlib
import logging
import math
import os
import pickle
import re
import struct
import sys
import time
from typing import (Any, Callable, Dict, Iterable, Iterator, List, Literal, Optional, Sequence,
                    Tuple, Union, overload)

import numpy as np
import numpy.typing as npt

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
    "VerifyProblem",
    "VerifyReport",
    "GcReport",
    "StoreStats",
    "RegionDiff",
    "TransferStats",
    "PruneDecision",
    "PruneReport",
    "Progress",
    "default_path",
    "keygen",
    "key_fingerprint",
    "set_log_level",
    "log_level",
    "log_to_python",
    "flush_log",
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

_Array = npt.NDArray[Any]
_CoreStore = _core.Store
_PathArg = Union[str, "os.PathLike[str]"]

# (dtype, shape) of a region, when known.
_Layout = Optional[Tuple[np.dtype[Any], Tuple[int, ...]]]

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


def _object_of_region(region: str) -> Optional[str]:
    """The object name a region belongs to (None for a region of its own)."""
    m = _OBJ_REGION_RE.fullmatch(region)
    return None if m is None else m.group(1)


def _object_names(regions: Iterable[str]) -> List[str]:
    return sorted(r[len(_OBJ_PREFIX):-len(".pickle")] for r in regions
                  if r.endswith(".pickle") and _is_object_region(r))


def _check_not_reserved(name: str) -> None:
    if isinstance(name, str) and name.startswith(_OBJ_PREFIX):
        raise InvalidArgument(
            f"region name '{name}' uses the prefix '{_OBJ_PREFIX}' reserved for put()/get() objects")


def _printable(text: Any) -> str:
    """``text`` for one line of a terminal: dvr::escape_text, the one rule of
    every text output of dvr and memdvr (docs/cli.md, "Text output"). Bytes
    are taken as they are; a str's lone surrogates (surrogateescape) as the
    bytes they stand for."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        data = bytes(text)
    else:
        text = str(text)
        try:
            data = text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # a surrogate that stands for no byte
            data = text.encode("utf-8", "surrogatepass")
    return _core.escape_text(data)


def _hint(name: str, candidates: Iterable[str], how: str) -> str:
    """"; did you mean 'X'? HOW" with the closest of ``candidates`` (difflib),
    or "; HOW" when none is close; ``how`` says which call lists what exists."""
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'? {how}" if close else f"; {how}"


def _decode_object(read: Callable[[str], memoryview], name: str, where: str) -> Any:
    """Rebuilds object ``name`` from a copy of its regions (``read(region)``
    gives a memoryview onto one); ``where`` names the session or clone."""
    with read(_pickle_region(name)) as mv:
        head = bytes(mv[:len(_OBJ_MAGIC) + 16])
        if head[:len(_OBJ_MAGIC)] != _OBJ_MAGIC or len(head) < len(_OBJ_MAGIC) + 16:
            raise Corrupt(f"object '{name}' in {where}: bad header (region {_pickle_region(name)})")
        stream_len, count = struct.unpack_from("<QQ", head, len(_OBJ_MAGIC))
        start = len(head) + 8 * count
        sizes = struct.unpack_from(f"<{count}Q", mv, len(head))
        stream = bytes(mv[start:start + stream_len])
    buffers = []
    for k, size in enumerate(sizes):
        with read(_buf_region(name, k)) as mv:
            buffers.append(bytearray(mv[:size]))
    return pickle.loads(stream, buffers=buffers)


# ---------------------------------------------------------------- results

def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return value.to_dict() if isinstance(value, _Result) else dataclasses.asdict(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


class _Result:
    """What every result dataclass offers besides its fields."""

    def to_dict(self) -> Dict[str, Any]:
        """The fields as a plain dict of JSON types (tuples become lists)."""
        assert dataclasses.is_dataclass(self)
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True)
class RegionInfo(_Result):
    """One region as recorded in a snapshot (or live in a session/clone) (dvr::RegionInfo)."""

    name: str
    size: int
    sdk_owned: bool


def _rfc3339(time_ns: int) -> str:
    secs, ns = divmod(time_ns, 1_000_000_000)
    t = _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc) + _dt.timedelta(seconds=secs)
    return t.strftime("%Y-%m-%dT%H:%M:%S") + f".{ns:09d}Z"


@dataclasses.dataclass(frozen=True)
class SnapshotInfo(_Result):
    """One snapshot as recorded in its manifest (dvr::SnapshotInfo; same field names).

    ``regions`` lists every region, the ``obj.NAME.*`` regions of put()
    objects included (``objects`` names those objects). ``pending`` is set
    for a background snapshot still being written (only session, name,
    parent and label are known then).
    """

    session: str
    name: str
    parent: str
    label: str
    time_ns: int
    #: Commit order in the store: the highest is the newest, whatever the clock said (dvr::SnapshotInfo::seq).
    seq: int
    #: When the snapshot was first made (ns since the epoch): ``time_ns`` for one taken here, the sender's time for a received one.
    origin_time_ns: int
    logical_bytes: int
    stored_bytes: int
    chunks: int
    zero_chunks: int
    regions: Tuple[RegionInfo, ...]
    tracking: str
    chunks_read: int
    damaged: bool
    damage: str
    pending: bool = False

    @property
    def time(self) -> _dt.datetime:
        """The commit time as a timezone-aware datetime (UTC; microseconds: ``time_ns`` has it all)."""
        return _dt.datetime.fromtimestamp(self.time_ns / 1e9, tz=_dt.timezone.utc)

    @property
    def objects(self) -> List[str]:
        """Names of the put() objects the snapshot holds, sorted."""
        return _object_names(r.name for r in self.regions)

    @classmethod
    def _from_dict(cls, d: Dict[str, Any]) -> "SnapshotInfo":
        d = dict(d)
        d["regions"] = tuple(RegionInfo(**r) for r in d["regions"])
        return cls(**d)

    def to_dict(self) -> Dict[str, Any]:
        """The fields as a plain dict, plus ``time``: RFC 3339 UTC with nanoseconds
        ("2026-12-02T00:31:07.123456789Z") beside ``time_ns``."""
        d = super().to_dict()
        out: Dict[str, Any] = {}
        for k, v in d.items():
            out[k] = v
            if k == "time_ns":
                out["time"] = _rfc3339(self.time_ns)
        return out


@dataclasses.dataclass(frozen=True)
class VerifyProblem(_Result):
    """One problem found by verify() (dvr::VerifyProblem): ``snapshot`` is "" when it is not tied to one."""

    session: str
    snapshot: str
    what: str


@dataclasses.dataclass(frozen=True)
class VerifyReport(_Result):
    """What Store.verify() found (dvr::VerifyReport): manifests examined,
    distinct chunks and bytes re-hashed, the problems, the damaged snapshots
    ("session/name", sorted), ``warnings`` (loosened store permissions: not
    damage, one line each saying what to do) and ``ok`` (no problem)."""

    snapshots: int
    chunks: int
    bytes: int
    problems: Tuple[VerifyProblem, ...]
    damaged_snapshots: Tuple[str, ...]
    ok: bool
    warnings: Tuple[str, ...] = ()

    @classmethod
    def _from_dict(cls, d: Dict[str, Any]) -> "VerifyReport":
        return cls(snapshots=d["snapshots"], chunks=d["chunks"], bytes=d["bytes"],
                   problems=tuple(VerifyProblem(**p) for p in d["problems"]),
                   damaged_snapshots=tuple(d["damaged_snapshots"]), ok=d["ok"],
                   warnings=tuple(d["warnings"]))


@dataclasses.dataclass(frozen=True)
class GcReport(_Result):
    """What Store.gc() did (dvr::GcReport): pack-file bytes before and after,
    pack files removed, leftovers of interrupted snapshots removed."""

    bytes_before: int
    bytes_after: int
    packs_removed: int
    temp_files_removed: int


@dataclasses.dataclass(frozen=True)
class StoreStats(_Result):
    """Store.stats() (dvr::StoreStats): ``medium`` is "pmem", "dram" or "disk";
    ``logical_bytes`` sums the snapshots' sizes, ``pack_bytes`` is the space used;
    ``warnings``: loosened store permissions, as in VerifyReport."""

    path: str
    medium: str
    format_version: int
    chunk_size: int
    sessions: int
    snapshots: int
    logical_bytes: int
    pack_bytes: int
    pack_files: int
    warnings: Tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class RegionDiff(_Result):
    """How one region, or one put() object, differs between two snapshots (dvr::RegionDiff).

    Sizes are 0 where it is missing; ``bytes_differ`` counts differing bytes
    plus the size difference, ``pages_differ`` the 4 KiB pages with any
    difference. ``object`` is True for a put() object (``name`` is then the
    object's name, and the figures add up its regions).
    """

    name: str
    size_a: int
    size_b: int
    only_in_a: bool
    only_in_b: bool
    bytes_differ: int
    pages_differ: int
    object: bool = False


@dataclasses.dataclass(frozen=True)
class TransferStats(_Result):
    """What Store.export() / Store.import_() moved (dvr::transfer::Stats, same names):
    the refs ("session/name"), the base used, logical, wire and chunk-data
    bytes, chunks (skipped: the receiver had them; compressed; raw), bytes read
    (export) and added to the store (import), seconds, the compression ratio
    and the content fingerprint; ``signed_by``: the fingerprint of the key
    that signed the stream ("" when it was not signed)."""

    refs: Tuple[str, ...]
    base: str
    logical_bytes: int
    wire_bytes: int
    data_bytes: int
    chunks: int
    chunks_skipped: int
    chunks_compressed: int
    chunks_raw: int
    read_bytes: int
    stored_bytes: int
    seconds: float
    compression_ratio: float
    fingerprint: str
    signed_by: str

    @classmethod
    def _from_dict(cls, d: Dict[str, Any]) -> "TransferStats":
        d = dict(d)
        d["refs"] = tuple(d["refs"])
        return cls(**d)


@dataclasses.dataclass(frozen=True)
class PruneDecision(_Result):
    """What Store.prune() decided for one snapshot (dvr::PruneDecision).

    ``reason`` names the rules that keep it ("last 3, daily 2026-12-01"),
    why it is kept anyway ("kept: damaged (...)", "kept: the DVR heap of
    process snapshot proc/NAME"), or "removed" with what still refers to it
    ("; an open clone keeps its data until it is closed").
    """

    snapshot: SnapshotInfo
    keep: bool
    reason: str


@dataclasses.dataclass(frozen=True)
class PruneReport(_Result):
    """What Store.prune() did (dvr::PruneReport): a decision for every
    snapshot of the session, oldest first; how many were removed (would be,
    for a dry run); whether it was a dry run."""

    decisions: Tuple[PruneDecision, ...]
    removed: int
    dry_run: bool

    @property
    def kept(self) -> List[SnapshotInfo]:
        """The snapshots kept, oldest first."""
        return [d.snapshot for d in self.decisions if d.keep]

    @property
    def removed_snapshots(self) -> List[SnapshotInfo]:
        """The snapshots removed (would be, for a dry run), oldest first."""
        return [d.snapshot for d in self.decisions if not d.keep]

    @classmethod
    def _from_dict(cls, d: Dict[str, Any]) -> "PruneReport":
        return cls(decisions=tuple(PruneDecision(snapshot=SnapshotInfo._from_dict(x["snapshot"]),
                                                 keep=bool(x["keep"]), reason=str(x["reason"]))
                                   for x in d["decisions"]),
                   removed=int(d["removed"]), dry_run=bool(d["dry_run"]))


def _infos(dicts: Iterable[Dict[str, Any]]) -> List[SnapshotInfo]:
    return [SnapshotInfo._from_dict(d) for d in dicts]


# ---------------------------------------------------------------- logging

_LOG_LEVELS = {"error": logging.ERROR, "warn": logging.WARNING, "info": logging.INFO, "debug": logging.DEBUG}
_log_atexit = False


def set_log_level(level: str) -> None:
    """Sets the library's log level for the whole process: "error", "warn"
    (the default), "info" or "debug" (overrides $DVR_LOG). At info the
    library says why write tracking fell back to hashing, each CRIU run,
    lock waits, autosaves, background snapshots, gc's and prune's summaries;
    at debug also each snapshot and restore with its figures
    (docs/operations.md, "Logging"). Raises InvalidArgument for another name."""
    if not isinstance(level, str):
        raise InvalidArgument(f"log level must be one of {', '.join(_LOG_LEVELS)}, not {level!r}")
    _core.set_log_level(level)


def log_level() -> str:
    """The library's log level: what set_log_level() set, else $DVR_LOG, else "warn"."""
    return _core.log_level()


def log_to_python(enable: bool = True, *, logger: Union[str, logging.Logger] = "memdvr") -> None:
    """Routes the library's log lines to Python's :mod:`logging` (``enable=False``:
    back to the default, "dvr[PID] LEVEL: ..." lines on stderr).

    Each line becomes a record of ``logger`` (the logger "memdvr" by
    default) at the matching level (error, warning, info, debug). The
    library decides what is logged (:func:`set_log_level`); the logger's own
    level and handlers then filter and place it as usual. The lines arrive
    on a helper thread of memdvr's, which takes the GIL (the library, which
    may log from any of its threads, never waits for Python): usually within
    a millisecond, and :func:`flush_log` waits for those already logged. At
    interpreter exit the default sink is put back (atexit).
    """
    global _log_atexit
    if not enable:
        _core.set_log_handler(None)
        return
    target = logger if isinstance(logger, logging.Logger) else logging.getLogger(logger)

    def handler(level: str, line: str) -> None:
        target.log(_LOG_LEVELS.get(level, logging.WARNING), "%s", line)

    _core.set_log_handler(handler)
    if not _log_atexit:
        atexit.register(_core.set_log_handler, None)
        _log_atexit = True


def flush_log() -> None:
    """Waits until every line the library logged so far has reached Python's
    logging (after :func:`log_to_python`; nothing to wait for otherwise)."""
    _core.flush_log()


def keygen(prefix: _PathArg) -> str:
    """Writes a new Ed25519 key pair for signed streams: ``PREFIX.key`` (the
    secret key, mode 0600: it stays with the sender, for ``Store.export(...,
    sign=)``) and ``PREFIX.pub`` (for the receivers, ``Store.import_(...,
    require_signature=)``), what ``dvr keygen --out PREFIX`` does. Returns the
    key's fingerprint ("ed25519:" and 32 hex digits). Raises AlreadyExists
    when either file exists (nothing is overwritten), NotFound (no such
    directory)."""
    return _core.keygen(os.fspath(prefix))


def key_fingerprint(path: _PathArg) -> str:
    """The fingerprint of a public key file (``PREFIX.pub``), as
    TransferStats.signed_by and the messages name keys."""
    return _core.key_fingerprint(os.fspath(path))


def _prune_policy(keep_last: int, keep_within: Union[None, float, _dt.timedelta], keep_hourly: int,
                  keep_daily: int, keep_weekly: int, keep_monthly: int) -> Dict[str, int]:
    """The keep-* arguments checked, keep_within as whole seconds (rounded up)."""
    policy: Dict[str, int] = {}
    for key, value in (("keep_last", keep_last), ("keep_hourly", keep_hourly), ("keep_daily", keep_daily),
                       ("keep_weekly", keep_weekly), ("keep_monthly", keep_monthly)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**32:
            raise InvalidArgument(f"prune: {key} must be a number of snapshots >= 0, not {value!r}")
        policy[key] = value
    if keep_within is None:
        seconds = 0.0
    elif isinstance(keep_within, _dt.timedelta):
        seconds = keep_within.total_seconds()
    elif isinstance(keep_within, (int, float)) and not isinstance(keep_within, bool):
        seconds = float(keep_within)
    else:
        raise InvalidArgument(f"prune: keep_within must be seconds or a datetime.timedelta, not {keep_within!r}")
    if not (0 <= seconds < 1e15):
        raise InvalidArgument(f"prune: keep_within must be >= 0 seconds, not {keep_within!r}")
    policy["keep_within"] = math.ceil(seconds)
    return policy


# ---------------------------------------------------------------- progress

#: What a ``progress=`` parameter takes: None (the default: a tqdm bar once
#: the call has run for about a second, when stderr is a terminal or in
#: Jupyter and tqdm is installed; nothing otherwise), True (a tqdm bar from
#: the start), False (nothing), or a callable(done, total) called with bytes.
Progress = Union[None, bool, Callable[[int, int], Any]]

_AUTO_BAR_AFTER = 1.0  # seconds before the default bar shows


def _in_jupyter() -> bool:
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    shell = ipython.get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def _tqdm_class(jupyter: bool) -> Any:
    """tqdm's bar class (tqdm.auto's in Jupyter), or None when tqdm is not installed."""
    try:
        return importlib.import_module("tqdm.auto" if jupyter else "tqdm").tqdm
    except ImportError:
        return None


class _Bar:
    """A progress callback drawing a tqdm bar of bytes, created on the first
    call that comes ``delay`` seconds or more after the start. ``tqdm()``
    gives the bar class (None: no bar) and is called only then, so a quick
    call never imports tqdm (tqdm.auto warns in a Jupyter without ipywidgets)."""

    def __init__(self, tqdm: Callable[[], Any], desc: str, delay: float) -> None:
        self._tqdm = tqdm
        self._desc = desc
        self._start = time.monotonic()
        self._delay = delay
        self._bar: Any = None
        self._off = False

    def __call__(self, done: int, total: int) -> None:
        if self._off:
            return
        if self._bar is None:
            if time.monotonic() - self._start < self._delay:
                return
            cls = self._tqdm()
            if cls is None:
                self._off = True
                return
            self._bar = cls(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                            desc=self._desc, leave=False)
        if self._bar.total != total:
            self._bar.total = total
        self._bar.update(done - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


@contextlib.contextmanager
def _progress(progress: Progress, desc: str) -> Iterator[Optional[Callable[[int, int], Any]]]:
    """The callable to give _core for a ``progress=`` argument (None: no progress)."""
    if progress is None or progress is True:
        jupyter = _in_jupyter()
        interactive = jupyter or (sys.stderr is not None and sys.stderr.isatty())
        if progress is True:
            tqdm = _tqdm_class(jupyter)
            if tqdm is None:
                raise InvalidArgument(
                    "progress=True draws a tqdm bar, but tqdm is not installed: "
                    "apt install python3-tqdm (or pip install tqdm), or pass a callable(done, total)")
            bar = _Bar(lambda: tqdm, desc, 0.0)
        elif interactive:
            bar = _Bar(lambda: _tqdm_class(jupyter), desc, _AUTO_BAR_AFTER)  # imported only if it is drawn
        else:
            yield None
            return
        try:
            yield bar
        finally:
            bar.close()
    elif progress is False:
        yield None
    elif callable(progress):
        yield progress
    else:
        raise TypeError(f"progress must be None, True, False or a callable(done, total), "
                        f"not a {type(progress).__name__}")


def default_path() -> str:
    """The default store: $DVR_STORE if set, else /dev/shm/dvr-<uid>, else ~/.local/share/dvr."""
    return _core.Store.default_path()


class _DeferredProgress:
    """A restore's progress callback that keeps an exception raised once the
    restore may be writing live memory (done >= total / 2: the bytes checked
    come first, then the bytes copied) and lets the restore complete;
    reraise() raises it after. So Session.restore() knows whether its object
    regions were reconciled for good: an exception that reaches it is one
    raised while checking, when nothing changed yet."""

    def __init__(self, cb: Callable[[int, int], Any]) -> None:
        self._cb = cb
        self._error: Optional[BaseException] = None

    def __call__(self, done: int, total: int) -> None:
        if self._error is not None:
            return
        try:
            self._cb(done, total)
        except BaseException as e:
            if total > 0 and 2 * done < total:
                raise
            self._error = e

    def reraise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error


class Store:
    """A store: a directory holding every snapshot, shared by sessions and processes.

    ``Store(path=None, chunk_size=None, create=True, lock_timeout=None)``
    opens (and creates) the store in ``path``, or the default store
    (:func:`default_path`) when ``path`` is None. ``chunk_size`` applies only
    when a new store is created. ``lock_timeout``: seconds a call waits for
    the store's lock while another process holds it (a send whose reader is
    slow, a gc, a process frozen inside a snapshot), then raises DvrIOError
    and changes nothing; None waits as long as it takes (with a warning on
    the library's log after a second).
    """

    _core: _CoreStore

    def __init__(self, path: Optional[_PathArg] = None, *,
                 chunk_size: Optional[int] = None, create: bool = True, lock_timeout: Optional[float] = None):
        path = default_path() if path is None else os.fspath(path)
        self._core = _core.Store.open(path, chunk_size, create, lock_timeout)

    @classmethod
    def _wrap(cls, core: _CoreStore) -> "Store":
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
        """Snapshots of ``session`` oldest first, or of every session (session by session, sessions by name,
        each oldest first); damaged ones are marked.

        An unknown session gives an empty list."""
        return _infos(self._core.list(session))

    # -- not-found hints: the Python call that lists what exists, and the closest name

    def _missing_snapshot(self, session: str, name: str) -> Optional[NotFound]:
        """A NotFound for snapshot ``session/name`` saying what exists, or None
        when it does exist (the NotFound was about something else)."""
        here = f"memdvr.Store({self.path!r})"
        try:
            sessions = self.sessions()
            names = [i.name for i in self.list(session)] if session in sessions else []
        except DvrError:
            return None
        if session not in sessions:
            return NotFound(
                f"no snapshot '{session}/{name}': there is no session '{session}' in store "
                f"{self.path}{_hint(session, sessions, f'{here}.sessions() lists the sessions')}")
        if name in names:
            return None
        return NotFound(
            f"no snapshot '{session}/{name}' in store {self.path}"
            f"{_hint(name, names, f'{here}.list({session!r}) lists its snapshots')}")

    @contextlib.contextmanager
    def _finding(self, session: str, name: str) -> Iterator[None]:
        """Re-raises a NotFound for snapshot ``session/name`` with the Python hints."""
        try:
            yield
        except NotFound:
            better = self._missing_snapshot(session, name)
            if better is None:
                raise
            raise better from None

    def info(self, session: str, name: str) -> SnapshotInfo:
        """Snapshot ``session/name``. Raises NotFound (naming the closest existing name) or Corrupt."""
        with self._finding(session, name):
            return SnapshotInfo._from_dict(self._core.info(session, name))

    def remove(self, session: str, name: str) -> None:
        """Deletes snapshot ``session/name`` (its space is reused; gc() returns it). Raises NotFound.

        As ``dvr rm``: process snapshot ``proc/NAME`` goes with its heap
        snapshots, and a heap snapshot ``SESSION/proc.NAME`` that a process
        snapshot still needs is refused (InvalidArgument; remove ``proc/NAME``)."""
        with self._finding(session, name):
            self._core.remove(session, name)

    def gc(self, *, progress: Progress = None) -> GcReport:
        """Returns the space of data no snapshot references to the file system (a :class:`GcReport`).

        ``progress``: see :data:`Progress` (bytes of pack files examined out
        of their size); a callback that raises stops gc between two pack
        files (what it freed was unreferenced; nothing else changed) and its
        exception propagates. The GIL is released meanwhile. Raises Corrupt
        while a manifest is unreadable (remove that snapshot first).
        """
        with _progress(progress, "gc") as cb:
            return GcReport(**self._core.gc(cb))

    def prune(self, session: str, *, keep_last: int = 0,
              keep_within: Union[None, float, _dt.timedelta] = None, keep_hourly: int = 0,
              keep_daily: int = 0, keep_weekly: int = 0, keep_monthly: int = 0,
              dry_run: bool = False) -> PruneReport:
        """Removes the snapshots of ``session`` that no keep-rule keeps (dvr::Store::prune;
        restic's ``forget --keep-*``) and returns a :class:`PruneReport`.

        Each rule keeps snapshots on its own; one kept by any rule is kept:
        ``keep_last`` the newest N; ``keep_within`` (seconds, or a timedelta;
        rounded up to whole seconds) those taken within that long of the
        newest one; ``keep_hourly/daily/weekly/monthly`` the newest snapshot of
        each of the newest N hours, days, ISO weeks, months (UTC) that hold
        one. Damaged snapshots are never removed. Every decision is made
        before anything is removed; ``dry_run=True`` changes nothing. Space
        is reused by later snapshots; gc() returns it to the file system.
        Raises InvalidArgument for a policy that keeps nothing (every rule 0)
        or a bad name, NotFound (naming the closest session) for an unknown
        session. The GIL is released meanwhile.
        """
        policy = _prune_policy(keep_last, keep_within, keep_hourly, keep_daily, keep_weekly, keep_monthly)
        try:
            d = self._core.prune(session, dry_run=bool(dry_run), **policy)
        except NotFound:
            sessions = self.sessions()
            if session in sessions:
                raise
            here = f"memdvr.Store({self.path!r})"
            raise NotFound(
                f"no session '{_printable(session)}' in store {self.path}"
                f"{_hint(session, sessions, f'{here}.sessions() lists the sessions')}") from None
        return PruneReport._from_dict(d)

    def verify(self, *, progress: Progress = None) -> VerifyReport:
        """Re-reads every manifest and re-hashes every chunk; never raises for damage.

        Returns a :class:`VerifyReport` (``ok``, ``problems``,
        ``damaged_snapshots``, counts). ``progress``: see :data:`Progress`
        (bytes re-hashed out of the total); an exception raised by a callback
        stops the verification and propagates. The GIL is released meanwhile.
        """
        with _progress(progress, "verify") as cb:
            return VerifyReport._from_dict(self._core.verify(cb))

    def stats(self) -> StoreStats:
        """Path, medium, format version, chunk size, counts and space used (a :class:`StoreStats`)."""
        d = self._core.stats()
        d["warnings"] = tuple(d["warnings"])
        return StoreStats(**d)

    def diff(self, session_a: str, snapshot_a: str, session_b: str, snapshot_b: str) -> List[RegionDiff]:
        """Per-region differences (bytes and 4 KiB pages) between two snapshots.

        One :class:`RegionDiff` per region, in the snapshots' order, then one
        per put() object (``object=True``, named by the object, its regions
        added up), also for what is unchanged. Raises NotFound or Corrupt.
        """
        with self._finding(session_a, snapshot_a), self._finding(session_b, snapshot_b):
            rows = self._core.diff(session_a, snapshot_a, session_b, snapshot_b)
        out = [RegionDiff(**r) for r in rows if not _is_object_region(r["name"])]
        objects: Dict[str, List[Dict[str, Any]]] = {}
        for r in rows:
            obj = _object_of_region(r["name"])
            if obj is not None:
                objects.setdefault(obj, []).append(r)
        for obj, parts in objects.items():
            out.append(RegionDiff(
                name=obj, size_a=sum(p["size_a"] for p in parts), size_b=sum(p["size_b"] for p in parts),
                only_in_a=all(p["only_in_a"] for p in parts), only_in_b=all(p["only_in_b"] for p in parts),
                bytes_differ=sum(p["bytes_differ"] for p in parts),
                pages_differ=sum(p["pages_differ"] for p in parts), object=True))
        return out

    def latest(self, session: str) -> Optional[SnapshotInfo]:
        """The newest intact snapshot of ``session`` (every chunk re-hashed), or None."""
        d = self._core.latest(session)
        return None if d is None else SnapshotInfo._from_dict(d)

    def open_snapshot(self, session: str, name: str, *, verify: bool = True,
                      writeable: bool = True) -> "Clone":
        """A copy-on-write clone of snapshot ``session/name``.

        Its regions come back as uint8 arrays (the store does not know dtypes;
        use ``Clone.array(name, dtype, shape)``, or ``Session.clone`` for the
        session's own layouts); put() objects with ``Clone.get(name)``.
        ``verify`` checks every chunk first.
        """
        with self._finding(session, name):
            return Clone(self._core.open_snapshot(session, name, verify), {}, writeable)

    def export(self, ref: str, path: _PathArg, *, base: str = "", compress: str = "auto",
               level: int = 1, progress: Progress = None,
               sign: Optional[_PathArg] = None) -> TransferStats:
        """Writes snapshot ``ref`` ("session/name", or "proc/NAME") to the file ``path``
        as a verified stream (what ``dvr export REF -o PATH`` does).

        ``base``: a snapshot of the same session that the importing store
        holds: only what differs is written. ``compress``: "auto", "zstd" or
        "none"; ``level``: zstd level 1-19 (0: none). The file is written
        beside ``path`` and renamed over it once complete: no half file, also
        when ``progress`` raises (bytes of the snapshot's data). The GIL is
        released meanwhile. ``sign``: a secret key file (:func:`keygen`, ``dvr
        keygen``): the stream is signed with it (``dvr export --sign KEY``;
        docs/migration.md, "Authenticated imports"). Raises NotFound, Corrupt,
        InvalidArgument, NoSpace, PermissionDenied (a key file others can read).
        """
        session, name = _core.split_ref(ref)
        key = "" if sign is None else os.fspath(sign)
        with _progress(progress, "export") as cb, self._finding(session, name):
            return TransferStats._from_dict(
                self._core.export_(ref, os.fspath(path), base, compress, level, cb, key))

    def import_(self, path: _PathArg, *, progress: Progress = None,
                require_signature: Union[_PathArg, Sequence[_PathArg], None] = None) -> TransferStats:
        """Reads a stream file written by :meth:`export` (or ``dvr export``) into the store.

        Every chunk is checked before anything is published; a broken file,
        or a ``progress`` callback that raises (bytes of the file read, out of
        its size: dvr::transfer::ReceiveOptions::progress), leaves the store
        as it was. The GIL
        is released meanwhile. ``require_signature``: a public key file (or
        several): the file must be signed by (one of) them, else nothing is
        stored and PermissionDenied (unsigned, or signed by another key) or
        Corrupt (the signature does not match: altered after signing) is
        raised (``dvr import --require-signature PUBKEY``). Raises Corrupt,
        AlreadyExists, NotFound (a base the store lacks, or no file), NoSpace.
        """
        if require_signature is None:
            keys: List[str] = []
        elif isinstance(require_signature, (str, os.PathLike)):
            keys = [os.fspath(require_signature)]
        else:
            keys = [os.fspath(k) for k in require_signature]
        with _progress(progress, "import") as cb:
            return TransferStats._from_dict(self._core.import_(os.fspath(path), cb, keys))


class Session:
    """One application's named set of memory regions in a store.

    ``Session(store, name, tracking=None)``: ``store`` is a :class:`Store`, a
    path, or None for the default store. ``tracking`` is "write_protect" (the
    default: the kernel records written pages, so snapshots and restores touch
    only what changed) or "hash". Threads may share a session: its calls run
    one at a time (a call waits for the one in flight; close() too), and a
    progress callback cannot call its own session. Regions must not be written
    by other threads while a snapshot or restore runs.
    """

    _core: Any  # _core.Session, or memdvr.mpi's local session (the same methods)

    def __init__(self, store: Union[Store, _PathArg, None], name: str,
                 tracking: Optional[str] = None):
        if name == "proc":
            raise InvalidArgument("session name 'proc' is where the store keeps process snapshots (dvr proc dump); "
                                  "choose another name for a session of regions")
        if not isinstance(store, Store):
            store = Store(store)
        self._store = store
        self._core = _core.Session(store._core, name, tracking)
        self._name = self._core.name
        self._layouts: Dict[str, _Layout] = {}
        self._arrays: Dict[str, _Array] = {}  # SDK-owned arrays made by array()

    @classmethod
    def _wrap(cls, core: Any, store: Store) -> "Session":
        """A Session over a session object made elsewhere: ``core`` offers the
        methods of ``_core.Session`` (memdvr.mpi: the rank's local session)."""
        self = cls.__new__(cls)
        self._store = store
        self._core = core
        self._name = core.name
        self._layouts = {}
        self._arrays = {}
        return self

    def __repr__(self) -> str:
        state = "closed" if self._core.closed else f"regions={list(self._layouts)}"
        return f"memdvr.Session({self.name!r}, {state})"

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, exc_type: Optional[type], exc: Optional[BaseException], tb: Any) -> None:
        """Closes the session. When the body raised, that exception is what
        propagates: a failure to close is only added to it as a note."""
        _close_after(self.close, exc, f"session '{self.name}'")

    @property
    def name(self) -> str:
        """The session's name."""
        return self._name

    @property
    def closed(self) -> bool:
        """True once close() was called."""
        return bool(self._core.closed)

    @property
    def store(self) -> Store:
        """The store the session lives in."""
        return self._store

    @property
    def head(self) -> str:
        """The snapshot most recently taken or restored here ("" if none)."""
        return str(self._core.head)

    def track(self, name: str, buffer: Any) -> Any:
        """Tracks ``buffer`` in place as region ``name`` and returns it.

        Zero-copy: snapshots read the buffer's memory and restores write into it,
        so the same object sees restored data. Accepts any writable C-contiguous
        buffer (numpy array, bytearray, memoryview, ...). A reference is held
        while it is tracked. Raises InvalidArgument (a ValueError) for
        read-only or non-contiguous buffers, AlreadyExists for a taken name.
        """
        _check_not_reserved(name)
        if isinstance(buffer, np.ndarray) and buffer.dtype.hasobject:
            raise InvalidArgument(f"cannot track region '{_printable(name)}': a numpy array of dtype {buffer.dtype} "
                                  "holds pointers to Python objects, which a restore would bring back dangling; "
                                  "track an array of numbers, or use Session.put() for objects")
        self._core.track(name, buffer)
        if isinstance(buffer, np.ndarray):
            self._layouts[name] = (buffer.dtype, tuple(buffer.shape))
        else:
            self._layouts[name] = None
        return buffer

    def array(self, name: str, shape: Union[int, Tuple[int, ...]], dtype: Any = np.float64) -> _Array:
        """Allocates an SDK-owned, page-aligned, zero-filled numpy array as region ``name``.

        The array stays valid as long as it is referenced (it keeps the session
        alive); untrack(name) frees it once no other reference to it remains.
        """
        _check_not_reserved(name)
        # Everything numpy could refuse is checked before the region exists.
        try:
            dtype = np.dtype(dtype)
        except TypeError as e:
            raise InvalidArgument(f"array '{_printable(name)}': {e}") from None
        if dtype.hasobject:
            raise InvalidArgument(f"array '{_printable(name)}': dtype {dtype} holds pointers to Python objects, "
                                  "which a restore would bring back dangling; use a numeric dtype, or Session.put()")
        if dtype.itemsize == 0:
            raise InvalidArgument(f"array '{_printable(name)}': dtype {dtype} has no size")
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(n) for n in shape)
        if any(n < 0 for n in shape):
            raise InvalidArgument(f"array '{_printable(name)}': shape {shape} has a negative dimension")
        count = math.prod(shape)
        mv = self._core.alloc(name, count * dtype.itemsize)
        try:
            arr = np.frombuffer(mv, dtype=dtype, count=count).reshape(shape)
        except BaseException:
            del mv
            self._core.untrack(name)  # no region left behind that session[name] cannot reach
            raise
        self._layouts[name] = (dtype, shape)
        self._arrays[name] = arr
        return arr

    def alloc(self, name: str, size: int) -> memoryview:
        """Allocates an SDK-owned, zero-filled region of ``size`` bytes; returns a writable memoryview."""
        _check_not_reserved(name)
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 0:
            raise InvalidArgument(f"alloc '{_printable(name)}': size must be a whole number of bytes >= 0, not {size!r}")
        mv: memoryview = self._core.alloc(name, size)
        self._layouts[name] = None
        return mv

    def __getitem__(self, name: str) -> Any:
        """The tracked object or SDK-owned array (a memoryview for alloc()) called ``name``.

        Raises NotFound naming the closest region (or the put() object of that name)."""
        if name in self._arrays:
            return self._arrays[name]
        with self._finding_region(name):
            return self._core.buffer(name)

    @contextlib.contextmanager
    def _finding_region(self, name: str) -> Iterator[None]:
        """Re-raises a NotFound for region ``name`` with the closest name and the Python call."""
        try:
            yield
        except NotFound:
            regions = [r.name for r in self.regions()]
            if name in regions:
                raise
            if name in _object_names(regions):
                how = f"'{name}' is a put() object: Session.get({name!r}) reads it"
            else:
                how = "Session.regions() lists them"
            mine = [r for r in regions if not _is_object_region(r)]
            raise NotFound(f"session '{self.name}' has no region '{_printable(name)}'"
                           f"{_hint(name, mine, how)}") from None

    def __contains__(self, name: str) -> bool:
        """Whether the session has a region ``name`` made by track(), array() or alloc()."""
        return name in self._layouts

    def untrack(self, name: str) -> None:
        """Forgets region ``name`` (freeing it if SDK-owned). Raises NotFound.

        For an SDK-owned region, raises InvalidArgument while arrays or
        memoryviews onto it are still referenced elsewhere.
        """
        had_array = self._arrays.pop(name, None) is not None
        try:
            with self._finding_region(name):
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
    def snapshot(self, name: str, label: str = ..., replace: bool = ..., *, wait: Literal[True] = ...,
                 progress: Progress = ...) -> SnapshotInfo: ...

    @overload
    def snapshot(self, name: str, label: str = ..., replace: bool = ..., *, wait: Literal[False],
                 progress: Literal[None, False] = ...) -> "SnapshotJob": ...

    def snapshot(self, name: str, label: str = "", replace: bool = False, *, wait: bool = True,
                 progress: Progress = None) -> Union[SnapshotInfo, "SnapshotJob"]:
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

        ``replace`` is False by default, as in C++ and ``dvr``: a snapshot is
        a record, and replacing one by accident loses it. Pass
        ``replace=True`` where re-running the code must work (a notebook cell,
        a script run again): the old snapshot of that name is then replaced
        atomically. Raises AlreadyExists unless ``replace``; InvalidArgument
        with no regions. Failures while copying in the background (NoSpace,
        ...) are raised by ``SnapshotJob.wait()``.

        ``progress`` (``wait=True`` only): see :data:`Progress`; bytes of
        region memory read out of the bytes the snapshot reads (the chunks
        with written pages, or all memory when it hashes). A callback that
        raises (KeyboardInterrupt included) abandons the snapshot: nothing is
        published (an existing snapshot it would replace stays) and the
        exception propagates. With ``wait=False`` the gauge is
        :attr:`SnapshotJob.progress`, polled by the program; passing a bar
        or a callback then raises InvalidArgument (nothing would call it).
        """
        if not wait and progress is not None and progress is not False:
            raise InvalidArgument(
                f"snapshot '{self.name}/{name}': progress= reports a snapshot taken with wait=True; with "
                "wait=False poll SnapshotJob.progress (bytes done, bytes in all) instead")
        if progress is None and not isinstance(self._core, _core.Session):
            progress = False  # memdvr.mpi's local session reports none: no default bar
        try:
            if not wait:
                return SnapshotJob(self._core.snapshot_background(name, label, replace))
            with _progress(progress, "snapshot") as cb:
                if cb is None:
                    return SnapshotInfo._from_dict(self._core.snapshot(name, label, replace))
                return SnapshotInfo._from_dict(self._core.snapshot(name, label, replace, self._progress_arg(cb)))
        except AlreadyExists:
            raise AlreadyExists(
                f"snapshot '{self.name}/{name}' exists already in store {self._store.path}; pass "
                f"replace=True to replace it, pick another name, or remove it first "
                f"(Session.remove({name!r}))") from None

    def _progress_arg(self, cb: Callable[[int, int], Any]) -> Callable[[int, int], Any]:
        """``cb`` for a progress argument of ``self._core``; memdvr.mpi's local
        session takes none (raises TypeError then)."""
        if not isinstance(self._core, _core.Session):
            raise TypeError(f"progress= is not available on session '{self.name}' "
                            "(the local session of a memdvr.mpi.Session)")
        return cb

    def _core_restore(self, name: str, cb: Optional[Callable[[int, int], Any]]) -> None:
        if cb is None:
            self._core.restore(name)
        else:
            self._core.restore(name, self._progress_arg(cb))

    def restore(self, name: str, *, progress: Progress = None) -> None:
        """Puts every region recorded in snapshot ``name`` back, bit-exact, in place.

        Objects stored with put() come back as they were at the snapshot: their
        regions are first re-allocated, created or dropped to match the
        snapshot (objects put since are gone afterwards). Other regions must
        match the snapshot's in name and size. Nothing changes on error
        (NotFound, Corrupt, InvalidArgument when a region is missing or changed
        size). The GIL is released meanwhile.

        ``progress``: see :data:`Progress`; bytes checked, then bytes copied,
        out of twice the bytes the restore copies. A callback that raises
        while the data is being checked stops the restore at once: memory is
        as it was (objects too). Once live memory is being written, the
        restore completes (memory is then exactly the snapshot) and the
        exception propagates after.
        """
        if progress is None and not isinstance(self._core, _core.Session):
            progress = False  # memdvr.mpi's local session reports none: no default bar
        with _progress(progress, "restore") as cb:
            if cb is None:
                self._restore(name, None)
                return
            deferring = _DeferredProgress(cb)
            self._restore(name, deferring)
            deferring.reraise()

    def _restore(self, name: str, cb: Optional[Callable[[int, int], Any]]) -> None:
        info = self.info(name)
        want = {r.name: r.size for r in info.regions if _is_object_region(r.name)}
        have = {r.name: r.size for r in self.regions() if _is_object_region(r.name)}
        others_want = {(r.name, r.size) for r in info.regions if not _is_object_region(r.name)}
        others_have = {(r.name, r.size) for r in self.regions() if not _is_object_region(r.name)}
        if want == have or others_want != others_have:
            # Nothing to reconcile, or the core refuses anyway (its message).
            self._core_restore(name, cb)
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
            self._core_restore(name, cb)
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
            if region.startswith(f"{_OBJ_PREFIX}{name}.buf.") and int(region.rsplit(".", 1)[1]) >= len(raws):
                self._core.untrack(region)

    def get(self, name: str) -> Any:
        """Object ``name`` as last put (or restored), rebuilt from a copy of its regions.

        The result shares no memory with the session: later put()/restore()
        calls do not change it. Raises NotFound naming the object and the
        closest existing one.
        """
        _check_object_name(name)
        self._require_object(name)
        return _decode_object(self._core.buffer, name, f"session '{self.name}'")

    def _require_object(self, name: str) -> None:
        regions = [r.name for r in self.regions()]
        if _pickle_region(name) not in regions:
            how = ("Session.objects() lists them; put() it first, or restore a snapshot that has it")
            if name in regions:
                how = f"'{name}' is a region: session[{name!r}] gives it"
            raise NotFound(f"no object '{name}' in session '{self.name}'"
                           f"{_hint(name, _object_names(regions), how)}")

    def objects(self) -> List[str]:
        """Names of the objects stored with put(), sorted."""
        return _object_names(r.name for r in self.regions())

    def delete(self, name: str) -> None:
        """Removes object ``name`` from the session (snapshots keep it). Raises NotFound."""
        _check_object_name(name)
        self._require_object(name)
        for region in self._object_regions(name):
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

    def _require_open(self) -> None:
        """The calls that go to the store directly fail on a closed session like the others."""
        if self._core.closed:
            raise InvalidArgument(f"memdvr: session '{_printable(self.name)}' is closed")

    def info(self, name: str) -> SnapshotInfo:
        """This session's snapshot ``name``. Raises NotFound."""
        self._require_open()
        return self._store.info(self.name, name)

    def remove(self, name: str) -> None:
        """Deletes this session's snapshot ``name``. Raises NotFound."""
        self._require_open()
        self._store.remove(self.name, name)

    def gc(self, *, progress: Progress = None) -> GcReport:
        """Same as ``store.gc(progress=...)`` (the whole store)."""
        self._require_open()
        return self._store.gc(progress=progress)

    def prune(self, *, keep_last: int = 0, keep_within: Union[None, float, _dt.timedelta] = None,
              keep_hourly: int = 0, keep_daily: int = 0, keep_weekly: int = 0, keep_monthly: int = 0,
              dry_run: bool = False) -> PruneReport:
        """``store.prune(session.name, ...)``: applies a retention policy to this
        session's snapshots (see :meth:`Store.prune`). The session goes on
        working when its head is removed (its next snapshot reads more)."""
        self._require_open()
        return self._store.prune(self.name, keep_last=keep_last, keep_within=keep_within,
                                 keep_hourly=keep_hourly, keep_daily=keep_daily, keep_weekly=keep_weekly,
                                 keep_monthly=keep_monthly, dry_run=dry_run)

    def verify(self, *, progress: Progress = None) -> VerifyReport:
        """Same as ``store.verify(progress=...)`` (checks the whole store)."""
        self._require_open()
        return self._store.verify(progress=progress)

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
        with self._store._finding(self.name, name):
            return Clone(self._core.clone(name, verify), dict(self._layouts), writeable)

    def autosave(self, every: Union[float, _dt.timedelta], keep: int) -> None:
        """Turns on autosave (dvr::Session::autosave): at the first
        :meth:`checkpoint_point` once ``every`` (seconds, or a timedelta) has
        passed since the session's last snapshot, a snapshot "autosave-N" (N
        counting up) is taken, labelled "autosave", and only the newest
        ``keep`` autosaves are kept; named snapshots are never removed.
        ``every=0`` turns it off. Raises InvalidArgument for ``keep=0`` or a
        negative ``every``. While it is on, the store's job registry
        (STORE/run/PID.autosave.SESSION.json) announces it to ``dvr serve``,
        which lists it and alerts when an autosave fails or is late.
        """
        seconds = every.total_seconds() if isinstance(every, _dt.timedelta) else float(every)
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
            raise InvalidArgument(f"autosave: keep must be a number of snapshots >= 1, not {keep!r}")
        self._core.autosave(seconds, keep)

    def checkpoint_point(self) -> Optional[SnapshotInfo]:
        """A safe point for autosave: call it where the regions are consistent
        (between time steps, after a cell). Costs a clock read when nothing is
        due; returns the autosave taken, if one was (the GIL is released meanwhile)."""
        d = self._core.checkpoint_point()
        return None if d is None else SnapshotInfo._from_dict(d)

    def tracking(self, region: str) -> str:
        """The change-tracking mechanism in use for ``region``: "write_protect" or "hash"."""
        with self._finding_region(region):
            return str(self._core.tracking(region))

    def tracking_note(self) -> str:
        """Why write_protect tracking is not in use for some region ("" if it is for all)."""
        return str(self._core.tracking_note())

    def close(self) -> None:
        """Ends the session: forgets every region and releases tracked buffers;
        cancels a background snapshot. Closing twice does nothing.

        Arrays made by array() (and memoryviews from alloc()) that are still
        referenced elsewhere stay valid: their memory is freed when the last
        of them goes. Every other call on the session then raises InvalidArgument.
        """
        self._arrays.clear()
        self._core.close()
        self._layouts.clear()

    def _rewrap(self, name: str) -> None:
        layout = self._layouts[name]
        assert layout is not None  # array() records one
        dtype, shape = layout
        buf = self._core.buffer(name)
        self._arrays[name] = np.frombuffer(buf, dtype=dtype, count=math.prod(shape)).reshape(shape)


def _close_after(close: Callable[[], None], exc: Optional[BaseException], what: str) -> None:
    """``close()`` at the end of a with block: when the block raised ``exc``,
    a failure to close never replaces it (it is added to it as a note)."""
    if exc is None:
        close()
        return
    try:
        close()
    except Exception as err:
        exc.add_note(f"memdvr: closing {what} after this error also failed: "
                     f"{type(err).__name__}: {err}")


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
    """A copy-on-write view of one snapshot's regions, as numpy arrays, and of its put() objects.

    ``clone[name]`` gives a region's array; ``clone.arrays()`` all of them;
    ``clone.get(name)`` a put() object as it was in the snapshot (the live
    session is not touched). The clone's memory lives while the Clone or any
    of its arrays is referenced.
    """

    def __init__(self, core: _core.Clone, layouts: Dict[str, _Layout], writeable: bool = True):
        self._core = core
        self._layouts = layouts
        self._writeable = writeable
        self._cache: Dict[str, _Array] = {}

    def __repr__(self) -> str:
        return (f"memdvr.Clone({self.session}/{self.snapshot}, regions={self.names()}, "
                f"objects={self.objects()})")

    def __enter__(self) -> "Clone":
        return self

    def __exit__(self, exc_type: Optional[type], exc: Optional[BaseException], tb: Any) -> None:
        """Drops the clone's cached arrays (the memory goes once nothing references it)."""
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
        """Every region of the clone, the ``obj.NAME.*`` regions of put() objects included."""
        return [RegionInfo(**r) for r in self._core.regions()]

    def names(self) -> List[str]:
        """The names of the clone's own regions (not those holding put() objects: see objects())."""
        return [r["name"] for r in self._core.regions() if not _is_object_region(r["name"])]

    def objects(self) -> List[str]:
        """Names of the put() objects in the snapshot, sorted."""
        return _object_names(r["name"] for r in self._core.regions())

    def _where(self) -> str:
        return f"the clone of '{self.session}/{self.snapshot}'"

    @contextlib.contextmanager
    def _finding_region(self, name: str) -> Iterator[None]:
        try:
            yield
        except NotFound:
            regions = [r["name"] for r in self._core.regions()]
            if name in regions:
                raise
            if name in _object_names(regions):
                how = f"'{name}' is a put() object: Clone.get({name!r}) reads it"
            else:
                how = "Clone.names() lists them"
            raise NotFound(f"{self._where()} has no region '{_printable(name)}'"
                           f"{_hint(name, self.names(), how)}") from None

    def buffer(self, name: str) -> memoryview:
        """A writable (copy-on-write) memoryview onto region ``name``. Raises NotFound."""
        with self._finding_region(name):
            return self._core.buffer(name)

    def array(self, name: str, dtype: Any = None, shape: Optional[Tuple[int, ...]] = None) -> _Array:
        """Region ``name`` as a numpy array: of ``dtype``/``shape`` if given, else the
        recorded layout (uint8, flat, when none is known or the size differs)."""
        mv = self.buffer(name)
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

    def __getitem__(self, name: str) -> _Array:
        """Region ``name`` as a numpy array with its recorded layout (cached)."""
        if name not in self._cache:
            self._cache[name] = self.array(name)
        return self._cache[name]

    def arrays(self) -> Dict[str, _Array]:
        """Every region of the clone's own (not those of put() objects) as a numpy array, by name."""
        return {n: self[n] for n in self.names()}

    def get(self, name: str) -> Any:
        """put() object ``name`` as it was in the snapshot, rebuilt from a copy
        (it shares no memory with the clone or the session). Raises NotFound
        naming the closest object."""
        _check_object_name(name)
        regions = [r["name"] for r in self._core.regions()]
        if _pickle_region(name) not in regions:
            how = "Clone.objects() lists them"
            if name in regions:
                how = f"'{name}' is a region: clone[{name!r}] gives it"
            raise NotFound(f"no object '{name}' in {self._where()}"
                           f"{_hint(name, _object_names(regions), how)}")
        return _decode_object(self._core.buffer, name, self._where())


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext memdvr``: registers the ``%dvr`` line magic (see memdvr.magics)."""
    from .magics import DvrMagics  # imported here so memdvr alone never imports IPython
    ipython.register_magics(DvrMagics)
