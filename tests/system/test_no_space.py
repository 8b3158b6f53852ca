"""A full store: snapshot() fails cleanly with no_space and a message that says
what to do, nothing half-written becomes visible, every earlier snapshot stays
intact, and following the advice (rm + gc) makes room again.

Two ways to run out: a small tmpfs (needs root to mount) and RLIMIT_FSIZE on an
ordinary directory (SIGXFSZ ignored, so the write fails with EFBIG instead of
killing the process)."""

import errno
import os
import resource
import shutil
import signal

import pytest
from dvrtest import DVR_ERROR, describe, run, skip_unless_root

MIB = 1024 * 1024


@pytest.fixture
def tmpfs(tmp_path):
    """A 24 MiB tmpfs mounted for this test only."""
    skip_unless_root("mounting a tmpfs")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = run(["mount", "-t", "tmpfs", "-o", "size=24m,mode=0700", "tmpfs", mnt])
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        proc = run(["umount", mnt])
        if proc.returncode != 0:
            run(["umount", "-l", mnt], expect=0)


def fill(store, *args, **kwargs):
    """Runs `fill`; returns (names committed, error line, process). Asserts it ended with no_space."""
    proc = store.worker("fill", "s", *args, expect=None, timeout=300, **kwargs)
    assert proc.returncode == DVR_ERROR, "fill did not end with no_space:\n" + describe(proc)
    lines = proc.stdout.splitlines()
    committed = [l.split()[1] for l in lines if l.startswith("committed fill-")]
    errors = [l for l in lines if l.startswith("error ")]
    assert len(errors) == 1 and errors[0].startswith("error no_space:"), describe(proc)
    assert f"committed before the error: {len(committed)}" in lines, describe(proc)
    return committed, errors[0], proc


def assert_clean_and_intact(store, committed):
    report = store.verify()
    assert report["ok"] and report["snapshots"] == len(committed), report
    listing = store.ls("s")
    assert [s["name"] for s in listing] == committed, "a half-written snapshot became visible"
    assert not any(s["damaged"] for s in listing)
    store.check("s", *committed)


def assert_says_full_and_what_to_do(message):
    assert "full" in message, message
    assert "dvr gc" in message, message


def test_full_tmpfs_gives_no_space_and_keeps_earlier_snapshots(tmpfs, make_store):
    store = make_store(parent=tmpfs)
    committed, error, _ = fill(store)
    assert committed, "not one 6 MiB snapshot fit into a 24 MiB tmpfs"
    assert_says_full_and_what_to_do(error)
    assert str(store.path) in error or "pack" in error, error  # names the file involved
    assert store.stat()["medium"] == "dram"
    assert_clean_and_intact(store, committed)

    # Follow the advice: remove snapshots, run gc, and there is room again.
    store.dvr("rm", *[f"s/{n}" for n in committed[:2]])
    store.gc()
    more, _, _ = fill(store, "--start", "100")
    assert more, "rm + gc freed no room for another snapshot"
    assert_clean_and_intact(store, committed[2:] + more)


def fill_up(path):
    """Writes `path` until the file system has no byte left."""
    with open(path, "wb", buffering=0) as f:
        for size in (MIB, 4096, 1):
            try:
                while True:
                    f.write(b"\xff" * size)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e


def test_rm_and_gc_work_on_a_completely_full_file_system(tmpfs, make_store):
    """Other files took the last free byte: reading commands, rm and gc (the
    advice the no_space message gives) must still work."""
    store = make_store(parent=tmpfs)
    committed, _, _ = fill(store)
    fill_up(tmpfs / "filler")
    assert os.statvfs(tmpfs).f_bavail == 0
    store.dvr("ls")
    assert store.verify()["ok"]
    store.check("s", *committed)
    store.dvr("rm", f"s/{committed[0]}")
    proc = store.dvr("gc", expect=None)
    assert proc.returncode == 0, "gc cannot free space on a full file system:\n" + describe(proc)
    assert os.statvfs(tmpfs).f_bavail > 0, "gc freed nothing"
    assert_clean_and_intact(store, committed[1:])


def test_gc_frees_space_when_the_file_system_filled_after_the_rm(tmpfs, make_store):
    """Snapshots removed first, then another program takes the last free
    byte: gc (which must announce a new epoch before it frees anything) still
    frees the space instead of failing with no_space itself."""
    store = make_store(parent=tmpfs)
    committed, _, _ = fill(store)
    store.dvr("rm", f"s/{committed[0]}", f"s/{committed[1]}")
    fill_up(tmpfs / "filler")
    assert os.statvfs(tmpfs).f_bavail == 0
    proc = store.dvr("gc", expect=None)
    assert proc.returncode == 0, "gc cannot free space on a full file system:\n" + describe(proc)
    assert os.statvfs(tmpfs).f_bavail > 0, "gc freed nothing"
    assert_clean_and_intact(store, committed[2:])


def limit_file_size(limit):
    def preexec():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    return preexec


def test_file_size_limit_gives_no_space_and_keeps_earlier_snapshots(store):
    committed, error, _ = fill(store, preexec_fn=limit_file_size(24 * MIB))
    # Names the cause (a limit, not a full disk) and what to do about it.
    assert "limit" in error and ("raise" in error or "dvr gc" in error), error
    assert committed, "not one 6 MiB snapshot fit under a 24 MiB file-size limit:\n" + error
    assert_clean_and_intact(store, committed)
    # Without the limit the store goes on.
    store.snap("s", "after")
    store.check("s", *committed, "after")
    assert store.verify()["ok"]


def test_a_snapshot_that_adds_little_fits_into_little_free_space(tmpfs, make_store):
    """With 2 MiB free, a snapshot whose new data is a few hundred KiB must
    succeed: the space a snapshot needs is what it adds, not its logical size."""
    store = make_store(parent=tmpfs)
    base = ["a", "b", "c"]
    store.snap("s", *base)  # together they store (almost) all the shared base content
    have = {}
    for name in base:
        have.update(store.content_keys(name))

    def adds(name):
        return sum(n for k, n in store.content_keys(name).items() if k not in have)

    small = min((f"small-{i}" for i in range(30)), key=adds)
    assert adds(small) < 512 * 1024, (small, adds(small))
    filler = tmpfs / "filler"
    fill_up(filler)
    os.truncate(filler, filler.stat().st_size - 2 * MIB)
    free = os.statvfs(tmpfs).f_bavail * os.statvfs(tmpfs).f_frsize
    proc = store.snap("s", small, expect=None)
    assert proc.returncode == 0, f"a snapshot adding {adds(small)} bytes failed with {free} bytes free:\n" + describe(proc)
    store.check("s", *base, small)
    assert store.verify()["ok"]


def test_a_fresh_snapshot_into_nearly_full_space_fails_cleanly_or_fits(tmpfs, make_store):
    """With little room left, a snapshot either fits or fails with no_space:
    never a crash, never a visible half-written snapshot. The free space at
    which it starts to fit is found by bisection (each try on a new store),
    then every page-sized step just below it is tried: there the data fits but
    the page hash pages written beside it may not (they must be reserved too,
    and are only a cache when they cannot be)."""
    probe = make_store(name="probe", parent=tmpfs)
    probe.snap("s", "a", "fill-0001")
    need_kib = probe.dvr_json("info", "s/fill-0001")["stored_bytes"] // 1024
    shutil.rmtree(probe.path)
    filler = tmpfs / "filler"

    def attempt(free_kib):
        store = make_store(name=f"store-{free_kib}", parent=tmpfs)
        store.snap("s", "a")
        fill_up(filler)
        os.truncate(filler, max(0, filler.stat().st_size - free_kib * 1024))
        proc = store.snap("s", "fill-0001", expect=None)
        assert proc.returncode in (0, DVR_ERROR), f"{free_kib} KiB free:\n" + describe(proc)
        if proc.returncode == DVR_ERROR:
            assert_says_full_and_what_to_do(proc.stderr)
        committed = ["a"] + (["fill-0001"] if proc.returncode == 0 else [])
        assert [x["name"] for x in store.ls("s")] == committed, "a half-written snapshot became visible"
        os.unlink(filler)
        store.check("s", *committed)
        shutil.rmtree(store.path)
        return proc.returncode == 0

    lo, hi = need_kib // 2 // 4 * 4, (need_kib + need_kib // 4) // 4 * 4
    assert not attempt(lo) and attempt(hi)
    while hi - lo > 4:
        mid = (lo + hi) // 8 * 4
        if attempt(mid):
            hi = mid
        else:
            lo = mid
    for free_kib in range(hi - 64, hi, 4):
        attempt(free_kib)


def test_a_store_on_a_read_only_mount_can_be_read_and_refuses_writes(tmpfs, make_store, tmp_path):
    """A store on a read-only mount (a backup, a file-system snapshot): listing,
    verify, info, restore and export work (its lock file is opened for
    reading); what would write fails with the file system's reason."""
    store = make_store(parent=tmpfs)
    store.snap("s", "a", "b")
    run(["mount", "-o", "remount,ro", tmpfs], expect=0)
    try:
        assert [s["name"] for s in store.ls("s")] == ["a", "b"]
        assert store.verify()["snapshots"] == 2
        assert store.info("s/a")["name"] == "a"
        store.check("s", "a", "b")
        store.dvr("export", "s/b", "-o", tmp_path / "b.dvr")
        assert (tmp_path / "b.dvr").stat().st_size > 0
        proc = store.dvr("rm", "s/a", expect=1)
        assert "Read-only file system" in proc.stderr, describe(proc)
        assert [s["name"] for s in store.ls("s")] == ["a", "b"]
    finally:
        run(["mount", "-o", "remount,rw", tmpfs], expect=0)


def test_a_full_destination_of_an_export_is_named_and_not_blamed_on_the_store(tmpfs, make_store, tmp_path):
    """`dvr export` and `dvr send` onto a full file system that is not the
    store's: the message names the file the stream went to and says the
    store is not affected (no advice to remove snapshots), and no part file
    is left."""
    import subprocess
    import sys
    from pathlib import Path
    store = make_store()
    env = {"PYTHONPATH": str(Path(store.dvr_bin).resolve().parent / "python")}  # the build's memdvr, beside dvr
    make = (f"import memdvr, numpy as np\ns = memdvr.Session(memdvr.Store({str(store.path)!r}), 's')\n"
            "a = s.array('a', (4 << 20,), np.uint64)\na[:] = np.random.default_rng(1).integers(0, 2**63, a.size, dtype=np.uint64)\n"
            "s.snapshot('big')\ns.close()\n")
    run([sys.executable, "-c", make], expect=0, timeout=120, env=env)
    out = tmpfs / "big.dvr"
    proc = store.dvr("export", "s/big", "-o", out, "--compress=none", expect=1)
    assert f"cannot write the stream to {out}.part-" in proc.stderr and "the store is not affected" in proc.stderr, describe(proc)
    assert "dvr gc" not in proc.stderr and "remove snapshots" not in proc.stderr, describe(proc)
    assert os.listdir(tmpfs) == [], os.listdir(tmpfs)
    with open(tmpfs / "big.stream", "wb") as f:
        proc = subprocess.run([str(a) for a in store.argv("send", "s/big", "--compress=none")], stdout=f, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    assert proc.returncode == 1, proc
    assert f"cannot write the stream to {tmpfs / 'big.stream'}" in proc.stderr and "the store is not affected" in proc.stderr, describe(proc)
    store.verify()
