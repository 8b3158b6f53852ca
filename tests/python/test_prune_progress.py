"""Progress on snapshot, restore and gc; retention (Store.prune, Session.prune,
`python -m memdvr prune`); the library's log routed to Python's logging
(issue #17 item 4, issue #18 items 3-5).

The progress contract is libdvr's (dvr::Progress in store.hpp): calls on the
calling thread, done never decreasing, a final call with done == total; a
callback that raises abandons a snapshot (nothing published) or gc, and a
restore either stops before live memory changes or completes."""

import datetime as dt
import json
import logging
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import memdvr

MiB = 1 << 20


class Recorder:
    def __init__(self, raise_when=None, exc=None):
        self.calls = []
        self.raise_when = raise_when  # (done, total) -> bool
        self.exc = exc if exc is not None else ValueError("stop from the callback")

    def __call__(self, done, total):
        assert isinstance(done, int) and isinstance(total, int)
        self.calls.append((done, total))
        if self.raise_when is not None and self.raise_when(done, total):
            raise self.exc


def check_calls(calls, total=None):
    assert calls, "the callback was never called"
    dones = [d for d, _ in calls]
    totals = [t for _, t in calls]
    assert dones == sorted(dones), "done went backwards"
    assert totals == sorted(totals), "total went backwards"
    assert all(0 <= d <= t for d, t in calls), calls
    assert calls[-1][0] == calls[-1][1], calls[-3:]
    if total is not None:
        assert calls[-1] == (total, total), (calls[-3:], total)


@pytest.fixture
def store(tmp_path):
    return memdvr.Store(tmp_path / "store")


@pytest.fixture
def session(store):
    with memdvr.Session(store, "p") as s:
        yield s


def fill(s, mib=32, seed=3):
    return s.track("a", np.random.default_rng(seed).random(mib * MiB // 8))


# ---------------------------------------------------------------- snapshot


def test_snapshot_progress_counts_the_memory_read(session):
    a = fill(session)
    rec = Recorder()
    info = session.snapshot("one", progress=rec)
    check_calls(rec.calls, info.logical_bytes)  # the first snapshot reads everything
    a[: MiB // 8] = 0.25  # 1 MiB changed
    rec = Recorder()
    two = session.snapshot("two", progress=rec)
    check_calls(rec.calls)
    assert 0 < rec.calls[-1][1] <= two.logical_bytes
    if session.tracking("a") == "write_protect":
        assert rec.calls[-1][1] < two.logical_bytes // 4  # only the chunks with written pages


@pytest.mark.parametrize("exc", [ValueError("stop from the callback"), KeyboardInterrupt()])
@pytest.mark.parametrize("where", ["first", "final"])
def test_snapshot_callback_raising_publishes_nothing(store, session, exc, where):
    a = fill(session)
    first = session.snapshot("base", label="kept")
    a[:] = 0.5
    before = [(i.name, i.time_ns, i.label) for i in store.list()]
    when = (lambda d, t: True) if where == "first" else (lambda d, t: d == t)
    for name, replace in [("new", False), ("base", True)]:  # a new name, and a replacement
        rec = Recorder(when, exc)
        with pytest.raises(type(exc)) as e:
            session.snapshot(name, label="lost", replace=replace, progress=rec)
        assert e.value is exc
        assert when(*rec.calls[-1]) and sum(when(*c) for c in rec.calls) == 1  # never called after it raised
        assert [(i.name, i.time_ns, i.label) for i in store.list()] == before
    assert store.info("p", "base").time_ns == first.time_ns
    assert store.verify().ok
    again = session.snapshot("new")  # the session goes on working
    assert again.name == "new" and session.info("new").logical_bytes == a.nbytes
    session.restore("base")
    assert float(a[0]) != 0.5


def test_snapshot_progress_true_false_and_background(session):
    fill(session, mib=4)
    session.snapshot("quiet", progress=False)
    with pytest.raises(memdvr.InvalidArgument, match="SnapshotJob.progress"):
        session.snapshot("bg", wait=False, progress=Recorder())
    assert [i.name for i in session.list()] == ["quiet"]
    job = session.snapshot("bg", wait=False, progress=False)
    info = job.wait(timeout=60)
    assert info.name == "bg"
    done, total = job.progress
    assert done == total
    with pytest.raises(TypeError, match="progress"):
        session.snapshot("bad", progress="yes")


def test_default_bar_imports_tqdm_only_when_drawn(session, monkeypatch):
    """A quick snapshot on a terminal (or in Jupyter) never imports tqdm: in a
    Jupyter without ipywidgets tqdm.auto warns on stderr at import."""
    import io

    class Tty(io.StringIO):
        def isatty(self):
            return True

    asked = []

    def tqdm_class(jupyter):
        asked.append(jupyter)
        return None  # as if tqdm were not installed: no bar, no error

    fill(session, mib=4)
    monkeypatch.setattr("sys.stderr", Tty())
    monkeypatch.setattr(memdvr, "_tqdm_class", tqdm_class)
    session.snapshot("quick")
    assert asked == []
    monkeypatch.setattr(memdvr, "_AUTO_BAR_AFTER", 0.0)  # every call is "long" now
    session.snapshot("slow")
    session.restore("quick")
    assert asked and len(asked) <= 2  # once per call, at its first report
    assert [i.name for i in session.list()] == ["quick", "slow"]


# ---------------------------------------------------------------- restore


def test_restore_progress_checks_then_copies(session):
    a = fill(session)
    session.snapshot("one")
    want = a.copy()
    a[: 8 * MiB // 8] = 0.0  # 8 MiB written
    rec = Recorder()
    session.restore("one", progress=rec)
    np.testing.assert_array_equal(a, want)
    check_calls(rec.calls)
    total = rec.calls[-1][1]
    assert total % 2 == 0 and 8 * MiB <= total // 2 <= a.nbytes  # checked, then copied


@pytest.mark.parametrize("exc", [ValueError("stop from the callback"), KeyboardInterrupt()])
def test_restore_callback_raising_leaves_memory_before_or_restored(session, exc):
    a = fill(session)
    session.put("cfg", {"lr": 0.1})
    session.snapshot("one")
    snap = a.copy()
    a[: 16 * MiB // 8] = 1.5
    session.put("cfg", {"lr": 0.2, "extra": list(range(5000))})  # object regions differ in size
    before = a.copy()
    rec = Recorder(lambda d, t: True, exc)  # raises at its first call, whenever that comes
    with pytest.raises(type(exc)) as e:
        session.restore("one", progress=rec)
    assert e.value is exc and len(rec.calls) == 1
    if np.array_equal(a, snap):  # raised while copying: completed
        assert session.get("cfg") == {"lr": 0.1}
        assert session.head == "one"
    else:  # raised while checking: nothing changed, the objects neither
        np.testing.assert_array_equal(a, before)
        assert session.get("cfg") == {"lr": 0.2, "extra": list(range(5000))}
    session.restore("one")
    np.testing.assert_array_equal(a, snap)


@pytest.mark.parametrize("exc", [ValueError("stop from the callback"), KeyboardInterrupt()])
def test_restore_callback_raising_at_the_end_completes_first(session, exc):
    a = fill(session)
    session.put("cfg", {"lr": 0.1})
    session.snapshot("one")
    snap = a.copy()
    a[: 16 * MiB // 8] = 1.5
    session.put("cfg", {"lr": 0.2, "extra": list(range(5000))})
    rec = Recorder(lambda d, t: d == t, exc)  # the final call: memory has been written
    with pytest.raises(type(exc)) as e:
        session.restore("one", progress=rec)
    assert e.value is exc
    np.testing.assert_array_equal(a, snap)
    assert session.get("cfg") == {"lr": 0.1}  # the object regions were not rolled back
    check_calls(rec.calls)


# ---------------------------------------------------------------- gc and import


def test_gc_progress_and_cancel(store, session):
    a = fill(session)
    session.snapshot("one")
    a[:] = 2.0
    session.snapshot("two")
    session.remove("one")
    with pytest.raises(KeyboardInterrupt):
        store.gc(progress=Recorder(lambda d, t: True, KeyboardInterrupt()))
    assert store.verify().ok and [i.name for i in store.list("p")] == ["two"]
    rec = Recorder()
    rep = store.gc(progress=rec)
    assert isinstance(rep, memdvr.GcReport)
    check_calls(rec.calls)
    rec = Recorder()
    session.gc(progress=rec)  # Session.gc passes it on
    check_calls(rec.calls)
    session.restore("two")
    assert float(a[-1]) == 2.0


def test_import_progress_is_the_library_own(store, session, tmp_path):
    """import_ reports ReceiveOptions::progress (bytes of the file read out of
    its size), with no helper thread of the binding's."""
    import threading
    fill(session, mib=8)
    session.snapshot("one")
    path = tmp_path / "one.dvr"
    store.export("p/one", path)
    other = memdvr.Store(tmp_path / "other")
    threads = []

    def rec(done, total):
        threads.append(threading.get_ident())
        calls.append((done, total))

    calls = []
    other.import_(path, progress=rec)
    check_calls(calls, path.stat().st_size)
    assert set(threads) == {threading.get_ident()}


# ---------------------------------------------------------------- prune


def five(session):
    a = fill(session, mib=1)
    for k in range(5):
        a[0] = k
        session.snapshot(f"s{k}", label=f"step {k}")
    return a


def test_prune_keep_last_dry_run_then_for_real(store, session):
    five(session)
    rep = store.prune("p", keep_last=2, dry_run=True)
    assert isinstance(rep, memdvr.PruneReport) and rep.dry_run and rep.removed == 3
    assert [d.snapshot.name for d in rep.decisions] == [f"s{k}" for k in range(5)]  # oldest first
    assert [d.keep for d in rep.decisions] == [False, False, False, True, True]
    assert all(isinstance(d, memdvr.PruneDecision) and isinstance(d.snapshot, memdvr.SnapshotInfo)
               for d in rep.decisions)
    assert "last 2" in rep.decisions[-1].reason and rep.decisions[0].reason.startswith("removed")
    assert [i.name for i in store.list("p")] == [f"s{k}" for k in range(5)]  # nothing changed
    d = rep.to_dict()
    assert d["dry_run"] is True and d["removed"] == 3
    assert d["decisions"][0]["snapshot"]["name"] == "s0" and "time" in d["decisions"][0]["snapshot"]
    json.dumps(d)

    rep = session.prune(keep_last=2)
    assert not rep.dry_run and rep.removed == 3
    assert [s.name for s in rep.kept] == ["s3", "s4"]
    assert [s.name for s in rep.removed_snapshots] == ["s0", "s1", "s2"]
    assert [i.name for i in store.list("p")] == ["s3", "s4"]
    session["a"][0] = 99
    session.snapshot("s5")  # the session goes on
    session.restore("s3")
    assert session["a"][0] == 3


def test_prune_within_and_buckets(store, session):
    five(session)
    rep = store.prune("p", keep_within=dt.timedelta(hours=1), dry_run=True)
    assert rep.removed == 0 and all("within" in d.reason for d in rep.decisions)
    rep = store.prune("p", keep_within=3600.0, dry_run=True)
    assert rep.removed == 0
    rep = store.prune("p", keep_daily=1, keep_monthly=1, dry_run=True)
    kept = [d for d in rep.decisions if d.keep]
    assert len(kept) in (1, 2)  # the newest (2 only when the run crossed midnight UTC)
    assert kept[-1].snapshot.name == "s4" and "daily" in kept[-1].reason and "monthly" in kept[-1].reason


def test_prune_open_clone_is_said(store, session):
    five(session)
    with session.clone("s0") as c:
        rep = store.prune("p", keep_last=1)
        assert "open clone" in rep.decisions[0].reason
        assert float(c["a"][0]) == 0.0  # the clone still reads its data
    assert [i.name for i in store.list("p")] == ["s4"]


def test_prune_errors(store, session):
    five(session)
    with pytest.raises(memdvr.InvalidArgument):
        store.prune("p")  # every rule 0 keeps nothing: refused
    with pytest.raises(memdvr.NotFound, match=r"did you mean 'p'\?.*sessions\(\)"):
        store.prune("pp", keep_last=1)
    with pytest.raises(memdvr.NotFound, match=r"no session 'nosuch'.*sessions\(\) lists"):
        store.prune("nosuch", keep_last=1)
    for bad in [dict(keep_last=-1), dict(keep_daily=1.5), dict(keep_last=True),
                dict(keep_within="2h"), dict(keep_within=-5)]:
        with pytest.raises(memdvr.InvalidArgument, match="prune"):
            store.prune("p", **bad)
    assert len(store.list("p")) == 5


# ---------------------------------------------------------------- python -m memdvr prune


def cli(store, *args, expect=0):
    proc = subprocess.run([sys.executable, "-m", "memdvr", "--store", store.path, *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == expect, (args, proc.returncode, proc.stdout, proc.stderr)
    return proc


def test_cli_prune_text_and_json(store, session):
    five(session)
    out = cli(store, "prune", "p", "--keep-last", "2", "--keep-within", "0s", "--dry-run").stdout.splitlines()
    assert len(out) == 6
    assert [line.split()[0] for line in out[:5]] == ["remove"] * 3 + ["keep"] * 2
    assert out[0].startswith("remove s0  ") and "removed" in out[0]
    assert out[4].startswith("keep   s4  ") and "last 2" in out[4]
    assert "dry run" in out[5] and "3" in out[5]
    assert len(store.list("p")) == 5

    doc = json.loads(cli(store, "prune", "p", "--keep-last", "3", "--json").stdout)
    assert list(doc) == ["schema_version", "session", "dry_run", "removed", "decisions"]
    assert doc["schema_version"] == 1 and doc["session"] == "p" and doc["dry_run"] is False
    assert doc["removed"] == 2
    assert [list(d) for d in doc["decisions"]] == [["snapshot", "keep", "reason"]] * 5
    import memdvr.__main__ as main
    infos = {i.name: i for i in store.list("p")}
    first = doc["decisions"][-1]
    assert first["snapshot"] == main._snapshot(infos["s4"]) and first["keep"] is True
    assert [d["keep"] for d in doc["decisions"]] == [False, False, True, True, True]
    assert [i.name for i in store.list("p")] == ["s2", "s3", "s4"]

    doc = json.loads(cli(store, "prune", "p", "--keep-within", "1w", "--json").stdout)
    assert doc["removed"] == 0


def test_cli_prune_errors(store, session):
    five(session)
    assert "is not a duration" in cli(store, "prune", "p", "--keep-within", "2x", expect=2).stderr
    assert "number of snapshots" in cli(store, "prune", "p", "--keep-last", "-1", expect=2).stderr
    assert "no session 'q'" in cli(store, "prune", "q", "--keep-last", "1", expect=1).stderr
    cli(store, "prune", "p", expect=2)  # no rule: refused (InvalidArgument)
    assert len(store.list("p")) == 5


@pytest.mark.parametrize("text,seconds", [("90s", 90), ("10m", 600), ("2h", 7200), ("3d", 3 * 86400),
                                          ("1w", 7 * 86400), ("1h30m", 5400), ("45", 45), ("1.5h", 5400)])
def test_cli_durations(text, seconds):
    import memdvr.__main__ as main
    assert main._duration(text) == seconds


def test_cli_prune_same_document_as_dvr(store, session):
    dvr_bin = os.environ.get("DVR_BIN")
    verbs = subprocess.run([dvr_bin, "--help"], capture_output=True, text=True).stdout if dvr_bin else ""
    if not any(line.split()[:1] == ["prune"] for line in verbs.splitlines()):
        pytest.skip("$DVR_BIN is not set, or that dvr has no prune verb yet")
    five(session)
    args = ["prune", "p", "--keep-last", "2", "--dry-run", "--json"]
    a = json.loads(subprocess.run([dvr_bin, "--store", store.path, *args], capture_output=True, text=True,
                                  check=True).stdout)
    b = json.loads(cli(store, *args).stdout)
    assert a == b


# ---------------------------------------------------------------- logging


@pytest.fixture
def python_log():
    old = memdvr.log_level()
    memdvr.log_to_python()
    yield
    memdvr.flush_log()
    memdvr.log_to_python(False)
    memdvr.set_log_level(old)


def test_log_level_names():
    old = memdvr.log_level()
    try:
        for level in ["error", "warn", "info", "debug"]:
            memdvr.set_log_level(level)
            assert memdvr.log_level() == level
        with pytest.raises(memdvr.InvalidArgument, match="loud"):
            memdvr.set_log_level("loud")
        with pytest.raises(memdvr.InvalidArgument):
            memdvr.set_log_level(3)
    finally:
        memdvr.set_log_level(old)


def test_log_reaches_python_logging(store, session, python_log, caplog):
    caplog.set_level(logging.DEBUG, logger="memdvr")
    memdvr.set_log_level("debug")
    a = fill(session, mib=4)
    session.snapshot("one")
    a[:] = 1.0
    job = session.snapshot("bg", wait=False)  # logged from the library's worker thread too
    job.wait(timeout=60)
    session.restore("one")
    session.remove("one")
    store.gc()
    memdvr.flush_log()
    records = [r for r in caplog.records if r.name == "memdvr"]
    assert records, "nothing was logged"
    text = "\n".join(r.getMessage() for r in records)
    assert "gc" in text and "restore" in text, text
    assert {r.levelno for r in records} <= {logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR}
    assert any(r.levelno == logging.DEBUG for r in records)

    caplog.clear()
    memdvr.set_log_level("warn")
    store.gc()
    memdvr.flush_log()
    assert [r for r in caplog.records if r.name == "memdvr" and r.levelno < logging.WARNING] == []


def test_log_to_python_off_goes_back_to_stderr(tmp_path):
    code = (
        "import memdvr, logging, numpy as np\n"
        "memdvr.set_log_level('info')\n"
        "memdvr.log_to_python()\n"
        "memdvr.log_to_python(False)\n"
        f"st = memdvr.Store({str(tmp_path / 's')!r}); st.gc()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "dvr[" in proc.stderr and "gc" in proc.stderr, proc.stderr


def test_log_handler_exit_with_work_in_flight(tmp_path):
    """The interpreter exits cleanly with the Python sink set, a slow handler,
    library threads logging and a background snapshot left running."""
    code = (
        "import logging, time, threading, numpy as np, memdvr\n"
        "class Slow(logging.Handler):\n"
        "    def emit(self, record): time.sleep(0.001)\n"
        "logging.getLogger('memdvr').addHandler(Slow()); logging.getLogger('memdvr').setLevel(logging.DEBUG)\n"
        "memdvr.set_log_level('debug'); memdvr.log_to_python()\n"
        f"st = memdvr.Store({str(tmp_path / 's')!r})\n"
        "s = memdvr.Session(st, 'x'); a = s.track('a', np.random.rand(1 << 20))\n"
        "def lister():\n"
        "    for _ in range(200): st.list()\n"  # keeps taking the GIL and the store
        "t = threading.Thread(target=lister); t.start()\n"
        "for k in range(20):\n"
        "    a[k] = k; s.snapshot(f's{k}')\n"
        "t.join()\n"
        "s.snapshot('bg', wait=False)\n"
        "print('ok')\n"
    )
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
    assert time.monotonic() - start < 60


def test_other_threads_use_the_store_while_a_callback_runs(store, session):
    """A progress callback takes the GIL while its snapshot holds the store:
    a thread using the store meanwhile (list, info, sessions, stats, remove,
    which waits for the writers' lock) must not wait for it with the GIL
    held (that would deadlock)."""
    import threading
    a = fill(session, mib=64)
    session.snapshot("one")
    with memdvr.Session(store, "junk") as j:
        j.track("x", np.zeros(4096))
        for k in range(50):
            j.snapshot(f"j{k}")
    stop = threading.Event()
    reads = []

    def reader():
        while not stop.is_set():
            store.list("p")
            store.info("p", "one")
            store.sessions()
            store.stats()
            if len(reads) < 50:
                store.remove("junk", f"j{len(reads)}")  # a writer: waits for the snapshot's lock
            reads.append(1)

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    try:
        for k in range(3):
            a[:: 512] = k  # every page written: each snapshot reads all 64 MiB
            session.snapshot(f"s{k}", progress=lambda done, total: time.sleep(0.02))
            session.restore("one", progress=lambda done, total: time.sleep(0.02))
    finally:
        stop.set()
        t.join(timeout=60)
    assert not t.is_alive()
    assert reads
