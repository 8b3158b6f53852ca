#!/usr/bin/python3
"""Memory and speed of moving a snapshot through a stream: dvr export/import
and dvr send | dvr receive, each process's peak resident memory next to the
256 MiB limit, and each throughput next to the same command of another dvr
(an older build, --peer-dvr) or, without one, next to cat of the same bytes.

    /usr/bin/python3 bench/transfer_rss.py [--size 4G] [--build build] [--peer-dvr OLD/dvr] [--json]

Takes a snapshot of --size bytes (float32 normal noise, like a data set) in a
store on /dev/shm, then measures, on pre-faulted data:
  export_rss / import_rss      peak RSS of dvr export / dvr import     vs 256 MiB
  send_rss / receive_rss       peak RSS of dvr send / dvr receive      vs 256 MiB
  export_gbps ... receive_gbps logical GB/s of each                    vs the peer dvr (or cat)
With --json, one object per line: {"name", "value", "unit", "peer", "peer_value", "ratio"}.
Peak RSS is each process's own maximum resident set (GNU time's %M), which
counts the store's tmpfs pages that process maps and touches.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

LIMIT_MIB = 256


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B").rstrip("I")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1:] in units else int(text)


def measured(cmds, stdin_file=None, stdout_file=None):
    """Runs a pipeline of commands; returns ([peak RSS MiB of each], seconds)."""
    t = time.perf_counter()
    procs = []
    prev = open(stdin_file, "rb") if stdin_file else subprocess.DEVNULL
    out = open(stdout_file, "wb") if stdout_file else None
    reports = []
    for k, c in enumerate(cmds):
        last = k == len(cmds) - 1
        # GNU time reports the command's own peak RSS (ru_maxrss of a child of
        # this big Python process would include the Python process's own peak:
        # Linux keeps the high-water mark across exec).
        fd, report = tempfile.mkstemp(prefix="dvr-rss-")
        os.close(fd)
        reports.append(report)
        c = ["/usr/bin/time", "-f", "%M", "-o", report] + c
        p = subprocess.Popen(c, stdin=prev, stdout=(out if out else subprocess.DEVNULL) if last else subprocess.PIPE,
                             stderr=subprocess.PIPE)
        if prev not in (subprocess.DEVNULL, None) and not isinstance(prev, int):
            prev.close()
        prev = p.stdout
        procs.append(p)
    rss = []
    for p, c, report in zip(procs, cmds, reports):
        err = p.stderr.read().decode(errors="replace")
        p.wait()
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(c)} failed ({p.returncode}): {err}")
        with open(report) as f:
            rss.append(int(f.read().split()[-1]) / 1024)  # KiB
        os.unlink(report)
    if out:
        out.close()
    return rss, time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="4G")
    ap.add_argument("--build", default="build")
    ap.add_argument("--peer-dvr", default="", help="another dvr binary to compare throughput with (e.g. an older build)")
    ap.add_argument("--json", action="store_true", help="JSON lines (with --table, the table too)")
    ap.add_argument("--table", action="store_true")
    args = ap.parse_args()
    build = os.path.abspath(args.build)
    dvr = os.path.join(build, "dvr")
    size = parse_size(args.size) // 4096 * 4096
    sys.path.insert(0, os.path.join(build, "python"))
    import numpy as np
    import memdvr

    work = tempfile.mkdtemp(prefix="dvr-transfer-rss-", dir="/dev/shm")
    files = tempfile.mkdtemp(prefix="dvr-transfer-rss-", dir="/var/tmp")
    rows = []
    try:
        a = os.path.join(work, "a")
        s = memdvr.Session(memdvr.Store(a), "data")
        arr = s.array("x", (size // 4,), np.float32)
        arr[:] = np.random.default_rng(3).standard_normal(arr.size, dtype=np.float32)
        s.snapshot("v0")
        del arr, s
        export = os.path.join(files, "x.dvr")

        def one(binary, tag):
            stores = {k: os.path.join(work, f"{tag}-{k}") for k in ("import", "receive")}
            r = {}
            f = export + "." + tag
            rss, t = measured([[binary, "--store", a, "export", "data/v0", "-o", f]])
            r["export"] = (rss[0], t)
            rss, t = measured([[binary, "--store", stores["import"], "import", f]])
            r["import"] = (rss[0], t)
            rss, t = measured([[binary, "--store", a, "send", "data/v0"], [binary, "--store", stores["receive"], "receive"]])
            r["send"] = (rss[0], t)
            r["receive"] = (rss[1], t)
            os.unlink(f)
            for p in stores.values():
                shutil.rmtree(p, ignore_errors=True)
            return r

        one(dvr, "warm")  # faults the store's pages in, warms the page cache
        mine = one(dvr, "new")
        if args.peer_dvr:
            peer, peer_name = one(os.path.abspath(args.peer_dvr), "peer"), "peer dvr"
        else:
            # cat of the stream's own bytes: the speed of moving them at all.
            f = export + ".cat"
            measured([[dvr, "--store", a, "export", "data/v0", "-o", f]])
            _, t = measured([["cat", f]])
            peer, peer_name = {k: (0, t) for k in mine}, "cat of the export file"
            os.unlink(f)
        gb = size / 1e9
        for op in ("export", "import", "send", "receive"):
            rss, t = mine[op]
            rows.append({"name": f"{op}_rss", "value": round(rss, 1), "unit": "MiB", "peer": "limit",
                         "peer_value": LIMIT_MIB, "ratio": round(rss / LIMIT_MIB, 3)})
            if args.peer_dvr:
                rows.append({"name": f"{op}_rss_peer", "value": round(peer[op][0], 1), "unit": "MiB", "peer": "limit",
                             "peer_value": LIMIT_MIB, "ratio": round(peer[op][0] / LIMIT_MIB, 3)})
            rows.append({"name": f"{op}_gbps", "value": round(gb / t, 3), "unit": "GB/s", "peer": peer_name,
                         "peer_value": round(gb / peer[op][1], 3), "ratio": round(peer[op][1] / t, 3)})
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(files, ignore_errors=True)
    if args.json:
        for r in rows:
            print(json.dumps(r))
    if not args.json or args.table:
        print(f"transfer-rss: {size / 2**30:.2f} GiB snapshot (float32 noise), stores on /dev/shm, files on /var/tmp")
        for r in rows:
            print(f"  {r['name']:<18} {r['value']:>9} {r['unit']:<5}  {r['peer']}: {r['peer_value']} (ratio {r['ratio']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
