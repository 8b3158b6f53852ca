"""Moving snapshots between stores and servers (issue #6): `dvr send | dvr
receive` through a pipe, `export`/`import` through a file, `push`/`pull` over
ssh (a real sshd on 127.0.0.1, see conftest.py), for region snapshots and for
whole-process snapshots with their DVR heaps.

What must hold:
  * a received snapshot restores bit-exact in the receiving store;
  * against a base (`--base`, or the one push/pull negotiate) only what
    differs travels: after 1% of the pages of a 64 MiB snapshot changed, the
    second push sends at most 5% of what the first sent;
  * a damaged, truncated, tampered or foreign stream, a stream of another
    format version, a snapshot the receiver already holds, and a base it lacks
    are each refused with a message saying so, and the receiving store is
    exactly as before (listing, manifest files, temporary files, verify);
  * a process snapshot restores from the receiving store and continues, its
    heap brought back from the snapshot that travelled with it.
"""

import ctypes
import json
import os
import pty
import re
import select
import struct
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from dvrtest import MIB, WORKER_BYTES, alive, assert_failed, cmdline, describe, parse_json, processes_naming, run

# --- moving snapshots

def send_to_file(store, ref, path, *opts, expect=0):
    """`dvr send REF OPTS > path`; returns the process (stderr: the summary)."""
    with open(path, "wb") as out:
        proc = subprocess.run([str(a) for a in store.argv("send", ref, *opts)], stdin=subprocess.DEVNULL, stdout=out,
                              stderr=subprocess.PIPE, timeout=180)
    proc.stderr = proc.stderr.decode(errors="replace")
    proc.stdout = ""
    if expect is not None:
        assert proc.returncode == expect, describe(proc)
    return proc


def receive_from_file(store, path, *opts, expect=0):
    """`dvr receive OPTS < path`."""
    with open(path, "rb") as f:
        return store.dvr("receive", *opts, stdin=f, expect=expect)


def pipe(sender, ref, receiver, send_opts=(), receive_opts=("--json",), timeout=180):
    """`dvr --store A send REF SEND_OPTS | dvr --store B receive RECEIVE_OPTS`
    through a real pipe. Returns (send, receive): finished processes with text
    stdout/stderr (the sender's stdout is the pipe)."""
    with tempfile.TemporaryFile() as send_err, tempfile.TemporaryFile() as recv_out, \
            tempfile.TemporaryFile() as recv_err:
        send_argv = [str(a) for a in sender.argv("send", ref, *send_opts)]
        recv_argv = [str(a) for a in receiver.argv("receive", *receive_opts)]
        s = subprocess.Popen(send_argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=send_err)
        try:
            r = subprocess.Popen(recv_argv, stdin=s.stdout, stdout=recv_out, stderr=recv_err)
        except BaseException:
            s.kill()
            s.wait()
            raise
        s.stdout.close()  # the receiver holds the only read end: the sender sees EPIPE if it quits
        try:
            r.wait(timeout=timeout)
            s.wait(timeout=30)
        finally:
            for p in (r, s):
                if p.poll() is None:
                    p.kill()
                    p.wait()
        results = []
        for argv, p, out, err in ((send_argv, s, None, send_err), (recv_argv, r, recv_out, recv_err)):
            err.seek(0)
            text_out = ""
            if out is not None:
                out.seek(0)
                text_out = out.read().decode(errors="replace")
            results.append(subprocess.CompletedProcess(argv, p.returncode, text_out, err.read().decode(errors="replace")))
    return tuple(results)


def pipe_ok(sender, ref, receiver, send_opts=("--json",)):
    """A successful pipe round trip: (send summary, receive summary), both --json."""
    s, r = pipe(sender, ref, receiver, send_opts=send_opts, receive_opts=("--json",))
    assert s.returncode == 0, describe(s) + "\n(receiver)\n" + describe(r)
    assert r.returncode == 0, describe(r) + "\n(sender)\n" + describe(s)
    return parse_json(s.stderr, "the summary send --json prints on stderr", s), \
        parse_json(r.stdout, "the summary receive --json prints on stdout", r)


def ssh_opts(sshd, dvr_bin):
    """The options push and pull need to reach the test sshd and the built dvr."""
    return ["--ssh", sshd.ssh, "--remote-dvr", dvr_bin]


SEND_FIELDS = ("ref", "logical_bytes", "sent_bytes", "compression_ratio", "chunks", "chunks_skipped", "seconds")
RECEIVE_FIELDS = ("ref", "logical_bytes", "received_bytes", "chunks", "stored_bytes", "seconds")
PUSH_FIELDS = ("sent_bytes", "logical_bytes", "chunks_skipped", "compression_ratio", "seconds", "base")

DAMAGED = r"checksum|corrupt|damaged|mismatch"
TRUNCATED = r"truncat|unexpected end|ended|incomplete|short|empty"
COMPRESSION_OPTIONS = {"default": (), "no-compress": ("--no-compress",), "level-3": ("--level", "3"),
                       "compress-auto": ("--compress=auto",), "compress-zstd": ("--compress", "zstd"),
                       "compress-none": ("--compress=none",)}
UNCOMPRESSED = ("no-compress", "compress-none")


# --- helpers

def check_fields(summary, fields, what):
    missing = [f for f in fields if f not in summary]
    assert not missing, f"{what} lacks {missing}: {summary}"
    for f in fields:
        if f not in ("ref", "base"):
            assert isinstance(summary[f], (int, float)) and summary[f] >= 0, f"{what}: {f} = {summary[f]!r}: {summary}"


def refs_of(summary):
    """The summary's "ref": a list of refs (a single string is taken as one)."""
    ref = summary["ref"]
    return [ref] if isinstance(ref, str) else list(ref)


def summary_of(proc, what):
    """The --json summary of export/import/push/pull: stdout (or stderr, should
    stdout be empty)."""
    text = proc.stdout if proc.stdout.strip() else proc.stderr
    return parse_json(text, what, proc)


def no_progress(proc, what):
    """Progress is for terminals only: nothing of it in captured stderr."""
    assert "\r" not in proc.stderr and not re.search(r"\bETA\b", proc.stderr), (
        f"{what} printed progress although stderr is not a terminal:\n{describe(proc)}")


def push(store, ref, sshd, target, dvr_bin, *opts, expect=0, env=None):
    return store.dvr("push", ref, sshd.url(target.path), *ssh_opts(sshd, dvr_bin), *opts, expect=expect, env=env)


def push_json(store, ref, sshd, target, dvr_bin, *opts, env=None):
    proc = push(store, ref, sshd, target, dvr_bin, *opts, "--json", env=env)
    no_progress(proc, "push")
    summary = parse_json(proc.stdout, "the summary push --json prints on stdout", proc)
    check_fields(summary, PUSH_FIELDS, "push --json")
    return summary


def same_base(got, name, session):
    """`base` may name the snapshot alone or as SESSION/NAME."""
    return got in (name, f"{session}/{name}")


def export(store, ref, path, *opts):
    proc = store.dvr("export", ref, "-o", path, *opts, "--json")
    summary = summary_of(proc, "the summary of export --json")
    check_fields(summary, SEND_FIELDS, "export --json")
    assert Path(path).is_file() and Path(path).stat().st_size > 0, describe(proc)
    return summary


def import_json(store, path):
    proc = store.dvr("import", path, "--json")
    summary = summary_of(proc, "the summary of import --json")
    check_fields(summary, RECEIVE_FIELDS, "import --json")
    return summary


def same_shape(a, b, ref):
    """Snapshot REF has the same regions and size in stores a and b."""
    ia, ib = a.info(ref), b.info(ref)
    shape = lambda i: (i["logical_bytes"], [(r["name"], r["size"]) for r in i["regions"]])
    assert shape(ia) == shape(ib), f"{ref} differs between {a.path} and {b.path}:\n{ia}\n{ib}"
    owned = lambda i: {r["name"]: r.get("sdk_owned") for r in i["regions"]}
    assert owned(ia) == owned(ib), (
        f"{ref}: which regions are SDK-owned (alloc()) was lost on the way (the stream carries it): "
        f"{owned(ia)} in {a.path}, {owned(ib)} in {b.path}")
    assert ia.get("label", "") == ib.get("label", ""), (ia, ib)


def units(worker_bin, name):
    """[(region, unit, kind, length)] of the worker's content for NAME (--mib 1)."""
    out = run([worker_bin, "describe", name], expect=0).stdout
    return [(r, int(u), kind, int(length)) for r, u, kind, _, length, _ in (l.split() for l in out.splitlines())]


def corrupt_copy(data, path):
    Path(path).write_bytes(bytes(data))
    return path


def refuse(store, path, transport, *patterns, context):
    """Feeds stream file PATH to STORE by `import` or `receive`; it must be
    refused (message matching `patterns`) and leave the store as it was."""
    before = store.state()
    if transport == "import":
        proc = store.dvr("import", path, expect=None)
    else:
        proc = receive_from_file(store, path, expect=None)
    assert_failed(proc, *patterns, context=f"{context} ({transport})")
    store.assert_unchanged(before, f"after {transport} refused {context}")
    return proc


def restored_continues(job, at_dump, pid, gen):
    """The restored process `pid` is the dumped one (same id), counts on from
    the dump-time count with the dump-time buffer, and keeps counting."""
    first = job.wait_next(at_dump)
    assert first["id"] == at_dump["id"], f"a different process came back: {first} vs {at_dump}"
    assert first["count"] >= at_dump["count"], f"the counter went back: dumped at {at_dump}, restored {first}"
    job.assert_intact(first, gen=gen)
    later = job.wait_count(first["count"] + 10)
    assert alive(pid) and later["id"] == first["id"]
    return first


# --- the stream's documented layout (docs/format.md, "Stream format")

MAGIC = b"DVRSTRM\0"
HEADER_BYTES = 16  # magic, u32 version, u32 flags
KIND_SNAPSHOT, KIND_CHUNK, KIND_SNAPSHOT_END, KIND_STREAM_END = 1, 2, 7, 8


def records(data):
    """[(offset, kind, payload length)] of the stream's records, which must
    chain from the header to the very end: u32 kind, u32 length, payload, u64
    checksum."""
    out, off = [], HEADER_BYTES
    while off < len(data):
        assert off + 8 <= len(data), f"a record header at {off} runs past the end ({len(data)} bytes)"
        kind, length = struct.unpack_from("<II", data, off)
        assert off + 8 + length + 8 <= len(data), f"record {kind} at {off} of {length} bytes runs past the end"
        out.append((off, kind, length))
        off += 8 + length + 8
    assert off == len(data)
    return out


class Xxh:
    """XXH3 from the system's libxxhash (the library dvr links), through ctypes."""

    class _H128(ctypes.Structure):
        _fields_ = [("lo", ctypes.c_uint64), ("hi", ctypes.c_uint64)]

    def __init__(self):
        lib = ctypes.CDLL("libxxhash.so.0")
        lib.XXH3_64bits.restype = ctypes.c_uint64
        lib.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        lib.XXH3_128bits.restype = self._H128
        lib.XXH3_128bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        self.lib = lib

    def h64(self, b):
        return self.lib.XXH3_64bits(bytes(b), len(b))

    def h128(self, b):
        h = self.lib.XXH3_128bits(bytes(b), len(b))
        return h.lo, h.hi

    def chunk_hash(self, data):
        """A chunk's content address: XXH3-128 of its page hashes (XXH3-64 each, LE u64)."""
        pages = b"".join(struct.pack("<Q", self.h64(data[i:i + 4096])) for i in range(0, len(data), 4096))
        return self.h128(pages)


@pytest.fixture(scope="session")
def xxh():
    try:
        return Xxh()
    except (OSError, AttributeError) as e:
        pytest.skip(f"libxxhash.so.0 cannot be loaded through ctypes ({e}): no way to forge record checksums")


def replace_record(data, off, payload, xxh):
    """The stream with the record at `off` given a new payload and a correct
    record checksum (what a forger, not a flipped bit, would produce)."""
    kind, length = struct.unpack_from("<II", data, off)
    head = struct.pack("<II", kind, len(payload))
    sealed = head + bytes(payload) + struct.pack("<Q", xxh.h64(head + bytes(payload)))
    return bytearray(data[:off]) + sealed + bytearray(data[off + 8 + length + 8:])


def raw_chunk_records(data):
    """(offset, length) of the uncompressed, whole-page chunk records of a stream."""
    found = []
    for off, kind, length in records(data):
        if kind == KIND_CHUNK:
            codec, raw, wire = struct.unpack_from("<BII", data, off + 8 + 28)
            if codec == 0 and raw == wire and raw % 4096 == 0 and length == 37 + raw:
                found.append((off, length))
    return found


# --- the ssh server itself

def test_the_test_sshd_runs_commands_and_carries_bytes(sshd):
    assert sshd.run("true").returncode == 0
    data = os.urandom(1 << 20)
    out = sshd.run("cat", input=data, expect=0)
    assert out.stdout == data
    assert sshd.host.startswith("root@127.0.0.1:") and sshd.host.endswith(str(sshd.port))


# --- send | receive

@pytest.mark.parametrize("compression", sorted(COMPRESSION_OPTIONS))
def test_send_receive_through_a_pipe_restores_bit_exact(store_a, store_b, compression):
    store_a.snap("s", "n1")
    sent, received = pipe_ok(store_a, "s/n1", store_b, send_opts=(*COMPRESSION_OPTIONS[compression], "--json"))
    check_fields(sent, SEND_FIELDS, "send --json")
    check_fields(received, RECEIVE_FIELDS, "receive --json")
    assert refs_of(sent) == ["s/n1"], sent
    assert received["ref"] == ["s/n1"], received
    assert sent["logical_bytes"] == received["logical_bytes"] == WORKER_BYTES, (sent, received)
    assert sent["sent_bytes"] > 0 and received["received_bytes"] > 0 and received["stored_bytes"] > 0, (sent, received)
    assert sent["chunks"] > 0 and sent["chunks_skipped"] <= sent["chunks"], sent
    if compression in UNCOMPRESSED:
        # The worker's non-zero content is random: uncompressed, most of it is on the wire.
        assert sent["sent_bytes"] >= WORKER_BYTES // 2 and sent["compression_ratio"] <= 1.01, sent
    assert store_b.refs() == {"resident/r1", "s/n1"}
    same_shape(store_a, store_b, "s/n1")
    store_b.check("s", "n1")
    store_b.check("resident", "r1")
    store_b.verify()


def test_send_without_json_prints_a_summary_on_stderr_and_no_progress(store_a, store_b):
    store_a.snap("s", "n1")
    sent, received = pipe(store_a, "s/n1", store_b, receive_opts=())
    assert sent.returncode == 0 and received.returncode == 0, describe(sent) + describe(received)
    assert sent.stderr.strip(), f"send printed no summary on stderr:\n{describe(sent)}"
    assert received.stdout.strip(), f"receive printed no summary on stdout:\n{describe(received)}"
    no_progress(sent, "send")
    no_progress(received, "receive")
    store_b.check("s", "n1")


def test_send_refuses_to_write_to_a_terminal(store_a):
    store_a.snap("s", "n1")
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen([str(a) for a in store_a.argv("send", "s/n1")], stdin=subprocess.DEVNULL,
                                stdout=slave, stderr=subprocess.PIPE)
        os.close(slave)
        slave = None
        written = 0
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.1)
            if ready:
                try:
                    written += len(os.read(master, 1 << 16))
                except OSError:
                    break
        if proc.poll() is None:
            proc.kill()
        err = proc.communicate(timeout=30)[1].decode(errors="replace")
    finally:
        if slave is not None:
            os.close(slave)
        os.close(master)
    assert proc.returncode != 0, f"send wrote {written} bytes to a terminal instead of refusing; stderr: {err}"
    assert re.search(r"terminal|tty|redirect", err, re.IGNORECASE), f"the refusal should say why: {err!r}"
    assert written < 4096, f"send refused, but wrote {written} bytes of stream to the terminal first"


def test_send_with_a_base_sends_only_what_differs(store_a, store_b, scratch, worker_bin):
    """n1 and n2 share the worker's "base" units; with --base n1 only n2's
    other units travel (the stores' chunks are exactly the worker's units)."""
    store_a.snap("s", "n1", "n2")
    pipe_ok(store_a, "s/n1", store_b)
    full = send_to_file(store_a, "s/n2", scratch / "full", "--json")
    full_summary = parse_json(full.stderr, "send --json", full)
    delta, received = pipe_ok(store_a, "s/n2", store_b, send_opts=("--base", "n1", "--json"))
    assert received["ref"] == ["s/n2"], received

    u1, u2 = units(worker_bin, "n1"), units(worker_bin, "n2")
    assert [u[:2] for u in u1] == [u[:2] for u in u2]
    shared = sum(1 for a, b in zip(u1, u2) if a[2] == b[2] == "base")
    nonzero = sum(b[3] for b in u2 if b[2] != "zero")
    differ = sum(b[3] for a, b in zip(u1, u2) if b[2] != "zero" and not (a[2] == b[2] == "base"))
    assert shared > 0 and differ < nonzero
    assert full_summary["sent_bytes"] >= 0.9 * nonzero, f"n2 alone ({nonzero} non-zero bytes of random data): {full_summary}"
    assert delta["sent_bytes"] <= differ * 1.02 + 64 * 1024, (
        f"against n1, only the {differ} bytes of n2 that differ from n1 should travel (of {nonzero}): {delta}")
    assert delta["sent_bytes"] < full_summary["sent_bytes"], (delta, full_summary)
    assert delta["chunks_skipped"] >= shared, f"{shared} chunks of n2 are n1's: {delta}"
    assert delta["logical_bytes"] == WORKER_BYTES, delta

    store_b.check("s", "n1", "n2")
    same_shape(store_a, store_b, "s/n2")
    store_b.verify()


def test_a_base_the_receiver_lacks_is_refused(store_a, store_b, scratch):
    store_a.snap("s", "n1", "n2")
    before = store_b.state()
    sent, received = pipe(store_a, "s/n2", store_b, send_opts=("--base", "n1"), receive_opts=())
    assert_failed(received, r"\bn1\b", context="receiving a stream relative to a base the store lacks")
    store_b.assert_unchanged(before, "after refusing a stream whose base it lacks")

    export(store_a, "s/n2", scratch / "n2-on-n1", "--base", "n1")
    refuse(store_b, scratch / "n2-on-n1", "import", r"\bn1\b", context="a stream whose base the store lacks")


def test_a_base_the_sender_lacks_is_refused(store_a, scratch):
    store_a.snap("s", "n1")
    proc = send_to_file(store_a, "s/n1", scratch / "x", "--base", "nosuch", expect=None)
    assert_failed(proc, r"nosuch", context="send --base naming a snapshot that does not exist")


def test_a_base_given_as_session_slash_name_is_the_same_base(store_a, store_b, scratch):
    """`dvr send sweep/b --base sweep/a` (the form the help's example shows)
    sends what --base a sends; a base of another session is refused by name."""
    store_a.snap("s", "n1", "n2")
    pipe_ok(store_a, "s/n1", store_b)
    by_name = send_to_file(store_a, "s/n2", scratch / "by-name", "--base", "n1", "--json")
    by_ref = send_to_file(store_a, "s/n2", scratch / "by-ref", "--base", "s/n1", "--json")
    a, b = parse_json(by_name.stderr, "send --json", by_name), parse_json(by_ref.stderr, "send --json", by_ref)
    assert b["base"] == "n1" and a["base"] == "n1", (a, b)
    assert b["sent_bytes"] == a["sent_bytes"] and b["chunks_skipped"] == a["chunks_skipped"] > 0, (a, b)
    sent, received = pipe_ok(store_a, "s/n2", store_b, send_opts=("--base", "s/n1", "--json"))
    assert sent["base"] == "n1" and received["ref"] == ["s/n2"], (sent, received)
    store_b.check("s", "n1", "n2")

    proc = send_to_file(store_a, "s/n2", scratch / "x", "--base", "other/n1", expect=None)
    assert_failed(proc, r"other/n1.*session 's'", context="send --base naming a snapshot of another session")


def test_a_base_of_the_same_name_but_other_content_never_yields_a_wrong_snapshot(store_a, store_b):
    """B's s/n1 is not A's s/n1 (same name, other content). A stream of n2
    against n1 must then be refused, or else arrive correct: never patched onto
    the wrong base."""
    store_a.snap("s", "n1", "n2")
    store_b.snap("s", "n1", "--content-of", "other")
    before = store_b.state()
    sent, received = pipe(store_a, "s/n2", store_b, send_opts=("--base", "n1"), receive_opts=())
    if received.returncode == 0:
        store_b.check("s", "n2")
    else:
        assert_failed(received, r"n1|base|differ|content|fingerprint", context="a base of other content")
        store_b.assert_unchanged(before, "after refusing a stream against a base with other content")


def test_sending_a_snapshot_that_does_not_exist_names_it(store_a, scratch):
    store_a.snap("s", "n1")
    proc = send_to_file(store_a, "s/nosuch", scratch / "x", expect=None)
    assert_failed(proc, r"nosuch", context="send of a snapshot that does not exist")
    proc = store_a.dvr("export", "s/nosuch", "-o", scratch / "y", expect=None)
    assert_failed(proc, r"nosuch", context="export of a snapshot that does not exist")


# --- export / import

def test_export_import_round_trip(store_a, store_b, scratch):
    store_a.snap("s", "n1")
    stream = scratch / "n1.dvrstream"
    sent = export(store_a, "s/n1", stream)
    size = stream.stat().st_size
    assert refs_of(sent) == ["s/n1"] and sent["logical_bytes"] == WORKER_BYTES, sent
    assert abs(sent["sent_bytes"] - size) <= max(4096, size // 100), f"the file holds {size} bytes: {sent}"
    received = import_json(store_b, stream)
    assert received["ref"] == ["s/n1"] and received["logical_bytes"] == WORKER_BYTES, received
    assert abs(received["received_bytes"] - size) <= max(4096, size // 100), f"the file holds {size} bytes: {received}"
    same_shape(store_a, store_b, "s/n1")
    store_b.check("s", "n1")
    store_b.verify()


def test_export_levels_compress_and_every_level_restores_bit_exact(store_a, make_store, scratch, memdvr):
    """An 8 MiB array of a repeating pattern plus 1 MiB of random bytes: --level
    3 shrinks it, --no-compress sends every byte; both restore bit-exact."""
    pattern = (np.arange(8 * MIB, dtype=np.uint64) % 251 + 1).astype(np.uint8)
    noise = np.frombuffer(os.urandom(MIB), dtype=np.uint8)
    expected = np.concatenate([pattern, noise])
    with memdvr.Session(memdvr.Store(str(store_a.path)), "comp") as s:
        data = s.array("data", expected.shape, np.uint8)
        data[:] = expected
        s.snapshot("v1")
        del data  # the session closes only when no array of it is left
    sizes, summaries = {}, {}
    for level in ("no-compress", "level-3", "default"):
        path = scratch / f"comp-{level}"
        summaries[level] = export(store_a, "comp/v1", path, *COMPRESSION_OPTIONS[level])
        sizes[level] = path.stat().st_size
        target = make_store(f"to-{level}")
        import_json(target, path)
        with memdvr.Session(memdvr.Store(str(target.path)), "comp") as s:
            got = s.array("data", expected.shape, np.uint8)
            s.restore("v1")
            assert np.array_equal(got, expected), f"comp/v1 imported from the {level} stream is not bit-exact"
            del got
        target.verify()
    assert sizes["no-compress"] >= expected.size, f"uncompressed, the stream must hold every byte: {sizes}"
    assert summaries["no-compress"]["compression_ratio"] <= 1.01, summaries["no-compress"]
    assert sizes["level-3"] <= sizes["no-compress"] * 0.3, f"--level 3 should shrink the pattern: {sizes}"
    assert summaries["level-3"]["compression_ratio"] >= 3, summaries["level-3"]
    assert sizes["default"] <= sizes["no-compress"] * 0.3, f"the default compresses too: {sizes}"


def test_export_compress_auto_skips_noise_zstd_compresses_all_none_nothing(store_a, make_store, scratch, memdvr):
    """The pattern of the test above, then 1 MiB of random bytes, then 1 MiB
    whose first 8 KiB of every 64 KiB are random and the rest zero:
    --compress=auto compresses the pattern only (its sample of each chunk's
    first bytes says whether), zstd the pattern and the mostly-zero chunks,
    none nothing; every stream restores bit-exact."""
    pattern = (np.arange(8 * MIB, dtype=np.uint64) % 251 + 1).astype(np.uint8)
    noise = np.frombuffer(os.urandom(MIB), dtype=np.uint8)
    head_noise = np.zeros(MIB, dtype=np.uint8).reshape(16, -1)  # every 64 KiB: 8 KiB random, then zeros
    head_noise[:, :8192] = np.frombuffer(os.urandom(16 * 8192), dtype=np.uint8).reshape(16, -1)
    expected = np.concatenate([pattern, noise, head_noise.reshape(-1)])
    with memdvr.Session(memdvr.Store(str(store_a.path)), "comp") as s:
        data = s.array("data", expected.shape, np.uint8)
        data[:] = expected
        s.snapshot("v1")
        del data
    sizes, summaries = {}, {}
    for mode in ("auto", "zstd", "none"):
        path = scratch / f"comp-{mode}"
        summaries[mode] = export(store_a, "comp/v1", path, f"--compress={mode}")
        sizes[mode] = path.stat().st_size
        target = make_store(f"to-{mode}")
        import_json(target, path)
        with memdvr.Session(memdvr.Store(str(target.path)), "comp") as s:
            got = s.array("data", expected.shape, np.uint8)
            s.restore("v1")
            assert np.array_equal(got, expected), f"comp/v1 imported from the --compress={mode} stream is not bit-exact"
            del got
    auto, zstd, none = summaries["auto"], summaries["zstd"], summaries["none"]
    chunks = auto["chunks"]
    per_mib = chunks * MIB // expected.size  # chunks of 1 MiB (the store's chunk size: 64 KiB or 256 KiB)
    assert auto["chunks_compressed"] == chunks - 2 * per_mib and auto["chunks_raw"] == 2 * per_mib, auto
    assert zstd["chunks_compressed"] == chunks - per_mib and zstd["chunks_raw"] == per_mib, zstd
    assert none["chunks_compressed"] == 0 and none["chunks_raw"] == chunks, none
    assert sizes["none"] >= expected.size > sizes["auto"] > sizes["zstd"], sizes
    assert auto["read_bytes"] == zstd["read_bytes"] == none["read_bytes"] == expected.size, summaries


@pytest.mark.parametrize("verb", ["send", "export", "push"])
def test_a_bad_compress_value_names_the_option_and_the_values(store_a, store_b, sshd, dvr_bin, scratch, verb):
    store_a.snap("s", "n1")
    args = {"send": ("send", "s/n1"), "export": ("export", "s/n1", "-o", str(scratch / "x.dvr")),
            "push": ("push", "s/n1", sshd.url(store_b.path), *ssh_opts(sshd, dvr_bin))}[verb]
    proc = store_a.dvr(*args, "--compress=fast", expect=2)
    assert "--compress" in proc.stderr and "auto, zstd or none" in proc.stderr and "'fast'" in proc.stderr, describe(proc)
    proc = store_a.dvr(*args, "--compress=zstd", "--no-compress", expect=2)
    assert "--compress=zstd" in proc.stderr and "--no-compress" in proc.stderr, describe(proc)
    assert not (scratch / "x.dvr").exists()
    assert "s/n1" not in store_b.refs()


# --- damaged, truncated and foreign streams

@pytest.fixture
def stream(store_a, scratch):
    """An exported stream of s/n1 (with its bytes), factory by compression."""

    def make(compression="default"):
        path = scratch / f"n1-{compression}.dvrstream"
        if "s/n1" not in store_a.refs():
            store_a.snap("s", "n1")
        export(store_a, "s/n1", path, *COMPRESSION_OPTIONS[compression])
        return path, bytearray(path.read_bytes())

    return make


@pytest.mark.parametrize("transport", ["import", "receive"])
@pytest.mark.parametrize("compression", ["default", "no-compress"])
def test_a_flipped_byte_in_the_middle_is_refused(store_b, stream, scratch, compression, transport):
    path, data = stream(compression)
    data[len(data) // 2] ^= 0xFF
    refuse(store_b, corrupt_copy(data, scratch / "flipped"), transport, DAMAGED,
           context=f"a stream ({compression}) with a flipped byte in the middle")
    # The intact stream still goes in afterwards.
    import_json(store_b, path)
    store_b.check("s", "n1")


def test_a_flipped_byte_anywhere_is_refused(store_b, stream, scratch):
    path, data = stream("default")
    for at in (16, 100, len(data) // 3, len(data) - 8):
        damaged = bytearray(data)
        damaged[at] ^= 0x01
        refuse(store_b, corrupt_copy(damaged, scratch / f"flipped-{at}"), "import",
               context=f"a stream of {len(data)} bytes with byte {at} flipped")


def test_the_stream_follows_its_documented_layout(stream, xxh):
    _, data = stream("no-compress")
    assert data[:8] == MAGIC, f"the stream should start with {MAGIC!r}: {bytes(data[:16])!r}"
    assert struct.unpack_from("<II", data, 8) == (1, 0), f"version 1, flags 0: {bytes(data[:16])!r}"
    recs = records(data)
    kinds = [k for _, k, _ in recs]
    assert kinds[0] == KIND_SNAPSHOT and kinds[-2:] == [KIND_SNAPSHOT_END, KIND_STREAM_END], kinds
    assert set(kinds) <= set(range(1, 9)), kinds
    off, _, length = recs[-1]
    assert length == 4 and struct.unpack_from("<I", data, off + 8) == (1,), "the end record counts one snapshot"
    for off, kind, length in recs:
        (stored,) = struct.unpack_from("<Q", data, off + 8 + length)
        assert stored == xxh.h64(data[off:off + 8 + length]), f"record {kind} at {off}: checksum"
    assert raw_chunk_records(data), "an uncompressed stream of random data should hold raw chunk records"
    for off, length in raw_chunk_records(data)[:3]:
        lo, hi = struct.unpack_from("<QQ", data, off + 8 + 12)
        assert (lo, hi) == xxh.chunk_hash(data[off + 8 + 37:off + 8 + length]), f"chunk record at {off}: XXH3-128"


@pytest.mark.parametrize("transport", ["import", "receive"])
def test_a_truncated_stream_is_refused(store_b, stream, scratch, transport):
    """Cut inside the header, right after it, inside a record header, inside a
    chunk, just before the snapshot's end record, just before the stream's end
    record, and inside that."""
    path, data = stream("no-compress")
    recs = records(data)
    chunk_off, _, chunk_len = max((r for r in recs if r[1] == KIND_CHUNK), key=lambda r: r[2])
    snapshot_end = next(off for off, kind, _ in recs if kind == KIND_SNAPSHOT_END)
    stream_end = recs[-1][0]
    cuts = sorted({0, 4, 8, 12, HEADER_BYTES, HEADER_BYTES + 5, chunk_off + 8 + chunk_len // 2, snapshot_end,
                   stream_end, stream_end + 10, len(data) - 1})
    if transport == "receive":
        cuts = [12, chunk_off + 8 + chunk_len // 2, stream_end, len(data) - 1]
    for cut in cuts:
        refuse(store_b, corrupt_copy(data[:cut], scratch / f"cut-{cut}"), transport, TRUNCATED,
               context=f"a stream of {len(data)} bytes cut after {cut} bytes")
    import_json(store_b, path)
    store_b.check("s", "n1")


@pytest.mark.parametrize("version", [2, 0])
def test_a_stream_of_another_format_version_is_refused(store_b, stream, scratch, version):
    """The u32 after the 8 bytes of magic is the format version (1)."""
    _, data = stream("default")
    assert data[:8] == MAGIC and struct.unpack_from("<I", data, 8) == (1,), bytes(data[:16])
    other = bytearray(data)
    struct.pack_into("<I", other, 8, version)
    path = corrupt_copy(other, scratch / f"version-{version}")
    for transport in ("import", "receive"):
        refuse(store_b, path, transport, r"version", context=f"a stream of format version {version}")


def test_a_tampered_chunk_with_a_resealed_record_is_refused(store_b, stream, scratch, xxh):
    """A chunk's bytes changed and its record's XXH3-64 recomputed: the chunk's
    own XXH3-128 still catches it."""
    _, data = stream("no-compress")
    off, length = raw_chunk_records(data)[len(raw_chunk_records(data)) // 2]
    payload = bytearray(data[off + 8:off + 8 + length])
    payload[37 + 1000] ^= 0x40
    tampered = replace_record(data, off, payload, xxh)
    refuse(store_b, corrupt_copy(tampered, scratch / "tampered"), "import", DAMAGED + r"|xxh",
           context="a chunk changed under a resealed record")


def test_a_tampered_chunk_with_its_hash_recomputed_is_refused(store_b, stream, scratch, xxh):
    """A chunk's bytes and its XXH3-128 both changed (and the record resealed):
    the snapshot's fingerprint no longer matches."""
    _, data = stream("no-compress")
    off, length = raw_chunk_records(data)[len(raw_chunk_records(data)) // 3]
    payload = bytearray(data[off + 8:off + 8 + length])
    payload[37 + 5000] ^= 0x01
    struct.pack_into("<QQ", payload, 12, *xxh.chunk_hash(payload[37:]))
    tampered = replace_record(data, off, payload, xxh)
    refuse(store_b, corrupt_copy(tampered, scratch / "tampered"), "import", DAMAGED + r"|fingerprint|match",
           context="a chunk and its hash changed under a resealed record")


@pytest.mark.parametrize("field,value", [("session", ".."), ("name", "../evil"), ("session", "a/b")])
def test_a_stream_naming_a_path_outside_the_store_is_refused(store_b, stream, scratch, xxh, field, value):
    """Names from the stream are checked like any other: a forged session or
    snapshot name can never reach outside the store's directories."""
    _, data = stream("default")
    off, kind, length = records(data)[0]
    assert kind == KIND_SNAPSHOT
    payload = bytes(data[off + 8:off + 8 + length])
    (n_session,) = struct.unpack_from("<I", payload, 0)
    session = payload[4:4 + n_session]
    (n_name,) = struct.unpack_from("<I", payload, 4 + n_session)
    name = payload[8 + n_session:8 + n_session + n_name]
    assert (session, name) == (b"s", b"n1"), (session, name)
    rest = payload[8 + n_session + n_name:]
    session, name = (value.encode(), name) if field == "session" else (session, value.encode())
    forged = struct.pack("<I", len(session)) + session + struct.pack("<I", len(name)) + name + rest
    path = corrupt_copy(replace_record(data, off, forged, xxh), scratch / "forged")
    listing = sorted(os.listdir(scratch))
    refuse(store_b, path, "import", r"name|invalid|session", context=f"a stream whose {field} is {value!r}")
    assert sorted(os.listdir(scratch)) == listing, "something was written beside the store"


def test_something_that_is_not_a_stream_is_refused(store_b, scratch):
    refuse(store_b, corrupt_copy(os.urandom(100000), scratch / "noise"), "import",
           r"not a|magic|stream|format|corrupt|damaged", context="random bytes")
    text = scratch / "text"
    text.write_text("hello, this is not a Memory DVR stream\n" * 100)
    refuse(store_b, text, "receive", r"not a|magic|stream|format|corrupt|damaged", context="a text file")


def test_import_of_a_missing_file_names_it(store_b, scratch):
    before = store_b.state()
    proc = store_b.dvr("import", scratch / "nothing-here", expect=None)
    assert_failed(proc, r"nothing-here", context="import of a file that does not exist")
    store_b.assert_unchanged(before, "after import of a missing file")


def test_a_snapshot_already_there_is_refused(store_a, store_b, stream, scratch):
    path, _ = stream("default")
    import_json(store_b, path)
    for transport in ("import", "receive"):
        refuse(store_b, path, transport, r"exist", context="a snapshot the store already holds")
    # Also when the store's own snapshot of that name has other content.
    store_b.snap("t", "n1", "--content-of", "other")
    store_a.snap("t", "n1")
    export(store_a, "t/n1", scratch / "t-n1")
    refuse(store_b, scratch / "t-n1", "import", r"exist", context="a snapshot name the store holds with other content")


def test_damage_in_the_senders_store_never_reaches_the_receiver(store_a, store_b, worker_bin):
    """A flipped byte in a chunk A stores for n1: the transfer fails and B is as before."""
    store_a.snap("s", "n1")
    lines = [l.split() for l in run([worker_bin, "describe", "n1"], expect=0).stdout.splitlines()]
    head = bytes.fromhex(next(l[5] for l in lines if l[2] == "fresh" and int(l[4]) > 8192))
    found = []
    for pack in sorted((store_a.path / "packs").glob("*.pack")):
        blob = pack.read_bytes()
        at = blob.find(head)
        if at >= 0:
            found.append((pack, at))
    assert len(found) == 1, f"expected one stored copy of the chunk starting {head.hex()}: {found}"
    pack, at = found[0]
    with open(pack, "r+b") as f:
        f.seek(at + 5000)
        b = f.read(1)
        f.seek(at + 5000)
        f.write(bytes([b[0] ^ 0xFF]))
    before = store_b.state()
    sent, received = pipe(store_a, "s/n1", store_b, receive_opts=())
    assert sent.returncode != 0 or received.returncode != 0, describe(sent) + describe(received)
    assert received.returncode != 0, f"B accepted a snapshot whose data was damaged:\n{describe(received)}"
    assert re.search(DAMAGED + "|" + TRUNCATED, sent.stderr + received.stderr, re.IGNORECASE), \
        describe(sent) + describe(received)
    store_b.assert_unchanged(before, "after a transfer of a damaged snapshot")


# --- push and pull over ssh

@pytest.mark.parametrize("compression", sorted(COMPRESSION_OPTIONS))
def test_push_over_ssh(store_a, store_b, sshd, dvr_bin, compression):
    store_a.snap("s", "n1")
    summary = push_json(store_a, "s/n1", sshd, store_b, dvr_bin, *COMPRESSION_OPTIONS[compression])
    assert summary["base"] == "", f"B holds nothing of session s: {summary}"
    assert summary["logical_bytes"] == WORKER_BYTES and summary["sent_bytes"] > 0, summary
    if compression in UNCOMPRESSED:
        assert summary["compression_ratio"] <= 1.01, summary
    assert store_b.refs() == {"resident/r1", "s/n1"}
    same_shape(store_a, store_b, "s/n1")
    store_b.check("s", "n1")
    store_b.verify()


def test_pull_over_ssh_with_the_ssh_command_from_the_environment(store_a, make_store, sshd, dvr_bin):
    """$DVR_SSH stands in for --ssh; the URL names neither user nor port (both
    come from the ssh command: root, -p PORT)."""
    store_a.snap("s", "n1", "n2")
    c = make_store("C")
    for name in ("n1", "n2"):
        proc = c.dvr("pull", sshd.url(store_a.path, user=None, port=False), f"s/{name}", "--remote-dvr", dvr_bin,
                     "--json", env={"DVR_SSH": sshd.ssh})
        no_progress(proc, "pull")
        assert isinstance(summary_of(proc, "pull --json"), dict)
    c.check("s", "n1", "n2")
    same_shape(store_a, c, "s/n2")
    c.verify()


def _accepted(sshd):
    """How many ssh connections the test sshd has authenticated so far."""
    return sshd.log.read_text(errors="replace").count("Accepted publickey")


def _kept_receivers(store, settle=10):
    """PIDs of the kept receivers (`dvr receive --listen`) of STORE. The
    processes they fork per connection carry the same command line and end on
    their own once their push (or a check that the receiver is there) is
    done, so this waits up to `settle` s for those to go."""
    deadline = time.monotonic() + settle
    while True:
        found = {pid for pid in processes_naming(str(store.path)) if "--listen" in cmdline(pid).split()}
        if len(found) <= 1 or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def _kept_log(store):
    """The log of STORE's kept receiver on the test sshd's side (root, no
    $XDG_RUNTIME_DIR there): `receive --listen` finds the running one and
    names its socket; the log is beside it."""
    proc = store.dvr("receive", "--listen", "--idle", "60", env={"XDG_RUNTIME_DIR": ""})
    sock = proc.stdout.strip().removeprefix("listening ")
    assert sock.endswith(".sock") and Path(sock).is_socket(), describe(proc)
    return Path(sock[:-len(".sock")] + ".log")


def _stop_kept(sshd, control, store):
    """Ends the kept connection and STORE's kept receivers, and removes the
    receivers' sockets and logs (outside the scratch directory: in
    /tmp/dvr-receive-0 on the test sshd's side)."""
    run([*shlex.split(sshd.ssh), "-o", f"ControlPath={control}/%C", "-O", "exit", "root@127.0.0.1"])
    for pid in _kept_receivers(store, settle=0):
        try:
            log = os.readlink(f"/proc/{pid}/fd/2")  # a receiver's stderr is its log
        except OSError:
            log = ""
        os.kill(pid, 9)
        if log.endswith(".log"):
            for leftover in (log, log[:-len(".log")] + ".sock"):
                Path(leftover).unlink(missing_ok=True)


def test_keep_ssh_shares_one_connection_between_pushes_and_pulls(store_a, store_b, make_store, sshd, dvr_bin,
                                                                 scratch):
    """--keep-ssh 60: the first push opens the connection and leaves it open
    (its control socket in a private $XDG_RUNTIME_DIR/dvr-ssh); the next push
    and a pull to the same host go through it: sshd authenticates no new
    connection, and what they carry arrives intact."""
    runtime = scratch / "run"
    runtime.mkdir(mode=0o700)
    env = {"XDG_RUNTIME_DIR": runtime}
    control = runtime / "dvr-ssh"
    store_a.snap("s", "n1", "n2")
    try:
        push(store_a, "s/n1", sshd, store_b, dvr_bin, "--keep-ssh", "60", env=env)
        # The connection's control socket, and the kept receiver's forwarded one.
        sockets = [p for p in control.iterdir() if not p.name.startswith("recv-")]
        assert len(sockets) == 1 and sockets[0].is_socket(), f"one control socket expected in {control}: {sockets}"
        assert control.stat().st_mode & 0o777 == 0o700, oct(control.stat().st_mode)
        before = _accepted(sshd)
        push(store_a, "s/n2", sshd, store_b, dvr_bin, "--keep-ssh", "60", env=env)
        c = make_store("C")
        c.dvr("pull", sshd.url(store_b.path), "s/n2", *ssh_opts(sshd, dvr_bin), env={**env, "DVR_KEEP_SSH": "60"})
        assert _accepted(sshd) == before, (
            f"the second push and the pull opened connections of their own:\n{sshd.log_text()}")
        store_b.check("s", "n1", "n2")
        c.check("s", "n2")
        store_b.verify()
    finally:
        _stop_kept(sshd, control, store_b)


def test_keep_ssh_leaves_a_kept_receiver_that_later_pushes_reach_without_a_login(store_a, store_b, sshd_forwarding,
                                                                                 dvr_bin, scratch):
    """--keep-ssh: the first push also starts a kept receiver at the far end
    (`dvr receive --listen`, one process) and forwards a private local socket
    to it; the next pushes go through it (its log records them, sshd
    authenticates nothing new, no second receiver starts) and arrive intact.
    A kept receiver that is gone, or a connection that is gone, costs the next
    push a session of its own, nothing else; the push after goes through a
    kept receiver again."""
    sshd = sshd_forwarding
    runtime = scratch / "run"
    runtime.mkdir(mode=0o700)
    env = {"XDG_RUNTIME_DIR": runtime}
    control = runtime / "dvr-ssh"
    names = [f"n{k}" for k in range(1, 8)]
    store_a.snap("s", *names)
    try:
        push(store_a, "s/n1", sshd, store_b, dvr_bin, "--keep-ssh", "60", env=env)
        kept = _kept_receivers(store_b)
        assert len(kept) == 1, f"one kept receiver of {store_b.path} expected: {kept}"
        forwarded = [p for p in control.iterdir() if p.name.startswith("recv-")]
        assert len(forwarded) == 1 and forwarded[0].is_socket(), forwarded
        assert forwarded[0].stat().st_mode & 0o077 == 0, oct(forwarded[0].stat().st_mode)
        log = _kept_log(store_b)
        assert log.stat().st_mode & 0o077 == 0 and log.parent.stat().st_mode & 0o777 == 0o700, oct(log.parent.stat().st_mode)
        before = _accepted(sshd)
        for name in ("n2", "n3"):
            summary = push_json(store_a, f"s/{name}", sshd, store_b, dvr_bin, "--keep-ssh", "60", env=env)
            assert summary["ref"] == [f"s/{name}"] and summary["sent_bytes"] > 0, summary
        assert _accepted(sshd) == before, f"pushes through the kept receiver logged in:\n{sshd.log_text()}"
        text = log.read_text()
        assert "received s/n2" in text and "received s/n3" in text, f"the kept receiver did not receive them:\n{text}"
        assert _kept_receivers(store_b) == kept, "a second kept receiver started"

        # The far receiver is gone: the next push opens a session (and starts
        # a receiver again), the one after goes through the new receiver.
        for pid in kept:
            os.kill(pid, 9)
        push(store_a, "s/n4", sshd, store_b, dvr_bin, "--keep-ssh", "60", env=env)
        assert len(_kept_receivers(store_b)) == 1
        push(store_a, "s/n5", sshd, store_b, dvr_bin, "--keep-ssh", "60", env=env)
        assert "received s/n5" in _kept_log(store_b).read_text()

        # The connection is gone (its forwarded socket stays behind, nobody
        # listening): the same.
        run([*shlex.split(sshd.ssh), "-o", f"ControlPath={control}/%C", "-O", "exit", "root@127.0.0.1"], expect=0)
        push(store_a, "s/n6", sshd, store_b, dvr_bin, "--keep-ssh", "60", env=env)
        push(store_a, "s/n7", sshd, store_b, dvr_bin, "--keep-ssh", "60", env=env)
        assert "received s/n7" in _kept_log(store_b).read_text()
        store_b.check("s", *names)
        same_shape(store_a, store_b, "s/n7")
        store_b.verify()
    finally:
        _stop_kept(sshd, control, store_b)


def test_a_push_the_kept_receiver_refuses_says_why_and_changes_nothing(store_a, store_b, sshd_forwarding, dvr_bin,
                                                                      scratch):
    """Through the kept receiver a refusal reads as without it: a snapshot B
    holds is named, nothing is sent, B is as it was."""
    sshd = sshd_forwarding
    runtime = scratch / "run"
    runtime.mkdir(mode=0o700)
    env = {"XDG_RUNTIME_DIR": runtime}
    store_a.snap("s", "n1", "n2")
    try:
        push(store_a, "s/n1", sshd, store_b, dvr_bin, "--keep-ssh", "60", env=env)
        push(store_a, "s/n2", sshd, store_b, dvr_bin, "--keep-ssh", "60", env=env)
        assert "received s/n2" in _kept_log(store_b).read_text()
        before = store_b.state()
        proc = push(store_a, "s/n2", sshd, store_b, dvr_bin, "--keep-ssh", "60", env=env, expect=None)
        assert_failed(proc, r"holds snapshot 's/n2' already", r"nothing was sent", context="a push of a snapshot B holds")
        store_b.assert_unchanged(before, "after a refused push through the kept receiver")
        store_b.check("s", "n1", "n2")
    finally:
        _stop_kept(sshd, runtime / "dvr-ssh", store_b)


@pytest.mark.parametrize("why", ["older far dvr", "forwarding refused"])
def test_a_far_side_without_a_kept_receiver_costs_a_note_once_and_pushes_go_on(store_a, store_b, sshd, sshd_forwarding,
                                                                               dvr_bin, scratch, why):
    """A far side that cannot keep a receiver: a far dvr without `receive
    --listen` (an older one; here a wrapper refusing it), or an sshd that
    forwards nothing (the `sshd` fixture). Every push still arrives, the first
    says once on stderr why the next ones start a dvr there again, and no
    forwarded socket is left."""
    runtime = scratch / "run"
    runtime.mkdir(mode=0o700)
    env = {"XDG_RUNTIME_DIR": runtime}
    far_dvr, server, reason = dvr_bin, sshd, r"refuses forwarded connections.*sshd_config"
    if why == "older far dvr":
        far_dvr, server, reason = scratch / "old-dvr", sshd_forwarding, r"started no kept receiver.*--listen"
        far_dvr.write_text("#!/bin/sh\nfor a in \"$@\"; do [ \"$a\" = --listen ] && "
                           "{ echo 'The following argument was not expected: --listen' >&2; exit 109; }; done\n"
                           f"exec {dvr_bin} \"$@\"\n")
        far_dvr.chmod(0o755)
    store_a.snap("s", "n1", "n2", "n3")
    try:
        first = push(store_a, "s/n1", server, store_b, far_dvr, "--keep-ssh", "60", env=env)
        assert re.search(r"each push there starts a dvr again: .*" + reason, first.stderr), describe(first)
        for name in ("n2", "n3"):
            proc = push(store_a, f"s/{name}", server, store_b, far_dvr, "--keep-ssh", "60", env=env)
            assert "starts a dvr again" not in proc.stderr, f"the note came again:\n{describe(proc)}"
        left = [p.name for p in (runtime / "dvr-ssh").iterdir() if p.name.endswith(".sock")]
        assert not left, f"a forwarded socket was left: {left}"
        store_b.check("s", "n1", "n2", "n3")
    finally:
        _stop_kept(server, runtime / "dvr-ssh", store_b)


def test_receive_listen_keeps_one_receiver_per_store_and_ends_when_idle(store_b, scratch):
    """`dvr receive --listen --idle 10` (what push --keep-ssh runs at the far
    end): it prints the socket it listens on (in a private directory) and
    returns; a second call finds the same receiver; with no push for 10 s the
    receiver ends and removes its socket."""
    # (10 s of idle time: a loaded machine may take seconds between the two
    # calls, and the second must find the first receiver still there.)
    runtime = scratch / "run"
    runtime.mkdir(mode=0o700)
    env = {"XDG_RUNTIME_DIR": runtime}
    first = store_b.dvr("receive", "--listen", "--idle", "10", env=env)
    sock = Path(first.stdout.strip().removeprefix("listening "))
    assert sock.parent == runtime / "dvr-receive" and sock.is_socket(), describe(first)
    assert sock.parent.stat().st_mode & 0o777 == 0o700
    kept = _kept_receivers(store_b)
    assert len(kept) == 1, kept
    second = store_b.dvr("receive", "--listen", "--idle", "10", env=env)
    assert second.stdout == first.stdout and _kept_receivers(store_b) == kept, describe(second)
    deadline = time.monotonic() + 40
    while (_kept_receivers(store_b) or sock.exists()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _kept_receivers(store_b) and not sock.exists(), "the kept receiver outlived its idle time"
    assert "idle for 10 s; stopping" in Path(str(sock)[:-len(".sock")] + ".log").read_text()


@pytest.mark.parametrize("wrong", ["shared", "no idle"])
def test_receive_listen_refuses_a_shared_directory_and_a_missing_idle_time(store_b, scratch, wrong):
    runtime = scratch / "run"
    runtime.mkdir(mode=0o700)
    if wrong == "shared":
        (runtime / "dvr-receive").mkdir()
        os.chmod(runtime / "dvr-receive", 0o777)
        proc = store_b.dvr("receive", "--listen", "--idle", "5", env={"XDG_RUNTIME_DIR": runtime}, expect=None)
        assert_failed(proc, re.escape(str(runtime / "dvr-receive")), r"other users may use it", r"private",
                      context="receive --listen with a shared directory")
    else:
        proc = store_b.dvr("receive", "--listen", env={"XDG_RUNTIME_DIR": runtime}, expect=None)
        assert_failed(proc, r"--idle", context="receive --listen without --idle")
    assert not _kept_receivers(store_b)


@pytest.mark.parametrize("wrong", ["shared", "link"])
def test_keep_ssh_refuses_a_control_directory_other_users_can_reach(store_a, store_b, sshd, dvr_bin, scratch, wrong):
    """A control socket lets whoever reaches it run commands on the far host:
    a dvr-ssh directory others may use, or a link, is refused by name and
    nothing is sent."""
    runtime = scratch / "run"
    runtime.mkdir(mode=0o700)
    if wrong == "shared":
        (runtime / "dvr-ssh").mkdir()
        os.chmod(runtime / "dvr-ssh", 0o777)
    else:
        (scratch / "elsewhere").mkdir(mode=0o700)
        (runtime / "dvr-ssh").symlink_to(scratch / "elsewhere")
    store_a.snap("s", "n1")
    before = store_b.state()
    proc = push(store_a, "s/n1", sshd, store_b, dvr_bin, "--keep-ssh", "1m", expect=None,
                env={"XDG_RUNTIME_DIR": runtime})
    assert_failed(proc, re.escape(str(runtime / "dvr-ssh")), r"other users|not a directory", r"private",
                  context=f"--keep-ssh with a {wrong} control directory")
    store_b.assert_unchanged(before, "after a push refused for its control directory")


def test_keep_ssh_with_a_bad_duration_names_it(store_a, store_b, sshd, dvr_bin):
    store_a.snap("s", "n1")
    before = store_b.state()
    proc = push(store_a, "s/n1", sshd, store_b, dvr_bin, "--keep-ssh", "soon", expect=None)
    assert_failed(proc, r"keep-ssh", r"soon", context="--keep-ssh soon")
    proc = push(store_a, "s/n1", sshd, store_b, dvr_bin, expect=None, env={"DVR_KEEP_SSH": "9w"})
    assert_failed(proc, r"DVR_KEEP_SSH", r"9w", context="DVR_KEEP_SSH=9w")
    store_b.assert_unchanged(before, "after pushes refused for their --keep-ssh")


def test_second_push_sends_only_the_changed_pages(store_a, store_b, sshd, dvr_bin, memdvr):
    """64 MiB of random data pushed; 1% of its pages changed and pushed again:
    the second push negotiates the first snapshot as its base and sends at most
    5% of what the first sent. Both restore bit-exact in B."""
    words = 64 * MIB // 8
    rng = np.random.default_rng(6)
    with memdvr.Session(memdvr.Store(str(store_a.path)), "big") as s:
        data = s.array("data", (words,), np.uint64)
        data[:] = rng.integers(0, 2 ** 64 - 1, size=words, dtype=np.uint64, endpoint=True)
        s.snapshot("v1")
        v1 = data.copy()
        first = push_json(store_a, "big/v1", sshd, store_b, dvr_bin)

        pages = 64 * MIB // 4096
        changed = rng.choice(pages, size=pages // 100, replace=False)
        at = changed * 512 + rng.integers(0, 512, size=changed.size)
        data[at] ^= rng.integers(1, 2 ** 63, size=changed.size, dtype=np.uint64)
        s.snapshot("v2")
        v2 = data.copy()
        del data  # the session closes only when no array of it is left
        second = push_json(store_a, "big/v2", sshd, store_b, dvr_bin)

    assert first["base"] == "", first
    assert first["logical_bytes"] == second["logical_bytes"] == 64 * MIB, (first, second)
    assert first["sent_bytes"] >= 0.9 * 64 * MIB, f"64 MiB of random bytes do not compress: {first}"
    assert same_base(second["base"], "v1", "big"), f"the second push should be against v1: {second}"
    assert second["sent_bytes"] <= 0.05 * first["sent_bytes"], (
        f"{changed.size} of {pages} pages changed, yet the second push sent {second['sent_bytes']} bytes "
        f"against the first's {first['sent_bytes']}: {second}")
    assert second["chunks_skipped"] > 0, second

    with memdvr.Session(memdvr.Store(str(store_b.path)), "big") as s:
        got = s.array("data", (words,), np.uint64)
        s.restore("v2")
        assert np.array_equal(got, v2), "big/v2 pushed against v1 does not restore bit-exact in B"
        s.restore("v1")
        assert np.array_equal(got, v1), "big/v1 does not restore bit-exact in B"
        del got
    store_b.verify()


def test_push_of_a_snapshot_the_remote_holds_is_refused(store_a, store_b, sshd, dvr_bin):
    store_a.snap("s", "n1")
    push_json(store_a, "s/n1", sshd, store_b, dvr_bin)
    before = store_b.state()
    proc = push(store_a, "s/n1", sshd, store_b, dvr_bin, expect=None)
    assert_failed(proc, r"exist", context="push of a snapshot the remote store holds")
    store_b.assert_unchanged(before, "after a refused push")


def test_push_against_a_remote_base_with_other_content_is_never_wrong(store_a, store_b, sshd, dvr_bin):
    """B holds s/n1 with other content than A's: the negotiated push of s/n2
    must not patch A's differences onto it."""
    store_a.snap("s", "n1", "n2")
    store_b.snap("s", "n1", "--content-of", "other")
    before = store_b.state()
    proc = push(store_a, "s/n2", sshd, store_b, dvr_bin, "--json", expect=None)
    if proc.returncode == 0:
        store_b.check("s", "n2")
        summary = parse_json(proc.stdout, "push --json", proc)
        assert summary["base"] == "", f"B's s/n1 is not A's: it cannot serve as the base: {summary}"
    else:
        assert_failed(proc, r"n1|base|differ|content|fingerprint", context="a remote base of other content")
        store_b.assert_unchanged(before, "after a refused push against a base with other content")


def test_push_with_a_remote_dvr_that_does_not_exist_fails_with_a_message(store_a, store_b, sshd, scratch):
    store_a.snap("s", "n1")
    before = store_b.state()
    proc = store_a.dvr("push", "s/n1", sshd.url(store_b.path), "--ssh", sshd.ssh, "--remote-dvr",
                       scratch / "no-such-dvr", expect=None, timeout=120)
    assert_failed(proc, r"no-such-dvr|not found|no such file|remote|ssh",
                  context="push with a --remote-dvr that does not exist")
    store_b.assert_unchanged(before, "after a push that found no dvr on the other side")


def test_pull_of_a_snapshot_that_does_not_exist_names_it(store_a, store_b, sshd, dvr_bin):
    store_a.snap("s", "n1")
    before = store_b.state()
    proc = store_b.dvr("pull", sshd.url(store_a.path), "s/nosuch", *ssh_opts(sshd, dvr_bin), expect=None)
    assert_failed(proc, r"nosuch", context="pull of a snapshot the remote store lacks")
    store_b.assert_unchanged(before, "after a refused pull")


# --- process snapshots (real CRIU; root)

def test_process_snapshots_pushed_over_ssh_restore_and_continue_on_the_other_store(work, store_a, store_b, sshd,
                                                                                  dvr_bin):
    """A counter job dumped twice (c1 leaving it running, c2 killing it), each
    pushed to B; c2 travels against c1. Restored from B alone, c2 continues from
    its dump-time count with its buffer intact."""
    job = work.start_job("counter", mib=32, wait_count=30)
    job.mutate()
    work.dump(job.pid, "c1", leave_running=True)
    first = push_json(store_a, "proc/c1", sshd, store_b, dvr_bin)
    assert first["base"] == "" and first["logical_bytes"] >= 32 * MIB, first
    job.assert_intact(job.mutate(), gen=2)
    work.dump(job.pid, "c2")
    at_dump = job.status()
    second = push_json(store_a, "proc/c2", sshd, store_b, dvr_bin)
    assert same_base(second["base"], "c1", "proc"), f"the second push should be against c1: {second}"
    assert second["sent_bytes"] <= first["sent_bytes"] / 4, (
        f"1% of the buffer changed between the dumps, yet c2 sent {second['sent_bytes']} bytes, c1 "
        f"{first['sent_bytes']}")

    store_a.dvr("proc", "rm", "c1", "c2")
    listed = {p["name"] for p in store_b.dvr_json("proc", "ls")["processes"]}
    assert {"c1", "c2"} <= listed, listed
    work.store = store_b.path
    pid = work.restore("c2")
    restored_continues(job, at_dump, pid, gen=2)
    job.pid = pid
    job.assert_intact(job.mutate(), gen=3)
    store_b.verify()


@pytest.mark.parametrize("transport", ["pipe", "pull"])
def test_a_heap_job_migrates_with_its_heap(work, store_a, store_b, dvr_bin, request, transport):
    """A heap job (its buffer a DVR persistent heap in store A) dumped into A
    and moved to B. Then A loses the process snapshot, the heap's snapshot and
    the heap file itself; restored from B, the job finds its heap back at its
    path with the dump-time content."""
    job = work.start_job("heap", mib=16, wait_count=20)
    job.assert_intact(job.mutate(), gen=1)
    info = work.dump(job.pid, "h1")
    heap = Path(store_a.path / "heaps" / "job" / "heap")
    assert [Path(h["path"]).resolve() for h in info["heaps"]] == [heap.resolve()], info
    at_dump = job.status()
    in_a = store_a.refs()
    heap_refs = in_a - {"proc/h1"}
    assert "proc/h1" in in_a and heap_refs, f"the dump should have snapshotted the heap in A: {in_a}"

    before = store_b.refs()
    if transport == "pipe":
        sent, received = pipe_ok(store_a, "proc/h1", store_b)
        assert "proc/h1" in received["ref"], received
        assert len(received["ref"]) >= 2, f"the heap's snapshot must travel with proc/h1: {received}"
    else:
        sshd = request.getfixturevalue("sshd")
        proc = store_b.dvr("pull", sshd.url(store_a.path), "proc/h1", *ssh_opts(sshd, dvr_bin), "--json")
        no_progress(proc, "pull")
    arrived = store_b.refs() - before
    assert "proc/h1" in arrived and len(arrived) >= 2, f"proc/h1 and its heap's snapshot should be in B: {arrived}"

    store_a.dvr("proc", "rm", "h1")
    assert not (store_a.refs() & (heap_refs | {"proc/h1"})), f"A still holds {store_a.refs()}"
    heap.unlink()

    work.store = store_b.path
    # The heap's directory is A's, not B's: refused until the operator names it.
    refused = work.dvr("proc", "restore", "h1", "--detach", expect=1)
    assert str(heap) in refused.stderr and "--heap-dir" in refused.stderr, describe(refused)
    assert not heap.exists(), f"a refused restore created {heap}"
    pid = work.restore("h1", "--heap-dir", str(store_a.path / "heaps"))
    restored_continues(job, at_dump, pid, gen=1)
    assert heap.is_file() and heap.stat().st_size == 16 * MIB, f"the heap file is not back at {heap}"
    job.pid = pid
    job.assert_intact(job.mutate(), gen=2)
    store_b.verify()


# --- fields of the snapshot record a forger chooses (the record resealed)

def snapshot_fields(data):
    """(offset of the snapshot record, its payload split as [session, name,
    label, parent, middle, base, base fingerprint]): str fields are u32 length
    and bytes; the base is the last str, before 16 fingerprint bytes."""
    off, kind, length = records(data)[0]
    assert kind == KIND_SNAPSHOT
    payload = bytes(data[off + 8:off + 8 + length])
    fields, at = [], 0
    for _ in range(4):
        (n,) = struct.unpack_from("<I", payload, at)
        fields.append(payload[at + 4:at + 4 + n])
        at += 4 + n
    (n_base,) = struct.unpack_from("<I", payload, len(payload) - 16 - 4)
    assert n_base == 0, "the stream should be a full one (no base)"
    fields += [payload[at:len(payload) - 20], b"", payload[-16:]]
    return off, fields


def forge(data, xxh, **changes):
    """The stream with snapshot-record fields (session, name, label, base) replaced, resealed."""
    off, f = snapshot_fields(data)
    keys = ["session", "name", "label", "parent"]
    for key, value in changes.items():
        f[keys.index(key) if key in keys else 5] = value
    s = lambda b: struct.pack("<I", len(b)) + b  # noqa: E731
    payload = s(f[0]) + s(f[1]) + s(f[2]) + s(f[3]) + f[4] + s(f[5]) + f[6]
    return replace_record(data, off, payload, xxh)


@pytest.mark.parametrize("field,value", [("session", b"se\x00s"), ("name", b"n\nx"), ("session", b"s\x99"), ("name", b"n\x1b[2J"),
                                         ("base", b"n1\ndvr: received s/evil OK, signed by ed25519:0000")])
def test_a_forged_name_is_damage_reported_on_one_line(store_b, stream, scratch, xxh, field, value):
    """A name the stream carries that is not valid (a control character, a
    byte that is not UTF-8, a base name with a line of its own) is damage:
    exit status 1 (not bad usage), nothing stored, and the message is one line
    that names the file, shows the byte by its value and escapes nothing twice
    (no line of the stream's choosing reaches the terminal)."""
    _, data = stream("default")
    path = corrupt_copy(forge(data, xxh, **{field: value}), scratch / "forged")
    proc = refuse(store_b, path, "import", r"damaged", context=f"a stream whose {field} is {value!r}")
    assert proc.returncode == 1, describe(proc)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dvr: import of {path}: the stream is damaged: "), describe(proc)
    assert "nothing was stored" in lines[0] and "is not valid" in lines[0] and "\\\\" not in lines[0], describe(proc)
    bad = next(c for c in value if c < 0x20 or c >= 0x80)
    assert f"the byte 0x{bad:02x}" in lines[0], describe(proc)


def test_a_label_that_is_not_utf8_is_kept_and_read_everywhere(store_b, stream, scratch, xxh):
    """A label may hold any bytes (docs/cli.md, "JSON documents"): one from a
    stream is stored as it is; dvr escapes it, JSON writes \\xNN, and the
    Python API gives it as a str with surrogates (surrogateescape) instead of
    failing for the whole store with UnicodeDecodeError."""
    import memdvr
    label = b"lab\xff\xfe\x1b"
    _, data = stream("default")
    import_json(store_b, corrupt_copy(forge(data, xxh, label=label), scratch / "labelled"))
    assert "lab\\xff\\xfe\\x1b" in store_b.dvr("ls", "s").stdout
    assert json.loads(store_b.dvr("info", "s/n1", "--json").stdout)["label"] == "lab\\xff\\xfe\x1b"
    st = memdvr.Store(store_b.path, create=False)
    want = label.decode("utf-8", "surrogateescape")
    assert [i.label for i in st.list("s")] == [want]
    assert st.info("s", "n1").label == want and st.latest("s").label == want
    proc = run([sys.executable, "-m", "memdvr", "--store", store_b.path, "ls", "s"], expect=0)
    assert "lab\\xff\\xfe\\x1b" in proc.stdout, describe(proc)
    proc = run([sys.executable, "-m", "memdvr", "--store", store_b.path, "info", "s/n1", "--json"], expect=0)
    assert json.loads(proc.stdout)["label"] == "lab\\xff\\xfe\x1b", describe(proc)


def proc_stream(xxh, meta, chunk_size=262144):
    """A stream of process snapshot proc/night1 built by hand (docs/format.md,
    "Stream format"): its metadata region `meta` and one CRIU image."""
    def s(b):
        return struct.pack("<I", len(b)) + b

    def rec(kind, payload):
        head = struct.pack("<II", kind, len(payload))
        return head + payload + struct.pack("<Q", xxh.h64(head + payload))

    regions = [(b"dvr-proc.meta", meta), (b"core-1.img", b"c" * 100)]
    head = s(b"proc") + s(b"night1") + s(b"") + s(b"") + struct.pack("<QIBI", 1, chunk_size, 1, len(regions))
    head += b"".join(s(n) + struct.pack("<QB", len(d), 1) for n, d in regions) + s(b"") + bytes(16)
    out, fp = [rec(KIND_SNAPSHOT, head)], struct.pack("<IB", chunk_size, 1)
    fp += b"".join(s(n) + struct.pack("<Q", len(d)) for n, d in regions)
    for i, (_, d) in enumerate(regions):
        lo, hi = xxh.chunk_hash(d)
        fp += struct.pack("<QQ", lo, hi)
        out.append(rec(KIND_CHUNK, struct.pack("<IQQQBII", i, 0, lo, hi, 0, len(d), len(d)) + d))
    lo, hi = xxh.h128(fp)
    out += [rec(KIND_SNAPSHOT_END, struct.pack("<QQQ", lo, hi, len(regions))), rec(KIND_STREAM_END, struct.pack("<I", 1))]
    return MAGIC + struct.pack("<II", 1, 0) + b"".join(out)


def test_a_received_process_snapshot_removes_heap_snapshots_only_here(store_a, store_b, scratch, xxh):
    """The heap stores a received process snapshot's metadata names are the
    sender's choice: `dvr proc rm` removes its heap snapshots in the receiving
    store only, and `proc info` counts nothing of another store."""
    store_a.snap("sim", "proc.night1")  # the victim: another store of this host
    before = store_a.state()
    meta = (f"dvr-proc 1\npid=4242\nown_pid_namespace=1\ncriu_version=4.1.1\nleave_running=0\ntcp_established=0\n"
            f"image_bytes=5000\nheap=5000\t{store_a.path}\tsim\t{store_a.path}/heaps/sim/state\nkernel=6.1\ncommand=job\n").encode()
    path = scratch / "proc.dvr"
    path.write_bytes(proc_stream(xxh, meta))
    import_json(store_b, path)
    info = json.loads(store_b.dvr("proc", "info", "night1", "--json").stdout)
    assert info["stored_bytes"] < 64 * 1024, info  # the victim's heap snapshot is not counted
    proc = store_b.dvr("proc", "rm", "night1")
    assert "in store" not in proc.stdout, describe(proc)  # no heap snapshot elsewhere is claimed removed
    store_a.assert_unchanged(before, "after `dvr proc rm` of a received snapshot naming this store")
    assert "sim/proc.night1" in store_a.refs()
