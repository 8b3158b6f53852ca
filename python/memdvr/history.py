"""Automatic notebook history: a commit of the notebook's namespace after every cell.

:class:`NotebookHistory` is what ``%dvr auto on``, ``%dvr checkout``, ``%dvr undo``
and ``%dvr log`` (memdvr.magics) drive; it can also be used on its own with any
namespace dict and a :class:`memdvr.Session`::

    h = NotebookHistory(session, namespace)
    h.commit(cell=3, source="a = np.zeros(10**8)")   # "cell-3", or None if nothing changed
    h.checkout("cell-3")                              # the namespace as it was then

What a commit holds, per variable of the namespace (IPython's own names such as
``In``, ``Out``, ``_``, ``_i3``, ``_3`` and dunder names are left out):

- numpy arrays of at least 64 KiB (C-contiguous, writable, no Python objects
  inside) become session regions, tracked in place: a commit reads only the
  pages written since the previous commit or checkout, and a checkout writes
  the old values back into the same array object when it still has the same
  dtype and shape. An array that only the namespace references is first moved
  into page-aligned memory of the same dtype, shape and values (``id()``
  changes, nothing else), so each written page costs one stored page.
- views onto such an array (slices, reshapes, transposes) are recorded as views:
  after a checkout they are views onto the restored array again.
- modules are recorded by name and imported again by a checkout.
- functions and classes defined by a ``def``/``class`` statement of a cell
  while the history was on are recorded by their source and defined again by a
  checkout that needs them (also after a kernel restart).
- everything else that pickles is stored with :meth:`Session.put` (pickle
  protocol 5, large buffers out of band, deduplicated page by page by the
  store); it is re-pickled after every cell to see whether it changed.
- what does not pickle (lambdas, generators, open files, ...) is listed as
  skipped, with a note printed once per variable; a checkout leaves such a
  variable as it is.

Each commit also stores a small object ``dvr-history`` with the cell's number
and source, the variable map and the fingerprints, so that ``checkout`` needs
nothing but the store (a new kernel can check out any past commit).
"""

from __future__ import annotations

import ast
import dataclasses
import datetime as _dt
import difflib
import hashlib
import html
import importlib
import math
import mmap
import pickle
import re
import struct
import sys
import textwrap
import time
import types
import weakref
from typing import (Any, Callable, Dict, Iterator, List, MutableMapping, Optional, Sequence,
                    Set, TextIO, Tuple)

import numpy as np

from . import (_OBJ_MAGIC, DvrError, NotFound, Session, SnapshotInfo,
               Store, _is_object_region, _pickle_region, _printable)

__all__ = ["NotebookHistory", "NotebookSnapshot", "SnapshotTable", "HistoryLog", "LogEntry",
           "VariableInfo", "SnapshotDetail", "VariableDiff", "DiffTable", "AutoStatus",
           "HistoryError", "META_OBJECT", "TRACK_MIN_BYTES", "LABEL_MAX_CHARS"]

#: The object each commit stores with the history's own metadata ('-' keeps it
#: apart from Python identifiers, so no variable can take its name).
META_OBJECT = "dvr-history"
#: The metadata object of manual ``%dvr snapshot`` snapshots (hidden like META_OBJECT).
MANUAL_META_OBJECT = "dvr-magics"
_FORMAT = 1
#: Arrays smaller than this are pickled with the other objects instead of tracked.
TRACK_MIN_BYTES = 64 << 10
#: Commit labels hold the cell's source on one line, cut to this many characters.
LABEL_MAX_CHARS = 80
_PAGE = mmap.PAGESIZE
_IPYTHON_NAME = re.compile(r"_+|_i+|_i?[0-9]+|_[iod]h|_oh|In|Out|exit|quit|get_ipython|__.*__")
_OBJ_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}")
_CELL_NAME = re.compile(r"cell-([0-9]+)(?:\.([0-9]+))?")

# One variable's entry in a commit (tuples of plain values, pickled in the metadata):
#   ("array", REGION)                             a tracked array, region REGION
#   ("view", REGION, OFFSET, SHAPE, STRIDES, DTYPE) a view onto region REGION
#   ("object", OBJECT)                            stored with put(OBJECT)
#   ("module", MODULE)                            import MODULE
#   ("source", SOURCE)                            a def/class statement
Entry = Tuple[Any, ...]


class HistoryError(DvrError):
    """A history operation that cannot be done as asked (the message says what to do)."""

    code = "invalid_argument"



def _region_diff(store: Store, sa: str, a: str, sb: str, b: str) -> List[Dict[str, Any]]:
    """Per-region differences with the store's own region names (obj.* included):
    the history maps regions to its variables itself, so it reads the rows
    before Store.diff folds put() objects into one row each."""
    return list(store._core.diff(sa, a, sb, b))

def _oneline(text: str, limit: int = LABEL_MAX_CHARS) -> str:
    """``text`` on one line (its lines joined by " ⏎ "), escaped as every text
    output is (_printable), cut to ``limit`` characters."""
    flat = " ⏎ ".join(" ".join(line.split()) for line in text.strip().split("\n") if line.strip())
    flat = _printable(flat)
    return flat if len(flat) <= limit else flat[:limit - 1] + "…"


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _aligned_empty(shape: Tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    """An uninitialised C-contiguous array whose data starts on a page boundary."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + _PAGE, np.uint8)
    start = (-raw.ctypes.data) % _PAGE
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _trackable(val: Any) -> bool:
    # Exactly ndarray: a subclass (np.memmap, np.matrix, masked arrays) keeps
    # its type and behaviour only through pickling.
    return (type(val) is np.ndarray and not val.dtype.hasobject and val.flags.c_contiguous
            and val.flags.writeable and val.nbytes >= TRACK_MIN_BYTES)


def _read_object(store: Store, session: str, snapshot: str, obj: str) -> Any:
    """Object ``obj`` as stored in ``session/snapshot``, without restoring anything
    (NotFound when the snapshot has no such object)."""
    return store.open_snapshot(session, snapshot, verify=False).get(obj)


def _fingerprint(val: Any) -> Tuple[str, int]:
    """(hash of the pickle of ``val``, its size in bytes); raises what pickling raises."""
    h = hashlib.blake2b(digest_size=16)
    total = 0

    def keep(pb: pickle.PickleBuffer) -> None:
        nonlocal total
        try:
            m = pb.raw()
        except BufferError:
            m = memoryview(bytes(pb))
        h.update(m)
        total += m.nbytes

    stream = pickle.dumps(val, protocol=5, buffer_callback=keep)
    h.update(stream)
    return h.hexdigest(), total + len(stream)


def _definitions(source: str) -> Dict[str, str]:
    """Top-level ``def``/``class`` statements of ``source`` by name (with decorators)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return {}
    lines = source.splitlines(keepends=True)
    defs = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            end = node.end_lineno or node.lineno
            defs[node.name] = textwrap.dedent("".join(lines[first - 1:end]))
    return defs


# ------------------------------------------------------------ results

@dataclasses.dataclass(frozen=True)
class VariableInfo:
    """One variable of a commit: ``kind`` is array, view, object, module, source
    (a function or class defined again from its source) or skipped (not captured;
    ``note`` says why); ``size`` its bytes (pickle size for objects, 0 if unknown);
    ``change`` what the commit did to it against its parent: new, changed,
    unchanged or removed; ``bytes_changed`` the bytes that differ (arrays:
    page-exact, from the store; objects: their whole size when changed)."""

    name: str
    kind: str
    size: int
    change: str
    bytes_changed: int
    note: str = ""


@dataclasses.dataclass(frozen=True)
class NotebookSnapshot:
    """A snapshot of the notebook's session as ``%dvr ls`` lists it: the store's
    :class:`SnapshotInfo` (``info``), its variables, the cell number it was
    committed after (None for other snapshots), the cell's source, the label
    shown, and whether it is the HEAD (what the namespace was committed or
    restored as last). Listing reads no snapshot data: for commits made or
    read by this kernel, ``variables`` and ``source`` come from the history's
    metadata; for others (a new kernel) ``variables`` are the arrays and
    objects held in regions and ``source`` is "" (``%dvr info`` reads it all)."""

    info: SnapshotInfo
    variables: Tuple[str, ...]
    cell: Optional[int]
    source: str
    head: bool
    label: str

    @property
    def name(self) -> str:
        """The snapshot's name."""
        return self.info.name

    @property
    def parent(self) -> str:
        """The snapshot it was taken after ("" for none)."""
        return self.info.parent

    @property
    def time(self) -> _dt.datetime:
        """When it was committed (UTC)."""
        return _dt.datetime.fromtimestamp(self.info.time_ns / 1e9, tz=_dt.timezone.utc)

    @property
    def stored_bytes(self) -> int:
        """Bytes it added to the store."""
        return self.info.stored_bytes

    @property
    def logical_bytes(self) -> int:
        """The size of everything it holds."""
        return self.info.logical_bytes


def _head_mark(is_head: bool) -> str:
    return "  <- HEAD" if is_head else ""


class SnapshotTable(Sequence[NotebookSnapshot]):
    """What ``%dvr ls`` returns: the session's snapshots, oldest first, as a
    sequence of :class:`NotebookSnapshot`; shown as a table (text and HTML)."""

    def __init__(self, session: str, store: str, items: List[NotebookSnapshot]) -> None:
        self.session = session
        self.store = store
        self._items = items

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, str):
            for it in self._items:
                if it.name == i:
                    return it
            raise KeyError(i)
        return self._items[i]

    def names(self) -> List[str]:
        """The snapshots' names, oldest first."""
        return [i.name for i in self._items]

    def __repr__(self) -> str:
        if not self._items:
            return f"no snapshots in session '{self.session}' ({self.store})"
        rows = [f"{'NAME':<16} {'TIME (UTC)':<19} {'SIZE':>10} {'STORED':>10}  VARIABLES / LABEL"]
        for i in self._items:
            flag = "  DAMAGED" if i.info.damaged else ""
            rows.append(f"{_oneline(i.name, 40):<16} {i.time.strftime('%Y-%m-%d %H:%M:%S'):<19} "
                        f"{_size(i.logical_bytes):>10} {_size(i.stored_bytes):>10}  "
                        f"{_oneline(' '.join(i.variables), 60)}"
                        f"{'  | ' + _oneline(i.label, 60) if i.label else ''}{flag}{_head_mark(i.head)}")
        return "\n".join(rows)

    def _repr_html_(self) -> str:
        if not self._items:
            return f"<p>{html.escape(repr(self))}</p>"
        out = [f"<table><caption>session {html.escape(self.session)} "
               f"({html.escape(self.store)})</caption><thead><tr><th>name</th><th>time (UTC)</th>"
               "<th>size</th><th>stored</th><th>variables</th><th>label</th></tr></thead><tbody>"]
        for i in self._items:
            name = html.escape(i.name) + (" <b>HEAD</b>" if i.head else "")
            if i.info.damaged:
                name += " <b>DAMAGED</b>"
            out.append(f"<tr><td>{name}</td><td>{i.time.strftime('%Y-%m-%d %H:%M:%S')}</td>"
                       f"<td>{_size(i.logical_bytes)}</td><td>{_size(i.stored_bytes)}</td>"
                       f"<td>{html.escape(' '.join(i.variables))}</td>"
                       f"<td><code>{html.escape(_oneline(i.label))}</code></td></tr>")
        out.append("</tbody></table>")
        return "".join(out)


@dataclasses.dataclass(frozen=True)
class LogEntry:
    """One line of ``%dvr log``: a snapshot, its depth in the tree (branches
    indent), the drawing before its name (``graph``) and whether it is the HEAD."""

    snapshot: NotebookSnapshot
    depth: int
    graph: str

    @property
    def name(self) -> str:
        """The snapshot's name."""
        return self.snapshot.name

    @property
    def parent(self) -> str:
        """The snapshot's parent ("" for a root)."""
        return self.snapshot.parent

    @property
    def head(self) -> bool:
        """Whether it is the HEAD."""
        return self.snapshot.head


class HistoryLog(Sequence[LogEntry]):
    """What ``%dvr log`` returns: the commit tree in drawing order (a sequence of
    :class:`LogEntry`): a line of commits stays in one column, and each branch
    after a checkout hangs off the commit it started from (├─ / └─). HEAD is marked.
    Shown as text and as an HTML table."""

    def __init__(self, session: str, entries: List[LogEntry]) -> None:
        self.session = session
        self._entries = entries

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, str):
            for e in self._entries:
                if e.name == i:
                    return e
            raise KeyError(i)
        return self._entries[i]

    @property
    def head(self) -> Optional[str]:
        """The HEAD's name (None when no listed snapshot is the HEAD)."""
        return next((e.name for e in self._entries if e.head), None)

    def children(self, name: str) -> List[str]:
        """Names of the snapshots taken right after ``name``, oldest first."""
        return [e.name for e in self._entries if e.parent == name]

    def __repr__(self) -> str:
        if not self._entries:
            return f"no snapshots in session '{self.session}'"
        width = max(len(e.graph) + len(e.name) for e in self._entries)
        return "\n".join(
            f"{e.graph}{e.name}{' ' * (width - len(e.graph) - len(e.name))}  "
            f"{_oneline(e.snapshot.label, 70)}{_head_mark(e.head)}" for e in self._entries)

    def _repr_html_(self) -> str:
        if not self._entries:
            return f"<p>{html.escape(repr(self))}</p>"
        out = ["<table><thead><tr><th style='text-align:left'>commit</th><th>time (UTC)</th>"
               "<th>stored</th><th style='text-align:left'>cell</th></tr></thead><tbody>"]
        for e in self._entries:
            style = " style='font-weight:bold'" if e.head else ""
            out.append(f"<tr{style}><td style='font-family:monospace;white-space:pre;text-align:left'>"
                       f"{html.escape(e.graph)}{html.escape(e.name)}{' ← HEAD' if e.head else ''}</td>"
                       f"<td>{e.snapshot.time.strftime('%H:%M:%S')}</td>"
                       f"<td>{_size(e.snapshot.stored_bytes)}</td>"
                       f"<td style='text-align:left'><code>{html.escape(_oneline(e.snapshot.label))}"
                       "</code></td></tr>")
        out.append("</tbody></table>")
        return "".join(out)


@dataclasses.dataclass(frozen=True)
class SnapshotDetail:
    """What ``%dvr info NAME`` returns: the store's :class:`SnapshotInfo`, the
    cell it was committed after (number and full source; None and "" if it was
    not made by the history), and its variables with kinds, sizes and what
    changed against its parent (:class:`VariableInfo`)."""

    info: SnapshotInfo
    cell: Optional[int]
    source: str
    label: str
    variables: Tuple[VariableInfo, ...]
    head: bool

    def __repr__(self) -> str:
        i = self.info
        lines = [f"snapshot {i.session}/{i.name}{_head_mark(self.head)}",
                 f"  parent   {i.parent or '(none)'}",
                 f"  time     {_dt.datetime.fromtimestamp(i.time_ns / 1e9, tz=_dt.timezone.utc):%Y-%m-%d %H:%M:%S} UTC",
                 f"  size     {_size(i.logical_bytes)}, stored {_size(i.stored_bytes)}",
                 f"  label    {_oneline(self.label, 100)}"]
        if self.cell is not None:
            lines.append(f"  cell     {self.cell}")
            lines += ["    " + _printable(line) for line in self.source.split("\n")]
        lines.append(f"  {'VARIABLE':<20} {'KIND':<8} {'SIZE':>10}  {'CHANGE':<9} {'BYTES CHANGED':>13}")
        for v in self.variables:
            note = f"  ({_oneline(v.note, 80)})" if v.note else ""
            lines.append(f"  {_oneline(v.name, 40):<20} {v.kind:<8} {_size(v.size):>10}  "
                         f"{v.change:<9} {_size(v.bytes_changed):>13}{note}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        i = self.info
        rows = "".join(
            f"<tr><td>{html.escape(v.name)}</td><td>{v.kind}</td><td>{_size(v.size)}</td>"
            f"<td>{v.change}</td><td>{_size(v.bytes_changed)}</td><td>{html.escape(v.note)}</td></tr>"
            for v in self.variables)
        src = (f"<pre>{html.escape(self.source)}</pre>" if self.source else "")
        return (f"<p><b>{html.escape(i.session)}/{html.escape(i.name)}</b>"
                f"{' (HEAD)' if self.head else ''}, parent {html.escape(i.parent or '(none)')}, "
                f"{_size(i.logical_bytes)}, stored {_size(i.stored_bytes)}<br>"
                f"label: <code>{html.escape(_oneline(self.label))}</code></p>{src}"
                "<table><thead><tr><th>variable</th><th>kind</th><th>size</th><th>change</th>"
                f"<th>bytes changed</th><th>note</th></tr></thead><tbody>{rows}</tbody></table>")


@dataclasses.dataclass(frozen=True)
class VariableDiff:
    """One variable in ``%dvr diff A B``: its size in A and B (0 where absent),
    whether it is only in one of them, and the bytes and 4 KiB pages that differ
    (summed over the regions that hold it)."""

    name: str
    size_a: int
    size_b: int
    only_in_a: bool
    only_in_b: bool
    bytes_differ: int
    pages_differ: int


class DiffTable(Sequence[VariableDiff]):
    """What ``%dvr diff A B`` returns: per-variable differences (:class:`VariableDiff`)."""

    def __init__(self, a: str, b: str, rows: List[VariableDiff]) -> None:
        self.a, self.b = a, b
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, str):
            for r in self._rows:
                if r.name == i:
                    return r
            raise KeyError(i)
        return self._rows[i]

    def __repr__(self) -> str:
        lines = [f"{'VARIABLE':<24} {'SIZE A':>12} {'SIZE B':>12} {'BYTES DIFFER':>14} {'PAGES':>8}"]
        for r in self._rows:
            note = " (only in A)" if r.only_in_a else " (only in B)" if r.only_in_b else ""
            lines.append(f"{_oneline(r.name, 40):<24} {r.size_a:>12} {r.size_b:>12} "
                         f"{r.bytes_differ:>14} {r.pages_differ:>8}{note}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{html.escape(r.name)}</td><td>{r.size_a}</td><td>{r.size_b}</td>"
            f"<td>{r.bytes_differ}</td><td>{r.pages_differ}</td>"
            f"<td>{'only in A' if r.only_in_a else 'only in B' if r.only_in_b else ''}</td></tr>"
            for r in self._rows)
        return (f"<table><caption>{html.escape(self.a)} → {html.escape(self.b)}</caption><thead><tr>"
                "<th>variable</th><th>size A</th><th>size B</th><th>bytes differ</th><th>pages</th>"
                f"<th></th></tr></thead><tbody>{rows}</tbody></table>")


@dataclasses.dataclass(frozen=True)
class AutoStatus:
    """What ``%dvr auto`` returns: whether the automatic history is on, the HEAD,
    how many commits this kernel made, the last commit's name, time taken
    (seconds, the whole post-cell hook) and stored bytes, the variables not
    captured, and the time the hook took after the last cell (commit or not)."""

    on: bool
    head: str
    commits: int
    last_commit: Optional[str]
    last_commit_seconds: float
    last_stored_bytes: int
    skipped: Tuple[str, ...]
    last_cell_seconds: float = 0.0

    def __repr__(self) -> str:
        if not self.on and not self.head:
            return "automatic history is off (`%dvr auto on` turns it on)"
        last = (f"; last commit {self.last_commit}: {self.last_commit_seconds * 1e3:.1f} ms, "
                f"{_size(self.last_stored_bytes)} stored" if self.last_commit else "")
        skipped = f"; not captured: {', '.join(self.skipped)}" if self.skipped else ""
        return (f"automatic history is {'on' if self.on else 'off'}: HEAD {self.head or '(none)'}, "
                f"{self.commits} commit(s) in this kernel{last}{skipped}")


# ------------------------------------------------------------ the history

@dataclasses.dataclass
class _State:
    """The namespace as one commit recorded it."""

    entries: Dict[str, Entry]
    fps: Dict[str, str]
    sizes: Dict[str, int]
    skipped: Dict[str, str]
    regions: Dict[str, Tuple[str, Tuple[int, ...]]]


class NotebookHistory:
    """Commits of a namespace into ``session`` after each cell, and checkouts of them.

    ``namespace`` is the dict the cells run in (IPython's ``user_ns``);
    ``is_hidden(name)`` says which names are the shell's own (always skipped
    too: IPython's output cache names and dunders); notes (unpicklable
    variables) go to ``out``. The history owns every region of the session:
    nothing else may track, allocate or put into it meanwhile. With
    ``take_over=False`` it only reads (ls, log, detail, diff, meta, resolve) and
    leaves the session's regions alone.
    """

    def __init__(self, session: Session, namespace: MutableMapping[str, Any], *,
                 is_hidden: Callable[[str], bool] = lambda name: False,
                 out: Optional[TextIO] = None, take_over: bool = True) -> None:
        self._s = session
        self._ns = namespace
        self._is_hidden = is_hidden
        self._out = out if out is not None else sys.stdout
        self._regions: Dict[str, np.ndarray[Any, Any]] = {}  # region -> the array tracked as it
        self._state = _State({}, {}, {}, {}, {})
        self._noted: Set[Tuple[str, str]] = set()
        self._defs: Dict[str, Tuple[Any, str]] = {}  # name -> (weakref to the object, its source)
        self._names: Optional[Set[str]] = None
        self._meta_cache: Dict[Tuple[str, int], Optional[Dict[str, Any]]] = {}
        self.commits = 0
        self.last_commit: Optional[str] = None
        self.last_commit_seconds = 0.0
        self.last_stored_bytes = 0
        self.last_restore_seconds = 0.0
        self.last_cell_seconds = 0.0
        self._define_error = ""
        if not take_over:  # a reader only (ls, log, info, diff): the regions are someone else's
            return
        for r in session.regions():  # left by someone else: the history starts from nothing
            if not _is_object_region(r.name):
                session.untrack(r.name)
        for obj in session.objects():
            session.delete(obj)

    @property
    def session(self) -> Session:
        """The session the commits go into."""
        return self._s

    @property
    def head(self) -> str:
        """The commit the namespace was committed or checked out as last ("" if none)."""
        return self._s.head

    @property
    def skipped(self) -> Dict[str, str]:
        """Variables the HEAD state did not capture, with why."""
        return dict(self._state.skipped)

    # -------------------------------------------------------- names

    def _user_var(self, name: str) -> bool:
        return not (_IPYTHON_NAME.fullmatch(name) or self._is_hidden(name))

    def _snapshot_names(self) -> Set[str]:
        if self._names is None:
            self._names = {i.name for i in self._s.list()}
        return self._names

    def commit_name(self, cell: Optional[int]) -> str:
        """The name the next commit after cell ``cell`` gets: ``cell-N``, or
        ``cell-N.K`` (K = 2, 3, ...) when ``cell-N`` exists already (the kernel
        was restarted, so IPython counts cells from 1 again)."""
        base = f"cell-{cell}" if cell is not None else "commit"
        taken = self._snapshot_names()
        if base not in taken:
            return base
        k = 2
        while f"{base}.{k}" in taken:
            k += 1
        return f"{base}.{k}"

    def resolve(self, ref: str) -> str:
        """The snapshot ``ref`` names: a snapshot name, ``HEAD``, or a cell number N
        (``cell-N``, else the newest ``cell-N.K``). Raises NotFound with the closest names."""
        names = self._snapshot_names()
        if ref in names:
            return ref
        if ref == "HEAD":
            if not self.head:
                raise NotFound(f"no HEAD yet in session '{self._s.name}': no commit was made or "
                               "checked out in this kernel")
            return self.head
        if ref.isdigit():
            cands = sorted((n for n in names if (m := _CELL_NAME.fullmatch(n)) and m.group(1) == ref),
                           key=lambda n: int(_CELL_NAME.fullmatch(n).group(2) or 1))  # type: ignore[union-attr]
            if cands:
                return cands[-1]
        close = difflib.get_close_matches(f"cell-{ref}" if ref.isdigit() else ref, sorted(names), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise NotFound(f"no snapshot '{ref}' in session '{self._s.name}' of store "
                       f"{self._s.store.path}{hint} (`%dvr log` shows the commits)")

    def _region_name(self, var: str, taken: Set[str]) -> str:
        base = var if re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,100}", var) else \
            "v-" + hashlib.sha1(var.encode()).hexdigest()[:20]
        name, k = base, 2
        while name in taken or name.startswith("obj."):
            name, k = f"{base}-{k}", k + 1
        return name

    @staticmethod
    def _object_name(var: str) -> str:
        return var if _OBJ_NAME.fullmatch(var) else "v-" + hashlib.sha1(var.encode()).hexdigest()[:20]

    # -------------------------------------------------------- scanning the namespace

    def _note(self, var: str, why: str) -> None:
        if (var, why) not in self._noted:
            self._noted.add((var, why))
            print(f"memdvr: not captured: '{var}' ({why}); a checkout leaves it as it is",
                  file=self._out)

    def _view_of(self, val: np.ndarray[Any, Any],
                 regions: Dict[str, np.ndarray[Any, Any]]) -> Optional[Entry]:
        if val.nbytes == 0:
            return None
        lo, hi = np.byte_bounds(val)
        for r, arr in regions.items():
            base = arr.ctypes.data
            if base <= lo and hi <= base + arr.nbytes:
                return ("view", r, val.ctypes.data - base, tuple(val.shape), tuple(val.strides),
                        val.dtype.str)
        return None

    def _source_of(self, var: str, val: Any) -> Optional[str]:
        if not isinstance(val, (types.FunctionType, type)) or getattr(val, "__name__", "") != var \
                or getattr(val, "__module__", None) != "__main__":
            return None
        known = self._defs.get(var)
        if known is not None and known[0]() is val:
            return known[1]
        return None

    def _scan(self) -> Tuple[_State, Dict[str, Any], Dict[str, np.ndarray[Any, Any]]]:
        """The namespace's state now, the objects to put (changed or new) and the
        arrays to track anew (region -> array)."""
        ns, old = self._ns, self._state
        names = [v for v in list(ns) if isinstance(v, str) and self._user_var(v)]
        st = _State({}, {}, {}, {}, {})
        by_id = {id(a): r for r, a in self._regions.items()}
        new_regions: Dict[str, np.ndarray[Any, Any]] = {}
        pending: List[str] = []
        others: List[str] = []
        for var in names:
            val = ns[var]
            if type(val) is np.ndarray and not val.dtype.hasobject:
                r = by_id.get(id(val))
                if r is not None and self._regions[r] is val:
                    st.entries[var] = ("array", r)
                    st.sizes[var] = val.nbytes
                else:
                    pending.append(var)
            else:
                others.append(var)
            del val
        # Largest first, so that an array is tracked before the views onto it.
        pending.sort(key=lambda v: (-int(ns[v].nbytes), not ns[v].flags.c_contiguous))
        avail = -1
        for var in pending:
            val = ns[var]
            view = self._view_of(val, {**self._regions, **new_regions})
            if view is not None:
                st.entries[var] = view
                st.sizes[var] = val.nbytes
            elif _trackable(val):
                r = self._region_name(var, set(self._regions) | set(new_regions))
                if val.ctypes.data % _PAGE and sys.getrefcount(val) <= 3:
                    # Only the namespace holds it (and `val` here): move it to
                    # page-aligned memory unless that would take over half the free memory.
                    if avail < 0:
                        avail = _mem_available()
                    if val.nbytes * 2 < avail:
                        moved = _aligned_empty(tuple(val.shape), val.dtype)
                        moved[...] = val
                        ns[var] = val = moved
                new_regions[r] = val
                st.entries[var] = ("array", r)
                st.sizes[var] = val.nbytes
            else:
                others.append(var)
            del val
        puts: Dict[str, Any] = {}
        for var in others:
            val = ns[var]
            if isinstance(val, types.ModuleType):
                st.entries[var] = ("module", val.__name__)
                continue
            src = self._source_of(var, val)
            if src is not None:
                st.entries[var] = ("source", src)
                st.fps[var] = hashlib.blake2b(src.encode(), digest_size=16).hexdigest()
                st.sizes[var] = len(src)
                continue
            if isinstance(val, (types.FunctionType, type)) and getattr(val, "__module__", None) == "__main__":
                st.skipped[var] = (f"{'class' if isinstance(val, type) else 'function'} without "
                                   "known source: defined before `%dvr auto on` or not by a "
                                   "def/class statement")
                self._note(var, st.skipped[var])
                continue
            try:
                fp, size = _fingerprint(val)
            except Exception as e:  # PicklingError, TypeError, AttributeError, ...
                st.skipped[var] = f"a {type(val).__name__} cannot be pickled: {type(e).__name__}: {e}"
                self._note(var, f"a {type(val).__name__} cannot be pickled")
                continue
            obj = self._object_name(var)
            st.entries[var] = ("object", obj)
            st.fps[var] = fp
            st.sizes[var] = size
            if old.fps.get(var) != fp or old.entries.get(var) != st.entries[var]:
                puts[obj] = val
        st.entries = {v: st.entries[v] for v in names if v in st.entries}  # namespace order
        used = {e[1] for e in st.entries.values() if e[0] in ("array", "view")}
        for region in used:
            arr = self._regions.get(region, new_regions.get(region))
            assert arr is not None
            st.regions[region] = (arr.dtype.str, tuple(arr.shape))
        return st, puts, {r: a for r, a in new_regions.items() if r in used}

    # -------------------------------------------------------- commit

    def _meta(self, st: _State, cell: Optional[int], source: str) -> Dict[str, Any]:
        return {"format": _FORMAT, "cell": cell, "source": source, "entries": st.entries,
                "fps": st.fps, "sizes": st.sizes, "skipped": st.skipped, "regions": st.regions}

    def learn_definitions(self, source: str) -> None:
        """Records the ``def``/``class`` statements of a cell that just ran, so
        that the functions and classes it defined are captured by their source."""
        for name, src in _definitions(source).items():
            val = self._ns.get(name)
            if isinstance(val, (types.FunctionType, type)) and getattr(val, "__name__", "") == name:
                try:
                    self._defs[name] = (weakref.ref(val), src)
                except TypeError:
                    pass

    def commit(self, cell: Optional[int] = None, source: str = "", *,
               name: Optional[str] = None, label: Optional[str] = None,
               force: bool = False) -> Optional[SnapshotInfo]:
        """Commits the namespace if it changed since the HEAD (or ``force``), as
        ``name`` or :meth:`commit_name` ``(cell)``, labelled with the source on
        one line (cut to LABEL_MAX_CHARS) unless ``label`` is given. Returns the
        new snapshot's info, or None when nothing changed (then nothing is kept)."""
        t0 = time.perf_counter()
        self.learn_definitions(source)
        st, puts, new_regions = self._scan()
        old = self._state
        changed = (force or bool(puts) or st.entries != old.entries or st.regions != old.regions
                   or st.skipped.keys() != old.skipped.keys())
        s = self._s
        # Bring the session's regions in line with the state (nothing is lost if
        # this fails half-way: the next commit starts over from the namespace).
        for r in list(self._regions):
            if r not in st.regions:
                s.untrack(r)
                del self._regions[r]
        for r, arr in new_regions.items():
            s.track(r, arr)
            self._regions[r] = arr
        live_objs = set(s.objects())
        wanted_objs = {e[1] for e in st.entries.values() if e[0] == "object"}
        for obj in live_objs - wanted_objs - {META_OBJECT}:
            s.delete(obj)
        for obj, val in puts.items():
            s.put(obj, val)
        if not changed and not self._regions:
            self._finish(t0, None, st)
            return None
        meta = self._meta(st, cell, source)
        s.put(META_OBJECT, meta)
        snap = name or self.commit_name(cell)
        parent = s.head
        text = _oneline(source) if label is None else label
        replace = name is not None and name in self._snapshot_names()
        if replace and name == parent:
            raise HistoryError(f"cannot commit as '{name}': it is the HEAD (the new commit's "
                               "parent); pick another name")
        info = s.snapshot(snap, label=text, replace=replace)
        self._snapshot_names().add(snap)
        self._meta_cache[(snap, 0)] = meta  # checkouts in this kernel read nothing back
        if not changed and parent and not self._arrays_written(info, parent):
            # Only the tracked arrays could have changed, and they did not:
            # drop the commit and go back to the parent (copies nothing).
            s.remove(snap)
            self._snapshot_names().discard(snap)
            s.restore(parent)
            self._finish(t0, None, st)
            return None
        self._finish(t0, info, st)
        return info

    def _arrays_written(self, info: SnapshotInfo, parent: str) -> bool:
        """Whether the tracked arrays changed between ``parent`` and ``info``
        (nothing else did but the history's metadata, rewritten every commit).

        With write_protect tracking a snapshot reads only the chunks with
        written pages, plus some it always reads: those holding a region's
        partial first or last page, and every chunk of a region that holds no
        whole page. If it read more chunks than the metadata's and an upper
        bound of those, something was written: changed, known without reading
        any data. Otherwise (or with hash tracking) the store's diff decides;
        it then reads at most the chunks that are always read."""
        if info.tracking == "write_protect":
            chunk = self._s.store.chunk_size
            meta_chunks = 0
            always = 0
            for r in info.regions:
                if r.name.startswith(f"obj.{META_OBJECT}."):
                    meta_chunks += -(-r.size // chunk)
                    continue
                arr = self._regions.get(r.name)
                start = arr.ctypes.data if arr is not None else 0  # SDK-owned: page-aligned
                first_page = -(-start // _PAGE) * _PAGE
                if first_page + _PAGE > start + r.size:  # no whole page: always compared
                    always += -(-r.size // chunk)
                    continue
                head, tail = start % _PAGE != 0, (start + r.size) % _PAGE != 0
                always += int(head) + int(tail) - int(head and tail and (r.size - 1) // chunk == 0)
            if info.chunks_read <= meta_chunks:
                return False
            if info.chunks_read > meta_chunks + always:
                return True
        for row in _region_diff(self._s.store, self._s.name, parent, self._s.name, info.name):
            if not _is_object_region(row["name"]) and (row["bytes_differ"] or row["only_in_a"]
                                                       or row["only_in_b"]):
                return True
        return False

    def _finish(self, t0: float, info: Optional[SnapshotInfo], st: _State) -> None:
        self._state = st
        self.last_cell_seconds = time.perf_counter() - t0
        if info is not None:
            self.commits += 1
            self.last_commit = info.name
            self.last_stored_bytes = info.stored_bytes
            self.last_commit_seconds = self.last_cell_seconds

    # -------------------------------------------------------- reading commits

    def meta(self, name: str) -> Optional[Dict[str, Any]]:
        """The history's metadata stored in snapshot ``name`` (None for a snapshot
        the history did not take). Raises NotFound."""
        key = (name, 0)
        if key not in self._meta_cache:
            try:
                self._meta_cache[key] = _read_object(self._s.store, self._s.name, name, META_OBJECT)
            except NotFound:
                self._s.info(name)  # NotFound for the snapshot itself
                self._meta_cache[key] = None
        return self._meta_cache[key]

    def _variables_of(self, info: SnapshotInfo, meta: Optional[Dict[str, Any]]) -> Tuple[str, ...]:
        if meta is not None:
            return tuple(meta["entries"])
        hidden = {_pickle_region(META_OBJECT), _pickle_region(MANUAL_META_OBJECT)}
        names = [r.name for r in info.regions if not _is_object_region(r.name)]
        names += [r.name[4:-7] for r in info.regions if _is_object_region(r.name)
                  and r.name.endswith(".pickle") and r.name not in hidden]
        return tuple(names)

    def _snapshot(self, info: SnapshotInfo, labels: Dict[str, str]) -> NotebookSnapshot:
        # Only metadata read before: reading it means mapping the snapshot, too
        # slow to do for every commit of a big namespace. Without it, the
        # variables are those held in regions (arrays and objects).
        meta = self._meta_cache.get((info.name, 0))
        m = _CELL_NAME.fullmatch(info.name)
        return NotebookSnapshot(info=info, variables=self._variables_of(info, meta),
                                cell=meta["cell"] if meta else int(m.group(1)) if m else None,
                                source=meta["source"] if meta else "",
                                head=info.name == self.head, label=labels.get(info.name, info.label))

    def ls(self, labels: Optional[Dict[str, str]] = None) -> SnapshotTable:
        """The session's snapshots, oldest first (``labels`` override stored labels)."""
        infos = self._s.list()
        self._names = {i.name for i in infos}
        return SnapshotTable(self._s.name, self._s.store.path,
                             [self._snapshot(i, labels or {}) for i in infos])

    def log(self, labels: Optional[Dict[str, str]] = None) -> HistoryLog:
        """The commit tree (see :class:`HistoryLog`)."""
        snaps = list(self.ls(labels))
        names = {s.name for s in snaps}
        kids: Dict[str, List[NotebookSnapshot]] = {}
        roots: List[NotebookSnapshot] = []
        for sn in snaps:  # oldest first, so children come out oldest first
            if sn.parent and sn.parent in names and sn.parent != sn.name:
                kids.setdefault(sn.parent, []).append(sn)
            else:
                roots.append(sn)
        entries: List[LogEntry] = []
        # (snapshot, prefix of its own line, prefix of the lines under it, depth)
        stack: List[Tuple[NotebookSnapshot, str, str, int]] = [
            (r, "", "", 0) for r in reversed(roots)]
        while stack:
            sn, first, rest, depth = stack.pop()
            entries.append(LogEntry(sn, depth, first))
            children = kids.get(sn.name, [])
            if len(children) == 1:
                stack.append((children[0], rest, rest, depth))
            else:
                for k in reversed(range(len(children))):
                    last = k == len(children) - 1
                    stack.append((children[k], rest + ("└─ " if last else "├─ "),
                                  rest + ("   " if last else "│  "), depth + 1))
        return HistoryLog(self._s.name, entries)

    def detail(self, ref: str, labels: Optional[Dict[str, str]] = None) -> SnapshotDetail:
        """Snapshot ``ref`` with its variables and what changed against its parent."""
        name = self.resolve(ref)
        info = self._s.info(name)
        meta = self.meta(name)
        label = (labels or {}).get(name, info.label)
        pmeta: Optional[Dict[str, Any]] = None
        rows: Dict[str, Any] = {}
        if info.parent:
            try:
                pmeta = self.meta(info.parent)
                rows = {r["name"]: r for r in _region_diff(self._s.store, self._s.name, info.parent,
                                                                self._s.name, name)}
            except NotFound:
                pmeta = None
        variables: List[VariableInfo] = []
        if meta is None:
            # Taken without the history's metadata (`%dvr snapshot NAME VAR...`):
            # what the regions say. An array is its region; an object its
            # pickle and out-of-band buffers.
            sizes: Dict[str, int] = {r.name: int(r.size) for r in info.regions}
            for v in self._variables_of(info, None):
                if v in sizes:
                    variables.append(VariableInfo(v, "array", sizes[v], "", 0))
                else:
                    prefix = f"obj.{v}."
                    size = sum(n for r, n in sizes.items() if r.startswith(prefix) and _is_object_region(r))
                    variables.append(VariableInfo(v, "object", size, "", 0))
            return SnapshotDetail(info, None, "", label, tuple(variables), name == self.head)
        pe: Dict[str, Entry] = pmeta["entries"] if pmeta else {}
        pf: Dict[str, str] = pmeta["fps"] if pmeta else {}
        for var, e in meta["entries"].items():
            size = int(meta["sizes"].get(var, 0))
            if var not in pe:
                change, nbytes = ("new", size) if info.parent else ("new", size)
            elif e[0] == "view":
                base = next((v for v, x in meta["entries"].items() if x == ("array", e[1])), e[1])
                variables.append(VariableInfo(var, "view", size, "unchanged" if pe[var] == e else "changed",
                                              0, f"a view onto '{base}': its bytes change with it"))
                continue
            elif e[0] == "array":
                row = rows.get(e[1])
                differ = int(row["bytes_differ"]) if row else 0
                same_binding = pe[var] == e
                change = "changed" if differ or not same_binding else "unchanged"
                nbytes = differ if same_binding else size
            else:
                same = pe[var] == e and pf.get(var) == meta["fps"].get(var)
                change, nbytes = ("unchanged", 0) if same else ("changed", size)
            variables.append(VariableInfo(var, e[0], size, change, nbytes))
        for var, why in meta["skipped"].items():
            variables.append(VariableInfo(var, "skipped", 0, "", 0, why))
        for var in pe:
            if var not in meta["entries"]:
                variables.append(VariableInfo(var, pe[var][0], int(pmeta["sizes"].get(var, 0)) if pmeta else 0,
                                              "removed", 0))
        return SnapshotDetail(info, meta["cell"], meta["source"], label, tuple(variables),
                              name == self.head)

    def diff(self, a: str, b: str) -> DiffTable:
        """Per-variable differences between snapshots ``a`` and ``b``."""
        na, nb = self.resolve(a), self.resolve(b)
        owner: Dict[str, str] = {}
        for n in (na, nb):
            meta = self.meta(n)
            if meta is None:
                continue
            for var, e in meta["entries"].items():
                if e[0] == "array":
                    owner.setdefault(e[1], var)
                elif e[0] == "object":
                    owner.setdefault(_pickle_region(e[1]), var)
        hidden = (f"obj.{META_OBJECT}.", f"obj.{MANUAL_META_OBJECT}.")
        acc: Dict[str, List[int]] = {}
        for row in _region_diff(self._s.store, self._s.name, na, self._s.name, nb):
            region = row["name"]
            if region.startswith(hidden):
                continue
            m = re.fullmatch(r"obj\.(.+?)\.(?:pickle|buf\.[0-9]+)", region)
            if m:
                var = owner.get(_pickle_region(m.group(1)), m.group(1))
            else:
                var = owner.get(region, region)
            a_ = acc.setdefault(var, [0, 0, 1, 1, 0, 0])
            a_[0] += row["size_a"]
            a_[1] += row["size_b"]
            a_[2] &= int(bool(row["only_in_a"]))
            a_[3] &= int(bool(row["only_in_b"]))
            a_[4] += row["bytes_differ"]
            a_[5] += row["pages_differ"]
        return DiffTable(na, nb, [VariableDiff(v, x[0], x[1], bool(x[2]), bool(x[3]), x[4], x[5])
                                  for v, x in acc.items()])

    # -------------------------------------------------------- checkout

    def checkout(self, ref: str) -> Tuple[str, List[str]]:
        """Restores the namespace to commit ``ref`` (a name or a cell number):
        variables it holds get their values back (tracked arrays in place when
        their dtype and shape are the same), variables created since are deleted,
        variables it skipped are left as they are. The HEAD becomes that commit;
        the next commit starts a branch from it. Returns (name, notes)."""
        name = self.resolve(ref)
        meta = self.meta(name)
        if meta is None:
            raise HistoryError(
                f"snapshot '{name}' was not taken by the automatic history (no {META_OBJECT} "
                f"object); restore it with `%dvr restore {name}` after `%dvr auto off`")
        if meta.get("format") != _FORMAT:
            raise HistoryError(f"snapshot '{name}' has history format {meta.get('format')}, "
                               f"this memdvr reads format {_FORMAT}")
        s, ns = self._s, self._ns
        want: Dict[str, Tuple[str, Tuple[int, ...]]] = meta["regions"]
        for r in list(self._regions):
            arr = self._regions[r]
            if r not in want or (arr.dtype.str, tuple(arr.shape)) != tuple(want[r]):
                s.untrack(r)
                del self._regions[r]
        in_place = set(self._regions)
        try:
            for r, (dtype, shape) in want.items():
                if r not in self._regions:
                    arr = _aligned_empty(tuple(shape), np.dtype(dtype))
                    s.track(r, arr)
                    self._regions[r] = arr
            t0 = time.perf_counter()
            s.restore(name)
            self.last_restore_seconds = time.perf_counter() - t0
        except BaseException:
            # The namespace is untouched; the next commit tracks it anew.
            for r in list(self._regions):
                if r not in in_place:
                    s.untrack(r)
                    del self._regions[r]
            self._state = _State({}, {}, {}, {}, {})
            raise
        notes: List[str] = []
        entries: Dict[str, Entry] = meta["entries"]
        values: Dict[str, Any] = {}
        later: List[Tuple[str, str]] = []
        for var, e in entries.items():
            kind = e[0]
            if kind == "array":
                values[var] = self._regions[e[1]]
            elif kind == "view":
                _, r, offset, shape, strides, dtype = e
                values[var] = np.ndarray(tuple(shape), np.dtype(dtype), buffer=self._regions[r],
                                         offset=offset, strides=tuple(strides))
            elif kind == "module":
                try:
                    values[var] = importlib.import_module(e[1])
                except ImportError as ex:
                    notes.append(f"module '{var}' ({e[1]}) cannot be imported: {ex}")
            elif kind == "source":
                cur = ns.get(var)
                if self._state.fps.get(var) == meta["fps"].get(var) and self._source_of(var, cur):
                    values[var] = cur
                else:
                    later.append((var, e[1]))
        # Definitions first (instances of a class defined in a cell need it to
        # unpickle), then the objects, then definitions that needed the objects.
        retry: List[Tuple[str, str]] = []
        for var, src in later:
            if not self._define(var, src, name, values):
                retry.append((var, src))
        for var, e in entries.items():
            if e[0] == "object":
                try:
                    values[var] = s.get(e[1])
                except Exception as ex:
                    notes.append(f"'{var}' cannot be unpickled: {type(ex).__name__}: {ex}")
        for var, src in retry:
            if not self._define(var, src, name, values):
                notes.append(f"'{var}' could not be defined again from its source: "
                             f"{self._define_error}")
        removed = [v for v in list(ns) if isinstance(v, str) and self._user_var(v)
                   and v not in values and v not in meta["skipped"]]
        for var in removed:
            del ns[var]
        if removed:
            notes.append(f"removed (not in {name}): {', '.join(removed)}")
        ns.update(values)
        kept = [v for v in meta["skipped"] if v in ns]
        if kept:
            notes.append(f"left as they are (not captured by {name}): {', '.join(kept)}")
        missing = [v for v in meta["skipped"] if v not in ns]
        if missing:
            notes.append(f"not captured by {name} and not defined now: {', '.join(missing)}")
        # Skipped variables that are not defined now are not part of the state
        # (the next cell would otherwise look like a change).
        self._state = _State(dict(entries), dict(meta["fps"]), dict(meta["sizes"]),
                             {v: why for v, why in meta["skipped"].items() if v in ns}, dict(want))
        return name, notes

    def _define(self, var: str, src: str, commit: str, values: Dict[str, Any]) -> bool:
        """Runs a def/class statement in the namespace; False (and why in
        ``_define_error``) if it raised."""
        try:
            exec(compile(src, f"<memdvr {commit}: {var}>", "exec"), self._ns)  # type: ignore[arg-type]
        except Exception as ex:
            self._define_error = f"{type(ex).__name__}: {ex}"
            return False
        values[var] = self._ns[var]
        self._defs[var] = (weakref.ref(self._ns[var]), src)
        return True

    def undo(self) -> Tuple[str, List[str]]:
        """Checks out the HEAD's parent (one commit back on the current branch)."""
        head = self.head
        if not head:
            raise HistoryError("nothing to undo: no commit yet in this kernel (`%dvr checkout N` "
                               "picks one from the store)")
        parent = self._s.info(head).parent
        if not parent:
            raise HistoryError(f"nothing to undo: '{head}' is the first commit of its branch")
        return self.checkout(parent)

    def remove(self, ref: str) -> str:
        """Deletes snapshot ``ref``; its children keep their data (they show as roots)."""
        name = self.resolve(ref)
        self._s.remove(name)
        self._snapshot_names().discard(name)
        self._meta_cache.pop((name, 0), None)
        return name

    def close(self) -> None:
        """Forgets every region and object of the session (the commits stay in the store)."""
        for r in list(self._regions):
            self._s.untrack(r)
        self._regions.clear()
        for obj in self._s.objects():
            self._s.delete(obj)
        self._state = _State({}, {}, {}, {}, {})

    def status(self, on: bool) -> AutoStatus:
        """The history's status (``on``: whether the magics commit after each cell)."""
        return AutoStatus(on, self.head, self.commits, self.last_commit, self.last_commit_seconds,
                          self.last_stored_bytes, tuple(self._state.skipped), self.last_cell_seconds)

    def __iter__(self) -> Iterator[NotebookSnapshot]:
        """The session's snapshots, oldest first (same as ``ls()``)."""
        return iter(self.ls())

