"""Python that behaves (issue #17, item 4): with-blocks that never mask the
body's exception and release regions safely, snapshot(replace=...), hints
that name the store and the closest existing name, Clone.get(), user names in
clones and diffs, one result style (dataclasses with to_dict()), autosave."""

import dataclasses
import datetime as dt
import gc
import json
import pathlib
import time

import numpy as np
import pytest

import memdvr


@pytest.fixture
def store(tmp_path):
    return memdvr.Store(tmp_path / "store")


# ---------------------------------------------------------------- with Session


def test_with_block_that_raises_keeps_its_exception_and_the_array_alive(store):
    """The issue's case: the body raises while an array() is referenced (by the
    traceback's frame, and by `kept` here). The user's exception comes out, and
    the array stays valid after the with block."""
    with pytest.raises(KeyError, match="the body's own error") as e:
        with memdvr.Session(store, "w") as s:
            a = s.array("a", 100_000, np.float64)
            a[:] = 7.0
            kept = a
            s.snapshot("s")
            raise KeyError("the body's own error")
    assert not getattr(e.value, "__notes__", None)  # closing did not fail
    assert s.closed
    with pytest.raises(memdvr.InvalidArgument, match="closed"):
        s.snapshot("t")
    # The memory is still there, readable and writable, after the session closed.
    assert float(kept.sum()) == 700_000.0
    kept[:10] = 1.0
    assert float(kept[:10].sum()) == 10.0
    # A new session of that name opens and restores into its own array.
    with memdvr.Session(store, "w") as s2:
        b = s2.array("a", 100_000, np.float64)
        s2.restore("s")
        assert float(b.sum()) == 700_000.0
    assert float(kept.sum()) == 700_000.0 - 60.0  # untouched by the other session


def test_array_outlives_close_and_is_freed_with_its_last_reference(store):
    s = memdvr.Session(store, "free")
    a = s.array("a", 1 << 20, np.uint8)
    view = memoryview(a)
    m = s.alloc("m", 4096)
    s.track("t", np.ones(10))
    s.close()  # no error: the buffers stay valid
    s.close()  # twice: nothing
    a[:] = 3
    m[:4] = b"abcd"
    assert bytes(view[:2]) == b"\x03\x03" and bytes(m[:4]) == b"abcd"
    del a, view
    gc.collect()
    assert bytes(m[:4]) == b"abcd"  # the other region lives on
    del m
    gc.collect()
    assert "closed" in repr(s)


def test_with_block_close_failure_becomes_a_note_not_the_exception(store):
    class Failing(memdvr.Session):
        def close(self):
            raise memdvr.InvalidArgument("cannot close for a test")

    with pytest.raises(ZeroDivisionError) as e:
        with Failing(store, "f"):
            1 / 0
    assert any("cannot close for a test" in n for n in e.value.__notes__)
    # Without an exception in the body, the close failure is raised.
    with pytest.raises(memdvr.InvalidArgument, match="cannot close"):
        with Failing(store, "f"):
            pass


def test_untrack_still_refuses_while_referenced(store):
    s = memdvr.Session(store, "u")
    a = s.array("a", 10)
    with pytest.raises(memdvr.InvalidArgument, match="still referenced"):
        s.untrack("a")
    assert s["a"] is not None  # still usable
    del a
    gc.collect()
    s.untrack("a")
    assert s.regions() == []


# ---------------------------------------------------------------- replace


def test_snapshot_replace_default_and_idempotent_reruns(store):
    def run():  # what a re-run script or cell does
        s = memdvr.Session(store, "rerun")
        a = s.track("a", np.arange(1000.0))
        s.snapshot("loaded", replace=True)
        a[:10] = -1
        s.restore("loaded")
        assert a[0] == 0
        s.close()

    run()
    run()  # no AlreadyExists the second time
    assert [i.name for i in store.list("rerun")] == ["loaded"]
    s = memdvr.Session(store, "rerun")
    s.track("a", np.arange(1000.0))
    with pytest.raises(memdvr.AlreadyExists) as e:
        s.snapshot("loaded")  # replace=False by default
    msg = str(e.value)
    assert "rerun/loaded" in msg and "replace=True" in msg and store.path in msg


# ---------------------------------------------------------------- hints


def test_not_found_snapshot_names_the_store_the_python_call_and_the_closest_name(store):
    s = memdvr.Session(store, "notebook")
    s.track("a", np.zeros(100))
    s.snapshot("loaded")
    s.snapshot("trained")
    with pytest.raises(memdvr.NotFound) as e:
        s.restore("lodaed")
    msg = str(e.value)
    assert "did you mean 'loaded'?" in msg
    assert f"memdvr.Store({store.path!r}).list('notebook')" in msg
    assert "dvr ls" not in msg  # the CLI's hint, without --store, is not for Python users
    for call in [lambda: store.info("notebook", "trainde"), lambda: s.clone("trainde"),
                 lambda: s.remove("trainde"), lambda: store.open_snapshot("notebook", "trainde"),
                 lambda: store.diff("notebook", "loaded", "notebook", "trainde")]:
        with pytest.raises(memdvr.NotFound, match="did you mean 'trained'"):
            call()
    # Nothing close: no suggestion, still the call that lists them.
    with pytest.raises(memdvr.NotFound) as e:
        s.info("zzzzzz")
    assert "did you mean" not in str(e.value) and ".list('notebook')" in str(e.value)


def test_not_found_session_suggests_the_closest_session(store):
    s = memdvr.Session(store, "notebook")
    s.track("a", np.zeros(100))
    s.snapshot("loaded")
    with pytest.raises(memdvr.NotFound) as e:
        store.info("notebok", "loaded")
    msg = str(e.value)
    assert "no session 'notebok'" in msg and "did you mean 'notebook'?" in msg
    assert f"memdvr.Store({store.path!r}).sessions()" in msg


def test_not_found_region_and_object_suggest_the_closest_name(store):
    s = memdvr.Session(store, "r")
    s.track("weights", np.zeros(100))
    s.put("params", {"lr": 0.1})
    with pytest.raises(memdvr.NotFound, match=r"did you mean 'weights'\? Session.regions\(\)"):
        s["weight"]
    with pytest.raises(memdvr.NotFound, match="did you mean 'weights'"):
        s.untrack("weigths")
    with pytest.raises(memdvr.NotFound, match="did you mean 'weights'"):
        s.tracking("weight")
    with pytest.raises(memdvr.NotFound, match=r"'params' is a put\(\) object: Session.get"):
        s["params"]
    with pytest.raises(memdvr.NotFound, match=r"did you mean 'params'\? Session.objects\(\)"):
        s.get("param")
    with pytest.raises(memdvr.NotFound, match="did you mean 'params'"):
        s.delete("parms")
    with pytest.raises(memdvr.NotFound, match=r"'weights' is a region"):
        s.get("weights")
    s.snapshot("s")
    with s.clone("s") as c:
        with pytest.raises(memdvr.NotFound, match=r"did you mean 'weights'\? Clone.names\(\)"):
            c["weight"]
        with pytest.raises(memdvr.NotFound, match=r"did you mean 'params'\? Clone.objects\(\)"):
            c.get("parms")


# ---------------------------------------------------------------- clones and diffs


def test_clone_get_reads_a_past_object_without_restoring(store):
    s = memdvr.Session(store, "c")
    data = s.track("data", np.arange(1000, dtype=np.int64))
    s.put("params", {"lr": 0.1, "w": np.ones(100_000)})
    s.snapshot("v1")
    s.put("params", {"lr": 0.5, "w": np.zeros(10)})
    s.put("extra", [1, 2, 3])
    data[:] = 0
    with s.clone("v1") as c:
        old = c.get("params")
        assert old["lr"] == 0.1 and old["w"].shape == (100_000,) and (old["w"] == 1).all()
        assert c.names() == ["data"]  # no obj.params.pickle, obj.params.buf.0
        assert c.objects() == ["params"]
        assert list(c.arrays()) == ["data"]
        assert "obj." not in repr(c)
        np.testing.assert_array_equal(c["data"], np.arange(1000))
        assert {r.name for r in c.regions()} >= {"obj.params.pickle", "obj.params.buf.0"}
        old["w"][:] = 5  # a copy: the clone is unchanged
        assert (c.get("params")["w"] == 1).all()
    # The live session was not touched.
    assert s.get("params")["lr"] == 0.5 and s.objects() == ["extra", "params"]
    assert (data == 0).all()
    # A clone from the store (no layouts) reads objects too.
    c2 = store.open_snapshot("c", "v1")
    assert c2.get("params")["lr"] == 0.1
    assert s.info("v1").objects == ["params"]


def test_diff_reports_objects_by_their_names(store):
    s = memdvr.Session(store, "d")
    a = s.track("a", np.zeros(10_000))
    s.put("cfg", {"x": np.zeros(50_000)})
    s.put("same", "unchanged")
    s.snapshot("x")
    a[:3] = 1
    s.put("cfg", {"x": np.ones(50_000)})
    s.put("new", 42)
    s.snapshot("y")
    rows = {r.name: r for r in store.diff("d", "x", "d", "y")}
    assert set(rows) == {"a", "cfg", "same", "new"}
    assert not rows["a"].object and rows["a"].bytes_differ > 0
    # 0.0 and 1.0 differ in 2 of their 8 bytes; the pickle stream is the same.
    assert rows["cfg"].object and rows["cfg"].bytes_differ == 50_000 * 2
    assert rows["cfg"].size_a == rows["cfg"].size_b
    assert rows["same"].object and rows["same"].bytes_differ == 0 and rows["same"].pages_differ == 0
    assert rows["new"].object and rows["new"].only_in_b and not rows["new"].only_in_a
    assert rows["new"].size_a == 0 and rows["new"].size_b > 0
    assert not any(name.startswith("obj.") for name in rows)


# ---------------------------------------------------------------- one result style


CONTRACT = {
    memdvr.SnapshotInfo: ["session", "name", "parent", "label", "time_ns", "seq", "origin_time_ns", "logical_bytes",
                          "stored_bytes", "chunks", "zero_chunks", "regions", "tracking",
                          "chunks_read", "damaged", "damage", "pending"],
    memdvr.RegionInfo: ["name", "size", "sdk_owned"],
    memdvr.VerifyReport: ["snapshots", "chunks", "bytes", "problems", "damaged_snapshots", "ok", "warnings"],
    memdvr.VerifyProblem: ["session", "snapshot", "what"],
    memdvr.GcReport: ["bytes_before", "bytes_after", "packs_removed", "temp_files_removed"],
    memdvr.StoreStats: ["path", "medium", "format_version", "chunk_size", "sessions", "snapshots",
                        "logical_bytes", "pack_bytes", "pack_files", "warnings"],
    memdvr.RegionDiff: ["name", "size_a", "size_b", "only_in_a", "only_in_b", "bytes_differ",
                        "pages_differ", "object"],
}


def test_every_result_is_a_dataclass_with_the_cpp_field_names():
    for cls, fields in CONTRACT.items():
        assert dataclasses.is_dataclass(cls), cls
        assert [f.name for f in dataclasses.fields(cls)] == fields, cls
        assert callable(cls.to_dict) and cls.__doc__


def test_results_round_trip_through_json(store):
    s = memdvr.Session(store, "j")
    a = s.track("a", np.arange(5000.0))
    s.snapshot("one")
    a[:] = 0
    s.snapshot("two")
    results = [s.info("one"), s.list()[1], s.latest(), store.verify(), store.gc(), store.stats(),
               store.diff("j", "one", "j", "two")[0]]
    for r in results:
        d = r.to_dict()
        assert json.loads(json.dumps(d)) == d, type(r)
    info = s.info("one").to_dict()
    keys = list(info)
    assert keys[keys.index("time_ns") + 1] == "time"  # beside time_ns
    t = info["time"]
    assert t.endswith("Z") and len(t.split(".")[1]) == 10  # 9 digits and the Z
    parsed = dt.datetime.strptime(t[:19], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=dt.timezone.utc)
    assert int(parsed.timestamp()) == info["time_ns"] // 10**9
    assert int(t[20:29]) == info["time_ns"] % 10**9
    assert info["regions"] == [{"name": "a", "size": a.nbytes, "sdk_owned": False}]
    assert info["pending"] is False


def test_rfc3339_of_exact_times():
    info = memdvr.SnapshotInfo(session="s", name="n", parent="", label="", time_ns=1_796_171_467_123_456_789, seq=1,
                               origin_time_ns=1_796_171_467_123_456_789,
                               logical_bytes=0, stored_bytes=0, chunks=0, zero_chunks=0, regions=(),
                               tracking="hash", chunks_read=0, damaged=False, damage="")
    assert info.to_dict()["time"] == "2026-12-02T00:31:07.123456789Z"
    zero = dataclasses.replace(info, time_ns=0)
    assert zero.to_dict()["time"] == "1970-01-01T00:00:00.000000000Z"


def test_verify_report_of_a_damaged_store(store):
    s = memdvr.Session(store, "dmg")
    s.track("a", np.random.default_rng(3).random(100_000))
    s.snapshot("s")
    pack = next(p for p in (pathlib.Path(store.path) / "packs").iterdir() if p.suffix == ".pack")
    raw = bytearray(pack.read_bytes())
    raw[4096 + 10] ^= 0xFF  # the first stored chunk
    pack.write_bytes(bytes(raw))
    rep = store.verify()
    assert not rep.ok and rep.problems
    assert all(isinstance(p, memdvr.VerifyProblem) for p in rep.problems)
    assert rep.damaged_snapshots == ("dmg/s",)
    assert rep.to_dict()["problems"][0]["session"] == "dmg"


# ---------------------------------------------------------------- autosave


def test_autosave_at_checkpoint_points(store):
    s = memdvr.Session(store, "auto")
    a = s.track("a", np.zeros(10_000))
    assert s.checkpoint_point() is None  # autosave is off
    s.autosave(0.001, keep=2)
    taken = []
    for step in range(4):
        a[step] = step + 1
        time.sleep(0.01)  # more than `every` has passed since the last snapshot
        info = s.checkpoint_point()
        assert info is not None and info.label == "autosave"
        taken.append(info.name)
    assert taken == ["autosave-1", "autosave-2", "autosave-3", "autosave-4"]
    s.snapshot("named")
    time.sleep(0.01)
    assert s.checkpoint_point().name == "autosave-5"
    assert [i.name for i in s.list()] == ["autosave-4", "named", "autosave-5"]  # keep=2; named kept
    s.autosave(dt.timedelta(hours=1), keep=1)
    assert s.checkpoint_point() is None  # not due for an hour
    s.autosave(0, keep=1)  # off
    time.sleep(0.01)
    assert s.checkpoint_point() is None
    a[:] = -1
    s.restore("autosave-4")
    assert list(a[:5]) == [1, 2, 3, 4, 0]


def test_autosave_bad_arguments(store):
    s = memdvr.Session(store, "bad")
    s.track("a", np.zeros(10))
    with pytest.raises(memdvr.InvalidArgument, match="keep"):
        s.autosave(1.0, keep=0)
    with pytest.raises(memdvr.InvalidArgument, match="every"):
        s.autosave(-1.0, keep=1)
    with pytest.raises(memdvr.InvalidArgument, match="keep"):
        s.autosave(1.0, keep=-3)


def test_every_public_call_is_documented():
    undocumented = []
    for name in memdvr.__all__:
        obj = getattr(memdvr, name)
        if not isinstance(obj, type):
            continue
        if not obj.__doc__:
            undocumented.append(name)
        for attr, member in vars(obj).items():
            if attr.startswith("_") and attr not in ("__init__", "__getitem__", "__contains__", "__enter__", "__exit__"):
                continue
            fn = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
            if callable(fn) and attr not in ("__init__", "__enter__") and not fn.__doc__:
                undocumented.append(f"{name}.{attr}")
    assert not undocumented, undocumented


def test_hints_escape_control_characters(store):
    s = memdvr.Session(store, "esc")
    s.track("a", np.zeros(10))
    with pytest.raises(memdvr.NotFound) as e:
        s["a\n\x1b[2Jb"]
    assert "\n" not in str(e.value) and "\x1b" not in str(e.value)
    assert "a\\n\\x1b[2Jb" in str(e.value)
