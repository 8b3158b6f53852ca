#!/usr/bin/python3
"""What the automatic notebook history (%dvr auto on) costs, measured in a real
Jupyter kernel: a notebook built here with nbformat and executed with nbclient.

    PYTHONPATH=build/python /usr/bin/python3 bench/notebook_bench.py [--size 1G] [--repeat 5] [--json]
    PYTHONPATH=build/python /usr/bin/python3 bench/notebook_bench.py --small --json   # what CTest runs

The notebook fills a float32 array of --size (every page written before any
timing), turns the history on, then runs --repeat cells that each add 1 to one
element in every 100th page (1% of the pages, scattered), and checks out the
commits of two of those cells in turn. Figures, each next to its peer from the
same run (medians over the repeats):

  commit_1pct          post-cell commit after a cell that changed 1%    vs pickle.dumps of the array
  commit_vs_cell       the same commit                                  vs the cell's own run time
  commit_vs_snapshot   the same commit                                  vs a plain Session.snapshot of the same change
  unchanged_cell       post-cell hook after a cell that changed nothing vs pickle.dumps of the array
  checkout_1pct        %dvr checkout of a commit 1% away                vs pickle.loads of the array
  undo_1pct            %dvr undo (to the commit 1% before)              vs pickle.loads of the array
  stored_per_cell      bytes the 1% commit added to the store           vs the bytes of the pages it wrote
  first_commit         the first commit of the array (all pages)        vs pickle.dumps of the array

Targets (docs/python.md): commit_1pct <= 20 ms or <= 5% of the cell's own time;
checkout_1pct <= 50 ms; stored_per_cell <= 2x the written pages (ratio >= 0.5).
--json prints one object per line (name, value, unit, peer, peer_value, ratio:
peer/value for costs; see docs/performance.md, "Reading the figures") with
bytes, target and met added. Exits 77 (skipped) without nbclient/ipykernel.
"""

import argparse
import importlib.util
import json
import os
import pathlib
import shutil
import statistics
import sys
import tempfile

memdvr = None  # imported by main()
SIZES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text):
    text = text.strip().upper()
    mult = SIZES.get(text[-1:], 1)
    digits = text[:-1] if text[-1:] in SIZES else text
    try:
        return int(float(digits) * mult)
    except ValueError:
        sys.exit(f"notebook_bench: --size {text!r} is not a size (use e.g. 64M or 1G)")


def cells(nbytes, repeat):
    """The benchmark notebook's cells."""
    n = nbytes // 4
    setup = """\
import json, os, pickle, time
import numpy as np
store_dir = os.environ["MEMDVR_BENCH_STORE"]
# The measurements live in a name IPython hides, so the history never captures them.
bench = {"cell": [], "commit": [], "stored": [], "unchanged": [], "checkout": [], "undo": [],
         "commits": []}
get_ipython().user_ns_hidden["bench"] = bench
"""
    fill = f"""\
a = np.empty({n}, np.float32)
a[:] = np.random.default_rng(7).random({n}, dtype=np.float32)   # every page written
"""
    # The cells below bind no new variables (only keys of `bench`), so that
    # only what they are meant to change changes.
    first = """\
bench["st"] = get_ipython().run_line_magic("dvr", "auto")
bench["first_commit"] = bench["st"].last_commit_seconds
bench["first_stored"] = bench["st"].last_stored_bytes
bench["aligned"] = a.ctypes.data % 4096 == 0
bench["t0"] = time.perf_counter(); bench["blob"] = pickle.dumps(a, protocol=5)
bench["pickle_dumps"] = time.perf_counter() - bench["t0"]
bench["t0"] = time.perf_counter(); bench["back"] = pickle.loads(bench["blob"])
bench["pickle_loads"] = time.perf_counter() - bench["t0"]
assert np.array_equal(bench["back"], a)
del bench["blob"], bench["back"], bench["st"]
"""
    change = """\
bench["t0"] = time.perf_counter()
a.reshape(-1, 1024)[::100, 0] += 1.0      # 1% of the 4 KiB pages, scattered
bench["cell"].append(time.perf_counter() - bench["t0"])
bench["pages"] = len(range(0, a.size, 102400))
"""
    record = """\
bench["st"] = get_ipython().run_line_magic("dvr", "auto")
bench["commit"].append(bench["st"].last_commit_seconds)
bench["stored"].append(bench["st"].last_stored_bytes)
bench["commits"].append(bench["st"].last_commit)
del bench["st"]
"""
    unchanged = """\
bench["unchanged"].append(get_ipython().run_line_magic("dvr", "auto").last_cell_seconds)
float(a[0])   # reads only
"""
    checkout = f"""\
def _checkouts(bench):
    x, y = bench["commits"][-2], bench["commits"][-1]
    expect = {{}}
    for c in (x, y):
        get_ipython().run_line_magic("dvr", f"checkout {{c}}")
        expect[c] = float(a[::1024].sum())
    assert expect[x] != expect[y]
    for k in range({repeat}):
        for c in (x, y):
            t0 = time.perf_counter()
            get_ipython().run_line_magic("dvr", f"checkout {{c}}")
            bench["checkout"].append(time.perf_counter() - t0)
            assert float(a[::1024].sum()) == expect[c], "checkout is not the committed state"
bench["checkouts"] = _checkouts   # (a checkout removes what the last commit lacks)
del _checkouts
bench.pop("checkouts")(bench)
"""
    undo = """\
bench["t0"] = time.perf_counter()
get_ipython().run_line_magic("dvr", "undo")
bench["undo"].append(time.perf_counter() - bench["t0"])
get_ipython().run_line_magic("dvr", f"checkout {bench['commits'][-1]}")
"""
    # The same change snapshotted by a plain session (an SDK-owned array, no
    # notebook): what the commit costs beyond the snapshot itself.
    raw = f"""\
def _raw(bench):
    import memdvr
    s = memdvr.Session(memdvr.Store(store_dir), "notebook-bench-raw")
    b = s.array("b", a.shape, a.dtype)
    b[:] = a
    s.snapshot("base")
    bench["raw"] = []
    for k in range({repeat}):
        b.reshape(-1, 1024)[::100, 0] += 1.0
        t0 = time.perf_counter()
        s.snapshot(f"r{{k}}")
        bench["raw"].append(time.perf_counter() - t0)
    del b
    s.close()
bench["raw_fn"] = _raw
del _raw
bench.pop("raw_fn")(bench)
"""
    out = ["%load_ext memdvr", setup, "%dvr store $store_dir", "%dvr session notebook-bench",
           "%dvr auto on", fill, first, change, record]  # one change untimed: warm-up
    for _ in range(repeat):
        out += [change, record, unchanged]
    out += [checkout]
    for _ in range(repeat):
        out += [change, record, undo]
    out += [raw, 'print("BENCH " + json.dumps(bench))']
    return out


def run(nbytes, repeat, store_dir):
    import nbclient
    import nbformat
    from jupyter_client.manager import KernelManager

    work = tempfile.mkdtemp(prefix="dvr-nb-bench-")
    try:
        kdir = pathlib.Path(work) / "jupyter" / "kernels" / "python3"
        kdir.mkdir(parents=True)
        (kdir / "kernel.json").write_text(json.dumps({
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "Python 3 (memdvr bench)", "language": "python"}))
        os.environ["JUPYTER_PATH"] = str(pathlib.Path(work) / "jupyter")
        os.environ["MEMDVR_BENCH_STORE"] = store_dir
        # The kernel runs elsewhere: it imports the memdvr this script found.
        package_dir = str(pathlib.Path(memdvr.__file__).resolve().parents[1])
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [package_dir] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
        os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_code_cell(c) for c in cells(nbytes, repeat)]
        km = KernelManager(kernel_name="python3")
        nbclient.NotebookClient(nb, timeout=1800, kernel_name="python3", km=km,
                                resources={"metadata": {"path": work}}).execute()
        for cell in nb.cells:
            for o in cell.outputs:
                if o.output_type == "stream" and o.name == "stderr" and "not committed" in o.text:
                    raise RuntimeError(f"a cell was not committed: {o.text}")
                if o.output_type == "stream" and o.text.startswith("BENCH "):
                    return json.loads(o.text[len("BENCH "):])
        raise RuntimeError("the benchmark notebook printed no results")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def figures(r, nbytes):
    med = statistics.median
    written = r["pages"] * 4096
    commit, cell = med(r["commit"]), med(r["cell"])
    rows = [
        ("commit_1pct", commit, "s", "pickle.dumps of the array", r["pickle_dumps"],
         "<= 20 ms or <= 5% of the cell", commit <= 0.020 or commit <= 0.05 * cell),
        ("commit_vs_cell", commit, "s", "the cell's own run time", cell, None, None),
        ("commit_vs_snapshot", commit, "s", "Session.snapshot of the same change (no notebook)",
         med(r["raw"]), None, None),
        ("unchanged_cell", med(r["unchanged"]), "s", "pickle.dumps of the array", r["pickle_dumps"],
         None, None),
        ("checkout_1pct", med(r["checkout"]), "s", "pickle.loads of the array", r["pickle_loads"],
         "<= 50 ms", med(r["checkout"]) <= 0.050),
        ("undo_1pct", med(r["undo"]), "s", "pickle.loads of the array", r["pickle_loads"],
         "<= 50 ms", med(r["undo"]) <= 0.050),
        ("stored_per_cell", med(r["stored"]), "B", "pages the cell wrote", written,
         "<= 2x the written pages", med(r["stored"]) <= 2 * written),
        ("first_commit", r["first_commit"], "s", "pickle.dumps of the array", r["pickle_dumps"],
         None, None),
    ]
    return [{"name": n, "value": round(v, 9) if u == "s" else int(v), "unit": u, "peer": p,
             "peer_value": round(pv, 9) if u == "s" else int(pv),
             "ratio": float(f"{pv / v:.6g}") if v else None, "bytes": nbytes,
             "target": t, "met": m} for n, v, u, p, pv, t, m in rows]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1G", help="the array's size (default 1G)")
    ap.add_argument("--repeat", type=int, default=5, help="1%% cells, checkouts and undos (default 5)")
    ap.add_argument("--small", action="store_true", help="64 MiB, 3 repeats (the test suite's run)")
    ap.add_argument("--store", help="store directory (default: a new one under /dev/shm, removed after)")
    ap.add_argument("--json", action="store_true", help="one JSON object per figure")
    args = ap.parse_args()
    nbytes, repeat = (64 << 20, 3) if args.small else (parse_size(args.size), args.repeat)
    if nbytes < 4096 * 100 or repeat < 1:
        sys.exit("notebook_bench: --size must be at least 400K and --repeat at least 1")
    global memdvr
    try:
        import memdvr
    except ImportError:
        sys.exit("notebook_bench: cannot import memdvr: run with PYTHONPATH=build/python")
    for needed in ("ipykernel", "nbclient", "nbformat"):
        if importlib.util.find_spec(needed) is None:
            print(f"SKIP: {needed} is not installed (Debian: python3-nbclient python3-ipykernel)",
                  file=sys.stderr)
            return 77
    own = args.store is None
    store_dir = args.store or tempfile.mkdtemp(prefix="dvr-nb-bench-store-",
                                               dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        r = run(nbytes, repeat, store_dir)
    finally:
        if own:
            shutil.rmtree(store_dir, ignore_errors=True)
    rows = figures(r, nbytes)
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    print(f"notebook history, {nbytes / 2**20:.0f} MiB float32 array, 1% of the pages per cell "
          f"({r['pages']} pages), medians of {repeat}; array page-aligned: {r['aligned']}")
    for row in rows:
        if row["unit"] == "s":
            val, peer = f"{row['value'] * 1e3:.2f} ms", f"{row['peer_value'] * 1e3:.2f} ms"
        else:
            val, peer = f"{row['value'] / 2**20:.2f} MiB", f"{row['peer_value'] / 2**20:.2f} MiB"
        target = f"  target {row['target']}: {'met' if row['met'] else 'MISSED'}" if row["target"] else ""
        print(f"  {row['name']:<19} {val:>12}   {row['peer']}: {peer} ({row['ratio']}x){target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
