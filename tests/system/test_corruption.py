"""Damage detection through the CLI: a flipped byte in a pack, a truncated or
altered manifest, a missing pack. `dvr verify` must name every damaged snapshot
(and only those), `dvr ls` must show damaged manifests, restore must refuse with
`corrupt` naming the snapshot, and healthy snapshots must still restore."""

import pytest
from dvrtest import DVR_ERROR, describe, flip_byte, worker_error


def locate(store, head):
    """(pack file, offset) of the single stored copy of the chunk starting with `head`."""
    found = []
    for pack in sorted((store.path / "packs").glob("*.pack")):
        data = pack.read_bytes()
        at = data.find(head)
        while at >= 0:
            found.append((pack, at))
            at = data.find(head, at + 1)
    assert len(found) == 1, f"expected one stored copy of chunk {head.hex()}, found {found}"
    return found[0]


def damage_chunk_of(store, name, kind, region="r0"):
    """Flips one byte inside the stored copy of a `kind` unit of snapshot `name`; returns the unit."""
    unit = next(u for u in store.units(name) if u[2] == kind and u[0] == region and u[4] > 2000)
    pack, at = locate(store, unit[5])
    flip_byte(pack, at + 1234)
    return unit


@pytest.fixture
def damaged_store(store):
    """s/a..s/d; b has one flipped byte in a chunk of its own, c's manifest is truncated."""
    store.snap("s", "a", "b", "c", "d")
    damage_chunk_of(store, "b", "fresh")
    manifest = store.path / "sessions" / "s" / "c.snap"
    data = manifest.read_bytes()
    manifest.write_bytes(data[: len(data) // 2])
    return store


def test_verify_names_each_damaged_snapshot_in_text_and_json(damaged_store):
    store = damaged_store
    proc = store.dvr("verify", expect=1)
    damaged_lines = [l for l in proc.stdout.splitlines() if l.startswith("DAMAGED")]
    assert any(l.startswith("DAMAGED s/b:") for l in damaged_lines), describe(proc)
    assert any(l.startswith("DAMAGED s/c:") for l in damaged_lines), describe(proc)
    assert not [l for l in damaged_lines if l.startswith(("DAMAGED s/a", "DAMAGED s/d"))], describe(proc)
    assert "2 damaged snapshot(s)" in proc.stdout, describe(proc)

    report = store.verify(expect=1)
    assert report["ok"] is False
    assert report["damaged_snapshots"] == ["s/b", "s/c"]
    assert report["snapshots"] == 4
    by_snapshot = {p["snapshot"]: p["what"] for p in report["problems"]}
    assert set(by_snapshot) == {"b", "c"} and all(p["session"] == "s" for p in report["problems"])
    # Each problem says what is wrong where, and what to do.
    assert "region 'r0'" in by_snapshot["b"] and f"dvr --store {store.path} rm s/b" in by_snapshot["b"], by_snapshot["b"]
    assert "truncated" in by_snapshot["c"] or "damaged" in by_snapshot["c"], by_snapshot["c"]


def test_ls_shows_the_damaged_manifest(damaged_store):
    store = damaged_store
    proc = store.dvr("ls")
    line_c = [l for l in proc.stdout.splitlines() if l.startswith("s/c ")]
    assert len(line_c) == 1 and "DAMAGED" in line_c[0], describe(proc)
    assert "DAMAGED" not in proc.stdout.replace(line_c[0], ""), describe(proc)
    listing = {s["name"]: s for s in store.ls()}
    assert set(listing) == {"a", "b", "c", "d"}
    assert listing["c"]["damaged"] is True and "s/c" in listing["c"]["damage"]
    assert not any(listing[n]["damaged"] for n in "abd")
    info = store.dvr("info", "s/c", expect=1)
    assert "s/c" in info.stderr and "damaged" in info.stderr, describe(info)


def test_restoring_a_damaged_snapshot_fails_with_corrupt_naming_it(damaged_store):
    store = damaged_store
    for name in ("b", "c"):
        proc = store.check("s", name, expect=DVR_ERROR)
        assert worker_error(proc).startswith("error corrupt:"), describe(proc)
        assert f"s/{name}" in proc.stderr, describe(proc)
    b = store.check("s", "b", expect=DVR_ERROR)
    assert "region 'r0'" in b.stderr and "live memory was not changed" in b.stderr, describe(b)
    # Checking every snapshot of the session fails too, on the damaged manifest.
    everything = store.check("s", expect=DVR_ERROR)
    assert "corrupt" in everything.stderr and "s/c" in everything.stderr, describe(everything)
    store.check("s", "a", "d")


def test_gc_refuses_while_a_manifest_is_unreadable_and_recovers_after_rm(damaged_store):
    store = damaged_store
    proc = store.dvr("gc", expect=1)
    assert "s/c" in proc.stderr and f"dvr --store {store.path} rm" in proc.stderr, describe(proc)
    store.dvr("rm", "s/c", "s/b")
    store.gc()
    assert store.verify()["ok"]
    assert store.names("s") == {"a", "d"}
    store.check("s", "a", "d")
    store.snap("s", "e")  # the store is fully usable again
    store.check("s")


def test_a_damaged_shared_chunk_names_every_snapshot_that_uses_it(store):
    store.snap("s", "a", "b", "c")
    store.snap("t", "x")
    region, index, *_ = damage_chunk_of(store, "a", "base", region="r2")

    def uses_it(name):
        return any(u[:3] == (region, index, "base") for u in store.units(name))

    users = {f"{s}/{n}" for s, n in (("s", "a"), ("s", "b"), ("s", "c"), ("t", "x")) if uses_it(n)}
    assert "s/a" in users and len(users) >= 3, users  # the chunk really is shared
    report = store.verify(expect=1)
    assert set(report["damaged_snapshots"]) == users, report
    for ref in users:
        session, name = ref.split("/")
        proc = store.check(session, name, expect=DVR_ERROR)
        assert "corrupt" in proc.stderr and ref in proc.stderr, describe(proc)


def test_altered_manifest_byte_is_caught_by_its_checksum(store):
    store.snap("s", "a", "b")
    manifest = store.path / "sessions" / "s" / "a.snap"
    flip_byte(manifest, manifest.stat().st_size // 2)
    assert store.verify(expect=1)["damaged_snapshots"] == ["s/a"]
    proc = store.check("s", "a", expect=DVR_ERROR)
    assert "corrupt" in proc.stderr and "s/a" in proc.stderr, describe(proc)
    store.check("s", "b")


def test_missing_pack_damages_every_snapshot_stored_in_it(store):
    store.snap("s", "a", "b")
    for pack in (store.path / "packs").glob("*.pack"):
        pack.unlink()
    report = store.verify(expect=1)
    assert report["damaged_snapshots"] == ["s/a", "s/b"], report
    proc = store.check("s", "a", expect=DVR_ERROR)
    assert "corrupt" in proc.stderr and "s/a" in proc.stderr and "missing" in proc.stderr, describe(proc)


def test_a_new_snapshot_of_intact_memory_does_not_inherit_stored_damage(store):
    """Dedup must not make a new snapshot depend on a stored chunk that no longer
    matches its hash: snapshot() succeeds, so its data must restore."""
    store.snap("s", "a", "b")
    damage_chunk_of(store, "b", "fresh")
    store.snap("t", "b")  # the same content as s/b, from intact memory
    proc = store.check("t", "b", expect=None)
    assert proc.returncode == 0, "a snapshot taken after the damage reuses the damaged chunk:\n" + describe(proc)
    assert store.verify(expect=1)["damaged_snapshots"] == ["s/b"]


def test_a_forged_commit_number_is_damage_and_does_not_wrap_the_next(store):
    """A manifest whose seq was set to 2^64-1 and its checksum recomputed (XXH3
    is no authentication): it is reported damaged, and the next snapshot is
    still the newest (its number did not wrap to 0)."""
    import ctypes
    import struct
    try:
        lib = ctypes.CDLL("libxxhash.so.0")
    except OSError as e:
        pytest.skip(f"libxxhash.so.0 cannot be loaded through ctypes ({e})")
    lib.XXH3_64bits.restype = ctypes.c_uint64
    lib.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    store.snap("s", "old")
    manifest = store.path / "sessions" / "s" / "old.snap"
    data = bytearray(manifest.read_bytes())
    (body,) = struct.unpack_from("<Q", data, 16)
    struct.pack_into("<Q", data, 72, 2**64 - 1)  # seq (docs/format.md, the manifest header)
    struct.pack_into("<Q", data, body, lib.XXH3_64bits(bytes(data[:body]), body))
    manifest.write_bytes(data)
    store.snap("s", "new")
    snaps = {s["name"]: s for s in store.ls("s")}
    assert snaps["old"]["damaged"] and "commit number" in snaps["old"]["damage"], snaps["old"]
    assert 0 < snaps["new"]["seq"] < 2**48, snaps["new"]
    assert store.dvr_json("recover", "s")["latest"]["name"] == "new"
    assert store.verify(expect=1)["damaged_snapshots"] == ["s/old"]
    store.check("s", "new")


@pytest.mark.parametrize("content", [b"", bytes(4096)])
def test_a_superblock_whose_data_was_lost_is_corrupt_not_a_foreign_directory(store, content):
    """A DVRSTORE emptied or zeroed (a file system that lost a file's data) is
    damage (exit status 1, restore it from a backup), not bad usage."""
    store.snap("s", "a")
    (store.path / "DVRSTORE").write_bytes(content)
    for verb in ("ls", "verify"):
        proc = store.dvr(verb, expect=1)
        assert "corrupt superblock" in proc.stderr and ("empty" if not content else "all zero bytes") in proc.stderr, describe(proc)
    (store.path / "DVRSTORE").write_text("something else\n")
    proc = store.dvr("ls", expect=2)
    assert "is not a Memory DVR superblock" in proc.stderr, describe(proc)
