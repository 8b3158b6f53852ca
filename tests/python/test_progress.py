"""Progress callbacks (issue #17, item 4): progress= on verify, export and
import — a callable(done, total) in bytes, True for a tqdm bar, None for the
default (a bar only for calls over about a second on a terminal or in
Jupyter) — called on the calling thread with the GIL re-acquired while libdvr
runs without it; a callback that raises stops the operation, its exception
propagates and nothing is left half done. Also Store.export() /
Store.import_() themselves. Snapshot, restore and gc progress, prune and
logging: test_prune_progress.py."""

import io
import re
from pathlib import Path

import numpy as np
import pytest

import memdvr

MiB = 1 << 20


@pytest.fixture
def store(tmp_path):
    return memdvr.Store(tmp_path / "store")


@pytest.fixture
def filled(store):
    """A session with 32 MiB of random data in two snapshots (verify then runs
    on several threads: libdvr's workers call the callback)."""
    s = memdvr.Session(store, "p")
    a = s.track("a", np.random.default_rng(11).random(32 * MiB // 8))
    s.snapshot("one")
    a[: 4 * MiB // 8] = 0.5
    s.snapshot("two")
    return s


class Recorder:
    def __init__(self, raise_at=None, exc=ValueError("stop from the callback")):
        self.calls = []
        self.raise_at = raise_at
        self.exc = exc

    def __call__(self, done, total):
        assert isinstance(done, int) and isinstance(total, int)
        self.calls.append((done, total))
        if self.raise_at is not None and len(self.calls) >= self.raise_at:
            raise self.exc


def check_calls(calls, total):
    assert calls, "the callback was never called"
    dones = [d for d, _ in calls]
    assert dones == sorted(dones), "done went backwards"
    assert all(0 <= d <= t for d, t in calls)
    assert calls[-1] == (total, total), calls[-3:]


def test_verify_progress_callable(store, filled):
    rec = Recorder()
    rep = store.verify(progress=rec)
    assert rep.ok
    check_calls(rec.calls, rep.bytes)
    rec2 = Recorder()
    assert filled.verify(progress=rec2).ok  # Session.verify passes it on
    check_calls(rec2.calls, rep.bytes)


@pytest.mark.parametrize("exc", [ValueError("stop from the callback"), KeyboardInterrupt()])
def test_verify_callback_exception_propagates(store, filled, exc):
    rec = Recorder(raise_at=1, exc=exc)
    with pytest.raises(type(exc)) as e:
        store.verify(progress=rec)
    assert e.value is exc  # the callback's own exception, not a DvrError
    assert len(rec.calls) == 1  # no call after it raised
    assert store.verify().ok  # nothing was harmed


def test_export_import_with_progress(store, filled, tmp_path):
    path = tmp_path / "two.dvr"
    rec = Recorder()
    st = store.export("p/two", path, progress=rec)
    assert isinstance(st, memdvr.TransferStats)
    assert st.refs == ("p/two",) and st.logical_bytes == 32 * MiB
    assert path.stat().st_size == st.wire_bytes
    check_calls(rec.calls, st.logical_bytes)
    assert st.to_dict()["refs"] == ["p/two"]

    other = memdvr.Store(tmp_path / "other")
    rec = Recorder()
    got = other.import_(path, progress=rec)
    check_calls(rec.calls, path.stat().st_size)
    assert got.refs == ("p/two",) and got.stored_bytes > 0
    assert [i.name for i in other.list("p")] == ["two"]
    with other.session("p") as s:
        b = s.track("a", np.zeros(32 * MiB // 8))
        s.restore("two")
        np.testing.assert_array_equal(b, filled["a"])
    assert other.verify().ok


def test_export_callback_raising_leaves_no_file(store, filled, tmp_path):
    path = tmp_path / "x.dvr"
    with pytest.raises(ValueError, match="stop from the callback"):
        store.export("p/one", path, progress=Recorder(raise_at=1))  # a quick export calls once
    assert not path.exists()
    assert list(tmp_path.glob("x.dvr*")) == []  # no .part file either
    store.export("p/one", path)  # works afterwards, without progress
    assert path.stat().st_size > 0


def test_import_callback_raising_stores_nothing(store, filled, tmp_path):
    path = tmp_path / "one.dvr"
    store.export("p/one", path)
    other = memdvr.Store(tmp_path / "other")
    for exc in [RuntimeError("stop"), KeyboardInterrupt()]:
        with pytest.raises(type(exc)):
            other.import_(path, progress=Recorder(raise_at=1, exc=exc))
        assert other.list() == []
    assert other.verify().ok
    other.import_(path)
    assert [i.name for i in other.list("p")] == ["one"]


def test_export_import_errors_name_the_thing(store, filled, tmp_path):
    with pytest.raises(memdvr.NotFound, match="did you mean 'one'"):
        store.export("p/oen", tmp_path / "f.dvr")
    with pytest.raises(memdvr.InvalidArgument):
        store.export("no-slash", tmp_path / "f.dvr")
    with pytest.raises(memdvr.InvalidArgument, match="compress"):
        store.export("p/one", tmp_path / "f.dvr", compress="lz4")
    with pytest.raises(memdvr.NotFound, match="missing.dvr"):
        store.import_(tmp_path / "missing.dvr")
    junk = tmp_path / "junk.dvr"
    junk.write_bytes(b"not a stream at all" * 100)
    for progress in [None, Recorder()]:
        with pytest.raises(memdvr.DvrError):
            store.import_(junk, progress=progress)
    path = tmp_path / "one.dvr"
    store.export("p/one", path)
    with pytest.raises(memdvr.AlreadyExists):
        store.import_(path, progress=Recorder())  # the store has it already


def test_progress_true_draws_a_tqdm_bar(store, filled, capsys):
    pytest.importorskip("tqdm", reason="python3-tqdm is not installed")
    assert store.verify(progress=True).ok
    err = capsys.readouterr().err
    assert re.search(r"verify:.*/[0-9.]+M \[.*B/s", err), err  # a bar of bytes, in MiB


def test_progress_false_and_default_off_a_terminal(store, filled, capsys):
    assert store.verify(progress=False).ok
    assert store.verify().ok  # stderr is not a terminal here: no bar
    assert capsys.readouterr().err == ""


def test_default_bar_on_a_terminal_only_after_a_while(store, filled, monkeypatch):
    pytest.importorskip("tqdm", reason="python3-tqdm is not installed")

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    monkeypatch.setattr("sys.stderr", tty)
    monkeypatch.setattr(memdvr, "_AUTO_BAR_AFTER", 3600.0)  # a call shorter than that: no bar
    assert store.verify().ok
    assert tty.getvalue() == ""
    monkeypatch.setattr(memdvr, "_AUTO_BAR_AFTER", 0.0)  # every call is "long" now
    assert store.verify().ok
    assert "verify:" in tty.getvalue()


def test_progress_true_without_tqdm_says_what_to_install(store, filled, monkeypatch):
    monkeypatch.setattr(memdvr, "_tqdm_class", lambda jupyter: None)
    with pytest.raises(memdvr.InvalidArgument, match="python3-tqdm"):
        store.verify(progress=True)
    assert store.verify().ok  # the default quietly goes without


def test_progress_of_the_wrong_type(store, filled):
    with pytest.raises(TypeError, match="progress"):
        store.verify(progress="yes")


def test_ctrl_c_without_a_progress_callback_stops_the_snapshot_and_publishes_nothing(store):
    """A script with no progress bar (not on a terminal: cron, a batch job)
    that gets SIGINT while a snapshot is written: KeyboardInterrupt comes out
    of snapshot() and nothing was published — the snapshot it would replace
    stays — instead of the interrupt arriving after the replacement."""
    import os
    import signal
    import threading
    s = memdvr.Session(store, "s")
    a = s.array("a", (512 << 20,), np.uint8)
    a[:] = 1
    s.snapshot("keep", progress=False)
    a[:] = 2
    packs = Path(store.path) / "packs"

    def written():
        return sum(p.stat().st_blocks for p in packs.iterdir())

    before = written()

    def interrupt_once_writing():  # SIGINT as soon as the new snapshot's data reaches the store
        while written() == before:
            pass
        os.kill(os.getpid(), signal.SIGINT)

    t = threading.Thread(target=interrupt_once_writing)
    t.start()
    with pytest.raises(KeyboardInterrupt):
        s.snapshot("keep", replace=True)  # progress=None: no callback of the caller's
    t.join()
    assert [i.name for i in s.list()] == ["keep"]
    s.restore("keep")
    assert (a == 1).all(), "the snapshot it would have replaced changed"
