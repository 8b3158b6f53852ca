"""IPython/Jupyter magics for memdvr: ``%load_ext memdvr`` then ``%dvr ...``.

    %dvr auto [on|off]             automatic history: a commit of the namespace after every
                                   cell that changed it (no argument: the status)
    %dvr checkout N|NAME           the namespace as it was after cell N (or snapshot NAME)
    %dvr undo                      back one commit on the current branch
    %dvr log                       the commit tree, HEAD marked
    %%dvr trial [BASE]             (cell magic) run the cell, then restore BASE (default: HEAD),
                                   also when the cell raises
    %dvr snapshot NAME [VAR ...] [--background]
                                   snapshot notebook variables (default: the last ones; with
                                   auto on, no VARs: the whole namespace as commit NAME);
                                   --background returns at once and copies while you work on
    %dvr wait                      wait for a background snapshot and say how it went
    %dvr restore NAME              restore them into the user namespace
    %dvr ls                        this session's snapshots (a table)
    %dvr info [NAME]               a snapshot's variables, sizes and what changed (default: HEAD)
    %dvr diff A B                  per-variable differences between two snapshots
    %dvr rm NAME [NAME ...]        delete snapshots
    %dvr label NAME TEXT           set the label shown for NAME (empty TEXT: back to the stored one)
    %dvr store [PATH]              use the store in PATH (default: $MEMDVR_STORE or memdvr.default_path())
    %dvr session [NAME]            use session NAME (default "notebook")

Where a snapshot is named, N (a cell number) means cell-N and HEAD the HEAD.
A `#` outside quotes starts a comment. The automatic history is described in
memdvr.history (what is captured, and how). Without it, C-contiguous, writable
numpy arrays (without Python objects inside) are tracked in place, zero-copy,
as region VAR: a restore writes the old values back into the same array
objects. Every other object is stored with ``Session.put(VAR, obj)`` and
re-bound with ``Session.get(VAR)`` on restore. One store and session per kernel.
"""

from __future__ import annotations

import importlib
import os
import shlex
import sys
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import numpy as np

# IPython ships no type information: imported by name, its classes are Any for
# mypy whether or not it is told to ignore missing imports.
_ipython_error: Any = importlib.import_module("IPython.core.error")
_ipython_magic: Any = importlib.import_module("IPython.core.magic")
UsageError = _ipython_error.UsageError
line_cell_magic = _ipython_magic.line_cell_magic
magics_class = _ipython_magic.magics_class
if TYPE_CHECKING:
    class Magics:
        """What mypy sees of IPython's Magics."""

        shell: Any

        def __init__(self, shell: Any) -> None: ...
else:
    Magics = _ipython_magic.Magics

from . import (DvrError, NotFound, Session, Store, _is_object_region, _printable, default_path)
from .history import (MANUAL_META_OBJECT, AutoStatus, DiffTable, HistoryLog, NotebookHistory,
                      SnapshotDetail, SnapshotTable, _read_object)

_META = MANUAL_META_OBJECT
_USAGE = __doc__.split("\n\n")[1]
_LABELS = "labels"  # the object (and snapshot) holding labels set with %dvr label


def _mib(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _trackable(obj: Any) -> bool:
    return (isinstance(obj, np.ndarray) and obj.flags.c_contiguous and obj.flags.writeable
            and not obj.dtype.hasobject and obj.nbytes > 0)


@magics_class
class DvrMagics(Magics):
    """The ``%dvr`` line magic and ``%%dvr trial`` cell magic (one store and one
    session per kernel)."""

    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self._store_path: Optional[str] = None
        self._session_name = "notebook"
        self._session: Optional[Session] = None
        self._arrays: Dict[str, np.ndarray[Any, Any]] = {}  # VAR -> array tracked as region VAR
        self._last_vars: List[str] = []
        self._job: Any = None
        self._history: Optional[NotebookHistory] = None
        self._auto = False

    # ------------------------------------------------------------ helpers

    def _open(self) -> Session:
        if self._session is None:
            # Absolute once: a cell that changes the working directory must not
            # move the store (a relative path would open another one next time).
            path = self._store_path or os.path.abspath(os.path.expanduser(os.environ.get("MEMDVR_STORE") or default_path()))
            self._store_path = path
            self._session = Session(Store(path), self._session_name)
        return self._session

    def _close(self) -> None:
        self._set_auto(False)
        self._history = None
        if self._session is not None:
            self._session.close()
        self._session = None
        self._arrays.clear()

    def _untrack(self, var: str) -> None:
        if self._arrays.pop(var, None) is not None:
            assert self._session is not None
            self._session.untrack(var)

    def _hidden(self, name: str) -> bool:
        return name in self.shell.user_ns_hidden

    def _hist(self) -> NotebookHistory:
        """The history, taking the session over from manual snapshots if needed."""
        if self._history is None:
            s = self._open()
            self._arrays.clear()
            self._last_vars = []
            self._history = NotebookHistory(s, self.shell.user_ns, is_hidden=self._hidden)
        return self._history

    def _viewer(self) -> NotebookHistory:
        """The history, or a reader of the session that leaves its regions alone."""
        if self._history is not None:
            return self._history
        return NotebookHistory(self._open(), self.shell.user_ns, is_hidden=self._hidden,
                               take_over=False)

    def _drop_history(self) -> None:
        """Back to manual snapshots: the history lets go of the session's regions."""
        if self._history is not None:
            if self._auto:
                raise UsageError("the automatic history is on: `%dvr snapshot NAME` (no variables) "
                                 "commits the whole namespace; `%dvr auto off` first for "
                                 "snapshots of chosen variables")
            self._history.close()
            self._history = None

    def _labels_session(self) -> str:
        return f"{self._open().name}.labels"

    def _labels(self) -> Dict[str, str]:
        s = self._open()
        try:
            labels: Dict[str, str] = _read_object(s.store, self._labels_session(), _LABELS, _LABELS)
            return labels
        except NotFound:
            return {}

    def _resume(self, on: bool) -> None:
        """After switching store or session: the history goes on there if it was on."""
        if on:
            self._hist()
            self._set_auto(True)

    def _set_auto(self, on: bool) -> None:
        if on and not self._auto:
            self.shell.events.register("post_run_cell", self._post_run_cell)
        elif not on and self._auto:
            self.shell.events.unregister("post_run_cell", self._post_run_cell)
        self._auto = on

    def _post_run_cell(self, result: Any) -> None:
        """IPython's post_run_cell event: commits the namespace if the cell changed it."""
        if not self._auto or self._history is None:
            return
        raw = result.info.raw_cell if result.info is not None else ""
        cell = result.execution_count
        try:
            source = self.shell.transform_cell(raw)
        except Exception:
            source = raw
        try:
            self._history.learn_definitions(source)
            self._history.commit(cell, raw)
        except Exception as e:  # shown, never raised into IPython's event loop
            print(f"memdvr: cell {cell} was not committed: {type(e).__name__}: {e}",
                  file=sys.stderr)

    # ------------------------------------------------------------ the magic

    @line_cell_magic  # type: ignore[misc]
    def dvr(self, line: str, cell: Optional[str] = None) -> Any:
        """Memory DVR snapshots of notebook variables; ``%dvr`` alone prints the usage."""
        __tracebackhide__ = True  # noqa: F841  (IPython leaves this frame out of tracebacks)
        try:
            args = shlex.split(line, comments=True)
        except ValueError as e:
            raise UsageError(f"%dvr: cannot read the arguments ({e}): close the quotes") from e
        if cell is not None:
            if not args or args[0] != "trial":
                raise UsageError("the cell magic is `%%dvr trial [BASE]`")
            return self._trial(args[1:], cell)
        if not args or args[0] in ("help", "-h", "--help"):
            print(_USAGE)
            return None
        verb, rest = args[0], args[1:]
        handler = getattr(self, f"_do_{verb}", None)
        if handler is None:
            raise UsageError(f"%dvr: unknown command '{verb}'\n{_USAGE}")
        try:
            return handler(rest)
        except DvrError as e:
            raise UsageError(f"%dvr {verb}: {e}") from e

    def _do_store(self, rest: List[str]) -> None:
        if len(rest) > 1:
            raise UsageError("usage: %dvr store [PATH]")
        if rest:
            was_on = self._auto
            self._close()
            self._store_path = os.path.abspath(os.path.expanduser(rest[0]))
            self._resume(was_on)
        s = self._open()
        print(f"memdvr store {s.store.path} ({s.store.medium}), session '{s.name}'")

    def _do_session(self, rest: List[str]) -> None:
        if len(rest) > 1:
            raise UsageError("usage: %dvr session [NAME]")
        if rest:
            if len(rest[0]) > 128 - len(".labels"):
                raise UsageError(f"%dvr session: a name of at most {128 - len('.labels')} characters (the session "
                                 f"NAME.labels keeps its labels, and names have at most 128), not {len(rest[0])}")
            was_on = self._auto
            self._close()
            self._session_name = rest[0]
            self._resume(was_on)
        s = self._open()
        print(f"memdvr session '{s.name}' in store {s.store.path}")

    def _do_snapshot(self, rest: List[str]) -> None:
        background = any(a in ("--background", "-b") for a in rest)
        rest = [a for a in rest if a not in ("--background", "-b")]
        if not rest:
            raise UsageError("usage: %dvr snapshot NAME [VAR ...] [--background]")
        if self._auto and len(rest) == 1:
            info = self._hist().commit(name=rest[0], label=f"%dvr snapshot {rest[0]}", force=True)
            assert info is not None
            print(f"commit '{info.name}' of the whole namespace: {_mib(info.logical_bytes)}, "
                  f"{_mib(info.stored_bytes)} stored")
            return
        self._drop_history()
        name, names = rest[0], list(dict.fromkeys(rest[1:])) or list(self._last_vars)
        if not names:
            raise UsageError(f"%dvr snapshot {name}: name the variables to snapshot "
                             "(no earlier snapshot to take them from)")
        ns = self.shell.user_ns
        missing = [v for v in names if v not in ns]
        if missing:
            raise UsageError(f"%dvr snapshot {name}: unknown variable(s): {', '.join(missing)}")
        bad = [v for v in names if not v.isidentifier()]
        if bad:
            raise UsageError(f"%dvr snapshot {name}: not variable names: {', '.join(bad)}")
        s = self._open()
        # The session's regions become exactly the named variables.
        for var in list(self._arrays):
            if var not in names or self._arrays[var] is not ns[var]:
                self._untrack(var)  # dropped, or re-bound (maybe to another size)
        for obj_name in s.objects():
            if obj_name not in names and obj_name != _META:
                s.delete(obj_name)
        meta: Dict[str, Any] = {"arrays": {}, "objects": []}
        parts: List[str] = []
        for var in names:
            value = ns[var]
            if _trackable(value):
                if var not in self._arrays:
                    if var in s.objects():
                        s.delete(var)
                    s.track(var, value)
                    self._arrays[var] = value
                meta["arrays"][var] = (value.dtype.str, tuple(value.shape))
                parts.append(f"{var} ({_mib(value.nbytes)}, in place)")
            else:
                s.put(var, value)
                meta["objects"].append(var)
                parts.append(f"{var} (object)")
        s.put(_META, meta)
        replaced = any(i.name == name for i in s.list())
        t0 = time.perf_counter()
        label = "%dvr snapshot " + " ".join(names)
        if background:
            job = s.snapshot(name, label=label, replace=True, wait=False)
            self._last_vars = names
            if job.background:
                self._job = job
                print(f"snapshot '{name}' started in the background: {', '.join(parts)}; "
                      f"you waited {job.stall_seconds * 1e3:.1f} ms; `%dvr wait` waits for it")
                return
            info = job.wait()
            print(f"snapshot '{name}' taken at once ({job.note}): {_mib(info.logical_bytes)} "
                  f"in {job.stall_seconds * 1e3:.1f} ms")
            return
        info = s.snapshot(name, label=label, replace=True)
        dt = time.perf_counter() - t0
        self._last_vars = names
        print(f"snapshot '{name}'{' (replaced)' if replaced else ''}: {', '.join(parts)}; "
              f"{_mib(info.logical_bytes)} in {dt * 1e3:.1f} ms")

    def _do_wait(self, rest: List[str]) -> None:
        if rest:
            raise UsageError("usage: %dvr wait")
        job = self._job
        if job is None:
            print("no background snapshot was started")
            return
        t0 = time.perf_counter()
        self._job = None
        info = job.wait()
        print(f"snapshot '{info.name}' is in the store: {_mib(info.logical_bytes)}, "
              f"waited {(time.perf_counter() - t0) * 1e3:.1f} ms")

    def _meta_of(self, s: Session, name: str) -> Dict[str, Any]:
        """The magics' metadata recorded in snapshot ``name`` ({} if none)."""
        try:
            meta: Dict[str, Any] = _read_object(s.store, s.name, name, _META)
            return meta
        except NotFound:
            return {}

    def _do_restore(self, rest: List[str]) -> None:
        if len(rest) != 1:
            raise UsageError("usage: %dvr restore NAME")
        name = rest[0]
        if self._viewer().meta(name) is not None:  # NotFound with the store's message
            self._print_checkout(*self._hist().checkout(name))
            return
        self._drop_history()
        s = self._open()
        info = s.info(name)
        want = {r.name: r.size for r in info.regions if not _is_object_region(r.name)}
        ns = self.shell.user_ns
        layouts: Dict[str, Tuple[str, Tuple[int, ...]]] = {}
        if any(var not in self._arrays or self._arrays[var].nbytes != size
               for var, size in want.items()):
            layouts = self._meta_of(s, name).get("arrays", {})
        # Check everything before changing anything.
        plan: Dict[str, Optional[np.ndarray[Any, Any]]] = {}  # VAR -> array to restore into (None: keep)
        notes = []
        for var, size in want.items():
            cur = self._arrays.get(var)
            if cur is not None and cur.nbytes == size:
                plan[var] = None
                continue
            val = ns.get(var)
            if cur is None and val is not None and _trackable(val) and val.nbytes == size and (
                    var not in layouts or np.dtype(layouts[var][0]) == val.dtype):
                plan[var] = val.reshape(layouts[var][1]) if var in layouts else val
                continue
            if var not in layouts:
                have = "no array" if cur is None else f"{cur.nbytes} bytes"
                raise UsageError(
                    f"%dvr restore {name}: array '{var}' has {size} bytes in the snapshot but "
                    f"{have} here, and the snapshot does not record its dtype/shape; re-bind "
                    f"'{var}' to a C-contiguous array of {size} bytes and retry")
            dtype, shape = np.dtype(layouts[var][0]), tuple(layouts[var][1])
            plan[var] = np.empty(shape, dtype)
            if cur is not None:
                notes.append(f"note: '{var}' is {_mib(cur.nbytes)} now but {_mib(size)} in "
                             f"snapshot '{name}': restored into a new {dtype} array of shape "
                             f"{shape}, not in place")
        for var in list(self._arrays):
            if var not in want or plan.get(var) is not None:
                self._untrack(var)
        for var, arr in plan.items():
            if arr is not None:
                s.track(var, arr)
                self._arrays[var] = arr
        t0 = time.perf_counter()
        s.restore(name)
        dt = time.perf_counter() - t0
        parts = []
        for var in want:
            ns[var] = self._arrays[var]
            parts.append(f"{var} ({_mib(self._arrays[var].nbytes)}"
                         f"{', in place' if plan[var] is None else ''})")
        for obj_name in s.objects():
            if obj_name != _META:
                ns[obj_name] = s.get(obj_name)
                parts.append(f"{obj_name} (object)")
        self._last_vars = list(want) + [o for o in s.objects() if o != _META]
        for note in notes:
            print(note)
        print(f"restored '{name}' in {dt * 1e3:.1f} ms: {', '.join(parts)}")

    # ------------------------------------------------------------ history and listings

    def _print_checkout(self, name: str, notes: List[str]) -> None:
        h = self._hist()
        for note in notes:
            print(f"note: {note}")
        print(f"HEAD is now {name} (restored in {h.last_restore_seconds * 1e3:.1f} ms)"
              + ("" if self._auto else "; `%dvr auto on` records the next cells from here"))

    def _do_auto(self, rest: List[str]) -> AutoStatus:
        if len(rest) > 1 or (rest and rest[0] not in ("on", "off", "status")):
            raise UsageError("usage: %dvr auto [on|off|status]")
        if rest and rest[0] == "on":
            self._hist()
            self._set_auto(True)
        elif rest and rest[0] == "off":
            self._set_auto(False)
        if self._history is None:
            return AutoStatus(False, "", 0, None, 0.0, 0, ())
        return self._history.status(self._auto)

    def _do_checkout(self, rest: List[str]) -> None:
        if len(rest) != 1:
            raise UsageError("usage: %dvr checkout N|NAME   (N: a cell number; `%dvr log` lists them)")
        self._print_checkout(*self._hist().checkout(rest[0]))

    def _do_undo(self, rest: List[str]) -> None:
        if rest:
            raise UsageError("usage: %dvr undo")
        self._print_checkout(*self._hist().undo())

    def _do_ls(self, rest: List[str]) -> SnapshotTable:
        if rest:
            raise UsageError("usage: %dvr ls")
        return self._viewer().ls(self._labels())

    def _do_log(self, rest: List[str]) -> HistoryLog:
        if rest:
            raise UsageError("usage: %dvr log")
        return self._viewer().log(self._labels())

    def _do_info(self, rest: List[str]) -> SnapshotDetail:
        if len(rest) > 1:
            raise UsageError("usage: %dvr info [NAME|N]")
        v = self._viewer()
        ref = rest[0] if rest else v.head
        if not ref:
            raise UsageError("usage: %dvr info NAME|N (no HEAD yet to default to)")
        return v.detail(ref, self._labels())

    def _do_diff(self, rest: List[str]) -> DiffTable:
        if len(rest) != 2:
            raise UsageError("usage: %dvr diff A B")
        return self._viewer().diff(rest[0], rest[1])

    def _do_rm(self, rest: List[str]) -> None:
        if not rest:
            raise UsageError("usage: %dvr rm NAME [NAME ...]")
        v = self._viewer()
        names = list(dict.fromkeys(v.resolve(r) for r in rest))  # all or nothing: every name first (each once)
        if self._history is not None and self._history.head in names:
            raise UsageError(f"%dvr rm: '{self._history.head}' is the HEAD (the parent of the next "
                             "commit): check out another commit first")
        for n in names:
            v.remove(n)
        print(f"removed {', '.join(names)} (`dvr --store {self._open().store.path} gc` returns "
              "the space)")

    def _do_label(self, rest: List[str]) -> None:
        if not rest:
            raise UsageError("usage: %dvr label NAME TEXT   (no TEXT: back to the stored label)")
        name = self._viewer().resolve(rest[0])
        text = " ".join(rest[1:])
        labels = self._labels()
        if text:
            labels[name] = text
        else:
            labels.pop(name, None)
        s = self._open()
        with Session(s.store, self._labels_session()) as ls:
            ls.put(_LABELS, labels)
            ls.snapshot(_LABELS, label="labels set with %dvr label", replace=True)
        print(f"label of {_printable(name)}: '{_printable(text)}'" if text else f"label of {_printable(name)}: the stored one again")

    # ------------------------------------------------------------ %%dvr trial

    def _trial(self, rest: List[str], cell: str) -> None:
        __tracebackhide__ = True  # noqa: F841
        if len(rest) > 1:
            raise UsageError("usage: %%dvr trial [BASE]   (BASE: a snapshot or cell number; "
                             "default: the HEAD)")
        if rest:
            base = rest[0]
        elif self._history is not None and self._history.head:
            base = self._history.head
        else:
            raise UsageError("%%dvr trial: name the snapshot to go back to (`%%dvr trial BASE`); "
                             "there is no HEAD yet (`%dvr auto on` or `%dvr snapshot NAME VAR ...`)")
        try:
            use_history = self._history is not None or self._viewer().meta(
                self._viewer().resolve(base)) is not None
        except DvrError as e:
            raise UsageError(f"%%dvr trial: {e}") from e
        code = self.shell.transform_cell(cell)
        filename = self.shell.compile.cache(code, self.shell.execution_count)
        compiled = compile(code, filename, "exec")
        try:
            exec(compiled, self.shell.user_global_ns, self.shell.user_ns)
        finally:
            try:
                if use_history:
                    name, notes = self._hist().checkout(base)
                    for note in notes:
                        print(f"note: {note}")
                    print(f"trial done: back to {name}")
                else:
                    self._do_restore([base])
            except DvrError as e:
                raise UsageError(f"%%dvr trial: the cell ran but {base} could not be restored: "
                                 f"{e}") from e


def load_ipython_extension(ipython: Any) -> None:
    """Registers the ``%dvr`` magics (``%load_ext memdvr``)."""
    ipython.register_magics(DvrMagics)
