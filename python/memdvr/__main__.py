"""python -m memdvr: the `dvr` command's store verbs, from Python.

    python -m memdvr [--store DIR] ls [SESSION] [--json]
    python -m memdvr [--store DIR] info SESSION/NAME [--json]
    python -m memdvr [--store DIR] rm SESSION/NAME...
    python -m memdvr [--store DIR] gc [--json]
    python -m memdvr [--store DIR] verify [--json]      (exit 1 when something is damaged)
    python -m memdvr [--store DIR] stat [--json]
    python -m memdvr [--store DIR] diff SESSION/A SESSION/B [--json]
    python -m memdvr [--store DIR] recover SESSION [--json]   (exit 1 when nothing is intact)

Without --store the default store (memdvr.default_path()) is used. Errors are
printed as "memdvr: MESSAGE" with exit status 2 for bad usage and 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, List, Optional, Tuple

from . import DvrError, Store, default_path
from ._core import split_ref


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


def _print_json(value: Any) -> None:
    json.dump(value, sys.stdout, sort_keys=True)
    sys.stdout.write("\n")


def _open(args: argparse.Namespace, create: bool = False) -> Store:
    return Store(args.store or default_path(), create=create)


def _ls(args: argparse.Namespace) -> int:
    snaps = _open(args).list(args.session)
    if args.json:
        _print_json([s.to_dict() for s in snaps])
        return 0
    if not snaps:
        print(f"no snapshots in session '{args.session}'" if args.session else "no snapshots")
        return 0
    print(f"{'SNAPSHOT':32} {'TIME':19} {'SIZE':>10} {'ADDED':>10}  LABEL")
    for s in snaps:
        ref = f"{s.session}/{s.name}"
        print(f"{ref:32} {s.time.strftime('%Y-%m-%d %H:%M:%S'):19} {_size(s.logical_bytes):>10} "
              f"{_size(s.stored_bytes):>10}  {s.label}")
    return 0


def _info(args: argparse.Namespace) -> int:
    session, name = _ref(args.ref)
    info = _open(args).info(session, name)
    if args.json:
        _print_json(info.to_dict())
        return 0
    for key, value in info.to_dict().items():
        if key != "regions":
            print(f"{key:14} {value}")
    for r in info.regions:
        print(f"region         {r.name} ({r.size} bytes){' sdk-owned' if r.sdk_owned else ''}")
    return 0


def _rm(args: argparse.Namespace) -> int:
    store = _open(args)
    refs = [_ref(r) for r in args.refs]  # all checked before anything is removed
    for session, name in refs:
        store.remove(session, name)
        print(f"removed {session}/{name}")
    return 0


def _gc(args: argparse.Namespace) -> int:
    report = _open(args).gc()
    if args.json:
        _print_json(report)
    else:
        print(f"gc: {_size(report['bytes_before'])} -> {_size(report['bytes_after'])}, "
              f"{report['packs_removed']} pack(s) and {report['temp_files_removed']} leftover file(s) removed")
    return 0


def _verify(args: argparse.Namespace) -> int:
    report = _open(args).verify()
    if args.json:
        _print_json(report)
    else:
        print(f"verified {report['snapshots']} snapshot(s), {report['chunks']} stored chunk(s), {_size(report['bytes'])}")
        for p in report.get("problems", []):
            print(f"DAMAGED {p['session']}/{p['snapshot']}: {p['what']}")
        print("ok" if report["ok"] else "damage found")
    return 0 if report["ok"] else 1


def _stat(args: argparse.Namespace) -> int:
    stats = _open(args).stats()
    if args.json:
        _print_json(stats)
    else:
        for key, value in stats.items():
            print(f"{key:15} {value}")
    return 0


def _diff(args: argparse.Namespace) -> int:
    (sa, a), (sb, b) = _ref(args.a), _ref(args.b)
    regions = _open(args).diff(sa, a, sb, b)
    if args.json:
        _print_json(regions)
        return 0
    for r in regions:
        where = " (only in A)" if r["only_in_a"] else " (only in B)" if r["only_in_b"] else ""
        print(f"{r['name']}: {r['bytes_differ']} bytes in {r['pages_differ']} pages differ{where}")
    return 0


def _recover(args: argparse.Namespace) -> int:
    latest = _open(args).latest(args.session)
    if args.json:
        _print_json(latest.to_dict() if latest else None)
    elif latest:
        print(f"{latest.session}/{latest.name}")
    else:
        print(f"no intact snapshot in session '{args.session}'")
    return 0 if latest else 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m memdvr", description="Memory DVR store commands.")
    p.add_argument("--store", help="store directory (default: memdvr.default_path())")
    sub = p.add_subparsers(dest="verb", required=True)

    def verb(name: str, func, help_text: str, json_flag: bool = True) -> argparse.ArgumentParser:
        v = sub.add_parser(name, help=help_text)
        v.set_defaults(func=func)
        if json_flag:
            v.add_argument("--json", action="store_true", help="print JSON")
        return v

    verb("ls", _ls, "list snapshots").add_argument("session", nargs="?")
    verb("info", _info, "one snapshot").add_argument("ref", metavar="SESSION/NAME")
    verb("rm", _rm, "remove snapshots", json_flag=False).add_argument("refs", metavar="SESSION/NAME", nargs="+")
    verb("gc", _gc, "give the space of removed snapshots back")
    verb("verify", _verify, "re-hash everything; exit 1 on damage")
    verb("stat", _stat, "store path, medium, format, space used")
    d = verb("diff", _diff, "bytes and pages that differ, per region")
    d.add_argument("a", metavar="SESSION/A")
    d.add_argument("b", metavar="SESSION/B")
    verb("recover", _recover, "the newest intact snapshot of a session").add_argument("session")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Runs one verb; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        return args.func(args)
    except DvrError as e:
        print(f"memdvr: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
