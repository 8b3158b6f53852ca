"""Misuse from Python that must fail cleanly, never crash or leave state behind
(found by an exploratory review): threads sharing a Session (close() or
track() while another thread snapshots), numpy object arrays, array() with a
shape or dtype numpy refuses, calls on a closed session that go to the store,
the session name "proc", names that are not ASCII or hold a NUL, and zstd
levels out of range."""

import os
import threading
import time

import numpy as np
import pytest

import memdvr


@pytest.fixture
def store(tmp_path):
    return memdvr.Store(tmp_path / "store")


def test_close_while_another_thread_snapshots_waits_for_it(store):
    """close() waits for the snapshot in flight (it used to free the session
    under it: a segfault); the snapshot thread then gets 'closed' errors."""
    for it in range(12):
        s = memdvr.Session(store, f"s{it}")
        a = s.array("a", 2_000_000)
        a[:] = it
        errors, done = [], []

        def snap():
            try:
                for j in range(4):
                    a[::512] += 1
                    s.snapshot(f"x{j}")
                    done.append(j)
            except memdvr.InvalidArgument as e:
                errors.append(str(e))

        th = threading.Thread(target=snap)
        th.start()
        time.sleep(0.005 * (it % 4))
        s.close()
        th.join(timeout=120)
        assert not th.is_alive()
        assert all("closed" in e for e in errors), errors
        assert len(done) + len(errors) >= 1
        # What the thread finished is whole in the store.
        for j in done:
            assert store.info(f"s{it}", f"x{j}").name == f"x{j}"


def test_track_and_untrack_while_another_thread_snapshots(store):
    s = memdvr.Session(store, "s")
    s.array("base", 200_000)[:] = 1
    stop = threading.Event()
    failures = []

    def snapper():
        while not stop.is_set():
            try:
                s.snapshot("x", replace=True)
            except memdvr.DvrError as e:  # not expected: every call runs whole
                failures.append(repr(e))

    th = threading.Thread(target=snapper)
    th.start()
    try:
        for k in range(300):
            n = f"t{k % 5}"
            if n in s:
                s.untrack(n)
            s.track(n, np.full(5000 + k, 1.0))
    finally:
        stop.set()
        th.join(timeout=120)
    assert not failures, failures[:3]
    assert store.verify().ok


def test_a_progress_callback_calling_its_own_session_gets_an_error_not_a_deadlock(store):
    s = memdvr.Session(store, "s")
    s.array("a", 1 << 20)[:] = 2
    seen = []

    def progress(done, total):
        try:
            s.regions()
        except memdvr.InvalidArgument as e:
            seen.append(str(e))

    s.snapshot("one", progress=progress)
    assert seen and "busy in this thread" in seen[0], seen
    assert [i.name for i in s.list()] == ["one"]


def test_numpy_object_arrays_are_refused(store):
    s = memdvr.Session(store, "s")
    objs = np.empty(8, dtype=object)
    with pytest.raises(memdvr.InvalidArgument, match="pointers to Python objects"):
        s.track("o", objs)
    with pytest.raises(memdvr.InvalidArgument, match="pointers to Python objects"):
        s.array("o", 10, object)
    assert s.regions() == [] and "o" not in s


def test_array_with_a_shape_numpy_refuses_leaves_no_region(store):
    s = memdvr.Session(store, "s")
    with pytest.raises(memdvr.InvalidArgument, match="negative dimension"):
        s.array("n", (-2, -3))
    with pytest.raises(memdvr.InvalidArgument):
        s.array("d", 4, "not-a-dtype")
    assert s.regions() == []
    assert s.array("n", (2, 3)).shape == (2, 3)  # the name is free


def test_a_closed_session_refuses_the_calls_that_go_to_the_store(store):
    s = memdvr.Session(store, "s")
    s.track("d", np.ones(1000))
    s.snapshot("x")
    s.close()
    for call in (lambda: s.info("x"), lambda: s.remove("x"), lambda: s.prune(keep_last=1),
                 lambda: s.gc(), lambda: s.verify()):
        with pytest.raises(memdvr.InvalidArgument, match="closed"):
            call()
    assert [i.name for i in store.list("s")] == ["x"]


def test_the_session_name_proc_is_refused(store):
    with pytest.raises(memdvr.InvalidArgument, match="process snapshots"):
        memdvr.Session(store, "proc")
    assert store.sessions() == []


# The whole character (not the first byte of é); a control character by its
# value (a message is a C string, and a newline would start a line of the
# name's choosing) and the name with U+FFFD for it.
@pytest.mark.parametrize("name, shown", [("é", "'é'"), ("a\0b", "the byte 0x00"), ("x\x01", "the byte 0x01"),
                                         ("a\nb", "the byte 0x0a"), ("a\xffb", "'\xff'")])
def test_a_name_that_is_not_allowed_is_named_in_the_message(store, name, shown):
    s = memdvr.Session(store, "s")
    with pytest.raises(memdvr.InvalidArgument) as e:
        s.track(name, bytearray(2))
    assert f"it contains {shown}" in str(e.value), str(e.value)
    assert "\\" not in str(e.value) and not any(ord(c) < 0x20 for c in str(e.value)), str(e.value)
    with pytest.raises(memdvr.InvalidArgument, match="session name .* is not valid"):
        memdvr.Session(store, name)


@pytest.mark.parametrize("level", [-5, 20, 99])
def test_export_refuses_a_zstd_level_out_of_range_and_writes_nothing(store, tmp_path, level):
    s = memdvr.Session(store, "s")
    s.track("d", np.ones(100_000))
    s.snapshot("x")
    out = tmp_path / "out.dvr"
    with pytest.raises(memdvr.InvalidArgument, match=f"zstd level {level} is out of range"):
        store.export("s/x", out, compress="zstd", level=level)
    assert not out.exists() and [p for p in os.listdir(tmp_path) if p != "store"] == []
    assert store.export("s/x", out, compress="zstd", level=0).chunks_compressed == 0  # 0: documented as none


def test_alloc_of_a_negative_size_and_import_of_a_directory_name_the_problem(store, tmp_path):
    s = memdvr.Session(store, "s")
    with pytest.raises(memdvr.InvalidArgument, match="size must be a whole number"):
        s.alloc("a", -1)
    assert s.regions() == []
    with pytest.raises(memdvr.InvalidArgument, match=f"cannot import {tmp_path}: it is a directory"):
        store.import_(tmp_path)
