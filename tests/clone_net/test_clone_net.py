"""Clones with their own network and files: `dvr proc clone NAME --net new
--ip ADDR/PREFIX` restores a redis-server beside its running original in a
network namespace of its own (a veth pair to the host) and a private mount
view. The clone answers at ADDR:PORT with the data of the dump while the
original answers at 127.0.0.1:PORT and on its Unix socket with what it was
given since; the clone never unlinks or takes over the original's socket
file, and once the clone is killed its veth pair is gone and the original
is still reachable both ways. `--net NAME` restores into an existing
`ip netns` namespace; wrong options are refused with a message that says
what to do, and a clone that CRIU cannot restore leaves no interface,
namespace, process or socket change behind."""

import ipaddress
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest
from dvrtest import alive, describe, run, wait_gone, wait_until

REDIS_SERVER = "/usr/bin/redis-server"
REDIS_CLI = "/usr/bin/redis-cli"
N_KEYS = 20000


# --- helpers

def redis(target, *args, ok=True, timeout=30):
    """redis-cli TARGET... ARGS: its stripped stdout (checks the exit status unless ok=False)."""
    proc = subprocess.run([REDIS_CLI, *target, *[str(a) for a in args]], capture_output=True, text=True, timeout=timeout)
    if ok:
        assert proc.returncode == 0, f"redis-cli {target} {args} -> {proc.returncode}: {proc.stdout!r} {proc.stderr!r}"
    return proc.stdout.strip()


def in_netns(pid, *argv, mounts=False, timeout=30):
    """Runs argv in process `pid`'s network namespace (and mount namespace with mounts=True): its stdout."""
    ns = ["-n", "-m"] if mounts else ["-n"]
    proc = subprocess.run(["nsenter", "-t", str(pid), *ns, *[str(a) for a in argv]], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"nsenter -t {pid} {ns} {argv} -> {proc.returncode}: {proc.stdout!r} {proc.stderr!r}"
    return proc.stdout.strip()


def wait_pong(target, timeout=30):
    if not wait_until(lambda: redis(target, "ping", ok=False, timeout=10) == "PONG", timeout=timeout, interval=0.05):
        raise AssertionError(f"redis-server at {target} did not answer within {timeout} s")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resp(*words):
    out = [f"*{len(words)}\r\n".encode()]
    for w in words:
        b = str(w).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


def dvr_links():
    """The host's interfaces called dvr* (the host ends of clones' veth pairs)."""
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    return {m.group(1) for m in re.finditer(r"^\d+: (dvr[0-9a-f]+)[@:]", out, re.M)}


def host_networks():
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, check=True).stdout
    return re.findall(r"inet (\d+\.\d+\.\d+\.\d+/\d+)", out)


def free_clone_ip():
    """10.213.0.2/24, or the first 10.213.X.2/24 whose network no interface of the host uses."""
    used = [ipaddress.ip_network(a, strict=False) for a in host_networks()]
    for x in range(0, 256):
        net = ipaddress.ip_network(f"10.213.{x}.0/24")
        if not any(net.overlaps(u) for u in used):
            return f"10.213.{x}.2/24"
    pytest.skip("every 10.213.X.0/24 is in use on this host")


def net_namespaces():
    """The distinct network namespaces live processes are in."""
    found = set()
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                found.add(os.readlink(f"/proc/{e}/ns/net"))
            except OSError:
                pass
    return found


def smaps_rollup(pid):
    """/proc/PID/smaps_rollup in kB: Rss, Pss, Private (Private_Clean + Private_Dirty), Shared."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            m = re.match(r"(\w+):\s+(\d+) kB", line)
            if m:
                fields[m.group(1)] = int(m.group(2))
    return {"Rss": fields["Rss"], "Pss": fields["Pss"], "Private": fields["Private_Clean"] + fields["Private_Dirty"],
            "Shared": fields["Shared_Clean"] + fields["Shared_Dirty"]}


class Server:
    """A redis-server started with `dvr run`, on TCP 0.0.0.0:PORT (protected mode off, so that
    it answers from another network) and on a Unix socket in the test's scratch directory."""

    def __init__(self, work, binds=("0.0.0.0",)):
        self.work = work
        self.port = free_port()
        self.sock = work.path("redis.sock")
        argv = [REDIS_SERVER, "--port", self.port, "--bind", *binds, "--protected-mode", "no", "--save", "", "--appendonly", "no",
                "--daemonize", "no", "--dir", work.root, "--unixsocket", self.sock, "--unixsocketperm", "700"]
        work.tokens.add(f":{self.port}")  # redis-server renames its command line to "redis-server ADDR:PORT"
        self.pid = work.dvr_run(argv, work.path("redis.out"))
        self.tcp = ["-h", "127.0.0.1", "-p", str(self.port)]
        self.unix = ["-s", str(self.sock)]
        wait_pong(self.tcp)
        wait_pong(self.unix)

    def load_and_dump(self, name="redis"):
        load = b"".join(resp("SET", f"key:{i}", f"value-{i}") for i in range(N_KEYS)) + resp("SET", "phase", "snapshot")
        out = subprocess.run([REDIS_CLI, *self.tcp, "--pipe"], input=load, capture_output=True, timeout=120).stdout.decode()
        assert "errors: 0" in out, out
        info = self.work.dump(self.pid, name, leave_running=True)
        # The original moves on after the dump.
        assert redis(self.tcp, "SET", "phase", "newer") == "OK"
        assert redis(self.tcp, "SET", "key:0", "changed") == "OK"
        assert redis(self.unix, "SET", "only-in-original", "1") == "OK"
        return info

    def assert_answers_newer(self, context):
        for target in (self.tcp, self.unix):
            assert redis(target, "GET", "phase") == "newer", f"{context}: the original at {target}"
            assert redis(target, "GET", "key:0") == "changed", f"{context}: the original at {target}"
            assert redis(target, "DBSIZE") == str(N_KEYS + 2), f"{context}: the original at {target}"


def sock_identity(path):
    st = os.lstat(path)
    assert (st.st_mode & 0o170000) == 0o140000, f"{path} is no longer a socket: {oct(st.st_mode)}"
    return st.st_ino, st.st_dev, st.st_mtime_ns


def clone_answers_snapshot(target, context):
    assert redis(target, "GET", "phase") == "snapshot", f"{context}: the clone at {target}"
    assert redis(target, "GET", "key:0") == "value-0", f"{context}: the clone at {target}"
    assert redis(target, "GET", f"key:{N_KEYS - 1}") == f"value-{N_KEYS - 1}", f"{context}: the clone at {target}"
    assert redis(target, "EXISTS", "only-in-original") == "0", f"{context}: the clone at {target}"
    assert redis(target, "DBSIZE") == str(N_KEYS + 1), f"{context}: the clone at {target}"


# --- the tests

def test_clone_in_a_new_network_answers_with_the_dump_while_the_original_keeps_its_sockets(work):
    server = Server(work)
    server.load_and_dump()
    sock_before = sock_identity(server.sock)
    links_before = dvr_links()
    ip = free_clone_ip()
    addr = ip.split("/")[0]

    out = work.dvr_json("proc", "clone", "redis", "--net", "new", "--ip", ip)
    clone = out["pid"]
    work.pids.add(clone)
    assert alive(clone) and alive(server.pid)
    host_if = out["host_if"]
    assert out["net"] == "new" and out["ip"] == ip and out["host_ip"] == ip.rsplit(".", 1)[0] + ".1/24", out
    assert dvr_links() - links_before == {host_if}, f"expected one new veth host end {host_if}: {dvr_links()} (before {links_before})"
    assert os.readlink(f"/proc/{clone}/ns/net") != os.readlink(f"/proc/{server.pid}/ns/net")
    assert os.readlink(f"/proc/{clone}/ns/mnt") != os.readlink(f"/proc/{server.pid}/ns/mnt")

    # The original's socket file is the one it bound: not unlinked, not rebound.
    assert sock_identity(server.sock) == sock_before
    # Both run at once, each with its own data.
    clone_tcp = ["-h", addr, "-p", str(server.port)]
    wait_pong(clone_tcp)
    clone_answers_snapshot(clone_tcp, "from the host through the veth pair")
    server.assert_answers_newer("beside the clone")
    # Inside its namespace: 127.0.0.1 is the clone's, and so is the socket path in its mount view.
    assert in_netns(clone, REDIS_CLI, "-p", server.port, "GET", "phase") == "snapshot"
    assert in_netns(clone, REDIS_CLI, "-s", server.sock, "GET", "phase", mounts=True) == "snapshot"
    assert in_netns(clone, "stat", "-c", "%i", server.sock, mounts=True) != str(sock_before[0])
    # It sees the directory's other files (its output log is the original's file).
    assert in_netns(clone, "stat", "-c", "%i", work.path("redis.out"), mounts=True) == str(os.stat(work.path("redis.out")).st_ino)
    # A write to the clone stays in the clone.
    assert redis(clone_tcp, "SET", "phase", "clone-write") == "OK"
    assert redis(clone_tcp, "GET", "phase") == "clone-write"
    server.assert_answers_newer("after a write to the clone")

    rollup, original = smaps_rollup(clone), smaps_rollup(server.pid)
    print(f"\nclone {clone} smaps_rollup: Rss {rollup['Rss']} kB, Pss {rollup['Pss']} kB, "
          f"Private (Clean+Dirty) {rollup['Private']} kB, Shared {rollup['Shared']} kB; original {server.pid}: "
          f"Rss {original['Rss']} kB, Pss {original['Pss']} kB, Private {original['Private']} kB ({N_KEYS + 2} keys)")
    assert rollup["Private"] > 0 and rollup["Rss"] >= rollup["Private"]

    os.kill(clone, signal.SIGKILL)
    assert wait_gone(clone)
    assert wait_until(lambda: host_if not in dvr_links(), timeout=15), f"{host_if} outlived the clone"
    assert dvr_links() == links_before
    assert sock_identity(server.sock) == sock_before
    server.assert_answers_newer("after the clone was killed")
    assert alive(server.pid)


def test_clone_without_ip_gets_a_free_network_and_two_clones_run_at_once(work):
    server = Server(work)
    server.load_and_dump()
    links_before = dvr_links()
    first = work.dvr_json("proc", "clone", "redis", "--net", "new")
    work.pids.add(first["pid"])
    second = work.dvr_json("proc", "clone", "redis", "--net", "new")
    work.pids.add(second["pid"])
    for c in (first, second):
        assert c["ip"].endswith("/30") and c["ip"].startswith("10.213."), c
        clone_answers_snapshot(["-h", c["ip"].split("/")[0], "-p", str(server.port)], f"clone {c['pid']}")
    assert first["ip"] != second["ip"] and first["host_if"] != second["host_if"]
    assert dvr_links() - links_before == {first["host_if"], second["host_if"]}
    server.assert_answers_newer("beside two clones")
    for c in (first, second):
        os.kill(c["pid"], signal.SIGKILL)
    assert wait_until(lambda: dvr_links() == links_before, timeout=15), f"veth pairs outlived their clones: {dvr_links()}"
    server.assert_answers_newer("after both clones were killed")


def test_clone_into_an_existing_named_namespace(work):
    server = Server(work)
    server.load_and_dump()
    name = f"dvr-test-{uuid.uuid4().hex[:8]}"
    run(["ip", "netns", "add", name], expect=0)
    try:
        run(["ip", "-n", name, "link", "set", "lo", "up"], expect=0)
        out = work.dvr_json("proc", "clone", "redis", "--net", name)
        work.pids.add(out["pid"])
        assert out["net"] == f"/run/netns/{name}" and "ip" not in out, out
        got = run(["ip", "netns", "exec", name, REDIS_CLI, "-p", server.port, "GET", "phase"], expect=0).stdout.strip()
        assert got == "snapshot"
        server.assert_answers_newer("beside a clone in a named namespace")
        os.kill(out["pid"], signal.SIGKILL)
        assert wait_gone(out["pid"])
        assert os.path.exists(f"/run/netns/{name}"), "the caller's namespace must stay"
        server.assert_answers_newer("after that clone was killed")
    finally:
        run(["ip", "netns", "del", name])


def test_wrong_network_options_are_refused_saying_what_to_do(work):
    server = Server(work)
    server.load_and_dump()
    links, before = dvr_links(), work.running()
    sock = sock_identity(server.sock)
    cases = [
        (["--ip", "10.213.0.2/24"], [r"--ip and --host-ip need --net new"]),
        (["--net", "new", "--ip", "10.213.0.300/24"], [r"--ip '10\.213\.0\.300/24' is not an IPv4 address", r"ADDR/PREFIX"]),
        (["--net", "new", "--ip", "10.213.0.2"], [r"is not an IPv4 address with a prefix"]),
        (["--net", "new", "--ip", "10.213.0.0/24"], [r"network address", r"10\.213\.0\.2/24"]),
        (["--net", "new", "--ip", "127.0.0.2/8"], [r"network 127\.0\.0\.0/8 .* in use on this host", r"127\.0\.0\.1/8 on lo", r"another --ip"]),
        (["--net", "new", "--ip", "10.213.0.2/24", "--host-ip", "10.9.9.9"], [r"--host-ip 10\.9\.9\.9 must be another host address"]),
        (["--net", "dvr-no-such-netns"], [r"no network namespace 'dvr-no-such-netns'", r"ip netns add dvr-no-such-netns", r"--net new"]),
        (["--net", "/proc/self/ns/uts"], [r"is not a network namespace"]),
    ]
    for args, patterns in cases:
        proc = work.dvr("proc", "clone", "redis", *args, expect=None)
        assert proc.returncode != 0 and proc.stdout == "", describe(proc)
        err = proc.stderr.strip()
        assert err.startswith("dvr: "), describe(proc)
        for p in patterns:
            assert re.search(p, err), f"{args}: {p!r} not in the message\n{describe(proc)}"
    proc = work.dvr("proc", "restore", "redis", "--net", "new", expect=None)
    assert proc.returncode != 0 and re.search(r"are for clones", proc.stderr), describe(proc)
    # Not root, with a store of one's own holding the snapshot: CRIU needs root, and the message says so.
    own = Path(tempfile.mkdtemp(prefix="dvr-clone-net-nobody-", dir="/dev/shm"))
    try:
        shutil.copytree(work.store, own / "store", symlinks=True)
        for d, dirs, files in os.walk(own):
            for n in [d, *[os.path.join(d, x) for x in dirs + files]]:
                os.lchown(n, 65534, 65534)
        proc = run([work.dvr_bin, "--store", own / "store", "proc", "clone", "redis", "--net", "new", "--ip", "10.213.0.2/24"],
                   preexec_fn=lambda: (os.setgid(65534), os.setuid(65534)))
        assert proc.returncode != 0 and re.search(r"cannot clone a process: CRIU needs root.*run dvr proc as root", proc.stderr), describe(proc)
    finally:
        shutil.rmtree(own, ignore_errors=True)
    assert dvr_links() == links
    work.assert_nothing_new_running(before, "refused clones")
    assert sock_identity(server.sock) == sock
    server.assert_answers_newer("after the refused clones")


def test_a_clone_criu_cannot_restore_leaves_nothing_behind(work):
    # The server also listens on an address only the host has: in a new
    # namespace CRIU cannot bind it and fails after the network was made.
    extra = "10.214.99.1"
    run(["ip", "addr", "add", f"{extra}/32", "dev", "lo"], expect=0)
    try:
        server = Server(work, binds=("127.0.0.1", extra))
        server.load_and_dump()
        links, before, netns = dvr_links(), work.running(), net_namespaces()
        sock = sock_identity(server.sock)
        proc = work.dvr("proc", "clone", "redis", "--net", "new", expect=None)
        assert proc.returncode != 0, describe(proc)
        assert re.search(r"CRIU could not restore", proc.stderr) and re.search(r"Can't bind inet socket|Cannot assign", proc.stderr), describe(proc)
        assert wait_until(lambda: dvr_links() == links, timeout=30), f"a failed clone left {dvr_links() - links}"
        work.assert_nothing_new_running(before, "a failed clone")
        assert net_namespaces() <= netns, "a failed clone left a network namespace in use"
        assert sock_identity(server.sock) == sock
        for target in (server.tcp, server.unix):
            assert redis(target, "GET", "phase") == "newer"
    finally:
        run(["ip", "addr", "del", f"{extra}/32", "dev", "lo"])
