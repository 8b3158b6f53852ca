"""Several processes on one store at once: writers serialize on the store lock,
dedup works across processes, gc in one process never frees what another one
references, and readers never see a half-written or damaged snapshot."""

import random
import subprocess
import time

from dvrtest import WORKER_BYTES, describe


def start(store, *args):
    return subprocess.Popen([str(a) for a in store.worker_args(*args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc, timeout=120):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"worker still running after {timeout} s: {proc.args}\n{err}")
    assert proc.returncode == 0, describe(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return out.splitlines()


def numbered(prefix, n):
    return [f"{prefix}{i:04d}" for i in range(1, n + 1)]


def assert_overlapped(first, second):
    """The two snapshot series really ran at the same time."""
    a = [s["time_ns"] for s in first]
    b = [s["time_ns"] for s in second]
    assert min(a) < max(b) and min(b) < max(a), "the workers did not run concurrently; nothing was tested"


def test_two_sessions_at_once_and_identical_content_is_stored_once(store):
    count = 30
    store.snap("warmup", "w")  # create the store before the race
    workers = [start(store, "loop", session, "--count", count, "--prefix", "p-") for session in ("s1", "s2")]
    for w in workers:
        assert finish(w) == numbered("p-", count)

    report = store.verify()
    assert report["ok"] and report["snapshots"] == 2 * count + 1, report
    store.check("s1")
    store.check("s2")
    s1 = {s["name"]: s for s in store.ls("s1")}
    s2 = {s["name"]: s for s in store.ls("s2")}
    assert sorted(s1) == sorted(s2) == numbered("p-", count)
    assert_overlapped(s1.values(), s2.values())
    # Same name, same content: whichever process committed second stored nothing.
    for name in s1:
        assert min(s1[name]["stored_bytes"], s2[name]["stored_bytes"]) == 0, (name, s1[name], s2[name])
    # Space reserved but left unused by a snapshot is free again; gc gives it back.
    store.gc()
    store.assert_space_matches_live_data()
    stat = store.stat()
    assert stat["logical_bytes"] == (2 * count + 1) * WORKER_BYTES
    assert stat["pack_bytes"] < 0.55 * stat["logical_bytes"], f"identical sessions were not deduplicated: {stat}"


def test_one_session_two_writers_with_gc_and_a_reader(store):
    """Two processes write one session (different names) with remove + gc
    churn, while a third process lists, restores, verifies and runs gc."""
    count = 25
    rng = random.Random(7)
    store.snap("shared", "seed")
    workers = [start(store, "loop", "shared", "--count", count, "--prefix", prefix, "--churn") for prefix in ("a-", "b-")]
    reads = 0
    deadline = time.monotonic() + 120
    while any(w.poll() is None for w in workers) and time.monotonic() < deadline:
        listing = store.ls("shared")
        assert not [s for s in listing if s["damaged"]], listing
        stable = [s["name"] for s in listing if not s["name"].startswith("tmp-")]  # never removed
        store.check("shared", rng.choice(stable))
        reads += 1
        if reads % 5 == 0:
            report = store.verify()
            assert report["ok"], report
        if reads % 5 == 2:
            store.gc()  # a third process frees what the writers' removals left
    outputs = [finish(w) for w in workers]
    for prefix, out in zip(("a-", "b-"), outputs):
        assert [l for l in out if l.startswith(prefix)] == numbered(prefix, count)
    assert reads >= 2, "the reader never ran while the writers did"

    assert store.verify()["ok"]
    listing = {s["name"]: s for s in store.ls("shared")}
    expected = {"seed", "tmp-a-" + numbered("", count)[-1], "tmp-b-" + numbered("", count)[-1]}
    expected |= set(numbered("a-", count)) | set(numbered("b-", count))
    assert set(listing) == expected
    store.check("shared")
    # Each process's timeline stays its own although the session is shared.
    for prefix in ("a-", "b-"):
        for k, name in enumerate(numbered(prefix, count)[1:], start=1):
            assert listing[name]["parent"] == f"tmp-{prefix}{k:04d}", listing[name]
    assert_overlapped([s for n, s in listing.items() if n.startswith("a-")],
                      [s for n, s in listing.items() if n.startswith("b-")])


def test_processes_creating_the_same_new_store_at_once_agree_on_it(make_store):
    """Four processes open a store that does not exist yet at the same instant
    (ten times over, since the window is short): all of them succeed."""
    sessions = [f"s{k}" for k in range(4)]
    refused = []
    for round_ in range(10):
        store = make_store(f"new-{round_}")
        workers = [start(store, "snap", session, "first", "second") for session in sessions]
        for session, w in zip(sessions, workers):
            out, err = w.communicate(timeout=120)
            if w.returncode != 0:
                refused.append(f"round {round_}, session {session}: exit {w.returncode}: {err.strip()}")
            else:
                assert out.splitlines() == ["first", "second"]
        ok = [s for s, w in zip(sessions, workers) if w.returncode == 0]
        assert {s["session"] for s in store.ls()} == set(ok)
        assert store.verify()["ok"]
        for session in ok:
            store.check(session, "first", "second")
    assert not refused, f"{len(refused)} of 40 processes could not open the new store:\n" + "\n".join(refused)
