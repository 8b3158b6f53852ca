"""IPython/Jupyter magics for memdvr: ``%load_ext memdvr`` then ``%dvr ...``.

    %dvr snapshot NAME [VAR ...] [--background]
                                   snapshot notebook variables (default: the last ones);
                                   --background returns at once and copies while you work on
    %dvr wait                      wait for a background snapshot and say how it went
    %dvr restore NAME              restore them into the user namespace
    %dvr ls                        list this session's snapshots
    %dvr diff A B                  per-region differences between two snapshots
    %dvr store [PATH]              use the store in PATH (default: $MEMDVR_STORE or memdvr.default_path())
    %dvr session [NAME]            use session NAME (default "notebook")

C-contiguous, writable numpy arrays (without Python objects inside) are tracked
in place, zero-copy, as region VAR: a restore writes the old values back into
the same array objects. Every other object is stored with ``Session.put(VAR, obj)``
and re-bound with ``Session.get(VAR)`` on restore. One store and session per kernel.
"""

from __future__ import annotations

import os
import pickle
import struct
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class

from . import (_OBJ_MAGIC, DvrError, NotFound, Session, Store, _is_object_region,
               _pickle_region, default_path)

# Object holding the magics' own metadata in every snapshot ('-' keeps it apart
# from Python identifiers): {"arrays": {VAR: (dtype.str, shape)}, "objects": [VAR, ...]}.
_META = "dvr-magics"
_USAGE = __doc__.split("\n\n")[1]


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
    """The ``%dvr`` line magic (one store and one session per kernel)."""

    def __init__(self, shell):
        super().__init__(shell)
        self._store_path: Optional[str] = None
        self._session_name = "notebook"
        self._session: Optional[Session] = None
        self._arrays: Dict[str, np.ndarray] = {}  # VAR -> array tracked as region VAR
        self._last_vars: List[str] = []

    # ------------------------------------------------------------ helpers

    def _open(self) -> Session:
        if self._session is None:
            path = self._store_path or os.environ.get("MEMDVR_STORE") or default_path()
            self._session = Session(Store(path), self._session_name)
        return self._session

    def _close(self) -> None:
        if self._session is not None:
            self._session.close()
        self._session = None
        self._arrays.clear()

    def _untrack(self, var: str) -> None:
        if self._arrays.pop(var, None) is not None:
            self._session.untrack(var)

    # ------------------------------------------------------------ the magic

    @line_magic
    def dvr(self, line: str) -> None:
        """Memory DVR snapshots of notebook variables; ``%dvr`` alone prints the usage."""
        args = line.split()
        if not args or args[0] in ("help", "-h", "--help"):
            print(_USAGE)
            return
        verb, rest = args[0], args[1:]
        handler = getattr(self, f"_do_{verb}", None)
        if handler is None:
            raise UsageError(f"%dvr: unknown command '{verb}'\n{_USAGE}")
        try:
            handler(rest)
        except DvrError as e:
            raise UsageError(f"%dvr {verb}: {e}") from e

    def _do_store(self, rest: List[str]) -> None:
        if len(rest) > 1:
            raise UsageError("usage: %dvr store [PATH]")
        if rest:
            self._close()
            self._store_path = os.path.expanduser(rest[0])
        s = self._open()
        print(f"memdvr store {s.store.path} ({s.store.medium}), session '{s.name}'")

    def _do_session(self, rest: List[str]) -> None:
        if len(rest) > 1:
            raise UsageError("usage: %dvr session [NAME]")
        if rest:
            self._close()
            self._session_name = rest[0]
        s = self._open()
        print(f"memdvr session '{s.name}' in store {s.store.path}")

    def _do_snapshot(self, rest: List[str]) -> None:
        background = any(a in ("--background", "-b") for a in rest)
        rest = [a for a in rest if a not in ("--background", "-b")]
        if not rest:
            raise UsageError("usage: %dvr snapshot NAME [VAR ...] [--background]")
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
        parts = []
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
        job = getattr(self, "_job", None)
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
            with s.store.open_snapshot(s.name, name, verify=False) as c:
                mv = c.buffer(_pickle_region(_META))
                head = bytes(mv[:len(_OBJ_MAGIC) + 16])
                if head[:len(_OBJ_MAGIC)] != _OBJ_MAGIC:
                    return {}
                stream_len, count = struct.unpack_from("<QQ", head, len(_OBJ_MAGIC))
                start = len(head) + 8 * count
                return pickle.loads(bytes(mv[start:start + stream_len]))
        except NotFound:
            return {}

    def _do_restore(self, rest: List[str]) -> None:
        if len(rest) != 1:
            raise UsageError("usage: %dvr restore NAME")
        name = rest[0]
        s = self._open()
        info = s.info(name)  # NotFound with the store's message
        want = {r.name: r.size for r in info.regions if not _is_object_region(r.name)}
        ns = self.shell.user_ns
        layouts: Dict[str, Tuple[str, Tuple[int, ...]]] = {}
        if any(var not in self._arrays or self._arrays[var].nbytes != size
               for var, size in want.items()):
            layouts = self._meta_of(s, name).get("arrays", {})
        # Check everything before changing anything.
        plan: Dict[str, Optional[np.ndarray]] = {}  # VAR -> array to restore into (None: keep)
        notes = []
        for var, size in want.items():
            cur = self._arrays.get(var)
            if cur is not None and cur.nbytes == size:
                plan[var] = None
                continue
            val = ns.get(var)
            if cur is None and _trackable(val) and val.nbytes == size and (
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

    def _do_ls(self, rest: List[str]) -> None:
        if rest:
            raise UsageError("usage: %dvr ls")
        s = self._open()
        snaps = s.list()
        if not snaps:
            print(f"no snapshots in session '{s.name}' ({s.store.path})")
            return
        print(f"{'NAME':<20} {'TIME (UTC)':<20} {'SIZE':>12} {'STORED':>12}  VARIABLES")
        for i in snaps:
            names = [r.name for r in i.regions if not _is_object_region(r.name)]
            names += [r.name[4:-7] for r in i.regions
                      if _is_object_region(r.name) and r.name.endswith(".pickle")
                      and r.name != _pickle_region(_META)]
            flag = "  DAMAGED" if i.damaged else ""
            print(f"{i.name:<20} {i.time.strftime('%Y-%m-%d %H:%M:%S'):<20} "
                  f"{_mib(i.logical_bytes):>12} {_mib(i.stored_bytes):>12}  {' '.join(names)}{flag}")

    def _do_diff(self, rest: List[str]) -> None:
        if len(rest) != 2:
            raise UsageError("usage: %dvr diff A B")
        a, b = rest
        s = self._open()
        rows = s.store.diff(s.name, a, s.name, b)
        print(f"{'REGION':<24} {'SIZE A':>12} {'SIZE B':>12} {'BYTES DIFFER':>14} {'PAGES':>8}")
        for r in rows:
            if r["name"].startswith(_pickle_region(_META)[:-len("pickle")]):
                continue
            note = " (only in A)" if r["only_in_a"] else " (only in B)" if r["only_in_b"] else ""
            print(f"{r['name']:<24} {r['size_a']:>12} {r['size_b']:>12} "
                  f"{r['bytes_differ']:>14} {r['pages_differ']:>8}{note}")


def load_ipython_extension(ipython) -> None:
    """Registers the ``%dvr`` magic (``%load_ext memdvr``)."""
    ipython.register_magics(DvrMagics)
