"""python -m memdvr: the store verbs from Python, as a script sees them."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import memdvr


def run(store, *args, expect=0):
    env = {**os.environ}
    proc = subprocess.run([sys.executable, "-m", "memdvr", "--store", str(store), *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == expect, (args, proc.returncode, proc.stdout, proc.stderr)
    return proc


@pytest.fixture
def store(tmp_path):
    path = tmp_path / "store"
    s = memdvr.Session(memdvr.Store(path), "s")
    a = s.array("a", (64, 1024), np.float32)
    a[:] = 1
    s.snapshot("one", label="first")
    a[3, 7] = 2
    s.snapshot("two")
    del a  # an SDK-owned array must be gone before its session closes
    s.close()
    return path


def test_ls_and_info_match_the_api(store):
    doc = json.loads(run(store, "ls", "--json").stdout)
    assert doc["schema_version"] == 1 and doc["session"] is None
    listed = doc["snapshots"]
    assert [(x["session"], x["name"]) for x in listed] == [("s", "one"), ("s", "two")]
    api = memdvr.Store(store).list()
    for entry, snap in zip(listed, api):
        assert entry["time"].endswith("Z") and entry["time_ns"] == snap.time_ns
        assert {k: entry[k] for k in ("name", "parent", "label", "logical_bytes", "stored_bytes", "chunks")} == {
            k: getattr(snap, k) for k in ("name", "parent", "label", "logical_bytes", "stored_bytes", "chunks")}
    info = json.loads(run(store, "info", "s/one", "--json").stdout)
    assert info["label"] == "first" and info["logical_bytes"] == 64 * 1024 * 4
    assert info.pop("schema_version") == 1 and info == listed[0]
    text = run(store, "ls").stdout
    assert "s/one" in text and "s/two" in text and "first" in text
    assert "label" in run(store, "info", "s/two").stdout


def test_diff_recover_stat_verify(store):
    regions = json.loads(run(store, "diff", "s/one", "s/two", "--json").stdout)["regions"]
    changed = sum(x != y for x, y in zip(np.float32(1).tobytes(), np.float32(2).tobytes()))
    assert [(r["name"], r["bytes_differ"], r["pages_differ"]) for r in regions] == [("a", changed, 1)]
    rec = json.loads(run(store, "recover", "s", "--json").stdout)
    assert rec["latest"]["name"] == "two" and rec["skipped"] == [] and rec["session"] == "s"
    assert run(store, "recover", "s").stdout.startswith("newest intact snapshot: s/two")
    assert json.loads(run(store, "stat", "--json").stdout)["snapshots"] == 2
    assert json.loads(run(store, "verify", "--json").stdout)["ok"] is True
    assert run(store, "verify").stdout.strip().endswith("ok: no damage found")
    log = run(store, "log", "s").stdout.splitlines()
    assert log[0].startswith("one ") and log[1].startswith("`-- two "), log
    assert json.loads(run(store, "log", "s", "--json").stdout)["snapshots"][1]["parent"] == "one"


def test_rm_and_gc(store):
    assert json.loads(run(store, "rm", "s/one", "s/one", "--json").stdout) == {"schema_version": 1, "removed": ["s/one"]}
    assert [x["name"] for x in json.loads(run(store, "ls", "--json").stdout)["snapshots"]] == ["two"]
    report = json.loads(run(store, "gc", "--json").stdout)
    assert set(report) == {"schema_version", "bytes_before", "bytes_after", "packs_removed", "temp_files_removed"}
    # A bad or unknown reference is refused before anything is removed.
    proc = run(store, "rm", "s/two", "nonsense", expect=2)
    assert "not a snapshot reference" in proc.stderr and "SESSION/NAME" in proc.stderr
    proc = run(store, "rm", "s/two", "s/nosuch", expect=1)
    assert "s/nosuch" in proc.stderr
    assert [x["name"] for x in json.loads(run(store, "ls", "--json").stdout)["snapshots"]] == ["two"]


def test_errors_name_the_thing_and_exit_nonzero(store, tmp_path):
    proc = run(store, "info", "s/nope", expect=1)
    assert proc.stderr.startswith("memdvr: ") and "s/nope" in proc.stderr
    missing = tmp_path / "missing"
    proc = run(missing, "ls", expect=1)
    assert "no store" in proc.stderr
    assert not missing.exists(), "a read-only verb must not create a store"
    for verb in ("ls", "log", "recover"):
        proc = run(store, verb, "nosuch", expect=1)
        assert "no session 'nosuch'" in proc.stderr, (verb, proc.stderr)
    assert run(store, "bogus", expect=2).returncode == 2  # usage error from argparse


def test_verify_exits_1_and_names_damage(store):
    pack = next(p for p in (store / "packs").iterdir() if p.suffix == ".pack")
    data = bytearray(pack.read_bytes())
    data[4096 + 10] ^= 0xFF  # the first stored chunk
    pack.write_bytes(bytes(data))
    proc = run(store, "verify", expect=1)
    assert "DAMAGED s/" in proc.stdout and "damaged snapshot(s)" in proc.stdout
    assert json.loads(run(store, "verify", "--json", expect=1).stdout)["ok"] is False


def test_an_empty_store_is_a_usage_error_and_hints_name_the_store(store, tmp_path):
    """`--store ""` (an unset variable) is refused like dvr refuses it, never
    the default store; the commands it suggests name the store, so they can be
    pasted."""
    proc = subprocess.run([sys.executable, "-m", "memdvr", "--store", "", "ls"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "DVR_STORE": str(tmp_path / "default-store")})
    assert proc.returncode == 2 and "--store was given an empty path" in proc.stderr, proc
    assert not (tmp_path / "default-store").exists()
    here = f"python -m memdvr --store {store}"
    assert f"`{here} ls`" in run(store, "ls", "nosuch", expect=1).stderr
    assert f"`{here} gc`" in run(store, "rm", "s/one").stdout
