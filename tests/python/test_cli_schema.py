"""One JSON schema for both front ends: `dvr --json` and `python -m memdvr
--json` print the same documents (keys and values) on the same store, and
every document fits the written schema, docs/cli-schema.json.

Fields only one side can know: recover's skipped[].why (dvr has the library's
reason for each skipped snapshot; Python only a damaged manifest's), and
nothing else. Also here: `--progress=json` lines of an import (monotonic,
ending at the total) and no progress output on a pipe by default.

Needs $DVR_BIN (the built dvr; CTest sets it) and the built memdvr on PYTHONPATH."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import memdvr

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "support"))
from schema_check import check, load_schema  # noqa: E402


@pytest.fixture(scope="module")
def dvr_bin():
    path = os.environ.get("DVR_BIN")
    if not path or not os.access(path, os.X_OK):
        pytest.fail(f"$DVR_BIN must name the built dvr (got {path!r}); run through CTest or set DVR_BIN=BUILD/dvr")
    return path


def run(argv, expect=0):
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == expect, (argv, proc.returncode, proc.stdout, proc.stderr)
    return proc


def dvr(dvr_bin, store, *args, expect=0):
    return run([dvr_bin, "--store", store, *args], expect=expect)


def py(store, *args, expect=0):
    return run([sys.executable, "-m", "memdvr", "--store", store, *args], expect=expect)


def both(dvr_bin, store, *args, expect=0):
    """The --json documents of both front ends for the same verb."""
    a = dvr(dvr_bin, store, *args, "--json", expect=expect)
    b = py(store, *args, "--json", expect=expect)
    return json.loads(a.stdout), json.loads(b.stdout)


@pytest.fixture
def store(tmp_path):
    path = tmp_path / "store"
    st = memdvr.Store(path)
    s = memdvr.Session(st, "s")
    a = s.array("a", (256, 1024), np.uint8)
    a[:] = 1
    s.snapshot("one", label="first: caf\u00e9 \u2713\ttab")
    a[5] = 2
    s.snapshot("two")
    b = s.array("b", (8192,), np.uint8)
    b[:] = 3
    s.snapshot("three", label="\x1b[2J escape")
    del a, b
    s.close()
    t = memdvr.Session(st, "t")
    c = t.array("c", (4096,), np.uint8)
    c[:] = 7
    t.snapshot("x")
    del c
    t.close()
    return path


VERBS = [("ls",), ("ls", "s"), ("info", "s/one"), ("info", "s/three"), ("log", "s"), ("diff", "s/one", "s/three"),
         ("diff", "s/one", "t/x"), ("verify",), ("stat",), ("recover", "s")]


def test_both_front_ends_print_the_same_documents_and_they_fit_the_schema(dvr_bin, store):
    schema = load_schema()
    for args in VERBS:
        a, b = both(dvr_bin, store, *args)
        assert a == b, f"{args}:\n dvr    {a}\n python {b}"
        check(a, args[0], schema)
    ls = both(dvr_bin, store, "ls")[0]
    assert [s["label"] for s in ls["snapshots"]][:3] == ["first: caf\u00e9 \u2713\ttab", "", "\x1b[2J escape"]
    assert all(s["time"].endswith("Z") and s["time"][:4].isdigit() for s in ls["snapshots"])
    # Text for people shows control characters escaped, in both front ends.
    for text in (dvr(dvr_bin, store, "ls").stdout, py(store, "ls").stdout, dvr(dvr_bin, store, "info", "s/three").stdout):
        assert "\\x1b[2J escape" in text and "\x1b" not in text, text
    assert "first: caf\u00e9 \u2713\\ttab" in dvr(dvr_bin, store, "ls", "s").stdout
    diff = both(dvr_bin, store, "diff", "s/one", "s/three")[0]
    assert [(r["name"], r["only_in_b"]) for r in diff["regions"]] == [("a", False), ("b", True)], diff
    # gc: the first run reclaims nothing here; the two agree on the same store.
    a, b = both(dvr_bin, store, "gc")
    assert a == b and a["packs_removed"] == 0, (a, b)
    check(a, "gc", schema)
    # rm: each front end removes another snapshot; duplicates count once.
    a = json.loads(dvr(dvr_bin, store, "rm", "t/x", "t/x", "--json").stdout)
    b = json.loads(py(store, "rm", "s/two", "s/two", "--json").stdout)
    assert a == {"schema_version": 1, "removed": ["t/x"]} and b == {"schema_version": 1, "removed": ["s/two"]}
    check(a, "rm", schema)
    check(b, "rm", schema)
    assert [(s["session"], s["name"]) for s in both(dvr_bin, store, "ls")[0]["snapshots"]] == [("s", "one"), ("s", "three")]


def test_a_damaged_snapshot_is_reported_alike(dvr_bin, store):
    schema = load_schema()
    manifest = store / "sessions" / "s" / "three.snap"
    manifest.write_bytes(manifest.read_bytes()[:-5])
    for args in (("ls", "s"), ("log", "s")):
        a, b = both(dvr_bin, store, *args)
        assert a == b, args
        check(a, args[0], schema)
        assert [s["damaged"] for s in a["snapshots"]] == [False, False, True] and a["snapshots"][2]["damage"]
    a, b = both(dvr_bin, store, "verify", expect=1)
    assert a == b and a["ok"] is False and a["damaged_snapshots"] == ["s/three"], a
    check(a, "verify", schema)
    a, b = both(dvr_bin, store, "recover", "s")
    check(a, "recover", schema)
    check(b, "recover", schema)
    assert a["latest"]["name"] == "two" and a["latest"] == b["latest"]
    # Only dvr knows the library's reason for a skip; both name the snapshot.
    assert [s["snapshot"] for s in a["skipped"]] == [s["snapshot"] for s in b["skipped"]] == ["s/three"]
    assert all(s["why"] for s in a["skipped"] + b["skipped"])


def test_loosened_permissions_are_warned_about_alike(dvr_bin, store):
    """verify and stat warn (not damage: exit 0) about a store opened up to
    group and others, in text and in the `warnings` array of their documents."""
    schema = load_schema()
    for verb in ("verify", "stat"):
        a, b = both(dvr_bin, store, verb)
        assert a == b and a["warnings"] == [], a
    manifest = store / "sessions" / "s" / "one.snap"
    os.chmod(manifest, 0o644)
    os.chmod(store / "packs", 0o755)
    for verb in ("verify", "stat"):
        a, b = both(dvr_bin, store, verb)
        check(a, verb, schema)
        assert a == b, verb
        assert len(a["warnings"]) == 2, a
        assert f"{store}/packs (mode 0755)" in a["warnings"][0]
        assert f"{manifest} (mode 0644)" in a["warnings"][1] and "chmod -R go=" in a["warnings"][1]
    assert both(dvr_bin, store, "verify")[0]["ok"] is True
    text = dvr(dvr_bin, store, "verify").stdout
    assert text.count("WARNING: ") == 2 and "ok: no damage found" in text, text
    assert py(store, "stat").stdout.count("WARNING: ") == 2
    # The store directory itself: open makes it private again, and says so once.
    os.chmod(store, 0o777)
    proc = dvr(dvr_bin, store, "verify")
    assert "was mode 0777" in proc.stdout and "dvr verify" in proc.stdout, proc.stdout
    assert "was mode 0777" in proc.stderr  # the log sink's warning, on stderr
    assert os.stat(store).st_mode & 0o777 == 0o700
    assert "was mode 0777" not in dvr(dvr_bin, store, "stat").stdout


def test_unknown_names_are_errors_in_both(dvr_bin, store):
    for args in (("ls", "nosuch"), ("log", "nosuch"), ("recover", "nosuch"), ("info", "s/nosuch"), ("diff", "s/one", "s/nosuch"),
                 ("rm", "s/one", "s/nosuch")):
        a = dvr(dvr_bin, store, *args, expect=1)
        b = py(store, *args, expect=1)
        assert "nosuch" in a.stderr and "nosuch" in b.stderr, (args, a.stderr, b.stderr)
    # rm checked every name first: s/one is still there.
    assert [s["name"] for s in both(dvr_bin, store, "ls", "s")[0]["snapshots"]] == ["one", "two", "three"]


def test_failures_print_the_error_document_in_both(dvr_bin, store):
    """With --json a failed verb still prints one document on stdout, the
    `error` document: the library's code, the message (also on stderr) and
    the exit status; bad usage is invalid_argument, exit status 2. Without
    --json stdout stays empty."""
    schema = load_schema()
    cases = [(("info", "s/nosuch"), 1, "not_found"), (("ls", "nosuch"), 1, "not_found"),
             (("rm", "s/one", "s/nosuch"), 1, "not_found"), (("info", "s/.."), 2, "invalid_argument"),
             (("prune", "s", "--keep-last", "x"), 2, "invalid_argument")]
    for args, status, code in cases:
        for front, proc in (("dvr", dvr(dvr_bin, store, *args, "--json", expect=status)),
                            ("memdvr", py(store, *args, "--json", expect=status))):
            lines = proc.stdout.splitlines()
            assert len(lines) == 1, (front, args, proc.stdout, proc.stderr)
            doc = json.loads(lines[0])
            check(doc, "error", schema)
            assert doc["error"]["code"] == code and doc["error"]["exit_status"] == status, (front, args, doc)
            assert doc["error"]["message"] and proc.stderr.strip(), (front, args, doc, proc.stderr)
            if status == 1:  # the library's message, on both channels
                assert doc["error"]["message"] in proc.stderr, (front, args, doc, proc.stderr)
        assert dvr(dvr_bin, store, *args, expect=status).stdout == "", args
    # recover of an unknown session prints its own document (latest null), and only that.
    for front, proc in (("dvr", dvr(dvr_bin, store, "recover", "nosuch", "--json", expect=1)),
                        ("memdvr", py(store, "recover", "nosuch", "--json", expect=1))):
        lines = proc.stdout.splitlines()
        assert len(lines) == 1 and json.loads(lines[0])["latest"] is None, (front, proc.stdout)
        check(json.loads(lines[0]), "recover", schema)
    # rm checked every name first: nothing was removed by the failed rm.
    assert [s["name"] for s in both(dvr_bin, store, "ls", "s")[0]["snapshots"]] == ["one", "two", "three"]


def test_import_progress_lines_are_monotonic_and_a_pipe_gets_none(dvr_bin, tmp_path):
    schema = load_schema()
    src = tmp_path / "src"
    s = memdvr.Session(memdvr.Store(src), "big")
    a = s.array("data", (32 << 20,), np.uint8)
    a[:] = np.random.default_rng(1).integers(0, 256, a.shape, dtype=np.uint8)  # 32 MiB that do not compress
    s.snapshot("one")
    del a
    s.close()
    stream = tmp_path / "one.dvr"
    sent = json.loads(dvr(dvr_bin, src, "export", "big/one", "-o", stream, "--json").stdout)
    check(sent, "transfer_sent", schema)
    proc = dvr(dvr_bin, tmp_path / "dst", "import", stream, "--json", "--progress=json")
    received = json.loads(proc.stdout)
    check(received, "transfer_received", schema)
    lines = [json.loads(line) for line in proc.stderr.splitlines()]
    assert lines, "no progress lines on stderr"
    for line in lines:
        check(line, "progress", schema)
        assert line["op"] == "import" and line["total"] == stream.stat().st_size, line
    done = [line["done"] for line in lines]
    assert done == sorted(done) and done[-1] == lines[-1]["total"], done
    # By default (auto), stderr that is a pipe gets no progress at all.
    shutil.rmtree(tmp_path / "dst")
    proc = dvr(dvr_bin, tmp_path / "dst", "import", stream)
    assert proc.stderr == "", proc.stderr
    proc = dvr(dvr_bin, src, "verify", "--progress=none")
    assert proc.stderr == ""
    proc = dvr(dvr_bin, src, "verify", "--progress=json")
    assert [json.loads(line)["op"] for line in proc.stderr.splitlines()][-1] == "verify"


def test_prune_keeps_by_rule_says_why_and_a_dry_run_changes_nothing(dvr_bin, store):
    schema = load_schema()
    names = lambda: [s["name"] for s in json.loads(dvr(dvr_bin, store, "ls", "s", "--json").stdout)["snapshots"]]
    before = names()
    dry = json.loads(dvr(dvr_bin, store, "prune", "s", "--keep-last", "1", "--dry-run", "--json").stdout)
    check(dry, "prune", schema)
    assert dry["dry_run"] is True and dry["session"] == "s" and dry["removed"] == 2
    assert [(d["snapshot"]["name"], d["keep"]) for d in dry["decisions"]] == [("one", False), ("two", False), ("three", True)]
    assert dry["decisions"][2]["reason"] == "last 1"
    assert "parent of three" in dry["decisions"][1]["reason"], dry["decisions"][1]
    assert names() == before  # nothing removed
    text = dvr(dvr_bin, store, "prune", "s", "--keep-last", "1", "-n").stdout
    assert "would remove one" in text and "keep    three" in text and "without --dry-run" in text, text
    # Refused, and nothing removed: no rule, an unknown session, a bad value.
    err = dvr(dvr_bin, store, "prune", "s", expect=2).stderr
    assert "--keep-last" in err and "keep_last" not in err, err
    assert "no session 'nosuch'" in dvr(dvr_bin, store, "prune", "nosuch", "--keep-last", "1", expect=1).stderr
    assert "--keep-within" in dvr(dvr_bin, store, "prune", "s", "--keep-within", "soon", expect=2).stderr
    assert names() == before
    # The real run removes what the dry run said, and the child stays restorable.
    real = json.loads(dvr(dvr_bin, store, "prune", "s", "--keep-last", "1", "--keep-within", "1w", "--json").stdout)
    check(real, "prune", schema)
    # --keep-within 1w keeps all three (taken within a second of each other).
    assert real["removed"] == 0 and all(d["keep"] for d in real["decisions"])
    real = json.loads(dvr(dvr_bin, store, "prune", "s", "--keep-last", "1", "--json").stdout)
    assert real["dry_run"] is False and real["removed"] == 2
    assert names() == ["three"]
    st = memdvr.Store(store)
    s = memdvr.Session(st, "s")
    a = s.array("a", (256, 1024), np.uint8)
    b = s.array("b", (8192,), np.uint8)
    s.restore("three")
    assert int(a[5, 0]) == 2 and int(a[0, 0]) == 1 and int(b[0]) == 3
    del a, b
    s.close()
    assert json.loads(dvr(dvr_bin, store, "verify", "--json").stdout)["ok"] is True


def test_demo_document_fits_the_schema(dvr_bin, tmp_path):
    doc = json.loads(run([dvr_bin, "--store", tmp_path / "demo", "demo", "--size", "16M", "--trials", "1", "--json"]).stdout)
    check(doc, "demo", load_schema())
    assert doc["checksums_ok"] is True and doc["data_bytes"] == 16 << 20, doc
