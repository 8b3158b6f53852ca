#!/usr/bin/python3
"""Moving a snapshot to another store through ssh, against moving its bytes
with cat and zstd through the same ssh connection.

    sudo /usr/bin/python3 bench/migrate_bench.py [--size 1G] [--repeat 2] [--json] [--build build]

Starts an sshd on 127.0.0.1 with throw-away keys and, for each data set of
--size bytes (best of --repeat each):
  noise   float32 normal noise, barely compressible (zstd -1: ~1.09x)
  mix     a realistic compressible mix, a quarter each: a sparse float32
          array (5% non-zero), int64 timestamps (sorted, small steps),
          text-like words (Zipf-distributed from a vocabulary), float32 noise
takes a snapshot in store A and measures, in the same run:
  push_full_DATA   dvr push of it to store B      vs cat of its bytes through ssh,
                                                     and zstd -1 | ssh | zstd -d;
                                                     (noise) vs cat | ssh 'cat > FILE',
                                                     FILE new beside store B: the
                                                     bytes kept, as a push keeps them
  push_1pct        (noise) push again after 1% of the pages changed (scattered:
                   every 100th page)               vs push_full_noise (target: <= 3%)
  push_1pct        the same                        vs `ssh HOST true` (the cost of the connection alone)
  push_1pct_bytes  bytes that second push sent     vs the first push's
  push_1pct_kept   (noise) the same 1% push through a connection and a far
                   receiver kept by an earlier one (--keep-ssh: no login, no
                   dvr start there)                 vs push_full_noise, and vs
                   `ssh HOST true` through that connection (what a session
                   that logs in costs)
  push_full_nologin, push_1pct_nologin
                   (noise) the same pushes to a third store with --ssh a script
                   that runs the far command here (no ssh, no login, no
                   encryption): dvr's own part   the 1% push vs the full one
With --json, one object per line: {"name", "value", "unit", "peer",
"peer_value", "ratio", "bytes", "data"}: value and peer_value are costs
(seconds, bytes) and ratio = peer_value / value, so above 1 means ours is
better (the convention of every benchmark here, docs/performance.md).
Without --json, a table with each figure next to its peer.
Needs root (for sshd), openssh-server, zstd.
"""

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B").rstrip("I")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1:] in units else int(text)


def run(args, **kw):
    t = time.perf_counter()
    p = subprocess.run(args, capture_output=True, text=True, **kw)
    took = time.perf_counter() - t
    if p.returncode != 0:
        raise RuntimeError(f"{args if isinstance(args, str) else ' '.join(map(str, args))} failed ({p.returncode}):\n{p.stdout}{p.stderr}")
    return p.stdout, took


def start_sshd(root):
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    host, client = os.path.join(root, "host"), os.path.join(root, "client")
    for k in (host, client):
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", k])
    auth = os.path.join(root, "authorized_keys")
    shutil.copy(client + ".pub", auth)
    os.chmod(auth, 0o600)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf = os.path.join(root, "sshd_config")
    with open(conf, "w") as f:
        f.write(f"Port {port}\nListenAddress 127.0.0.1\nHostKey {host}\nPidFile {root}/sshd.pid\n"
                f"AuthorizedKeysFile {auth}\nPermitRootLogin prohibit-password\nPasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n")
    sshd = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", conf], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ssh = (f"ssh -p {port} -i {client} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "
           "-o BatchMode=yes -o LogLevel=ERROR")
    for _ in range(200):
        if subprocess.run(f"{ssh} root@127.0.0.1 true", shell=True, capture_output=True).returncode == 0:
            return sshd, ssh, port
        time.sleep(0.05)
    sshd.kill()
    raise RuntimeError("sshd did not start")


def stop_kept_receivers(work):
    """Ends the kept receivers (`dvr receive --listen`, left by the pushes
    with --keep-ssh) of the stores under WORK, and removes their sockets and
    logs; alone they would wait out their idle time."""
    for pid in os.listdir("/proc"):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"--listen" in argv and any(a.startswith(work.encode()) for a in argv):
            try:
                log = os.readlink(f"/proc/{pid}/fd/2")  # its stderr is its log, beside its socket
            except OSError:
                log = ""
            try:
                os.kill(int(pid), 9)
            except (OSError, ValueError):
                pass
            if log.endswith(".log"):
                for leftover in (log, log[:-len(".log")] + ".sock"):
                    try:
                        os.unlink(leftover)
                    except OSError:
                        pass


def fill(np, arr, data):
    """Fills the uint8 array `arr` with data set `data` (deterministic)."""
    rng = np.random.default_rng(3)
    if data == "noise":
        arr.view(np.float32)[:] = rng.standard_normal(arr.size // 4, dtype=np.float32)
        return
    quarter = arr.size // 4 // 4096 * 4096
    sparse = arr[:quarter].view(np.float32)
    sparse[:] = 0
    mask = rng.random(sparse.size) < 0.05
    sparse[mask] = rng.standard_normal(int(mask.sum()), dtype=np.float32)
    del mask
    stamps = arr[quarter:2 * quarter].view(np.int64)
    stamps[:] = np.cumsum(rng.integers(0, 1000, stamps.size)) + 1_700_000_000_000_000
    vocab = [bytes(rng.choice(list(b"abcdefghijklmnopqrstuvwxyz"), int(rng.integers(2, 11)))) for _ in range(5000)]
    vocab = [w + (b"\n" if k % 17 == 0 else b" ") for k, w in enumerate(vocab)]
    blob = np.frombuffer(b"".join(vocab), np.uint8)
    lens = np.array([len(w) for w in vocab])
    starts = np.concatenate(([0], np.cumsum(lens)[:-1]))
    text = arr[2 * quarter:3 * quarter]
    at, piece = 0, 1 << 22
    while at < text.size:  # Zipf-distributed words, 4 MiB at a time
        ids = np.minimum(rng.zipf(1.2, piece // 4), len(vocab)) - 1
        word = np.repeat(ids, lens[ids])
        offset = np.arange(word.size) - np.repeat(np.cumsum(lens[ids]) - lens[ids], lens[ids])
        chunk = blob[starts[word] + offset]
        n = min(chunk.size, text.size - at)
        text[at:at + n] = chunk[:n]
        at += n
    arr[3 * quarter:].view(np.float32)[:] = rng.standard_normal((arr.size - 3 * quarter) // 4, dtype=np.float32)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1G")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--build", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build"))
    args = ap.parse_args()
    if os.geteuid() != 0 or not os.path.exists("/usr/sbin/sshd"):
        print("migrate_bench: needs root and /usr/sbin/sshd", file=sys.stderr)
        return 77
    build = os.path.abspath(args.build)
    dvr = os.path.join(build, "dvr")
    size = parse_size(args.size) // 4096 * 4096
    repeat = max(1, args.repeat)
    sys.path.insert(0, os.path.join(build, "python"))
    import numpy as np
    import memdvr

    work = tempfile.mkdtemp(prefix="dvr-migrate-bench-", dir="/dev/shm")
    sshd = None
    figures = []  # (name, value, unit, peer, peer value, data set)
    try:
        sshd, ssh, port = start_sshd(work)
        a, b = os.path.join(work, "a"), os.path.join(work, "b")
        url = f"ssh://root@127.0.0.1:{port}{b}"
        common = ["--ssh", ssh, "--remote-dvr", dvr, "--json"]
        ssh_s = min(run(f"{ssh} root@127.0.0.1 true", shell=True)[1] for _ in range(max(3, repeat)))
        store = memdvr.Store(a)
        for data in ("noise", "mix"):
            s = memdvr.Session(store, data)
            arr = s.array("x", (size,), np.uint8)
            fill(np, arr, data)
            s.snapshot("v0")
            raw = os.path.join(work, "raw.bin")
            arr.tofile(raw)
            cat_s = min(run(f"cat {raw} | {ssh} root@127.0.0.1 'cat > /dev/null'", shell=True)[1] for _ in range(repeat))
            zstd_s = min(run(f"zstd -1 -q -c {raw} | {ssh} root@127.0.0.1 'zstd -d -q -c > /dev/null'", shell=True)[1]
                         for _ in range(repeat))
            if data == "noise":
                # The bytes kept at the far end, in a new file on the medium of
                # store B (a push stores what it moves; cat > /dev/null does not).
                far = os.path.join(work, "far.bin")
                cat_file_s = []
                for _ in range(repeat):
                    cat_file_s.append(run(f"cat {raw} | {ssh} root@127.0.0.1 'cat > {far}'", shell=True)[1])
                    os.unlink(far)
            os.unlink(raw)

            full_s, full_bytes = [], 0
            for r in range(repeat):
                out, took = run([dvr, "--store", a, "push", f"{data}/v0", url] + common)
                full_s.append(took)
                full_bytes = json.loads(out)["sent_bytes"]
                if r + 1 < repeat:
                    run([dvr, "--store", b, "rm", f"{data}/v0"])
                    run([dvr, "--store", b, "gc"])
            figures += [(f"push_full_{data}", min(full_s), "s", "cat | ssh", cat_s, data),
                        (f"push_full_{data}", min(full_s), "s", "zstd -1 | ssh | zstd -d", zstd_s, data)]
            if data == "noise":
                figures.append((f"push_full_{data}", min(full_s), "s", "cat | ssh 'cat > FILE' (far end keeps it)", min(cat_file_s), data))
                pct_s, pct_bytes = [], []
                pages = arr.reshape(-1, 4096)
                for r in range(repeat):
                    pages[r % 100::100, 7] ^= np.uint8(1 + r)
                    s.snapshot(f"v{r + 1}")
                    out, took = run([dvr, "--store", a, "push", f"{data}/v{r + 1}", url] + common)
                    info = json.loads(out)
                    assert info["base"] == f"v{r}", info
                    pct_s.append(took)
                    pct_bytes.append(info["sent_bytes"])
                # The same through one kept connection (--keep-ssh): the
                # first of these pushes opens it and is not counted.
                kept_s, env = [], dict(os.environ, XDG_RUNTIME_DIR=work)
                control = f"-o ControlPath={work}/dvr-ssh/%C"
                try:
                    for r in range(repeat, 2 * repeat + 1):
                        pages[r % 100::100, 7] ^= np.uint8(1 + r)
                        s.snapshot(f"v{r + 1}")
                        out, took = run([dvr, "--store", a, "push", f"{data}/v{r + 1}", url, "--keep-ssh", "60"] + common,
                                        env=env)
                        assert json.loads(out)["base"] == f"v{r}", out
                        if r > repeat:
                            kept_s.append(took)
                    kept_true = min(run(f"{ssh} {control} root@127.0.0.1 true", shell=True)[1] for _ in range(3))
                finally:
                    subprocess.run(f"{ssh} {control} -O exit root@127.0.0.1", shell=True, capture_output=True)
                # dvr alone: the far command run here by a stand-in for ssh.
                local = os.path.join(work, "local-ssh")
                with open(local, "w") as f:
                    f.write("#!/bin/sh\n# ssh's options and the host are skipped; the command runs here.\n"
                            "while [ $# -gt 0 ]; do case \"$1\" in -[pioFlSO]) shift 2;; -*) shift;; *) shift; break;; esac; done\n"
                            "exec sh -c \"$*\"\n")
                os.chmod(local, 0o700)
                c_url = f"ssh://root@127.0.0.1{os.path.join(work, 'c')}"
                c_opts = ["--ssh", local, "--remote-dvr", dvr, "--json"]
                n = 2 * repeat + 1
                nologin_full = run([dvr, "--store", a, "push", f"{data}/v{n}", c_url] + c_opts)[1]
                nologin_s = []
                for r in range(n, n + repeat):
                    pages[r % 100::100, 7] ^= np.uint8(1 + r)
                    s.snapshot(f"v{r + 1}")
                    out, took = run([dvr, "--store", a, "push", f"{data}/v{r + 1}", c_url] + c_opts)
                    assert json.loads(out)["base"] == f"v{r}", out
                    nologin_s.append(took)
                del pages
                figures += [("push_1pct", min(pct_s), "s", "push_full_noise", min(full_s), data),
                            ("push_1pct", min(pct_s), "s", "ssh HOST true", ssh_s, data),
                            ("push_1pct_bytes", max(pct_bytes), "B", "push_full_noise bytes", full_bytes, data),
                            ("push_1pct_kept", min(kept_s), "s", "push_full_noise", min(full_s), data),
                            ("push_1pct_kept", min(kept_s), "s", "ssh HOST true (kept connection)", kept_true, data),
                            ("push_1pct_nologin", min(nologin_s), "s", "push_full_nologin", nologin_full, data)]
            del arr
            s.close()

        if args.json:
            for name, value, unit, peer, pv, data in figures:
                print(json.dumps({"name": name, "value": value, "unit": unit, "peer": peer, "peer_value": pv,
                                  "ratio": pv / value, "bytes": size, "data": data}))
        else:
            print(f"migrate-bench: {size / 2**30:.2f} GiB snapshots, stores in {work} (tmpfs), ssh to 127.0.0.1, best of {repeat}\n")
            print(f"  {'figure':18} {'value':>12}   {'peer':26} {'peer value':>12}   ratio (peer / ours: > 1 is better)")
            for name, value, unit, peer, pv, data in figures:
                fmt = (lambda v: f"{v * 1000:9.1f} ms") if unit == "s" else (lambda v: f"{v / 2**20:8.2f} MiB")
                print(f"  {name:18} {fmt(value):>12}   {peer:26} {fmt(pv):>12}   {pv / value:8.3f}")
    finally:
        if sshd:
            sshd.kill()
            sshd.wait()
        stop_kept_receivers(work)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
