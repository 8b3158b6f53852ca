"""TCP servers under `dvr proc`, driven by their own clients (docs/criu.md,
"TCP servers"): redis-server and memcached listening on 127.0.0.1 are dumped,
killed and restored, and their listening sockets come back with every key;
with `--tcp-established` a client's open connection survives the dump and the
restore; without it a dump of a job with a connected client fails saying so.

Needs root, CRIU that can dump inet sockets here (>= 4.2 on Linux >= 6.16)
and the servers (install-deps.sh installs redis-server, redis-tools,
memcached and python3-pymemcache); skips with the reason otherwise.

Run: DVR_BIN=build/dvr DVR_TEST_JOB=build/dvr-test-job /usr/bin/python3 -m pytest tests/proc/test_tcp_servers.py
"""

import json
import os
import secrets
import signal
import socket
import subprocess
import time

import pytest
from dvrtest import MIB, alive, criu_dumps_inet_sockets, criu_version, describe, kernel_version, wait_gone

REDIS_SERVER = "/usr/bin/redis-server"
REDIS_CLI = "/usr/bin/redis-cli"
MEMCACHED = "/usr/bin/memcached"


@pytest.fixture(autouse=True)
def _needs_inet_sockets():
    if not criu_dumps_inet_sockets():
        pytest.skip(f"CRIU {'.'.join(map(str, criu_version() or ()))} cannot dump TCP sockets on Linux "
                    f"{'.'.join(map(str, kernel_version()))} (CRIU < 4.2: SO_PASSCRED is refused on inet sockets "
                    f"since 6.16); run install-deps.sh")


def needs(*paths, what):
    missing = [p for p in paths if not os.access(p, os.X_OK)]
    if missing:
        pytest.skip(f"{', '.join(missing)} missing (install-deps.sh installs {what})")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port):
    """True when something accepts connections on 127.0.0.1:port."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def sigkill(pid):
    os.kill(pid, signal.SIGKILL)
    assert wait_gone(pid), f"pid {pid} survived SIGKILL"


def memcached_set_all(pymemcache, port, values):
    """Sets every (key, value) in memcached at 127.0.0.1:PORT and reads "big"
    back, then disconnects (a connected client would need --tcp-established)."""
    client = pymemcache.Client(("127.0.0.1", port), connect_timeout=5, timeout=10)
    assert client.set_many(values, noreply=False) == []
    assert client.get("big") == values["big"]
    client.close()


# --- redis: its own client (redis-cli), and a raw RESP connection

def resp(*words):
    out = [f"*{len(words)}\r\n".encode()]
    for w in words:
        b = w if isinstance(w, bytes) else str(w).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


def redis_cli(port, *args, stdin=None, binary=False, timeout=60):
    """redis-cli -p PORT ARGS...: its output, stripped (bytes as they are with binary=True)."""
    proc = subprocess.run([REDIS_CLI, "-p", str(port), *[str(a) for a in args]], input=stdin, capture_output=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"redis-cli {args} -> {proc.returncode}: {proc.stdout[-2000:]!r} {proc.stderr[-2000:]!r}"
    return proc.stdout if binary else proc.stdout.decode().strip()


def wait_redis(port, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        proc = subprocess.run([REDIS_CLI, "-p", str(port), "ping"], capture_output=True, text=True, timeout=10)
        if proc.stdout.strip() == "PONG":
            return
        time.sleep(0.05)
    raise AssertionError(f"redis-server on 127.0.0.1:{port} did not answer PONG within {timeout} s")


def start_redis(work):
    needs(REDIS_SERVER, REDIS_CLI, what="redis-server and redis-tools")
    port = free_port()
    argv = [REDIS_SERVER, "--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--daemonize", "no", "--dir", work.root]
    work.tokens.add(f"127.0.0.1:{port}")  # redis-server renames its command line
    pid = work.dvr_run(argv, work.path("redis.out"))
    wait_redis(port)
    return pid, port


def value_of(i):
    return f"value-{i}-" + "x" * (i % 97)


def nft_tables():
    """The host's nftables tables ("inet CRIU-..." ...) through libnftables, as
    CRIU's network lock makes them; None when libnftables cannot be used."""
    import ctypes
    try:
        lib = ctypes.CDLL("libnftables.so.1")
    except OSError:
        return None
    lib.nft_ctx_new.restype = ctypes.c_void_p
    lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
    lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.nft_ctx_get_output_buffer.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_get_output_buffer.restype = ctypes.c_char_p
    lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
    ctx = lib.nft_ctx_new(0)
    try:
        lib.nft_ctx_buffer_output(ctx)
        if lib.nft_run_cmd_from_buffer(ctx, b"list tables") != 0:
            return None
        out = lib.nft_ctx_get_output_buffer(ctx) or b""
        return {line.strip()[len("table "):] for line in out.decode().splitlines() if line.startswith("table ")}
    finally:
        lib.nft_ctx_free(ctx)


class RespConnection:
    """One TCP connection to redis, held open by this process (the client side
    of an established connection), speaking RESP over a raw socket."""

    def __init__(self, port):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.buf = b""

    def send(self, *words):
        self.sock.sendall(resp(*words))

    def reply(self):
        """One simple reply line (+PONG, +OK, :42) or a bulk string's bytes."""
        while b"\r\n" not in self.buf:
            chunk = self.sock.recv(65536)
            assert chunk, "redis closed the connection"
            self.buf += chunk
        line, self.buf = self.buf.split(b"\r\n", 1)
        if not line.startswith(b"$"):
            return line
        n = int(line[1:])
        while len(self.buf) < n + 2:
            chunk = self.sock.recv(65536)
            assert chunk, "redis closed the connection"
            self.buf += chunk
        data, self.buf = self.buf[:n], self.buf[n + 2:]
        return data

    def call(self, *words):
        self.send(*words)
        return self.reply()

    def close(self):
        self.sock.close()


def test_redis_tcp_server_comes_back_listening_with_every_key(work):
    """redis-server on 127.0.0.1, a few MB of keys loaded with `redis-cli
    --pipe` and canary keys set; dumped (left running), SIGKILLed, restored:
    its listening socket is back and every canary reads back exactly."""
    t0 = time.monotonic()
    pid, port = start_redis(work)
    n = 40000
    load = b"".join(resp("SET", f"key:{i}", value_of(i)) for i in range(n))
    big = os.urandom(2 * MIB)
    load += resp("SET", "big", big)
    out = redis_cli(port, "--pipe", stdin=load, timeout=120)
    assert "errors: 0" in out, out
    canaries = {f"canary:{k}": secrets.token_hex(16 + k) for k in range(5)}
    for key, value in canaries.items():
        assert redis_cli(port, "SET", key, value) == "OK"
    assert redis_cli(port, "DBSIZE") == str(n + 1 + len(canaries))

    info = work.dump(pid, "redis", leave_running=True)
    assert info["image_bytes"] > 4 * MIB, info
    assert info["tcp_established"] is False, info
    sigkill(pid)
    assert not listening(port), "the killed redis-server still listens"

    restored = work.restore("redis")
    wait_redis(port)
    assert redis_cli(port, "ping") == "PONG"
    for key, value in canaries.items():
        assert redis_cli(port, "GET", key) == value, key
    assert redis_cli(port, "DBSIZE") == str(n + 1 + len(canaries))
    for i in (0, 1, 4242, n - 1):
        assert redis_cli(port, "GET", f"key:{i}") == value_of(i)
    assert redis_cli(port, "--raw", "GET", "big", binary=True)[:len(big)] == big
    assert redis_cli(port, "SET", "after", "restore") == "OK" and redis_cli(port, "GET", "after") == "restore"
    assert alive(restored)
    print(f"redis over TCP: {time.monotonic() - t0:.1f} s (dump {info['seconds']:.2f} s, "
          f"{info['image_bytes'] / MIB:.1f} MiB of images)")


def test_redis_client_connection_survives_dump_and_restore_with_tcp_established(work):
    """A client holds a TCP connection to redis across `dvr proc dump
    --tcp-established` (the job is dumped and killed) and `dvr proc restore`
    (which passes --tcp-established itself, as the snapshot records it): the
    same socket answers PING with +PONG afterwards. A second connection sends
    a command while the server is gone; CRIU's network lock drops it, the
    client's TCP retransmits it, and the restored server answers it."""
    pid, port = start_redis(work)
    canary = secrets.token_hex(24)
    tables_before = nft_tables()
    quiet, busy = RespConnection(port), RespConnection(port)
    try:
        assert quiet.call("SET", "canary", canary) == b"+OK"
        assert busy.call("PING") == b"+PONG"

        proc = work.dvr("proc", "dump", pid, "--name", "est", "--tcp-established", "--json")
        info = json.loads(proc.stdout)
        assert info["tcp_established"] is True, info
        assert wait_gone(pid), "dump without --leave-running left redis running"
        assert work.dvr_json("proc", "info", "est")["tcp_established"] is True
        if tables_before is not None:  # CRIU's lock: a table of its own, until the restore
            assert len(nft_tables() - tables_before) == 1, (tables_before, nft_tables())

        busy.send("GET", "canary")  # while nothing serves it: dropped, retransmitted later

        proc = work.dvr("proc", "restore", "est", "--detach")
        assert "--tcp-established" in proc.stderr, describe(proc)
        restored = int(proc.stdout.strip())
        work.pids.add(restored)

        assert quiet.call("PING") == b"+PONG", "the connection held across the dump does not answer"
        assert quiet.call("GET", "canary") == canary.encode()
        assert busy.reply() == canary.encode(), "the command sent while redis was dumped got no answer"
        assert busy.call("PING") == b"+PONG"
        wait_redis(port)  # new connections too
        assert redis_cli(port, "GET", "canary") == canary
        assert alive(restored)
        if tables_before is not None:
            assert nft_tables() == tables_before, "the restore left CRIU's network lock in place"
    finally:
        quiet.close()
        busy.close()


def test_dump_with_a_connected_client_says_to_use_tcp_established(work):
    """Without --tcp-established CRIU refuses a connected TCP socket; the
    message says what to do, nothing is stored, and redis and its client go
    on as if nothing happened."""
    pid, port = start_redis(work)
    conn = RespConnection(port)
    try:
        assert conn.call("SET", "k", "v") == b"+OK"
        proc = work.dvr("proc", "dump", pid, "--name", "refused", expect=None)
        assert proc.returncode != 0, describe(proc)
        assert proc.stderr.startswith("dvr: ") and "--tcp-established" in proc.stderr, describe(proc)
        assert "dvr proc dump --tcp-established" in proc.stderr, describe(proc)
        assert alive(pid)
        assert conn.call("GET", "k") == b"v", "the client's connection broke in a refused dump"
        assert work.proc_ls() == []
    finally:
        conn.close()


# --- memcached, with a real client (pymemcache)

def test_memcached_tcp_server_keeps_its_keys(work):
    needs(MEMCACHED, what="memcached")
    pymemcache = pytest.importorskip("pymemcache.client.base", reason="python3-pymemcache is missing (install-deps.sh installs it)")
    port = free_port()
    argv = [MEMCACHED, "-l", "127.0.0.1", "-p", port, "-U", "0", "-m", "64", "-t", "2",
            "-P", work.path("memcached.pid"), *(["-u", "root"] if os.geteuid() == 0 else [])]
    pid = work.dvr_run(argv, work.path("memcached.out"))
    assert wait_until_listening(port), "memcached does not listen"

    values = {f"key:{i}": (f"{i}:" + "m" * (i % 300)).encode() for i in range(3000)}
    values["big"] = os.urandom(512 * 1024)
    memcached_set_all(pymemcache, port, values)

    info = work.dump(pid, "memcached")
    assert info["image_bytes"] > 0, info
    assert not listening(port), "the dumped memcached still listens"

    restored = work.restore("memcached")
    assert wait_until_listening(port), "the restored memcached does not listen"
    client = pymemcache.Client(("127.0.0.1", port), connect_timeout=5, timeout=10)
    try:
        got = client.get_many(list(values))
        assert set(got) == set(values), f"{len(set(values) - set(got))} keys missing after restore"
        assert all(got[k] == v for k, v in values.items())
        assert client.set("after", b"restore") and client.get("after") == b"restore"
    finally:
        client.close()
    assert alive(restored)


def wait_until_listening(port, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if listening(port):
            return True
        time.sleep(0.05)
    return False


def test_clone_of_a_tcp_established_dump_gets_its_connections_closed(work):
    """A clone must not take over the original's connections: `dvr proc
    clone` of a --tcp-established dump restores them closed (--tcp-close)
    and says so; the clone serves new connections. (Here the original is
    killed first: beside it, the clone could not bind the same port without
    --net new.) A dump with --leave-running leaves the connection working
    with the original."""
    pid, port = start_redis(work)
    conn = RespConnection(port)
    try:
        assert conn.call("SET", "canary", "c1") == b"+OK"
        info = work.dump(pid, "est", "--tcp-established", leave_running=True)
        assert info["tcp_established"] is True, info
        assert conn.call("PING") == b"+PONG", "--leave-running: the original keeps its connection"
        sigkill(pid)

        proc = work.dvr("proc", "clone", "est")
        assert "--tcp-close" in proc.stderr, describe(proc)
        clone = int(proc.stdout.strip())
        work.pids.add(clone)
        wait_redis(port)
        assert redis_cli(port, "GET", "canary") == "c1"
        try:
            conn.send("PING")
            answer = conn.sock.recv(100)
        except OSError:
            answer = b""
        assert answer == b"", f"the clone answered on the original's connection: {answer!r}"
        assert alive(clone)
    finally:
        conn.close()
