"""The `dvr` command as a user and a script see it: JSON output with the
documented fields, exit codes, clear errors for unknown names, bad references and
directories that are not stores, and space reclaimed by rm + gc."""

import json
from pathlib import Path
import os
import stat
import subprocess
import sys
import time

import pytest
from dvrtest import DVR_ERROR, PACK_METADATA_SLACK, WORKER_REGION_SIZES, WORKER_BYTES, describe, run, worker_error

CHUNK = 64 * 1024  # the worker creates stores with its 64 KiB content unit
SNAPSHOT_FIELDS = {"session", "name", "parent", "label", "time_ns", "time", "logical_bytes", "stored_bytes", "chunks",
                   "zero_chunks", "chunks_read", "tracking", "damaged", "damage", "pending", "regions", "seq", "origin_time_ns"}
STAT_FIELDS = {"schema_version", "path", "medium", "format_version", "chunk_size", "sessions", "snapshots", "logical_bytes",
               "pack_bytes", "pack_files", "warnings"}


def page_round(n):
    return (n + 4095) // 4096 * 4096


@pytest.fixture
def populated(store):
    store.snap("s", "a", "b")
    store.snap("t", "a")
    return store


def test_ls_json_has_the_documented_fields_and_true_values(populated):
    store = populated
    started = time.time_ns()
    snaps = store.ls()
    assert [(s["session"], s["name"]) for s in snaps] == [("s", "a"), ("s", "b"), ("t", "a")]
    for s in snaps:
        assert set(s) == SNAPSHOT_FIELDS, s
        assert s["damaged"] is False
        assert s["logical_bytes"] == WORKER_BYTES
        assert [(r["name"], r["size"], r["sdk_owned"]) for r in s["regions"]] == [
            ("r0", WORKER_REGION_SIZES["r0"], True), ("r1", WORKER_REGION_SIZES["r1"], False), ("r2", WORKER_REGION_SIZES["r2"], True)]
        assert s["chunks"] == sum((n + CHUNK - 1) // CHUNK for n in WORKER_REGION_SIZES.values())
        assert s["zero_chunks"] == sum(1 for u in store.units(s["name"]) if u[2] == "zero") > 0
        assert s["label"].startswith("dvr-test-worker pid ")
        assert started - 600 * 10**9 < s["time_ns"] <= time.time_ns()
    # The parent is the session's previous snapshot taken by the same process.
    assert [s["parent"] for s in snaps] == ["", "a", ""]
    assert snaps[0]["time_ns"] < snaps[1]["time_ns"]
    # One session only, oldest first.
    assert [s["name"] for s in store.ls("s")] == ["a", "b"]
    proc = store.dvr("ls", "nosuch", "--json", expect=1)
    assert "no session 'nosuch'" in proc.stderr and f"`dvr --store {store.path} ls`" in proc.stderr, describe(proc)
    assert json.loads(proc.stdout)["error"]["code"] == "not_found", describe(proc)  # the `error` document


def test_ls_text(populated):
    out = populated.dvr("ls").stdout.splitlines()
    assert out[0].split()[:2] == ["SNAPSHOT", "TIME"]
    assert [l.split()[0] for l in out[1:]] == ["s/a", "s/b", "t/a"]
    assert "6.3 MiB" in out[1]
    proc = populated.dvr("ls", "nosuch", expect=1)
    assert "no session 'nosuch'" in proc.stderr and "sessions: s, t" in proc.stderr, describe(proc)
    proc = populated.dvr("ls", "-l", expect=2)
    assert "unknown option '-l'" in proc.stderr and "dvr ls --help" in proc.stderr, describe(proc)


def test_info_matches_ls(populated):
    store = populated
    listed = {(s["session"], s["name"]): s for s in store.ls()}
    for (session, name), entry in listed.items():
        info = store.dvr_json("info", f"{session}/{name}")
        assert info.pop("schema_version") == 1 and info == entry
    text = store.dvr("info", "s/b").stdout
    assert "snapshot  s/b" in text and "parent    a" in text and "regions   3" in text, text
    assert f"r1  293.0 KiB ({WORKER_REGION_SIZES['r1']} bytes)  tracked" in text, text


def test_stored_bytes_count_exactly_the_chunks_new_to_the_store(store):
    """Dedup across snapshots and sessions: each snapshot adds the chunks no
    earlier snapshot stored (page-aligned), identical content adds nothing."""
    order = [("s", "a"), ("s", "b"), ("t", "c"), ("t", "a"), ("s", "fill-x")]
    seen = {}
    for session, name in order:
        store.snap(session, name)
        keys = store.content_keys(name)
        new = {k: n for k, n in keys.items() if k not in seen}
        seen.update(new)
        stored = store.dvr_json("info", f"{session}/{name}")["stored_bytes"]
        assert sum(new.values()) <= stored <= sum(map(page_round, new.values())), (session, name, stored, len(new))
    assert store.dvr_json("info", "t/a")["stored_bytes"] == 0  # same content as s/a
    store.gc()  # gives back space reserved but left unused by the snapshots
    stat_ = store.stat()
    total = sum(map(page_round, seen.values()))
    assert total <= stat_["pack_bytes"] <= total + stat_["pack_files"] * (4096 + PACK_METADATA_SLACK), stat_


def test_stat_json(populated):
    s = populated.stat()
    assert set(s) == STAT_FIELDS, s
    assert s["path"] == str(populated.path)
    assert s["medium"] in ("disk", "dram", "pmem")
    assert s["format_version"] == 1 and s["chunk_size"] == CHUNK
    assert (s["sessions"], s["snapshots"]) == (2, 3)
    assert s["logical_bytes"] == 3 * WORKER_BYTES
    assert s["pack_files"] >= 1 and 0 < s["pack_bytes"] < s["logical_bytes"]
    text = populated.dvr("stat").stdout
    assert f"store      {populated.path}" in text and "sessions   2, snapshots 3" in text, text


def test_verify_clean_store(populated):
    proc = populated.dvr("verify")
    assert "verified 3 snapshot(s)" in proc.stdout and "ok: no damage found" in proc.stdout, describe(proc)
    report = populated.verify()
    assert report["ok"] is True and report["damaged_snapshots"] == [] and report["problems"] == []
    assert report["snapshots"] == 3 and report["chunks"] > 0 and report["bytes"] > 0


def test_rm_then_gc_reclaims_space(populated):
    store = populated
    before = store.stat()["pack_bytes"]
    b_only = sum(n for k, n in store.content_keys("b").items() if k[0] == "fresh")
    proc = store.dvr("rm", "s/b")
    assert "removed s/b" in proc.stdout and " gc` to reclaim the space" in proc.stdout, describe(proc)
    assert store.names("s") == {"a"}
    assert store.stat()["pack_bytes"] == before  # rm alone frees nothing
    gc = store.gc()
    assert set(gc) == {"schema_version", "bytes_before", "bytes_after", "packs_removed", "temp_files_removed"}
    assert gc["bytes_before"] - gc["bytes_after"] >= b_only, gc
    after = store.stat()["pack_bytes"]
    assert before - after >= b_only, (before, after, b_only)
    store.check("s", "a")
    store.check("t", "a")
    assert store.verify()["ok"]
    # Removing the last snapshot of a session removes the session.
    store.dvr("rm", "s/a")
    assert store.stat()["sessions"] == 1
    assert "gc: reclaimed" in store.dvr("gc").stdout


def test_rm_of_an_unknown_snapshot_is_a_clear_error(populated):
    store = populated
    proc = store.dvr("rm", "s/zz", expect=None)
    assert proc.returncode not in (0, 2) and proc.returncode > 0, describe(proc)
    assert "no snapshot 's/zz'" in proc.stderr and "`dvr --store " in proc.stderr and " ls s`" in proc.stderr, describe(proc)
    proc = store.dvr("rm", "nosuch/a", expect=None)
    assert proc.returncode == 1 and "nosuch/a" in proc.stderr, describe(proc)
    assert len(store.ls()) == 3


def test_rm_collapses_duplicates(populated):
    proc = populated.dvr("rm", "s/b", "s/b")
    assert proc.stdout.count("removed s/b") == 1, describe(proc)
    assert populated.names("s") == {"a"}


def test_every_command_has_its_own_help_with_examples(store, dvr_bin):
    commands = ["demo", "ls", "info", "rm", "gc", "verify", "stat", "log", "diff", "recover", "run", "send", "receive",
                "export", "import", "push", "pull", "completion", "proc", "proc dump", "proc restore", "proc clone",
                "proc ls", "proc info", "proc rm", "proc check"]
    texts = {}
    for c in commands:
        text = run([dvr_bin, *c.split(), "--help"]).stdout
        assert f"usage: dvr {c}" in text, (c, text)
        texts[c] = text
    for c in ("ls", "info", "rm", "verify", "export", "import", "proc dump", "run"):
        assert "Examples:" in texts[c], (c, texts[c])
    assert "--every" in texts["proc dump"] and "--keep" in texts["proc dump"]
    assert "--dump-every" in texts["run"] and "--heap" in texts["run"]
    assert run([dvr_bin, "ls", "-h"]).stdout == texts["ls"]
    # The top-level help lists every command once.
    top = run([dvr_bin, "--help"]).stdout
    assert all(f"  {c} " in top for c in commands if " " not in c), top


def test_typed_options_name_the_option_and_what_was_expected(store, dvr_bin):
    proc = run([dvr_bin, "--store", store.path, "demo", "--trials", "abc"], expect=2)
    assert "--trials" in proc.stderr and "'abc' is not a whole number" in proc.stderr, describe(proc)
    proc = run([dvr_bin, "--store", store.path, "demo", "--size", "lots"], expect=2)
    assert "--size" in proc.stderr and "512M or 1G" in proc.stderr, describe(proc)
    proc = run([dvr_bin, "--store", store.path, "export", "s/a", "-o", "/dev/null", "--level", "40"], expect=2)
    assert "--level" in proc.stderr and "1 to 19" in proc.stderr, describe(proc)
    proc = run([dvr_bin, "--store", store.path, "export", "s/a", "-o", "/dev/null", "--compress", "fast"], expect=2)
    assert "--compress" in proc.stderr and "fast" in proc.stderr, describe(proc)
    proc = run([dvr_bin, "--progress=sometimes", "ls"], expect=2)
    assert "--progress" in proc.stderr, describe(proc)
    proc = run([dvr_bin, "info"], expect=2)
    assert "ref" in proc.stderr and "dvr info --help" in proc.stderr, describe(proc)
    version = run([dvr_bin, "--version"]).stdout.split()
    assert version[0] == "dvr" and version[1].count(".") == 2, version


def test_bash_completion_completes_commands_and_options(dvr_bin, tmp_path):
    script = run([dvr_bin, "completion", "bash"]).stdout
    built = Path(dvr_bin).parent / "dvr.bash-completion"
    assert built.read_text() == script, "the build's completion file is stale"

    def complete(*words):
        words = ["dvr", *words]
        line = f"source {tmp_path / 'c.sh'}; COMP_WORDS=({' '.join(repr(w) for w in words)}); COMP_CWORD={len(words) - 1}; " \
               "_dvr; printf '%s\\n' \"${COMPREPLY[@]}\""
        return set(run(["bash", "-c", line]).stdout.split())

    (tmp_path / "c.sh").write_text(script)
    assert complete("pr") == {"proc", "prune"}
    assert {"ls", "info", "verify", "proc", "run", "export", "completion"} <= complete("")
    assert complete("proc", "d") == {"dump"}
    assert {"--name", "--every", "--keep", "--leave-running", "--json", "--store"} <= complete("proc", "dump", "--")
    assert complete("verify", "--j") == {"--json"}
    assert complete("run", "--", "l") == set()  # after --: the job's own command line
    proc = run([dvr_bin, "completion", "zsh"], expect=2)
    assert "zsh" in proc.stderr, describe(proc)


def test_rm_checks_every_reference_before_removing_any(populated):
    proc = populated.dvr("rm", "s/a", "../x", expect=2)
    assert "not valid" in proc.stderr, describe(proc)
    assert populated.names("s") == {"a", "b"}, "`dvr rm s/a ../x` removed s/a before rejecting ../x:\n" + describe(proc)


@pytest.mark.parametrize("args", [
    ["info", "../x"], ["info", "x"], ["info", "s/b/c"], ["info", "/x"], ["info", "s/"], ["info", "s/.hidden"],
    ["info", "s/.."], ["info", "s/a b"], ["rm", "../x"], ["rm", "s/../../x"], ["ls", ".."], ["ls", "../s"],
    ["info", "s/" + "n" * 129],
])
def test_bad_references_are_rejected(populated, args):
    outside = sorted(os.listdir(populated.path.parent))
    proc = populated.dvr(*args, expect=2)
    assert proc.stderr.startswith("dvr: ") and ("not valid" in proc.stderr or "not a snapshot reference" in proc.stderr), describe(proc)
    assert proc.stdout == ""
    assert sorted(os.listdir(populated.path.parent)) == outside
    assert len(populated.ls()) == 3


@pytest.mark.parametrize("command", ["dvr ls", "dvr gc", "dvr rm s/a", "worker snap"])
def test_a_non_store_directory_is_refused_and_left_untouched(make_store, tmp_path, command):
    """`dvr --store DIR ...` (or a program opening DIR as a store) on a directory
    of someone's files must fail with a clear message and change nothing in it."""
    precious = make_store("precious")
    precious.path.mkdir()
    (precious.path / "notes.txt").write_text("mine\n")
    precious.path.chmod(0o755)
    tool, *args = command.split()
    if tool == "dvr":
        proc = precious.dvr(*args, expect=2)
    else:
        proc = precious.snap("s", "a", expect=DVR_ERROR)
        assert worker_error(proc).startswith("error invalid_argument:"), describe(proc)
    assert "is not a Memory DVR store" in proc.stderr, describe(proc)
    after = (sorted(os.listdir(precious.path)), oct(stat.S_IMODE(precious.path.stat().st_mode)))
    assert after == (["notes.txt"], "0o755"), f"{command} changed a foreign directory (files, mode): {after}"


def test_a_missing_store_is_reported_and_not_created(tmp_path, dvr_bin):
    missing = tmp_path / "no" / "store"
    for command in (["ls"], ["stat"], ["verify"], ["gc"], ["info", "s/a"]):
        proc = run([dvr_bin, "--store", missing, *command], expect=1)
        assert f"no store at {missing}" in proc.stderr, describe(proc)
    assert not (tmp_path / "no").exists()


def test_reading_commands_do_not_turn_an_empty_directory_into_a_store(tmp_path, dvr_bin):
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o755)
    empty.chmod(0o755)
    proc = run([dvr_bin, "--store", empty, "ls"], expect=1)
    assert "no store at" in proc.stderr, describe(proc)
    assert os.listdir(empty) == [] and stat.S_IMODE(empty.stat().st_mode) == 0o755, \
        f"`dvr ls` changed an empty directory: {os.listdir(empty)}, mode {stat.S_IMODE(empty.stat().st_mode):o}"


def test_usage_errors(store, dvr_bin):
    assert "usage: dvr" in run([dvr_bin, "--help"], expect=0).stdout
    assert run([dvr_bin, "--version"], expect=0).stdout.startswith("dvr ")
    assert "usage: dvr" in run([dvr_bin], expect=2).stderr
    proc = store.dvr("bogus", expect=2)
    assert "unknown command 'bogus'" in proc.stderr, describe(proc)
    proc = store.dvr("verify", "extra", expect=2)
    assert "unexpected argument 'extra'" in proc.stderr, describe(proc)


def test_check_catches_a_snapshot_with_the_wrong_content(store):
    """The checker itself: a snapshot holding other data fails, naming where."""
    store.snap("s", "x", "--content-of", "y")
    proc = store.check("s", "x", expect=1)
    fail = [l for l in proc.stderr.splitlines() if l.startswith("FAIL ")]
    assert len(fail) == 1 and fail[0].startswith("FAIL snapshot 's/x' restored wrong: region r"), describe(proc)
    assert " byte " in fail[0] and "expected 0x" in fail[0], describe(proc)
    store.snap("s", "y", "--content-of", "y")
    store.check("s", "y")


def test_worker_reports_library_errors_by_code(store):
    store.snap("s", "a")
    proc = store.snap("s", "a", expect=DVR_ERROR)
    assert worker_error(proc).startswith("error already_exists:") and "s/a" in proc.stderr, describe(proc)
    proc = store.snap("../x", "a", expect=DVR_ERROR)
    assert worker_error(proc).startswith("error invalid_argument:"), describe(proc)
    proc = store.check("s", "nosuch", expect=DVR_ERROR)
    assert worker_error(proc).startswith("error not_found:") and "s/nosuch" in proc.stderr, describe(proc)
    # Regions of another size: refused before live memory changes.
    proc = store.worker("check", "s", "a", "--mib", "2", expect=DVR_ERROR)
    assert worker_error(proc).startswith("error invalid_argument:") and "r0" in proc.stderr, describe(proc)
    store.check("s", "a")


@pytest.mark.parametrize("chunk_size", [4096, 1 << 20, 16 << 20])
def test_stores_with_other_chunk_sizes(store, chunk_size):
    store.snap("s", "a", "b", "--chunk-size", chunk_size)
    assert store.stat()["chunk_size"] == chunk_size
    info = store.dvr_json("info", "s/a")
    assert info["chunks"] == sum((n + chunk_size - 1) // chunk_size for n in WORKER_REGION_SIZES.values())
    store.snap("s", "c", "--chunk-size", 8192)  # an existing store keeps its chunk size
    assert store.stat()["chunk_size"] == chunk_size
    store.check("s", "a", "b", "c")
    assert store.verify()["ok"]


def test_log_draws_the_tree_and_recover_names_the_newest_intact(make_store, tmp_path):
    """`dvr log` shows branches by parent link; `dvr recover` names the newest
    intact snapshot and skips damaged newer ones."""
    store = make_store()
    store.snap("t", "base", "a1", "a2")
    log = store.dvr("log", "t").stdout
    lines = [l for l in log.splitlines() if l.strip()]
    assert lines[0].startswith("base "), log
    assert any(l.startswith("`-- a1 ") for l in lines), log
    assert any(l.startswith("    `-- a2 ") for l in lines), log
    rec = json.loads(store.dvr("recover", "t", "--json").stdout)
    assert rec["latest"]["name"] == "a2" and rec["skipped"] == [] and rec["session"] == "t"
    manifest = store.path / "sessions" / "t" / "a2.snap"
    manifest.write_bytes(manifest.read_bytes()[:-5])
    proc = store.dvr("recover", "t")
    assert "newest intact snapshot: t/a1" in proc.stdout and "skipped (damaged) t/a2" in proc.stdout, describe(proc)
    assert "session.restore(\"a1\")" in proc.stdout and "Session::" not in proc.stdout, describe(proc)
    rec = json.loads(store.dvr("recover", "t", "--json").stdout)
    assert rec["latest"]["name"] == "a1" and [s["snapshot"] for s in rec["skipped"]] == ["t/a2"], rec
    empty = store.dvr("recover", "nosuch", expect=1)
    assert "no session 'nosuch'" in empty.stderr, describe(empty)
    diff = json.loads(store.dvr("diff", "t/base", "t/a1", "--json").stdout)
    assert (diff["a"], diff["b"]) == ("t/base", "t/a1")
    assert {d["name"] for d in diff["regions"]} == {"r0", "r1", "r2"}
    assert sum(d["bytes_differ"] for d in diff["regions"]) > 0
    proc = store.dvr("log", "nosuch", expect=1)
    assert "no session 'nosuch'" in proc.stderr, describe(proc)


def test_export_to_a_fifo_or_device_writes_into_it_and_leaves_it_in_place(populated, tmp_path):
    """-o FILE that is a FIFO or a device is written in place: renaming the
    part file over it replaced it (it replaced /dev/null once)."""
    null = tmp_path / "null"
    os.mknod(null, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    populated.dvr("export", "s/a", "-o", null)
    assert stat.S_ISCHR(null.stat().st_mode)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    import threading
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    populated.dvr("export", "s/a", "-o", fifo)
    reader.join(timeout=60)
    assert stat.S_ISFIFO(fifo.stat().st_mode) and len(got) == 1 and len(got[0]) > 0
    other = tmp_path / "other"
    run([populated.dvr_bin, "--store", other, "receive"], input=got[0], expect=0)
    assert run([populated.dvr_bin, "--store", other, "ls", "--json"], expect=0).stdout.count('"name":"a"') == 1
    proc = populated.dvr("export", "s/a", "-o", tmp_path, expect=2)
    assert "is a directory" in proc.stderr, describe(proc)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "null", "other", populated.path.name]


def test_an_empty_store_option_and_durations_or_sizes_that_are_no_numbers_are_refused(populated, dvr_bin, tmp_path):
    """`--store "$S"` with S unset must not fall back on the default store (an
    `rm` there would remove another store's snapshots); inf, nan and hex are
    no sizes or durations."""
    proc = run([dvr_bin, "--store", "", "rm", "s/a"], expect=2, env={"DVR_STORE": str(populated.path)})
    assert "--store" in proc.stderr and "empty" in proc.stderr, describe(proc)
    assert [s["name"] for s in populated.ls("s")] == ["a", "b"]
    for args in (["run", "--heap", "inf", "--", "/bin/true"], ["run", "--heap", "0x10M", "--", "/bin/true"],
                 ["prune", "s", "--keep-within", "infs", "--dry-run"], ["prune", "s", "--keep-within", "nan", "--dry-run"]):
        proc = run([dvr_bin, "--store", populated.path, *args], expect=2)
        assert "is not a" in proc.stderr, describe(proc)


def test_import_of_a_directory_and_keygen_into_a_directory_name_the_problem(populated, dvr_bin, tmp_path):
    proc = populated.dvr("import", tmp_path, expect=2)
    assert f"cannot import {tmp_path}: it is a directory" in proc.stderr, describe(proc)
    out = tmp_path / "keys"
    out.mkdir()
    proc = run([dvr_bin, "keygen", "--out", f"{out}/"], expect=2)
    assert "names no file" in proc.stderr, describe(proc)
    assert list(out.iterdir()) == []


def test_suggested_commands_name_the_store_as_one_shell_word(dvr_bin, tmp_path):
    """A hint such as "`dvr --store PATH ls s` lists its snapshots" or "run
    `dvr gc`" can be pasted: it names the store given with --store, quoted
    where a shell would split or expand it."""
    path = tmp_path / "dir with space" / "st $(x)"
    quoted = f"'{path}'"
    run([dvr_bin, "--store", path, "demo", "--size", "1M", "--trials", "1"], expect=0)
    proc = run([dvr_bin, "--store", path, "info", "demo/nosuch"], expect=1)
    assert f"`dvr --store {quoted} ls demo`" in proc.stderr, describe(proc)
    proc = run([dvr_bin, "--store", path, "rm", "demo/loaded"], expect=0)
    assert f"run `dvr --store {quoted} gc`" in proc.stdout, describe(proc)


def test_a_held_lock_is_announced_and_lock_timeout_gives_up(store):
    """A send whose reader stalls holds the store's lock (shared): `dvr rm`
    says after a second what it waits for instead of looking hung, and
    `--lock-timeout` (Python: Store(lock_timeout=)) gives up with exit 1 and
    nothing removed."""
    env = {"PYTHONPATH": str(Path(store.dvr_bin).resolve().parent / "python")}  # the build's memdvr, beside dvr
    make = (f"import memdvr, numpy as np\ns = memdvr.Session(memdvr.Store({str(store.path)!r}), 's')\n"
            "a = s.array('a', (8 << 20,), np.uint64)\na[:] = np.random.default_rng(1).integers(0, 2**63, a.size, dtype=np.uint64)\n"
            "s.snapshot('a')\ns.snapshot('b')\ns.close()\n")
    run([sys.executable, "-c", make], expect=0, timeout=120, env=env)
    sender = subprocess.Popen(store.argv("send", "s/a", "--compress=none"), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1)  # the pipe is full: the sender holds the lock while it sends 64 MiB
        proc = run([store.dvr_bin, "--store", store.path, "--lock-timeout", "1s", "rm", "s/b"], expect=1, timeout=60)
        assert "stayed locked by another process" in proc.stderr, describe(proc)
        waiting = subprocess.Popen(store.argv("rm", "s/b"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(3)
        waiting.kill()
        _, err = waiting.communicate(timeout=60)
        assert "waiting for its lock, which another process holds" in err and "--lock-timeout" in err, err
        code = (f"import memdvr\ntry:\n    memdvr.Store({str(store.path)!r}, lock_timeout=0.5).remove('s', 'b')\n"
                "except memdvr.DvrIOError as e:\n    print('gave up:', e)\n")
        proc = run([sys.executable, "-c", code], expect=0, timeout=60, env=env)
        assert "gave up:" in proc.stdout and "stayed locked" in proc.stdout, describe(proc)
    finally:
        sender.kill()
        sender.wait()
    assert store.names("s") == {"a", "b"}


def test_out_of_address_space_is_this_runs_fault_not_damage(store):
    """Under a `ulimit -v` too small to map the store's packs (a batch
    system's memory limit), verify and recover stop with an error that says
    so, instead of calling every snapshot damaged and suggesting `dvr rm`."""
    import resource
    env = {"PYTHONPATH": str(Path(store.dvr_bin).resolve().parent / "python")}  # the build's memdvr, beside dvr
    make = (f"import memdvr, numpy as np\ns = memdvr.Session(memdvr.Store({str(store.path)!r}), 's')\n"
            "a = s.array('a', (32 << 20,), np.uint64)\na[:] = np.arange(a.size, dtype=np.uint64)\ns.snapshot('a')\ns.close()\n")
    run([sys.executable, "-c", make], expect=0, timeout=120, env=env)

    def small_address_space():
        resource.setrlimit(resource.RLIMIT_AS, (300 << 20, 300 << 20))

    for verb in (["verify"], ["recover", "s"]):
        proc = run(store.argv(*verb), expect=1, timeout=120, preexec_fn=small_address_space)
        assert "ran out of address space" in proc.stderr and "nothing is known to be wrong with the store" in proc.stderr, describe(proc)
        assert "DAMAGED" not in proc.stdout and "rm" not in proc.stdout, describe(proc)
    assert store.verify()["ok"]


def test_export_removes_part_files_of_killed_exports_and_keeps_live_ones(populated, tmp_path):
    """An export killed with SIGKILL leaves FILE.part-PID (no handler runs);
    the next export to FILE removes those whose process is gone, and keeps
    one whose export may still be running."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    out = tmp_path / "a.dvr"
    dead = tmp_path / f"a.dvr.part-{gone.pid}"
    live = tmp_path / f"a.dvr.part-{os.getpid()}"
    other = tmp_path / f"b.dvr.part-{gone.pid}"
    for f in (dead, live, other):
        f.write_bytes(b"half a stream")
    populated.dvr("export", "s/a", "-o", out)
    assert out.stat().st_size > 0
    assert not dead.exists() and live.exists() and other.exists()


def test_rm_of_an_unknown_process_snapshot_points_at_proc_ls(populated):
    proc = populated.dvr("rm", "s/a", "proc/nosuch", expect=1)
    assert "no process snapshot 'nosuch'" in proc.stderr and f"`dvr --store {populated.path} proc ls`" in proc.stderr, describe(proc)
    assert populated.names("s") == {"a", "b"}
