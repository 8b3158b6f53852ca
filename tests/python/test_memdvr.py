"""Tests of the Python package memdvr (bindings in python/src/core.cpp, API in
python/memdvr/__init__.py). Run by CTest as test `python` with
PYTHONPATH=<build>/python; each test uses a store of its own under tmp_path."""

import gc
import threading
import time

import numpy as np
import pytest

import memdvr


@pytest.fixture
def store(tmp_path):
    return memdvr.Store(tmp_path / "store")


@pytest.fixture
def session(store):
    s = memdvr.Session(store, "test")
    yield s


def test_package_layout():
    assert memdvr.__version__
    for name in ["NotFound", "AlreadyExists", "Corrupt", "NoSpace", "InvalidArgument",
                 "DvrIOError", "Unsupported", "PermissionDenied"]:
        exc = getattr(memdvr, name)
        assert issubclass(exc, memdvr.DvrError)
        assert exc.__module__ == "memdvr"
    assert issubclass(memdvr.InvalidArgument, ValueError)
    assert issubclass(memdvr.NotFound, LookupError)
    assert memdvr.NotFound.code == "not_found"
    for call in [memdvr.Store, memdvr.Session, memdvr.Session.track, memdvr.Session.array,
                 memdvr.Session.snapshot, memdvr.Session.restore, memdvr.Session.clone,
                 memdvr.Store.list, memdvr.Store.info, memdvr.Store.remove, memdvr.Store.gc,
                 memdvr.Store.verify, memdvr.Store.open_snapshot, memdvr.Clone.array]:
        assert call.__doc__, call


def test_tracked_array_round_trip_zero_copy(session):
    a = np.random.default_rng(1).random(100_000, dtype=np.float32)
    assert session.track("a", a) is a
    a[123] = 42.0  # written through the array after track: seen by the snapshot
    original = a.copy()
    info = session.snapshot("s1", label="first")
    assert info.name == "s1" and info.label == "first" and info.session == "test"
    assert info.logical_bytes == a.nbytes
    assert [r.name for r in info.regions] == ["a"]
    a[:] = -1
    session.restore("s1")
    np.testing.assert_array_equal(a, original)  # written back into the same object
    assert a[123] == 42.0
    assert session.head == "s1"
    assert session["a"] is a


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int8, np.int64, np.uint16,
                                   np.complex128, np.bool_])
@pytest.mark.parametrize("shape", [(1,), (4097,), (64, 33), (3, 5, 7)])
def test_dtypes_and_shapes(store, dtype, shape):
    s = memdvr.Session(store, "dt")
    rng = np.random.default_rng(0)
    a = (rng.random(shape) * 100).astype(dtype)
    b = s.array("b", shape, dtype)
    assert b.shape == shape and b.dtype == np.dtype(dtype) and not b.any()
    b[...] = a[...]
    s.track("a", a)
    want_a, want_b = a.copy(), b.copy()
    s.snapshot("x")
    a[...] = 0
    b[...] = 1
    s.restore("x")
    np.testing.assert_array_equal(a, want_a)
    np.testing.assert_array_equal(b, want_b)
    c = s.clone("x")
    assert c["a"].dtype == np.dtype(dtype) and c["a"].shape == shape
    np.testing.assert_array_equal(c["a"], want_a)
    np.testing.assert_array_equal(c["b"], want_b)


def test_sdk_owned_array(session):
    x = session.array("x", (512, 256), np.float32)
    assert x.flags.c_contiguous and x.flags.writeable
    assert x.ctypes.data % 4096 == 0  # page-aligned
    x[:] = np.arange(x.size, dtype=np.float32).reshape(x.shape)
    want = x.copy()
    session.snapshot("s")
    x *= 3
    session.restore("s")
    np.testing.assert_array_equal(x, want)
    assert session["x"] is x
    assert {r.name: r.sdk_owned for r in session.regions()} == {"x": True}


def test_sdk_array_outlives_untrack_attempt_and_session(store):
    s = memdvr.Session(store, "life")
    x = s.array("x", 1000, np.int32)
    with pytest.raises(memdvr.InvalidArgument, match="still referenced"):
        s.untrack("x")
    x[:] = 5  # still valid
    del s
    gc.collect()
    assert int(x.sum()) == 5000  # the array keeps the session (and its memory) alive
    s2 = memdvr.Session(store, "life2")
    s2.array("y", 10)
    s2.untrack("y")  # no other reference: freed
    assert s2.regions() == []


@pytest.mark.parametrize("mode", ["tracked", "sdk"])
def test_restore_after_one_percent_change_is_exact(session, mode):
    n = 4 << 20  # 16 MiB of float32
    if mode == "tracked":
        a = session.track("a", np.random.default_rng(2).random(n, dtype=np.float32))
    else:
        a = session.array("a", n, np.float32)
        a[:] = np.random.default_rng(2).random(n, dtype=np.float32)
    want = a.copy()
    session.snapshot("base")
    idx = np.random.default_rng(3).choice(n, n // 100, replace=False)
    a[idx] += 1.0
    assert not np.array_equal(a, want)
    session.restore("base")
    np.testing.assert_array_equal(a, want)
    # and again, after a second round of changes
    a[idx[: len(idx) // 2]] = 0
    session.restore("base")
    np.testing.assert_array_equal(a, want)


@pytest.mark.parametrize("head", [1, 16, 4095])
def test_tracked_array_off_a_page_boundary_rolls_back_exactly(session, head):
    # A numpy array starts 16 bytes past a page (its allocator's header): each
    # of the region's pages spans two memory pages. Rollbacks after scattered
    # writes are exact, and the bytes around the array (here: guard bytes in
    # the same buffer) are never written.
    size = 3 * (256 << 10) + 5 * 4096 + 123
    buf = np.full(size + 3 * 4096, 0xA5, dtype=np.uint8)
    start = (-buf.ctypes.data) % 4096 + head
    a = buf[start:start + size]
    a[:] = np.random.default_rng(head).integers(0, 256, size, dtype=np.uint8)
    session.track("a", a)
    want = a.copy()
    session.snapshot("base")
    buf[:start] = 0x5A  # the application's own bytes next to the array
    buf[start + size:] = 0x3C
    guards = np.concatenate([buf[:start], buf[start + size:]])
    first = 4096 - (start % 4096)  # region offset of the second memory page
    for trial in range(3):
        a[first + trial * 4096::3 * 4096] ^= np.uint8(1 + trial)  # one byte in every third memory page
        a[0] ^= 1
        a[-1] ^= 1
        assert not np.array_equal(a, want)
        session.restore("base")
        np.testing.assert_array_equal(a, want)
        np.testing.assert_array_equal(np.concatenate([buf[:start], buf[start + size:]]), guards)
    with session.clone("base") as c:
        np.testing.assert_array_equal(c["a"], want)


def test_bytearray_and_memoryview(session):
    ba = bytearray(b"hello world" * 1000)
    raw = bytearray(8192)
    mv = memoryview(raw)
    session.track("ba", ba)
    session.track("mv", mv)
    mv[:5] = b"abcde"
    session.snapshot("s")
    ba[:5] = b"HELLO"
    mv[:5] = b"zzzzz"
    session.restore("s")
    assert ba[:11] == b"hello world"
    assert raw[:5] == b"abcde"
    c = session.clone("s")
    assert c["ba"].dtype == np.uint8 and bytes(c["ba"][:5]) == b"hello"
    assert bytes(c.buffer("mv")[:5]) == b"abcde"


def test_alloc_memoryview(session):
    mv = session.alloc("raw", 10000)
    assert isinstance(mv, memoryview) and not mv.readonly and mv.nbytes == 10000
    mv[:3] = b"abc"
    session.snapshot("s")
    mv[:3] = b"xyz"
    session.restore("s")
    assert bytes(mv[:3]) == b"abc"


def test_tracked_object_kept_alive(session):
    a = np.full(10_000, 7, dtype=np.int64)
    session.track("a", a)
    del a
    gc.collect()
    session.snapshot("s")  # the session holds the array: no crash
    session["a"][:] = 0
    session.restore("s")
    assert int(session["a"].sum()) == 70_000
    session.untrack("a")
    assert "a" not in session


def test_untracked_buffer_can_be_resized_again(session):
    ba = bytearray(100)
    session.track("ba", ba)
    with pytest.raises(BufferError):
        ba.extend(b"x")  # pinned while tracked
    session.untrack("ba")
    ba.extend(b"x")


def test_unknown_snapshot_not_found(session):
    session.track("a", np.zeros(10))
    with pytest.raises(memdvr.NotFound, match="no-such-snap") as e:
        session.restore("no-such-snap")
    assert isinstance(e.value, memdvr.DvrError)
    with pytest.raises(memdvr.NotFound, match="nope"):
        session.info("nope")
    with pytest.raises(memdvr.NotFound, match="gone"):
        session.remove("gone")
    with pytest.raises(memdvr.NotFound, match="nothing"):
        session.clone("nothing")
    with pytest.raises(memdvr.NotFound):
        session.untrack("not-a-region")


def test_read_only_and_non_contiguous_rejected(session):
    ro = np.zeros(1000)
    ro.setflags(write=False)
    with pytest.raises(memdvr.InvalidArgument, match="read-only") as e:
        session.track("ro", ro)
    assert isinstance(e.value, ValueError)
    assert "'ro'" in str(e.value)
    base = np.zeros(1000)
    with pytest.raises(ValueError, match="not C-contiguous"):
        session.track("strided", base[::2])
    with pytest.raises(ValueError, match="not C-contiguous"):
        session.track("fortran", np.zeros((100, 100), order="F"))
    with pytest.raises(memdvr.InvalidArgument, match="read-only"):
        session.track("bytes", b"immutable")
    with pytest.raises(memdvr.InvalidArgument, match="buffer"):
        session.track("obj", object())
    assert session.regions() == []
    session.track("ok", base)  # nothing was left half-tracked
    with pytest.raises(memdvr.AlreadyExists):
        session.track("ok", np.zeros(10))


def test_duplicate_snapshot_already_exists(session):
    a = session.track("a", np.arange(100.0))
    session.snapshot("dup")
    with pytest.raises(memdvr.AlreadyExists, match="dup"):
        session.snapshot("dup")
    a[:] = 9
    session.snapshot("dup", replace=True)
    a[:] = 0
    session.restore("dup")
    assert (a == 9).all()


def test_bad_arguments(store, session):
    with pytest.raises(memdvr.InvalidArgument):
        memdvr.Session(store, "bad name!")
    with pytest.raises(memdvr.InvalidArgument, match="tracking"):
        memdvr.Session(store, "t", tracking="bogus")
    with pytest.raises(memdvr.InvalidArgument):
        session.snapshot("empty")  # no regions
    session.track("a", np.zeros(10))
    with pytest.raises(memdvr.InvalidArgument):
        session.snapshot(".hidden")


def test_error_message_matches_cxx(store, tmp_path):
    with pytest.raises(memdvr.NotFound) as e:
        memdvr.Store(tmp_path / "missing", create=False)
    assert str(tmp_path / "missing") in str(e.value)
    assert e.value.args == (str(e.value),)


def test_clone_views(session):
    a = session.track("a", np.arange(50_000, dtype=np.float64).reshape(100, 500))
    b = session.array("b", (1000,), np.int16)
    b[:] = 3
    session.snapshot("s")
    a[:] = 0  # live changes do not reach the clone
    c = session.clone("s")
    assert sorted(c.names()) == ["a", "b"]
    ca, cb = c["a"], c["b"]
    assert ca.shape == (100, 500) and ca.dtype == np.float64
    np.testing.assert_array_equal(ca, np.arange(50_000, dtype=np.float64).reshape(100, 500))
    assert (cb == 3).all()
    assert ca.ctypes.data != a.ctypes.data
    ca[:] = -5  # copy-on-write: private to this clone
    cb[:] = 0
    del c
    gc.collect()
    assert (ca == -5).all()  # views keep the clone alive
    c2 = session.clone("s")
    np.testing.assert_array_equal(c2["a"], np.arange(50_000, dtype=np.float64).reshape(100, 500))
    assert (c2["b"] == 3).all()
    assert (a == 0).all()
    session.restore("s")
    np.testing.assert_array_equal(a, c2["a"])
    ro = session.clone("s", writeable=False)
    with pytest.raises(ValueError):
        ro["a"][0, 0] = 1
    # Store.open_snapshot: raw bytes, reinterpretable
    oc = session.store.open_snapshot("test", "s")
    assert oc["a"].dtype == np.uint8 and oc["a"].nbytes == a.nbytes
    np.testing.assert_array_equal(oc.array("a", np.float64, (100, 500)), a)


def test_list_info_remove_gc_verify(store):
    s = memdvr.Session(store, "lst")
    a = s.track("a", np.random.default_rng(5).random(300_000))
    s.snapshot("one", label="L1")
    a[:1000] = 0
    s.snapshot("two")
    names = [i.name for i in s.list()]
    assert names == ["one", "two"]
    assert [i.name for i in store.list("lst")] == names
    assert {(i.session, i.name) for i in store.list()} >= {("lst", "one"), ("lst", "two")}
    assert store.sessions() == ["lst"]
    info = store.info("lst", "two")
    assert info.parent == "one" and info.logical_bytes == a.nbytes and not info.damaged
    assert info.time.year >= 2024
    assert s.info("one").label == "L1"
    assert info.to_dict()["regions"][0]["name"] == "a"
    assert s.latest().name == "two"
    rep = store.verify()
    assert isinstance(rep, memdvr.VerifyReport)
    assert rep.ok and rep.snapshots == 2 and rep.problems == () and rep.damaged_snapshots == ()
    assert rep.to_dict()["problems"] == [] and rep.to_dict()["ok"] is True
    st = store.stats()
    assert isinstance(st, memdvr.StoreStats)
    assert st.snapshots == 2 and st.path == store.path and st.medium == store.medium
    assert st.to_dict()["chunk_size"] == store.chunk_size
    s.remove("one")
    store.remove("lst", "two")
    assert s.list() == []
    assert s.latest() is None
    g = store.gc()
    assert isinstance(g, memdvr.GcReport)
    assert g.bytes_after <= g.bytes_before
    assert set(g.to_dict()) == {"bytes_before", "bytes_after", "packs_removed", "temp_files_removed"}
    assert store.verify().ok


def test_diff(session, store):
    a = session.track("a", np.zeros(100_000, dtype=np.uint8))
    session.snapshot("x")
    a[:10] = 1
    session.snapshot("y")
    (d,) = store.diff("test", "x", "test", "y")
    assert isinstance(d, memdvr.RegionDiff)
    assert d.name == "a" and d.bytes_differ == 10 and d.pages_differ == 1 and not d.object


def test_close_and_context_manager(store):
    a = np.ones(100)
    with memdvr.Session(store, "cm") as s:
        s.track("a", a)
        s.snapshot("s")
    with pytest.raises(memdvr.InvalidArgument, match="closed"):
        s.snapshot("t")
    with memdvr.Session(store, "cm") as s2:
        s2.track("a", a)
        a[:] = 0
        s2.restore("s")
    assert (a == 1).all()


def test_hash_tracking(store):
    s = memdvr.Session(store, "h", tracking="hash")
    a = s.array("a", 1 << 20, np.uint8)
    assert s.tracking("a") == "hash"
    a[::4096] = 1
    s.snapshot("s")
    a[:] = 2
    s.restore("s")
    assert int(a.sum()) == 256


def test_gil_released_during_snapshot(session):
    n = (256 << 20) // 4  # 256 MiB of float32
    a = session.array("big", n, np.float32)

    def one_try(k):
        """A snapshot of all-new data while a thread counts: (its length, the
        longest gap in the thread's counting during it)."""
        a[:] = 1.5 + k  # not all-zero chunks: every chunk is hashed and written
        a[::1024] = np.arange(n // 1024, dtype=np.float32)
        stamps = []
        stop = threading.Event()

        def spin():
            while not stop.is_set():
                stamps.append(time.perf_counter())

        t = threading.Thread(target=spin)
        t.start()
        try:
            while not stamps:
                time.sleep(0.001)
            t0 = time.perf_counter()
            session.snapshot(f"big-{k}")
            t1 = time.perf_counter()
        finally:
            stop.set()
            t.join()
        inside = [t0] + [x for x in stamps if t0 <= x <= t1] + [t1]
        return t1 - t0, max(b - a for a, b in zip(inside, inside[1:]))

    # Holding the GIL, the snapshot would keep the thread from running for its
    # whole duration (at most one switch interval, 5 ms, at either end); with
    # the GIL released the thread keeps counting: no gap anywhere near as long.
    # A loaded machine can stop the thread for a while anyway (other tests,
    # reclaim): one try of three must show it, and a held GIL fails all three.
    tries = []
    for k in range(3):
        d, gap = one_try(k)
        tries.append((round(d, 4), round(gap, 4)))
        assert d > 0.03, f"snapshot too fast ({d:.3f} s) to tell"
        if gap < d / 3:
            return
    raise AssertionError(f"the counting thread stopped for a third of every snapshot or more: (length, gap) {tries}")


def test_background_snapshot_is_the_array_at_the_call(session):
    """snapshot(wait=False): returns a job; a thread writing the array meanwhile does not leak into it."""
    a = np.random.default_rng(7).random((8 << 20) // 8)  # 8 MiB, tracked in place
    session.track("a", a)
    at_call = a.copy()
    job = session.snapshot("bg", label="background", wait=False)
    assert isinstance(job, memdvr.SnapshotJob)
    assert job.name == "bg"
    if not job.background and "userfaultfd" in job.note:
        job.wait()
        pytest.skip("background snapshots unavailable here: " + job.note)
    assert job.background, job.note
    stop = threading.Event()

    def writer():
        i = 0
        while not stop.is_set():
            a[(i * 4099) % a.size] = -1.0
            i += 1

    t = threading.Thread(target=writer)
    t.start()
    try:
        info = job.wait(timeout=60)
    finally:
        stop.set()
        t.join()
    assert info.name == "bg" and info.label == "background"
    assert job.done
    done, total = job.progress
    assert done == total == a.nbytes
    assert job.stall_seconds >= 0
    assert "bg" in repr(job)
    later = a.copy()
    session.snapshot("after")
    a[:] = 0
    session.restore("bg")
    assert np.array_equal(a, at_call)
    session.restore("after")
    assert np.array_equal(a, later)


def test_background_snapshot_taken_at_once_and_errors(session):
    a = np.zeros(1 << 20)
    session.track("a", a)
    session.snapshot("base")
    a[3] = 1.0  # little changed: quicker at once
    job = session.snapshot("small", wait=False)
    assert not job.background
    assert "quicker" in job.note
    assert job.wait().name == "small"
    with pytest.raises(memdvr.AlreadyExists):
        session.snapshot("small", wait=False)
    assert issubclass(memdvr.Cancelled, memdvr.DvrError)
    assert memdvr.Cancelled.code == "cancelled"
