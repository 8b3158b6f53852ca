"""python -m memdvr: the `dvr` command's store verbs, from Python.

    python -m memdvr [--store DIR] ls [SESSION] [--json]
    python -m memdvr [--store DIR] info SESSION/NAME [--json]
    python -m memdvr [--store DIR] log SESSION [--json]
    python -m memdvr [--store DIR] rm SESSION/NAME... [--json]
    python -m memdvr [--store DIR] gc [--json]
    python -m memdvr [--store DIR] verify [--json]      (exit 1 when something is damaged)
    python -m memdvr [--store DIR] stat [--json]
    python -m memdvr [--store DIR] diff SESSION/A SESSION/B [--json]
    python -m memdvr [--store DIR] recover SESSION [--json]   (exit 1 when nothing is intact)
    python -m memdvr [--store DIR] prune SESSION [--keep-last N] [--keep-within 2h]
                     [--keep-hourly N] [--keep-daily N] [--keep-weekly N] [--keep-monthly N]
                     [--dry-run] [--json]

prune keeps what any --keep-* rule keeps and removes the rest (restic's
forget; memdvr.Store.prune): --keep-within takes a duration such as 90s,
10m, 2h, 3d, 1w or 1h30m (a bare number is seconds); --dry-run only says
what it would remove.

Without --store the default store (memdvr.default_path()) is used. --json
prints the same documents as `dvr --json` (docs/cli.md, "JSON documents":
same names, same shapes, "schema_version": 1). Errors are printed as
"memdvr: MESSAGE" with exit status 2 for bad usage and 1 otherwise (with
--json also the `error` document on stdout, as dvr prints it); an
unknown session or snapshot is an error for every verb.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import re
import shlex
import sys
from typing import Any, Callable, Dict, List, NoReturn, Optional, Tuple

from . import DvrError, InvalidArgument, NotFound, Store, _printable, default_path
from ._core import split_ref

#: The version of the JSON documents (the same as dvr's).
SCHEMA_VERSION = 1


def _ref(text: str) -> Tuple[str, str]:
    """SESSION/NAME as (SESSION, NAME): dvr::split_ref, as the dvr command
    splits it (InvalidArgument otherwise)."""
    return split_ref(text)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _utf8(value: Any) -> str:
    """Text as valid UTF-8, as dvr writes it: bytes that are not UTF-8 become
    the four characters \\xNN (Python's "backslashreplace")."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    text = str(value)
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:  # lone surrogates from surrogateescape
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")




def _rfc3339(time_ns: int) -> str:
    """Nanoseconds since the epoch as RFC 3339 UTC with nanoseconds."""
    sec, frac = divmod(int(time_ns), 1_000_000_000)
    t = _dt.datetime.fromtimestamp(sec, tz=_dt.timezone.utc)
    return t.strftime("%Y-%m-%dT%H:%M:%S") + f".{frac:09d}Z"


def _doc(**fields: Any) -> Dict[str, Any]:
    return {"schema_version": SCHEMA_VERSION, **fields}


def _snapshot(s: Any) -> Dict[str, Any]:
    """A SnapshotInfo as dvr's JSON object (docs/cli.md, "Snapshot")."""
    return {
        "session": _utf8(s.session),
        "name": _utf8(s.name),
        "parent": _utf8(s.parent),
        "label": _utf8(s.label),
        "time_ns": int(s.time_ns),
        "time": _rfc3339(s.time_ns),
        "seq": int(s.seq),
        "origin_time_ns": int(s.origin_time_ns),
        "logical_bytes": int(s.logical_bytes),
        "stored_bytes": int(s.stored_bytes),
        "chunks": int(s.chunks),
        "zero_chunks": int(s.zero_chunks),
        "regions": [{"name": _utf8(r.name), "size": int(r.size), "sdk_owned": bool(r.sdk_owned)} for r in s.regions],
        "tracking": _utf8(s.tracking),
        "chunks_read": int(s.chunks_read),
        "damaged": bool(s.damaged),
        "damage": _utf8(s.damage),
        "pending": bool(getattr(s, "pending", False)),
    }


_printed = False  # a verb's own document went out: no `error` document after it (recover of an unknown session)


def _print_json(value: Any) -> None:
    global _printed
    json.dump(value, sys.stdout, ensure_ascii=False)
    sys.stdout.write("\n")
    _printed = True


def _json_requested(argv: List[str]) -> bool:
    """Whether the command line asks for JSON (`--json` before any `--`), as dvr decides it."""
    for arg in argv:
        if arg == "--":
            return False
        if arg == "--json":
            return True
    return False


def _fail(argv: List[str], code: str, message: str, status: int) -> int:
    """A failed verb: "memdvr: MESSAGE" on stderr and, when JSON was asked
    for, dvr's `error` document on stdout. Returns the exit status."""
    print(f"memdvr: {message}", file=sys.stderr)
    if _json_requested(argv) and not _printed:
        _print_json(_doc(error={"code": code, "message": _utf8(message), "exit_status": status}))
    return status


class _Parser(argparse.ArgumentParser):
    """argparse, whose usage errors also print the `error` document under --json."""

    argv: List[str] = []

    def error(self, message: str) -> NoReturn:
        if _json_requested(self.argv):
            _print_json(_doc(error={"code": "invalid_argument", "message": f"{self.prog}: {message}", "exit_status": 2}))
        super().error(message)


def _open(args: argparse.Namespace, create: bool = False) -> Store:
    if args.store == "":  # an unset variable, not a wish for the default store (as dvr: usage error)
        raise InvalidArgument("--store was given an empty path; name the store directory, or leave --store out "
                              f"for the default store ({default_path()})")
    return Store(args.store or default_path(), create=create)


def _here(store: Store) -> str:
    """This command for `store`, to suggest a next command that can be pasted."""
    return f"python -m memdvr --store {shlex.quote(str(store.path))}"


def _require_session(store: Store, session: str) -> None:
    """An unknown session is an error (NotFound), as for dvr."""
    sessions = store.sessions()
    if session in sessions:
        return
    store.list(session)  # an invalid name is InvalidArgument (exit status 2)
    known = ", ".join(sessions[:8]) + (", ..." if len(sessions) > 8 else "")
    raise NotFound(f"no session '{_printable(session)}' in store {store.path} "
                   + (f"(sessions: {known})" if sessions else "(it has no snapshots)")
                   + f"; `{_here(store)} ls` lists the snapshots")


def _ls(args: argparse.Namespace) -> int:
    store = _open(args)
    if args.session:
        _require_session(store, args.session)
    snaps = store.list(args.session)
    if args.json:
        _print_json(_doc(session=_utf8(args.session) if args.session else None, snapshots=[_snapshot(s) for s in snaps]))
        return 0
    if not snaps:
        print(f"no snapshots in {store.path}")
        return 0
    print(f"{'SNAPSHOT':32} {'TIME':19} {'SIZE':>10} {'ADDED':>10}  LABEL")
    for s in snaps:
        ref = _printable(f"{s.session}/{s.name}")
        if s.damaged:
            print(f"{ref:32} DAMAGED: {_printable(s.damage)}")
            continue
        local = s.time.astimezone()
        print(f"{ref:32} {local.strftime('%Y-%m-%d %H:%M:%S'):19} {_size(s.logical_bytes):>10} "
              f"{_size(s.stored_bytes):>10}  {_printable(s.label)}")
    return 0


def _info(args: argparse.Namespace) -> int:
    session, name = _ref(args.ref)
    info = _open(args).info(session, name)
    if args.json:
        _print_json(_doc(**_snapshot(info)))
        return 0
    d = _snapshot(info)
    for key, value in d.items():
        if key != "regions":
            print(f"{key:14} {_printable(value)}")
    for r in info.regions:
        print(f"region         {_printable(r.name)} ({r.size} bytes){' sdk-owned' if r.sdk_owned else ''}")
    return 0


def _log(args: argparse.Namespace) -> int:
    store = _open(args)
    _require_session(store, args.session)
    snaps = store.list(args.session)
    if args.json:
        _print_json(_doc(session=_utf8(args.session), snapshots=[_snapshot(s) for s in snaps]))
        return 0
    names = {s.name for s in snaps}
    children: Dict[str, List[Any]] = {}
    roots: List[Any] = []
    for s in snaps:
        if not s.damaged and s.parent and s.parent in names and s.parent != s.name:
            children.setdefault(s.parent, []).append(s)
        else:
            roots.append(s)

    def draw(s: Any, prefix: str, last: bool, root: bool) -> None:
        line = "" if root else prefix + ("`-- " if last else "|-- ")
        if s.damaged:
            print(f"{line}{_printable(s.name)}  DAMAGED: {_printable(s.damage)}")
        else:
            label = f"  {_printable(s.label)}" if s.label else ""
            print(f"{line}{_printable(s.name)}  {s.time.astimezone().strftime('%Y-%m-%d %H:%M:%S')}  "
                  f"+{_size(s.stored_bytes)}{label}")
        kids = children.get(s.name, [])
        nxt = "" if root else prefix + ("    " if last else "|   ")
        for k, kid in enumerate(kids):
            draw(kid, nxt, k + 1 == len(kids), False)

    for r in roots:
        draw(r, "", True, True)
    return 0


def _rm(args: argparse.Namespace) -> int:
    store = _open(args)
    refs: List[Tuple[str, str]] = []
    for text in dict.fromkeys(args.refs):  # each once, in the order given
        refs.append(_ref(text))
    for session, name in refs:  # all checked before anything is removed
        try:
            store.info(session, name)
        except DvrError as e:
            if type(e).__name__ != "Corrupt":  # a damaged snapshot can still be removed
                raise
        store._core.check_removable(session, name)  # a heap snapshot a process snapshot needs: refused
    removed = []
    for session, name in refs:
        store.remove(session, name)
        removed.append(f"{session}/{name}")
        if not args.json:
            print(f"removed {_printable(session + '/' + name)}")
    if args.json:
        _print_json(_doc(removed=[_utf8(r) for r in removed]))
    else:
        print(f"run `{_here(store)} gc` to reclaim the space")
    return 0


def _gc(args: argparse.Namespace) -> int:
    r = _open(args).gc()
    if args.json:
        _print_json(_doc(bytes_before=r.bytes_before, bytes_after=r.bytes_after, packs_removed=r.packs_removed,
                         temp_files_removed=r.temp_files_removed))
    else:
        freed = max(0, r.bytes_before - r.bytes_after)
        print(f"gc: reclaimed {_size(freed)} ({_size(r.bytes_before)} -> {_size(r.bytes_after)}), "
              f"{r.packs_removed} pack file(s) removed, {r.temp_files_removed} leftover temporary file(s) removed")
    return 0


def _verify(args: argparse.Namespace) -> int:
    r = _open(args).verify()
    problems = [{"session": _utf8(p.session), "snapshot": _utf8(p.snapshot), "what": _utf8(p.what)}
                for p in r.problems]
    doc = _doc(snapshots=r.snapshots, chunks=r.chunks, bytes=r.bytes, problems=problems,
               damaged_snapshots=[_utf8(d) for d in r.damaged_snapshots],
               warnings=[_utf8(w) for w in r.warnings], ok=r.ok)
    if args.json:
        _print_json(doc)
    else:
        print(f"verified {doc['snapshots']} snapshot(s), {doc['chunks']} stored chunk(s), {_size(doc['bytes'])}")
        for w in doc["warnings"]:
            print(f"WARNING: {_printable(w)}")
        if doc["ok"]:
            print("ok: no damage found")
        for p in problems:
            where = f"{p['session']}/{p['snapshot']}" if p["snapshot"] else p["session"]
            print(f"DAMAGED {_printable(where)}: {_printable(p['what'])}")
        if not doc["ok"]:
            print(f"{len(doc['damaged_snapshots'])} damaged snapshot(s)")
    return 0 if doc["ok"] else 1


def _stat(args: argparse.Namespace) -> int:
    st = _open(args).stats()
    keys = ("path", "medium", "format_version", "chunk_size", "sessions", "snapshots", "logical_bytes", "pack_bytes", "pack_files")
    values = st.to_dict()
    doc = _doc(**{k: (_utf8(values[k]) if isinstance(values[k], str) else int(values[k])) for k in keys},
               warnings=[_utf8(w) for w in st.warnings])
    if args.json:
        _print_json(doc)
    else:
        for key in keys:
            print(f"{key:15} {_printable(doc[key])}")
        for w in doc["warnings"]:
            print(f"WARNING: {_printable(w)}")
    return 0


def _diff(args: argparse.Namespace) -> int:
    (sa, a), (sb, b) = _ref(args.a), _ref(args.b)
    regions: List[Dict[str, Any]] = []
    # Region by region, as dvr reports it (Store.diff folds put() objects into
    # one row each: a Python view the dvr command cannot share).
    for r in _open(args)._core.diff(sa, a, sb, b):
        regions.append({"name": _utf8(r["name"]), "size_a": int(r["size_a"]), "size_b": int(r["size_b"]),
                        "only_in_a": bool(r["only_in_a"]), "only_in_b": bool(r["only_in_b"]),
                        "bytes_differ": int(r["bytes_differ"]), "pages_differ": int(r["pages_differ"])})
    if args.json:
        _print_json(_doc(a=_utf8(args.a), b=_utf8(args.b), regions=regions))
        return 0
    for r in regions:
        where = f" (only in {args.a})" if r["only_in_a"] else f" (only in {args.b})" if r["only_in_b"] else ""
        print(f"{_printable(r['name'])}: {r['bytes_differ']} bytes in {r['pages_differ']} pages differ{where}")
    return 0


def _recover(args: argparse.Namespace) -> int:
    store = _open(args)
    known = args.session in store.sessions()
    if not known:
        store.list(args.session)  # an invalid name is InvalidArgument (exit status 2)
    latest = store.latest(args.session) if known else None
    # The snapshots newer than the one found, newest first: what it skipped
    # (dvr also says why; Python knows only a damaged manifest's reason).
    skipped: List[Dict[str, str]] = []
    if known:
        for s in reversed(store.list(args.session)):
            if latest is not None and s.name == latest.name:
                break
            skipped.append({"snapshot": _utf8(f"{s.session}/{s.name}"),
                            "why": _utf8(s.damage if s.damaged else f"its data is damaged; run `{_here(store)} verify`")})
    if args.json:
        _print_json(_doc(session=_utf8(args.session), latest=_snapshot(latest) if latest else None, skipped=skipped))
    if not known:
        _require_session(store, args.session)
    if args.json:
        return 0 if latest else 1
    for sk in skipped:
        print(f"skipped (damaged) {_printable(sk['snapshot'])}: {_printable(sk['why'])}")
    if latest is None:
        print(f"no intact snapshot in session '{_printable(args.session)}'")
        return 1
    print(f"newest intact snapshot: {_printable(latest.session + '/' + latest.name)}  "
          f"({latest.time.astimezone().strftime('%Y-%m-%d %H:%M:%S')})")
    print(f"restore it with session.restore({latest.name!r}) in the program")
    return 0


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)([smhdw])")


def _duration(text: str) -> float:
    """Seconds of a duration such as 90s, 10m, 2h, 3d, 1w or 1h30m (a bare
    number is seconds), as dvr's parse_duration reads it."""
    t = text.strip()
    try:
        if re.fullmatch(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+", t):
            return float(t)
        pos, total = 0, 0.0
        while pos < len(t):
            m = _DURATION_PART.match(t, pos)
            if m is None:
                raise ValueError(text)
            total += float(m.group(1)) * _DURATION_UNITS[m.group(2)]
            pos = m.end()
        if pos == 0:
            raise ValueError(text)
        return total
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"duration '{text}' is not a duration like 90s, 10m, 2h, 3d, 1w or 1h30m") from None


def _count(text: str) -> int:
    """A number of snapshots (>= 0)."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number of snapshots (a whole number >= 0)")
    return n


def _prune(args: argparse.Namespace) -> int:
    store = _open(args)
    _require_session(store, args.session)
    r = store.prune(args.session, keep_last=args.keep_last, keep_within=args.keep_within,
                    keep_hourly=args.keep_hourly, keep_daily=args.keep_daily, keep_weekly=args.keep_weekly,
                    keep_monthly=args.keep_monthly, dry_run=args.dry_run)
    if args.json:
        _print_json(_doc(session=_utf8(args.session), dry_run=r.dry_run, removed=r.removed,
                         decisions=[{"snapshot": _snapshot(d.snapshot), "keep": d.keep, "reason": _utf8(d.reason)}
                                    for d in r.decisions]))
        return 0
    width = max([len(_printable(d.snapshot.name)) for d in r.decisions] + [1])
    for d in r.decisions:
        when = d.snapshot.time.astimezone().strftime("%Y-%m-%d %H:%M:%S")
        print(f"{'keep' if d.keep else 'remove':6} {_printable(d.snapshot.name):{width}}  {when}  {_printable(d.reason)}")
    kept = len(r.decisions) - r.removed
    if r.dry_run:
        print(f"dry run: would remove {r.removed} snapshot(s) of '{_printable(args.session)}', keep {kept}; "
              "nothing was changed")
    else:
        print(f"removed {r.removed} snapshot(s) of '{_printable(args.session)}', kept {kept}"
              + (f"; run `{_here(store)} gc` to reclaim the space" if r.removed else ""))
    return 0


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m memdvr", description="Memory DVR store commands (the dvr command's store verbs).")
    p.add_argument("--store", help="store directory (default: memdvr.default_path())")
    sub = p.add_subparsers(dest="verb", required=True)

    def verb(name: str, func: Callable[[argparse.Namespace], int], help_text: str) -> argparse.ArgumentParser:
        v = sub.add_parser(name, help=help_text, description=help_text)
        v.set_defaults(func=func)
        v.add_argument("--json", action="store_true", help="print one JSON document (the same as dvr --json)")
        return v

    verb("ls", _ls, "list snapshots (an unknown session is an error)").add_argument("session", nargs="?")
    verb("info", _info, "one snapshot").add_argument("ref", metavar="SESSION/NAME")
    verb("log", _log, "a session's snapshots as a tree of parent links").add_argument("session")
    verb("rm", _rm, "remove snapshots (all checked first; duplicates once)").add_argument("refs", metavar="SESSION/NAME", nargs="+")
    verb("gc", _gc, "give the space of removed snapshots back")
    verb("verify", _verify, "re-hash everything; exit 1 on damage")
    verb("stat", _stat, "store path, medium, format, space used")
    d = verb("diff", _diff, "bytes and pages that differ, per region")
    d.add_argument("a", metavar="SESSION/A")
    d.add_argument("b", metavar="SESSION/B")
    verb("recover", _recover, "the newest intact snapshot of a session (exit 1 when there is none)").add_argument("session")
    pr = verb("prune", _prune, "remove the snapshots of a session that no --keep-* rule keeps")
    pr.add_argument("session")
    pr.add_argument("--keep-last", type=_count, default=0, metavar="N", help="the newest N snapshots")
    pr.add_argument("--keep-within", type=_duration, default=None, metavar="DURATION",
                    help="snapshots taken within DURATION of the newest one (90s, 10m, 2h, 3d, 1w)")
    for rule, buckets in (("hourly", "hours"), ("daily", "days"), ("weekly", "ISO weeks"), ("monthly", "months")):
        pr.add_argument(f"--keep-{rule}", type=_count, default=0, metavar="N",
                        help=f"the newest snapshot of each of the newest N {buckets} (UTC)")
    pr.add_argument("--dry-run", action="store_true", help="say what would be removed, change nothing")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Runs one verb; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    _Parser.argv = argv
    args = _parser().parse_args(argv)
    try:
        return int(args.func(args))
    except DvrError as e:
        return _fail(argv, e.code, str(e), 2 if type(e).__name__ == "InvalidArgument" else 1)


if __name__ == "__main__":
    sys.exit(main())
