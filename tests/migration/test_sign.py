"""Signed streams (issue #20, item 6; docs/migration.md, "Authenticated
imports"): `dvr keygen`, `export/send/push --sign KEY` and `import/receive/pull
--require-signature PUBKEY`, and the same through memdvr.

What must hold:
  * a signed stream is stored by a receiver that requires its key (file, pipe,
    push, pull) and by one that requires nothing, bit-exact, and says who signed;
  * an unsigned stream, a stream signed by another key, one whose signature
    was stripped, and one a forger changed while making every checksum right
    again (a chunk, its XXH3-128 and the snapshot's fingerprint), are refused
    by a receiver that requires the key; nothing becomes visible (`ls` and the
    manifests as before) and `gc` gives back the space its chunks took;
  * the same forgery of an unsigned stream is stored: what the checksums alone
    cannot tell, which is why signatures exist;
  * key files: never overwritten, a secret key that others can read refused.
"""

import json
import os
import stat
import struct
import subprocess

import pytest
from dvrtest import assert_failed, describe, parse_json
from test_migration import (COMPRESSION_OPTIONS, KIND_CHUNK, KIND_SNAPSHOT, KIND_SNAPSHOT_END, KIND_STREAM_END,  # noqa: F401
                            corrupt_copy, export, pipe, push, receive_from_file, records, replace_record, ssh_opts,
                            xxh)

KIND_SIGNATURE = 9
SIGNATURE_BYTES = 8 + 100 + 8


@pytest.fixture
def keys(scratch, dvr_bin):
    """Two key pairs made by `dvr keygen`: {"alice": (key, pub, fingerprint), "mallory": ...}."""
    out = {}
    for who in ("alice", "mallory"):
        proc = subprocess.run([dvr_bin, "keygen", "--out", scratch / who, "--json"], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, describe(proc)
        doc = parse_json(proc.stdout, "keygen --json", proc)
        assert doc["secret_key"] == str(scratch / who) + ".key" and doc["public_key"] == str(scratch / who) + ".pub", doc
        out[who] = (scratch / f"{who}.key", scratch / f"{who}.pub", doc["fingerprint"])
    return out


def pack_bytes(store):
    return store.stat()["pack_bytes"]


def refused(store, path, transport, *patterns, require, context):
    """PATH fed to STORE by import/receive with --require-signature REQUIRE
    (none when None): refused with a message matching `patterns`, the store's
    listing and files as before, and gc back to the pack space it had."""
    store.gc()
    before, space = store.state(), pack_bytes(store)
    opts = [] if require is None else ["--require-signature", require]
    if transport == "import":
        proc = store.dvr("import", path, *opts, expect=None)
    else:
        proc = receive_from_file(store, path, *opts, expect=None)
    err = assert_failed(proc, *patterns, context=f"{context} ({transport})")
    assert proc.returncode == 1, describe(proc)
    store.assert_unchanged(before, f"after {transport} refused {context}")
    store.gc()
    assert pack_bytes(store) <= space, f"{context}: gc left {pack_bytes(store)} bytes of packs, {space} before"
    return err


def forge_chunk(data, xxh):
    """The stream (no compression, no base) with one chunk's bytes changed, and
    its XXH3-128, the snapshot's fingerprint and every record checksum made
    right again: everything a forger can do without the secret key. The
    signature record, if any, is kept."""
    recs = records(data)
    snap_off, kind, snap_len = recs[0]
    assert kind == KIND_SNAPSHOT
    p = bytes(data[snap_off + 8:snap_off + 8 + snap_len])
    at = 0

    def take_str():
        nonlocal at
        (n,) = struct.unpack_from("<I", p, at)
        s = p[at + 4:at + 4 + n]
        at += 4 + n
        return s

    for _ in range(4):  # session, name, label, parent
        take_str()
    at += 8  # time
    chunk_size, paged, nregions = struct.unpack_from("<IBI", p, at)
    at += 9
    regions = []
    for _ in range(nregions):
        name = take_str()
        (size,) = struct.unpack_from("<Q", p, at)
        at += 9
        regions.append((name, size))
    # The chunk to change: a raw whole-page chunk in the middle.
    chunks = [(off, length) for off, k, length in recs if k == KIND_CHUNK
              and struct.unpack_from("<BII", data, off + 8 + 28)[0] == 0 and length > 37 + 8192]
    assert chunks, "the stream should hold raw chunk records"
    off, length = chunks[len(chunks) // 2]
    payload = bytearray(data[off + 8:off + 8 + length])
    payload[37 + 4096 + 10] ^= 0x5A
    struct.pack_into("<QQ", payload, 12, *xxh.chunk_hash(payload[37:]))
    data = replace_record(data, off, payload, xxh)
    # Every chunk's hash, by (region, index), for the fingerprint.
    hashes = {}
    for o, k, n in records(data):
        if k in (2, 3, 4):  # chunk, pages, zero: u32 region, u64 index, hash
            r, j = struct.unpack_from("<IQ", data, o + 8)
            hashes[(r, j)] = bytes(data[o + 8 + 12:o + 8 + 28])
    fp = struct.pack("<IB", chunk_size, paged)
    for name, size in regions:
        fp += struct.pack("<I", len(name)) + name + struct.pack("<Q", size)
    for key in sorted(hashes):
        fp += hashes[key]
    end_off = next(o for o, k, _ in records(data) if k == KIND_SNAPSHOT_END)
    end = bytearray(data[end_off + 8:end_off + 8 + 24])
    end[0:16] = struct.pack("<QQ", *xxh.h128(fp))
    return replace_record(data, end_off, end, xxh)


def test_keygen_writes_a_key_pair_once_and_refuses_to_overwrite(scratch, dvr_bin, keys):
    key, pub, fp = keys["alice"]
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and stat.S_IMODE(pub.stat().st_mode) == 0o644
    assert key.read_text().startswith("dvr ed25519 secret key v1\n") and pub.read_text().startswith("dvr ed25519 public key v1\n")
    assert fp.startswith("ed25519:") and len(fp) == 40 and fp in pub.read_text()
    before = key.read_bytes()
    proc = subprocess.run([dvr_bin, "keygen", "--out", scratch / "alice"], capture_output=True, text=True, timeout=60)
    assert_failed(proc, r"alice\.key exists already", r"nothing", context="keygen over an existing key")
    assert key.read_bytes() == before
    text = subprocess.run([dvr_bin, "keygen", "--out", scratch / "bob"], capture_output=True, text=True, timeout=60)
    assert text.returncode == 0 and "bob.key" in text.stdout and "ed25519:" in text.stdout, describe(text)


@pytest.mark.parametrize("compression", ["default", "no-compress"])
def test_signed_export_is_imported_with_the_required_key_and_without(store_a, store_b, make_store, scratch, keys, compression):
    key, pub, fp = keys["alice"]
    store_a.snap("s", "n1")
    path = scratch / "signed.dvr"
    summary = export(store_a, "s/n1", path, "--sign", key, *COMPRESSION_OPTIONS[compression])
    assert summary["signed_by"] == fp, summary
    data = path.read_bytes()
    assert struct.unpack_from("<II", data, 8) == (1, 1), "version 1, flags: signed"
    assert records(data)[-1][1] == KIND_SIGNATURE and records(data)[-2][1] == KIND_STREAM_END
    got = store_b.dvr_json("import", path, "--require-signature", pub)
    assert got["signed_by"] == fp and got["ref"] == ["s/n1"], got
    store_b.check("s", "n1")
    # A receiver that requires nothing stores it too, and says who signed it.
    c = make_store("C")
    text = c.dvr("import", path)
    assert f"signed by {fp}" in text.stdout, describe(text)
    c.check("s", "n1")


def test_signed_send_receive_through_a_pipe(store_a, store_b, keys):
    key, pub, fp = keys["alice"]
    store_a.snap("s", "n1")
    s, r = pipe(store_a, "s/n1", store_b, send_opts=("--sign", key, "--json"), receive_opts=("--require-signature", pub, "--json"))
    assert s.returncode == 0 and r.returncode == 0, describe(s) + describe(r)
    assert json.loads(s.stderr)["signed_by"] == fp and json.loads(r.stdout)["signed_by"] == fp
    store_b.check("s", "n1")
    # Signed by another key, or not at all: refused, nothing stored.
    before = store_b.state()
    for opts, pattern in ((("--sign", keys["mallory"][0]), keys["mallory"][2]), ((), r"not signed")):
        if "s/n2" not in store_a.refs():
            store_a.snap("s", "n2")
        s, r = pipe(store_a, "s/n2", store_b, send_opts=opts, receive_opts=("--require-signature", pub))
        assert_failed(r, pattern, r"nothing was stored", context=f"receive of a stream sent with {opts}")
        store_b.assert_unchanged(before, f"after a refused receive ({opts})")


def test_a_signed_incremental_export_is_received_against_its_base(store_a, store_b, scratch, keys):
    key, pub, fp = keys["alice"]
    store_a.snap("s", "n1")
    export(store_a, "s/n1", scratch / "n1.dvr", "--sign", key)
    store_b.dvr("import", scratch / "n1.dvr", "--require-signature", pub)
    store_a.snap("s", "n2")
    full = export(store_a, "s/n2", scratch / "n2-full.dvr", "--sign", key)
    delta = export(store_a, "s/n2", scratch / "n2.dvr", "--sign", key, "--base", "n1")
    assert delta["signed_by"] == fp and delta["base"] in ("n1", "s/n1"), delta
    assert delta["chunks_skipped"] > 0 or delta["sent_bytes"] <= full["sent_bytes"], (delta, full)
    got = store_b.dvr_json("import", scratch / "n2.dvr", "--require-signature", pub)
    assert got["signed_by"] == fp and got["base"] in ("n1", "s/n1"), got
    store_b.check("s", "n1", "n2")


@pytest.mark.parametrize("transport", ["import", "receive"])
def test_a_receiver_that_requires_a_signature_refuses_every_other_stream(store_a, store_b, scratch, keys, xxh, transport):
    key, pub, fp = keys["alice"]
    store_a.snap("s", "n1")
    signed = scratch / "signed.dvr"
    export(store_a, "s/n1", signed, "--sign", key, "--no-compress")
    data = bytearray(signed.read_bytes())
    unsigned = scratch / "unsigned.dvr"
    export(store_a, "s/n1", unsigned, "--no-compress")
    other = scratch / "other.dvr"
    export(store_a, "s/n1", other, "--sign", keys["mallory"][0], "--no-compress")

    refused(store_b, unsigned, transport, r"not signed", r"--require-signature", require=pub, context="an unsigned stream")
    err = refused(store_b, other, transport, keys["mallory"][2], fp, require=pub, context="a stream signed by another key")
    if transport == "import":
        assert str(other) in err, err  # import names the file
    stripped = bytearray(data[:len(data) - SIGNATURE_BYTES])
    struct.pack_into("<I", stripped, 12, 0)
    refused(store_b, corrupt_copy(stripped, scratch / "stripped"), transport, r"not signed", require=pub,
            context="the signature stripped")
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x01
    refused(store_b, corrupt_copy(flipped, scratch / "flipped"), transport, r"damaged|checksum", require=pub,
            context="a byte flipped in the middle")
    forged = corrupt_copy(forge_chunk(data, xxh), scratch / "forged")
    err = refused(store_b, forged, transport, r"fails its signature", fp, require=pub,
                  context="a chunk forged with every checksum made right")
    if transport == "import":
        assert str(forged) in err, err
    refused(store_b, forged, transport, r"fails its signature", require=None,
            context="the forged signed stream, to a receiver that requires nothing")
    # The genuine stream is still stored afterwards.
    opts = ["--require-signature", pub]
    if transport == "import":
        store_b.dvr("import", signed, *opts)
    else:
        receive_from_file(store_b, signed, *opts)
    store_b.check("s", "n1")


def test_without_a_signature_a_forger_who_fixes_every_checksum_gets_in(store_a, store_b, scratch, xxh):
    """Why signatures exist: checksums catch damage, not a forger."""
    store_a.snap("s", "n1")
    export(store_a, "s/n1", scratch / "plain.dvr", "--no-compress")
    forged = corrupt_copy(forge_chunk(bytearray((scratch / "plain.dvr").read_bytes()), xxh), scratch / "forged")
    store_b.dvr("import", forged)
    assert "s/n1" in store_b.refs()
    proc = store_b.worker("check", "s", "n1", expect=None)
    assert proc.returncode != 0, "the forged snapshot should differ from the worker's content\n" + describe(proc)


def test_a_secret_key_others_can_read_is_refused(store_a, scratch, keys):
    key, _, _ = keys["alice"]
    store_a.snap("s", "n1")
    key.chmod(0o644)
    proc = store_a.dvr("export", "s/n1", "-o", scratch / "x.dvr", "--sign", key, expect=None)
    assert_failed(proc, r"accessible by other users", r"chmod 600", context="export --sign with a 0644 key")
    assert not (scratch / "x.dvr").exists()
    key.chmod(0o600)
    proc = store_a.dvr("export", "s/n1", "-o", scratch / "x.dvr", "--sign", scratch / "alice.pub", expect=None)
    assert_failed(proc, r"public key", context="export --sign with the public key file")
    proc = store_a.dvr("import", scratch / "nothing.dvr", "--require-signature", key, expect=None)
    assert_failed(proc, r"PREFIX\.pub", context="import --require-signature with the secret key file")


def test_push_and_pull_signed(store_a, store_b, sshd, dvr_bin, keys):
    key, pub, fp = keys["alice"]
    store_a.snap("s", "n1")
    got = parse_json(push(store_a, "s/n1", sshd, store_b, dvr_bin, "--sign", key, "--json").stdout, "push --json", None)
    assert got["signed_by"] == fp, got
    store_b.check("s", "n1")
    # pull: the far side signs with its key; this side requires it.
    store_b.snap("t", "m1")
    got = store_a.dvr_json("pull", sshd.url(store_b.path), "t/m1", *ssh_opts(sshd, dvr_bin), "--remote-sign", key,
                           "--require-signature", pub)
    assert got["signed_by"] == fp, got
    store_a.check("t", "m1")
    before = store_a.state()
    store_b.snap("t", "m2")
    proc = store_a.dvr("pull", sshd.url(store_b.path), "t/m2", *ssh_opts(sshd, dvr_bin), "--require-signature", pub, expect=None)
    assert_failed(proc, r"not signed", context="pull of an unsigned stream with --require-signature")
    store_a.assert_unchanged(before, "after a refused pull")


def test_memdvr_export_sign_and_import_require_signature(scratch, keys, memdvr):
    import numpy as np
    fp = memdvr.keygen(scratch / "py")
    assert fp == memdvr.key_fingerprint(scratch / "py.pub")
    with pytest.raises(memdvr.AlreadyExists):
        memdvr.keygen(scratch / "py")
    a, b = memdvr.Store(scratch / "pa"), memdvr.Store(scratch / "pb")
    s = memdvr.Session(a, "s")
    x = s.array("x", (1 << 18,), np.float64)
    x[:] = np.arange(x.size)
    s.snapshot("one")
    sent = a.export("s/one", scratch / "one.dvr", sign=scratch / "py.key")
    assert sent.signed_by == fp
    got = b.import_(scratch / "one.dvr", require_signature=[keys["alice"][1], scratch / "py.pub"])
    assert got.signed_by == fp and got.refs == ("s/one",)
    with pytest.raises(memdvr.PermissionDenied, match="ed25519:"):
        memdvr.Store(scratch / "pc").import_(scratch / "one.dvr", require_signature=keys["alice"][1])
    a.export("s/one", scratch / "plain.dvr")
    with pytest.raises(memdvr.PermissionDenied, match="not signed"):
        memdvr.Store(scratch / "pd").import_(scratch / "plain.dvr", require_signature=scratch / "py.pub")
    assert memdvr.Store(scratch / "pd").list() == []
