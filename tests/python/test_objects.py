"""Tests of Session.put()/get(): Python objects stored with pickle protocol 5,
their large buffers out of band in regions of their own (issue #4, item 2)."""

import dataclasses
import pickle

import numpy as np
import pytest

import memdvr

MiB = 1 << 20


@dataclasses.dataclass
class Params:
    lr: float
    layers: list
    tag: str = "x"


@pytest.fixture
def store(tmp_path):
    return memdvr.Store(tmp_path / "store")


@pytest.fixture
def session(store):
    return memdvr.Session(store, "objs")


def test_round_trip_through_snapshot_and_restore(session):
    objs = {"d": {"a": 1, "b": [1.5, "two", None], "c": {"nested": (1, 2)}},
            "l": list(range(100)),
            "s": "héllo wörld",
            "p": Params(0.1, [64, 32], tag="t")}
    for name, obj in objs.items():
        session.put(name, obj)
    assert session.objects() == sorted(objs)
    session.snapshot("s1")
    for name in objs:
        session.put(name, "overwritten")
    session.restore("s1")
    for name, obj in objs.items():
        assert session.get(name) == obj
    assert isinstance(session.get("p"), Params)


def test_arrays_out_of_band_and_dedup(session):
    rng = np.random.default_rng(0)
    big = {"x": rng.random(MiB // 2),                     # 4 MiB float64
           "y": rng.integers(0, 1 << 30, MiB, dtype=np.int32),  # 4 MiB
           "meta": {"step": 1}}
    session.put("data", big)
    regions = {r.name: r.size for r in session.regions()}
    # the arrays are not in the pickle stream but in buffer regions of their own
    assert regions["obj.data.pickle"] < 4096
    assert sorted(v for k, v in regions.items() if ".buf." in k) == [4 * MiB, 4 * MiB]
    first = session.snapshot("s1")
    assert first.stored_bytes > 4 * MiB
    big["meta"]["step"] = 2  # one small value of a small object changes
    session.put("data", big)
    session.put("small", {"counter": 1})
    second = session.snapshot("s2")
    assert second.logical_bytes >= 8 * MiB
    assert second.stored_bytes < MiB // 4, second  # the arrays deduplicate
    got = session.get("data")
    assert got["meta"] == {"step": 2}
    np.testing.assert_array_equal(got["x"], big["x"])
    np.testing.assert_array_equal(got["y"], big["y"])
    assert got["y"].dtype == np.int32
    session.restore("s1")
    assert session.get("data")["meta"] == {"step": 1}
    with pytest.raises(memdvr.NotFound):
        session.get("small")


def test_get_returns_a_copy(session):
    a = np.arange(1000, dtype=np.float64)
    session.put("a", a)
    session.snapshot("s1")
    got = session.get("a")
    assert not np.shares_memory(got, a)
    got[0] = -1  # writable, private
    session.put("a", np.zeros(1000))
    session.restore("s1")
    session.put("a", np.ones(5))
    assert got[0] == -1 and got[1] == 1.0  # unaffected by later put/restore
    np.testing.assert_array_equal(session.get("a"), np.ones(5))


def test_replace_with_different_size_then_restore_older(session):
    session.put("obj", {"arr": np.arange(10_000), "name": "old"})
    session.snapshot("old")
    session.put("obj", {"arr": np.arange(3), "more": np.ones(77), "name": "new" * 100})
    assert len([r for r in session.regions() if r.name.startswith("obj.obj.buf.")]) == 2
    session.snapshot("new")
    session.put("obj", "just a string, no buffers")
    assert [r.name for r in session.regions()] == ["obj.obj.pickle"]  # buffers untracked
    session.restore("old")
    old = session.get("obj")
    assert old["name"] == "old"
    np.testing.assert_array_equal(old["arr"], np.arange(10_000))
    session.restore("new")
    new = session.get("obj")
    assert new["name"] == "new" * 100
    np.testing.assert_array_equal(new["more"], np.ones(77))
    session.restore("old")
    assert session.get("obj")["name"] == "old"


def test_object_put_after_snapshot_disappears(session):
    session.put("a", 1)
    session.snapshot("s1")
    session.put("b", np.arange(100))
    assert session.objects() == ["a", "b"]
    session.restore("s1")
    assert session.objects() == ["a"]
    with pytest.raises(memdvr.NotFound, match="'b'"):
        session.get("b")
    assert session.get("a") == 1


def test_restore_with_tracked_arrays_and_objects(session):
    data = session.array("data", 1000, np.float32)
    data[:] = 1
    session.put("cfg", {"k": 1})
    session.snapshot("s1")
    data[:] = 2
    session.put("cfg", {"k": 2, "extra": np.arange(50)})
    session.restore("s1")
    assert (data == 1).all()
    assert session.get("cfg") == {"k": 1}


def test_restore_still_strict_for_other_regions(session):
    session.array("data", 10)
    session.put("cfg", 1)
    session.snapshot("s1")
    session.put("cfg", np.arange(100))  # object regions changed too
    session.untrack("data")
    session.array("data", 20)
    before = [(r.name, r.size) for r in session.regions()]
    with pytest.raises(memdvr.InvalidArgument):
        session.restore("s1")
    assert [(r.name, r.size) for r in session.regions()] == before
    np.testing.assert_array_equal(session.get("cfg"), np.arange(100))


@pytest.mark.parametrize("make", [lambda tmp: (lambda x: x), lambda tmp: open(tmp / "f", "w")],
                         ids=["lambda", "open-file"])
def test_unpicklable_leaves_session_unchanged(session, tmp_path, make):
    session.put("keep", {"v": np.arange(10)})
    before = [(r.name, r.size) for r in session.regions()]
    bad = make(tmp_path)
    try:
        with pytest.raises(memdvr.InvalidArgument, match="cannot be pickled"):
            session.put("keep", {"bad": bad})
        with pytest.raises(memdvr.InvalidArgument, match="cannot put object 'new'"):
            session.put("new", bad)
    finally:
        if hasattr(bad, "close"):
            bad.close()
    assert [(r.name, r.size) for r in session.regions()] == before
    np.testing.assert_array_equal(session.get("keep")["v"], np.arange(10))


@pytest.mark.parametrize("name", ["", ".hidden", "a b", "a/b", "x" * 101, "é", None, 3])
def test_invalid_names_rejected(session, name):
    with pytest.raises(memdvr.InvalidArgument, match="invalid object name"):
        session.put(name, 1)
    with pytest.raises(memdvr.InvalidArgument):
        session.get(name)
    assert session.regions() == []


def test_valid_names(session):
    names = ["a", "A-b_c.d", "x" * 100, "a.buf.0", "a.pickle", "0"]
    for i, name in enumerate(names):
        session.put(name, i)
    session.put("a", np.arange(3))
    for i, name in enumerate(names):
        if name != "a":
            assert session.get(name) == i
    np.testing.assert_array_equal(session.get("a"), np.arange(3))
    assert session.objects() == sorted(names)


def test_reserved_prefix_for_regions(session):
    with pytest.raises(memdvr.InvalidArgument, match="reserved"):
        session.array("obj.x.pickle", 10)
    with pytest.raises(memdvr.InvalidArgument, match="reserved"):
        session.track("obj.y", np.zeros(4))
    with pytest.raises(memdvr.InvalidArgument, match="reserved"):
        session.alloc("obj.z", 4)


def test_get_unknown_names_it(session):
    with pytest.raises(memdvr.NotFound, match="no object 'missing' in session 'objs'"):
        session.get("missing")
    with pytest.raises(memdvr.NotFound, match="'missing'"):
        session.delete("missing")


def test_delete(session):
    session.put("a", np.arange(10))
    session.put("b", 2)
    session.snapshot("s1")
    session.delete("a")
    assert session.objects() == ["b"]
    assert [r.name for r in session.regions()] == ["obj.b.pickle"]
    session.restore("s1")
    np.testing.assert_array_equal(session.get("a"), np.arange(10))


def test_pickle_buffer_and_bytearray(session):
    payload = bytearray(b"z" * 100_000)
    session.put("pb", pickle.PickleBuffer(payload))
    assert bytes(session.get("pb")) == bytes(payload)
    session.put("empty", {"e": np.zeros(0), "f": np.zeros((0, 3))})
    got = session.get("empty")
    assert got["e"].shape == (0,) and got["f"].shape == (0, 3)
    # non-contiguous arrays pickle in-band (numpy copies them)
    a = np.arange(100).reshape(10, 10)[:, ::2]
    session.put("strided", a)
    np.testing.assert_array_equal(session.get("strided"), a)


def test_objects_survive_in_a_fresh_session(tmp_path):
    path = tmp_path / "store"
    s = memdvr.Session(memdvr.Store(path), "job")
    obj = {"p": Params(0.5, [1]), "arr": np.linspace(0, 1, 100_000)}
    s.put("state", obj)
    s.put("other", "x")
    s.snapshot("ckpt")
    s.close()
    del s
    fresh = memdvr.Session(memdvr.Store(path), "job")  # as a new process would
    assert fresh.objects() == []
    with pytest.raises(memdvr.NotFound):
        fresh.get("state")
    fresh.restore("ckpt")
    assert fresh.objects() == ["other", "state"]
    got = fresh.get("state")
    assert got["p"] == obj["p"]
    np.testing.assert_array_equal(got["arr"], obj["arr"])
    assert fresh.get("other") == "x"


def test_failed_restore_puts_object_regions_back(session):
    session.put("a", {"v": np.arange(10)})
    session.snapshot("s1")
    session.put("a", {"v": np.arange(500), "w": np.ones(3)})
    session.put("b", "later")
    before = [(r.name, r.size) for r in session.regions()]

    class FailingRestore:  # the core restore fails after the object regions were reconciled
        def __init__(self, core):
            self._c = core

        def __getattr__(self, attr):
            return getattr(self._c, attr)

        def restore(self, name):
            raise memdvr.Corrupt("injected")

    core = session._core
    session._core = FailingRestore(core)
    try:
        with pytest.raises(memdvr.Corrupt, match="injected"):
            session.restore("s1")
    finally:
        session._core = core
    assert sorted(before) == sorted((r.name, r.size) for r in session.regions())
    got = session.get("a")
    np.testing.assert_array_equal(got["v"], np.arange(500))
    assert session.get("b") == "later"
    session.restore("s1")
    np.testing.assert_array_equal(session.get("a")["v"], np.arange(10))


def test_a_put_that_cannot_allocate_leaves_the_object_as_it_was(session):
    session.put("a", {"v": np.arange(10), "w": np.ones(4)})
    before = sorted((r.name, r.size) for r in session.regions())

    class FailingAlloc:  # the third region allocation of the next put fails
        def __init__(self, core):
            self._c = core
            self.calls = 0

        def __getattr__(self, attr):
            return getattr(self._c, attr)

        def alloc(self, name, size):
            self.calls += 1
            if self.calls == 3:
                raise memdvr.NoSpace("injected: out of memory")
            return self._c.alloc(name, size)

    core = session._core
    session._core = FailingAlloc(core)
    try:
        with pytest.raises(memdvr.NoSpace, match="injected"):
            session.put("a", {"v": np.arange(500), "w": np.ones(7), "x": np.zeros(3)})
    finally:
        session._core = core
    assert sorted((r.name, r.size) for r in session.regions()) == before
    got = session.get("a")
    np.testing.assert_array_equal(got["v"], np.arange(10))
    np.testing.assert_array_equal(got["w"], np.ones(4))
    session.put("a", {"v": np.arange(500)})  # and a later put works
    np.testing.assert_array_equal(session.get("a")["v"], np.arange(500))
