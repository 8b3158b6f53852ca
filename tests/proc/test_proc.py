"""Whole-process snapshots with the real CRIU: `dvr run` starts a job in a PID
namespace of its own, `dvr proc dump` checkpoints it into the store, `restore`
and `clone` bring it back, and the job's status file (see conftest.py) shows
that what came back is the same process, counting on from where it was dumped,
with its memory (anonymous, numpy, or a DVR persistent heap) bit-exact."""

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from dvrtest import (MIB, PYTHON, Job, alive, popen_killed_at_end, criu_dumps_inet_sockets, criu_version, data_extents, describe, free_pid,
                     kernel_version, ns_pid, pid_namespace, run, wait_gone)

REDIS_SERVER = "/usr/bin/redis-server"
REDIS_CLI = "/usr/bin/redis-cli"


def assert_dvr_error(proc, *patterns, context=""):
    """A failed dvr command: non-zero exit, a stderr message starting with "dvr: "
    that matches every regex in `patterns` (case-insensitive)."""
    assert proc.returncode != 0, f"{context}: expected a failure\n{describe(proc)}"
    err = proc.stderr.strip()
    assert err.startswith("dvr: "), f"{context}: the message must start with 'dvr: '\n{describe(proc)}"
    for pattern in patterns:
        assert re.search(pattern, err, re.IGNORECASE), f"{context}: message does not match {pattern!r}\n{describe(proc)}"
    return err


def restored_continues(job, at_dump, pid, gen=None):
    """The restored process `pid` reports the dump-time process's id, a count not
    below the dump-time one, the dump-time generation with its checksum, and
    keeps counting. Returns its first report."""
    first = job.wait_next(at_dump)
    assert first["id"] == at_dump["id"], f"a different process came back: {first} vs {at_dump}"
    assert first["count"] >= at_dump["count"], f"the counter went back: dumped at {at_dump}, restored {first}"
    job.assert_intact(first, gen=at_dump["gen"] if gen is None else gen)
    later = job.wait_count(first["count"] + 10)
    assert alive(pid) and later["id"] == first["id"]
    return first


# --- preflight

def test_check_passes_here_and_names_a_missing_plugin(work, tmp_path):
    ok = work.dvr("proc", "check")
    assert ok.returncode == 0, describe(ok)
    assert isinstance(work.dvr_json("proc", "check"), (dict, list))
    empty = tmp_path / "no-plugins"
    empty.mkdir()
    bad = work.dvr("proc", "check", expect=None, env={"DVR_CRIU_PLUGIN_DIR": str(empty)})
    assert bad.returncode == 1, describe(bad)
    assert "plugin" in (bad.stdout + bad.stderr).lower(), describe(bad)


def test_run_starts_a_session_leader_as_pid_1_of_its_own_namespace(work):
    job = work.start_job("counter", mib=4, wait_count=5)
    assert ns_pid(job.pid)[-1] == 1, f"the job is not PID 1 of its namespace: NSpid {ns_pid(job.pid)}"
    assert pid_namespace(job.pid) != pid_namespace(os.getpid())
    assert os.getsid(job.pid) == job.pid, "the job is not the leader of its own session"
    assert int(Path(f"/proc/{job.pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) != os.getpid(), \
        "the job should not stay a child of the caller"
    assert os.readlink(f"/proc/{job.pid}/fd/0") == "/dev/null"
    assert os.readlink(f"/proc/{job.pid}/fd/1") == os.readlink(f"/proc/{job.pid}/fd/2") == str(job.output)


# --- the counter job

def test_counter_job_restored_continues_counting_with_its_buffer_intact(work):
    job = work.start_job("counter", mib=32, wait_count=30)
    job.mutate()
    info = work.dump(job.pid, "c1")
    assert info["heaps"] == []
    assert info["image_bytes"] >= 32 * MIB, f"the images must hold the 32 MiB buffer: {info}"
    at_dump = job.status()  # the last report before the freeze
    assert at_dump["count"] >= 30
    work.assert_private()

    pid = work.restore("c1")
    assert ns_pid(pid)[-1] == 1, f"the restored job is not PID 1 of its namespace: NSpid {ns_pid(pid)}"
    restored_continues(job, at_dump, pid, gen=1)
    # The restored process is fully alive: it still takes signals and mutates correctly.
    job.pid = pid
    job.assert_intact(job.mutate(), gen=2)
    work.assert_private()
    work.verify()


def test_restore_pidfile_and_json(work):
    job = work.start_job("counter", mib=4)
    work.dump(job.pid, "j")
    at_dump = job.status()
    pidfile = work.path("restored.pid")
    out = work.dvr_json("proc", "restore", "j", "--detach", "--pidfile", pidfile)
    assert out["name"] == "j" and out["seconds"] >= 0, out
    pid = out["pid"]
    work.pids.add(pid)
    assert int(pidfile.read_text().strip()) == pid
    restored_continues(job, at_dump, pid)


def test_restore_in_the_foreground_waits_and_exits_with_the_jobs_status(work):
    job = work.start_job("counter", mib=4, extra=["--exit-at", "300", "--exit-code", "7"], wait_count=20)
    work.dump(job.pid, "fg")
    at_dump = job.status()
    assert at_dump["count"] < 300, "the job ran out before the dump; raise --exit-at"
    proc = work.dvr("proc", "restore", "fg", expect=None, timeout=120)
    assert proc.returncode == 7, describe(proc)
    last = job.status()
    assert last["id"] == at_dump["id"] and last["count"] >= at_dump["count"], (at_dump, last)
    work.assert_nothing_new_running(set(), "after the restored job exited")


def test_waiting_restore_does_not_keep_the_images_while_the_job_runs(work):
    """restore without --detach waits for the restored job; the rebuilt CRIU
    images (a full copy of the job's memory; in RAM when the store is on
    tmpfs) must not stay in STORE/proc-work for as long as the job runs (days,
    for a training job): they are useless once CRIU returned."""
    job = work.start_job("counter", mib=8)
    work.dump(job.pid, "c")
    job.forget()
    waiter = subprocess.Popen([work.dvr_bin, "--store", str(work.store), "proc", "restore", "c"],
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    work.children.append(waiter)
    try:
        job.wait(what="the restored job's first report")
        # dvr removes them right after CRIU returns, which the job may beat
        # to its first report by a few milliseconds.
        deadline = time.time() + 10
        while time.time() < deadline and any(p.is_dir() for p in (work.store / "proc-work").iterdir()):
            time.sleep(0.05)
        left = [p.name for p in (work.store / "proc-work").iterdir() if p.is_dir()]
        held = sum(f.stat().st_size for p in (work.store / "proc-work").iterdir() if p.is_dir() for f in p.iterdir())
        assert not left, f"while the restored job runs, {held} bytes of images stay in proc-work: {left}"
    finally:
        work.kill_all()


# --- Python / numpy

def test_python_numpy_job(work):
    job = work.start_job("py", mib=16, wait_count=20)
    job.mutate()
    info = work.dump(job.pid, "py")
    assert info["image_bytes"] >= 16 * MIB, info
    at_dump = job.status()
    pid = work.restore("py")
    restored_continues(job, at_dump, pid, gen=1)
    job.pid = pid
    job.assert_intact(job.mutate(), gen=2)


# --- the DVR persistent heap and the plugin

HEAP_MIB = 64


def heap_file(work):
    return work.store / "heaps" / "job" / "heap"


def test_heap_job_leave_running_then_restore_shows_the_dump_time_heap(work):
    job = work.start_job("heap", mib=HEAP_MIB, wait_count=20)
    before = job.status()  # the count at the freeze is at least this
    info = work.dump(job.pid, "h1", leave_running=True)
    heap_bytes = HEAP_MIB * MIB
    assert [(h["path"].endswith("heaps/job/heap"), h["bytes"]) for h in info["heaps"]] == [(True, heap_bytes)], (
        f"the dump must list the heap {heap_file(work)}: {info}")
    assert info["image_bytes"] < heap_bytes / 4, (
        f"the heap must be recorded by reference, not copied through CRIU's images: {info}")
    assert alive(job.pid)
    after = job.wait_next(job.status())  # frozen during the dump, it runs on
    assert after["gen"] == 0

    # The original keeps writing its heap after the dump.
    job.assert_intact(job.mutate(), gen=1)
    job.assert_intact(job.mutate(), gen=2)
    os.kill(job.pid, signal.SIGKILL)
    assert wait_gone(job.pid)
    job.forget()

    pid = work.restore("h1")
    first = job.wait(what="the restored job's report")
    assert first["id"] == before["id"] and first["count"] >= before["count"], (before, first)
    job.assert_intact(first, gen=0)
    job.pid = pid
    job.assert_intact(job.mutate(), gen=1)
    work.assert_private()
    work.verify()


def test_heap_dump_without_leave_running_and_restore(work):
    job = work.start_job("heap", mib=16, wait_count=20)
    job.assert_intact(job.mutate(), gen=1)
    work.dump(job.pid, "h")
    at_dump = job.status()
    pid = work.restore("h")
    restored_continues(job, at_dump, pid, gen=1)


def inside_snapshot(job, pid, number):
    """SIGHUP: the heap job snapshots its session from inside as inside-NUMBER."""
    os.kill(pid, signal.SIGHUP)
    s = job.wait(lambda s: s.get("snap") == f"inside-{number}" or "snap-error" in s,
                 what=f"the job's snapshot inside-{number}")
    assert s.get("snap") == f"inside-{number}", f"the job's own snapshot failed: {s}"
    return s


@pytest.mark.parametrize("tracking", ["hash", "write_protect"])
def test_a_restored_heap_job_still_snapshots_its_own_writes(work, tracking):
    """The SDK inside a restored job goes on working: a snapshot it takes after
    the restore records exactly the pages it wrote since its previous one,
    with either write-tracking mechanism (write_protect: a userfaultfd that
    CRIU dumped and restored)."""
    mib = 16
    job = work.start_job("heap", mib=mib, extra=["--tracking", tracking], wait_count=10)
    inside_snapshot(job, job.pid, 1)
    work.dump(job.pid, "inside")
    at_dump = job.status()
    pid = work.restore("inside")
    restored_continues(job, at_dump, pid, gen=0)
    job.pid = pid
    job.assert_intact(job.mutate(), gen=1)
    inside_snapshot(job, pid, 2)
    changed = run([work.job_bin, "expect", "--mib", mib, "--gen", 1, "--pages"], expect=0).stdout.split()
    diff = work.dvr_json("diff", "job/inside-1", "job/inside-2")
    heap = [r for r in diff["regions"] if r["name"] == "heap"]
    assert heap and heap[0]["pages_differ"] == len(changed), (
        f"the snapshot taken after the restore should differ from the one before in the {len(changed)} "
        f"pages mutation 1 wrote: {diff}")
    job.assert_intact(job.status(), gen=1)


@pytest.mark.parametrize("mode", ["counter", "heap"])
def test_clone_runs_beside_the_original_with_private_memory(work, mode):
    job = work.start_job(mode, mib=16, wait_count=20)
    before = job.status()  # the count at the freeze is at least this
    work.dump(job.pid, "orig", leave_running=True)
    original = job.pid
    assert job.wait_next(before)["gen"] == 0
    # The original moves on before the clone is made: the clone must show the dump.
    job.assert_intact(job.mutate(), gen=1)

    clone_out = work.dvr_json("proc", "clone", "orig")
    assert clone_out["name"] == "orig" and clone_out["seconds"] >= 0, clone_out
    clone = clone_out["pid"]
    work.pids.add(clone)
    assert alive(clone) and alive(original) and clone != original
    assert pid_namespace(clone) not in (pid_namespace(original), pid_namespace(os.getpid()))
    assert ns_pid(clone)[-1] == 1

    # Both write the same status file until told apart.
    orig_file, clone_file = work.path("original.status"), work.path("clone.status")
    o = job.redirect(original, orig_file)
    c = job.redirect(clone, clone_file)
    assert o["id"] == c["id"] == before["id"]
    job.assert_intact(o, gen=1)
    job.assert_intact(c, gen=0)
    assert c["count"] >= before["count"]

    # Both count.
    job.wait(lambda s: s["count"] >= o["count"] + 10, path=orig_file, what="the original counting")
    job.wait(lambda s: s["count"] >= c["count"] + 10, path=clone_file, what="the clone counting")

    # A change in the clone does not show in the original, and the other way round.
    os.kill(clone, signal.SIGUSR1)
    c2 = job.wait(lambda s: s["gen"] == 1, path=clone_file, what="the clone's generation 1")
    job.assert_intact(c2, gen=1)
    os.kill(clone, signal.SIGUSR1)
    c3 = job.wait(lambda s: s["gen"] == 2, path=clone_file, what="the clone's generation 2")
    job.assert_intact(c3, gen=2)
    o2 = job.wait(lambda s: s["seq"] >= o["seq"] + 2, path=orig_file, what="fresh reports of the original")
    job.assert_intact(o2, gen=1)
    os.kill(original, signal.SIGUSR1)
    o3 = job.wait(lambda s: s["gen"] == 2, path=orig_file, what="the original's generation 2")
    job.assert_intact(o3, gen=2)
    os.kill(original, signal.SIGUSR1)
    o4 = job.wait(lambda s: s["gen"] == 3, path=orig_file, what="the original's generation 3")
    job.assert_intact(o4, gen=3)
    c4 = job.wait(lambda s: s["seq"] >= c3["seq"] + 2, path=clone_file, what="fresh reports of the clone")
    job.assert_intact(c4, gen=2)

    # A second clone of the same snapshot, while both run (it writes the first status file).
    job.forget()
    second = work.clone("orig")
    job.assert_intact(job.wait(what="the second clone's report"), gen=0)
    assert alive(second) and alive(clone) and alive(original)


def test_five_dump_restore_cycles_each_continue_from_the_last(work):
    job = work.start_job("counter", mib=8, wait_count=10)
    dumped = []
    for cycle in range(1, 6):
        job.assert_intact(job.mutate(), gen=cycle)
        work.dump(job.pid, f"cyc{cycle}")
        at_dump = job.status()
        if dumped:
            assert at_dump["count"] > dumped[-1]["count"]
        dumped.append(at_dump)
        pid = work.restore(f"cyc{cycle}")
        first = restored_continues(job, at_dump, pid, gen=cycle)
        job.pid = pid
        job.wait_count(first["count"] + 40)
    names = [e["name"] for e in work.proc_ls()]
    assert names == [f"cyc{i}" for i in range(1, 6)], names

    # Any of them can be restored again: back to cycle 2.
    os.kill(job.pid, signal.SIGKILL)
    assert wait_gone(job.pid)
    job.forget()
    pid = work.restore("cyc2")
    first = job.wait(what="cycle 2's job again")
    assert dumped[1]["count"] <= first["count"] < dumped[2]["count"], (dumped, first)
    job.assert_intact(first, gen=2)
    assert alive(pid)
    work.verify()


def test_second_dump_of_the_same_job_stores_only_what_changed(work):
    """The job changes 1% of its buffer between two dumps, and like any program
    allocates a little on the way (dvr-test-job keeps a 12 KiB record on its
    malloc heap per mutation): CRIU's page image then holds 3 more pages before
    the buffer, so every later page sits 12 KiB further into pages-N.img than
    in the first dump. Deduplication has to match pages by what they are (or
    by virtual address, from pagemap-N.img), not by their offset in the image."""
    mib = 64
    job = work.start_job("counter", mib=mib, wait_count=10)
    first = work.dump(job.pid, "d1", leave_running=True)
    assert first["stored_bytes"] >= 0.9 * mib * MIB, f"the first dump must store the buffer: {first}"
    job.assert_intact(job.mutate(), gen=1)  # 1% of the pages
    second = work.dump(job.pid, "d2", leave_running=True)
    assert second["image_bytes"] >= mib * MIB, second
    assert second["stored_bytes"] <= 0.05 * first["stored_bytes"], (
        f"the second dump added {second['stored_bytes']} bytes, more than 5% of the first's "
        f"{first['stored_bytes']}")
    listed = {e["name"]: e for e in work.proc_ls()}
    assert listed["d2"]["stored_bytes"] == second["stored_bytes"], listed

    # Both restore exactly, deduplicated or not.
    os.kill(job.pid, signal.SIGKILL)
    assert wait_gone(job.pid)
    job.forget()
    pid = work.restore("d2")
    job.assert_intact(job.wait(what="d2 restored"), gen=1)
    os.kill(pid, signal.SIGKILL)
    assert wait_gone(pid)
    job.forget()
    work.restore("d1")
    job.assert_intact(job.wait(what="d1 restored"), gen=0)
    work.verify()


# --- errors

def test_unknown_snapshot_is_named(work):
    job = work.start_job("counter", mib=4, wait_count=5)
    work.dump(job.pid, "there", leave_running=True)  # the store exists and holds something
    for verb in (["proc", "restore", "nosuch", "--detach"], ["proc", "clone", "nosuch"], ["proc", "rm", "nosuch"]):
        before = work.running()
        proc = work.dvr(*verb, expect=None)
        assert_dvr_error(proc, r"nosuch", r"not found|no (such )?(process )?snapshot|does not exist|unknown",
                         context=" ".join(verb))
        work.assert_nothing_new_running(before, " ".join(verb))
    assert [e["name"] for e in work.proc_ls()] == ["there"]
    # rm checks every name before removing any.
    assert_dvr_error(work.dvr("proc", "rm", "there", "nosuch", expect=None), r"nosuch")
    assert [e["name"] for e in work.proc_ls()] == ["there"]


def test_dump_of_a_pid_that_does_not_exist(work):
    job = work.start_job("counter", mib=4, wait_count=5)
    work.dump(job.pid, "first", leave_running=True)
    pid = free_pid()
    proc = work.dvr("proc", "dump", pid, "--name", "ghost", expect=None)
    assert_dvr_error(proc, str(pid))
    assert [e["name"] for e in work.proc_ls()] == ["first"]
    work.verify()


def test_restore_while_the_original_still_holds_its_pid_is_refused(work):
    """A job started without `dvr run` lives in the caller's PID namespace: CRIU
    must give the restored process its old PID, so the restore waits for the
    original to be gone."""
    job = work.start_job("counter", mib=8, wait_count=10, plain=True)
    assert ns_pid(job.pid) == [job.pid]
    work.dump(job.pid, "busy", leave_running=True)
    job.assert_intact(job.mutate(), gen=1)
    before = work.running()
    proc = work.dvr("proc", "restore", "busy", "--detach", expect=None)
    assert_dvr_error(proc, rf"\b{job.pid}\b", r"in use|running")
    work.assert_nothing_new_running(before, "after the refused restore")
    seq = job.status()["seq"]
    job.assert_intact(job.wait(lambda s: s["seq"] >= seq + 2, what="fresh reports of the original"), gen=1)
    work.verify()
    # Once it is gone (and reaped), the restore works and the job has its PID again.
    job.popen.kill()
    job.popen.wait(timeout=30)
    job.forget()
    pid = work.restore("busy")
    assert pid == job.pid, f"restored as pid {pid}, dumped as {job.pid}"
    job.assert_intact(job.wait(what="the restored job"), gen=0)


def test_restore_while_the_original_maps_its_heap_is_refused(work):
    """Restoring a heap job puts its heap file back; with the original still
    running on that file, that would change its memory under it: refused."""
    job = work.start_job("heap", mib=8, wait_count=10)
    work.dump(job.pid, "busy", leave_running=True)
    job.assert_intact(job.mutate(), gen=1)
    before = work.running()
    proc = work.dvr("proc", "restore", "busy", "--detach", expect=None)
    assert_dvr_error(proc, rf"\b{job.pid}\b|running|in use")
    work.assert_nothing_new_running(before, "after the refused restore")
    # The original was not disturbed: its heap file still holds its own generation 1.
    seq = job.status()["seq"]
    job.assert_intact(job.wait(lambda s: s["seq"] >= seq + 2, what="fresh reports of the original"), gen=1)
    assert alive(job.pid)
    work.verify()
    # Once it is gone, the restore works.
    os.kill(job.pid, signal.SIGKILL)
    assert wait_gone(job.pid)
    job.forget()
    work.restore("busy")
    job.assert_intact(job.wait(what="the restored job"), gen=0)


def largest_data_extent(path):
    """(offset, length) of the longest data run of a sparse file past its first page."""
    best = (0, 0)
    for start, end in data_extents(path, 4096):
        if end - start > best[1]:
            best = (start, end - start)
    return best


@pytest.mark.parametrize("damage", ["flipped byte", "pack deleted"])
def test_damaged_image_is_refused_and_nothing_is_half_restored(work, damage):
    job = work.start_job("counter", mib=8, wait_count=10)
    work.dump(job.pid, "dmg")
    packs = work.pack_files()
    assert packs, f"no pack files in {work.store / 'packs'}"
    if damage == "flipped byte":
        pack = max(packs, key=lambda p: largest_data_extent(p)[1])
        offset, length = largest_data_extent(pack)
        assert length > 0, f"no data in {pack}"
        # Space reserved for a snapshot but left unused (its chunk was found
        # stored already) also reads as data: flip bytes from the middle on
        # until `dvr verify` sees the damage, i.e. the byte belongs to the
        # snapshot.
        def flip(at):
            with open(pack, "r+b") as f:
                f.seek(at)
                b = f.read(1)
                f.seek(at)
                f.write(bytes([b[0] ^ 0x40]))
        step = max(4096, length // 64)
        candidates = [offset + length // 2 + k * step for k in range(64)] + [offset + k * step for k in range(64)]
        for at in (a for a in candidates if offset <= a < offset + length):
            flip(at)
            if work.dvr("verify", expect=None).returncode != 0:
                break
            flip(at)  # not referenced: put it back
        else:
            pytest.fail(f"no byte of {pack} that the snapshot references was found to damage")
        patterns = [r"corrupt|checksum"]
    else:
        for p in packs:
            p.unlink()
        patterns = [r"missing|not found|no such|corrupt|damaged|cannot"]
    before = work.running()
    proc = work.dvr("proc", "restore", "dmg", "--detach", expect=None)
    assert_dvr_error(proc, *patterns, context=damage)
    work.assert_nothing_new_running(before, f"after restoring a snapshot with a {damage}")
    work.verify(expect=1)
    clone = work.dvr("proc", "clone", "dmg", expect=None)
    assert_dvr_error(clone, *patterns, context=f"clone, {damage}")
    work.assert_nothing_new_running(before, f"after cloning a snapshot with a {damage}")


def test_missing_plugin_is_named_at_dump_and_at_restore(work, tmp_path):
    empty = tmp_path / "no-plugins"
    empty.mkdir()
    no_plugin = {"DVR_CRIU_PLUGIN_DIR": str(empty)}
    job = work.start_job("heap", mib=16, wait_count=10)

    # Without the plugin the heap cannot be made consistent: the dump is refused
    # and the job keeps running untouched.
    proc = work.dvr("proc", "dump", job.pid, "--name", "nop", expect=None, env=no_plugin)
    assert_dvr_error(proc, r"plugin")
    assert alive(job.pid)
    job.assert_intact(job.wait_next(job.status()), gen=0)
    assert "nop" not in [e["name"] for e in work.proc_ls()]

    # Dumped with it, restored without it: refused, nothing half-restored.
    work.dump(job.pid, "withp")
    at_dump = job.status()
    before = work.running()
    proc = work.dvr("proc", "restore", "withp", "--detach", expect=None, env=no_plugin)
    assert_dvr_error(proc, r"plugin")
    work.assert_nothing_new_running(before, "after a restore without the plugin")
    work.verify()
    pid = work.restore("withp")
    restored_continues(job, at_dump, pid, gen=0)


@pytest.mark.parametrize("change", ["overwritten", "truncated", "deleted"])
def test_heap_file_changed_behind_the_plugins_back(work, change):
    """The heap file is changed after the dump by someone other than the job. The
    restore either puts it back to exactly the dump-time content or refuses
    with a message about the heap and starts nothing; it never runs the job on
    the changed heap."""
    job = work.start_job("heap", mib=16, wait_count=10)
    job.assert_intact(job.mutate(), gen=1)
    work.dump(job.pid, "hb")
    at_dump = job.status()
    heap = heap_file(work)
    if change == "overwritten":
        with open(heap, "r+b") as f:
            for page in range(0, 16 * MIB, 97 * 4096):
                f.seek(page)
                f.write(os.urandom(4096))
    elif change == "truncated":
        os.truncate(heap, 8 * MIB)
    else:
        heap.unlink()
    before = work.running()
    proc = work.dvr("proc", "restore", "hb", "--detach", expect=None)
    if proc.returncode == 0:
        pid = int(proc.stdout.strip())
        work.pids.add(pid)
        restored_continues(job, at_dump, pid, gen=1)
        assert os.path.getsize(heap) == 16 * MIB
    else:
        assert_dvr_error(proc, r"heap", context=f"heap file {change}")
        work.assert_nothing_new_running(before, f"after refusing a heap file {change}")
    work.verify()


# --- failures part way through a dump or restore leave the job, its heaps and the store as they were

# Runs argv[1:] with an unconnected TCP socket inherited: CRIU 4.1 cannot dump
# it on Linux >= 6.16 (a dump that fails after the plugin took its heap
# snapshots). Where CRIU can dump it, the dump succeeds and the test says so.
# A connected TCP connection (both ends in the job), which CRIU refuses to
# dump without --tcp-established: a dump that fails inside CRIU.
WITH_TCP_SOCKET = ("import os, socket, sys; l = socket.socket(); l.bind(('127.0.0.1', 0)); l.listen(1); "
                   "c = socket.create_connection(l.getsockname()); a, _ = l.accept(); "
                   "[os.set_inheritable(x.fileno(), True) for x in (l, c, a)]; "
                   "os.execv(sys.argv[1], sys.argv[1:])")


def heap_job(work, name, mib=4, wrapper=(), cwd=None, extra=()):
    """dvr-test-job in heap mode (session job, region heap of the test's store), via `dvr run`."""
    status, output = work.path(f"{name}.status"), work.path(f"{name}.out")
    argv = [*wrapper, work.job_bin, "heap", "--mib", mib, "--status", status, "--store", work.store, *extra]
    args = ["run", "--output", output, *(["--cwd", cwd] if cwd else []), "--", *argv]
    pid = work._started(work.dvr_unstored(*args))
    job = Job(work, "c", mib, status, output, pid)
    job.assert_intact(job.wait_count(5, timeout=60), gen=0)
    return job


def sigkill(pid):
    os.kill(pid, signal.SIGKILL)
    assert wait_gone(pid)


def test_failed_dump_leaves_the_existing_snapshot_and_its_heap_intact(work):
    """The plugin snapshots the heap (SESSION/proc.NAME) while CRIU runs, and
    CRIU may still fail after that. Then nothing of the failed dump may stay:
    no process snapshot, no heap snapshot; the existing process snapshot of
    the same heap keeps its own heap snapshot byte for byte and restores with
    it; the job keeps running; and the error says what to do."""
    a = heap_job(work, "a")
    work.dump(a.pid, "snap", leave_running=True)
    manifest = work.store / "sessions" / "job" / "proc.snap.snap"
    before = manifest.read_bytes()
    sigkill(a.pid)

    # Another job on the same heap, which CRIU refuses to dump (a connected
    # TCP connection, without --tcp-established).
    b = heap_job(work, "b", wrapper=(PYTHON, "-c", WITH_TCP_SOCKET))
    b.mutate()
    proc = work.dvr("proc", "dump", b.pid, "--name", "other", expect=None)
    assert proc.returncode != 0, "CRIU dumped a job holding a connected TCP connection without --tcp-established"
    assert "--tcp-established" in proc.stderr, proc.stderr
    assert alive(b.pid), "the failed dump did not leave the job running:\n" + proc.stderr
    sigkill(b.pid)
    listed = work.dvr("proc", "ls").stdout
    assert "other" not in listed, "the failed dump left a process snapshot:\n" + listed
    assert not list((work.store / "sessions" / "job").glob("proc.other*")), "the failed dump left its heap snapshot behind"
    assert manifest.read_bytes() == before, "the failed dump changed the heap snapshot job/proc.snap of 'snap'"

    a.forget()
    pid = work.restore("snap")
    s = a.wait(what="the restored job's report")
    sigkill(pid)
    a.assert_intact(s, gen=0)


def test_dump_does_not_hang_when_the_job_is_inside_a_snapshot(work):
    """While a job's session is inside Session::snapshot() it holds the store's
    lock (exclusively, until after publish_notes()). CRIU may freeze the job
    there; the plugin's snapshot_heaps() must not wait for that lock forever
    (`dvr proc dump` would never return and the job would stay frozen). The
    job is parked inside publish_notes() here (its note's temporary file is a
    FIFO nobody opens), which a freeze can hit by chance in any job that
    snapshots."""
    job = heap_job(work, "a", extra=("--tracking", "write_protect"))
    heap = work.store / "heaps" / "job" / "heap"
    fifo = heap.parent / f".heap.track.tmp{ns_pid(job.pid)[-1]}"
    os.mkfifo(fifo, 0o600)
    os.kill(job.pid, signal.SIGHUP)  # the job snapshots its session; blocks holding the store lock
    try:
        proc = work.dvr("proc", "dump", job.pid, "--name", "x", "--leave-running", expect=None, timeout=45)
        hung = False
    except subprocess.TimeoutExpired:
        hung = True
    finally:
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # let the job go on
        os.close(fd)
    assert not hung, "`dvr proc dump` did not return within 45 s (the plugin gives up on the lock after 5 s): it waits for the store lock the frozen job holds"
    assert alive(job.pid), proc.stderr


def test_restore_that_cannot_write_its_pid_file_leaves_nothing_running(work):
    """When the --pidfile cannot be written, dvr exits with an error ("cannot
    write PID file"); the restored job must not run on then, since the caller,
    told the restore failed, does not know its PID (the file is opened before
    CRIU runs, or the restored tree killed on that failure)."""
    job = work.start_job("counter", mib=4)
    work.dump(job.pid, "c")
    before = work.running()
    proc = work.dvr("proc", "restore", "c", "--detach", "--pidfile", work.path("no-such-dir") / "job.pid", expect=None)
    if proc.returncode != 0:
        work.assert_nothing_new_running(before, f"restore failed (exit {proc.returncode}: {proc.stderr.strip()})")


def test_failed_restore_leaves_the_heap_file_as_it_was(work):
    """The plugin's init(RESTORE) puts every heap file back to its dump-time
    content before CRIU restores anything. When CRIU then fails, the heap file
    must be as it was: whatever the (dead) job had written since the dump, the
    point of a persistent heap, would be lost, though dvr reports a failed
    restore ("nothing of it is left running") and docs/criu.md promises that
    nothing is half-done. Here CRIU fails because the job's working directory
    is gone."""
    cwd = work.path("cwd")
    cwd.mkdir()
    job = heap_job(work, "a", cwd=cwd)
    work.dump(job.pid, "snap", leave_running=True)
    job.mutate()  # the heap file moves on after the dump
    sigkill(job.pid)
    heap = work.store / "heaps" / "job" / "heap"
    before = heap.read_bytes()
    cwd.rmdir()
    proc = work.dvr("proc", "restore", "snap", "--detach", expect=None)
    assert proc.returncode != 0, "expected CRIU to fail without the job's working directory:\n" + proc.stdout
    assert heap.read_bytes() == before, "a failed restore rewrote the heap file:\n" + proc.stderr


def test_failed_import_without_leave_running_does_not_lose_the_job(work):
    """Without --leave-running CRIU kills the tree once it has written the
    images, and only then does dvr import them into the store. When the import
    fails (here: the store's file system fills up), the job must not be gone
    with its only copy deleted. docs/criu.md: "A failed dump adds nothing to
    the store ... and leaves the process running" (dvr dumps with
    --leave-running always and kills the tree after the snapshot is
    committed)."""
    small = work.path("small")
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "none", str(small)], check=True)
    try:
        work.store = small / "store"  # no room for the job's 16 MiB
        job = work.start_job("counter", mib=16)
        proc = work.dvr("proc", "dump", job.pid, "--name", "a", expect=None)
        assert proc.returncode != 0, "a 16 MiB job was stored in a 12 MiB file system"
        assert alive(job.pid), ("the dump failed after CRIU had killed the job, and its images were deleted:\n"
                                + proc.stderr)
        assert "a" not in work.dvr("proc", "ls").stdout.split()
    finally:
        work.kill_all()
        subprocess.run(["umount", "-l", str(small)])


# --- listing and removing

def test_proc_ls_rm_and_the_region_commands_still_work(work):
    started = time.time_ns()
    a = work.start_job("counter", mib=4, wait_count=5)
    b = work.start_job("heap", mib=8, wait_count=5)
    work.dump(a.pid, "alpha", leave_running=True)
    work.dump(b.pid, "beta")
    beta_at_dump = b.status()
    listed = work.proc_ls()
    assert [e["name"] for e in listed] == ["alpha", "beta"], listed
    for e, job in zip(listed, (a, b)):
        for key in ("name", "time_ns", "pid", "command", "image_bytes", "stored_bytes", "heaps"):
            assert key in e, f"proc ls --json lacks {key!r}: {e}"
        assert e["pid"] == job.pid and "dvr-test-job" in e["command"], e
        assert started <= e["time_ns"] <= time.time_ns() and e["image_bytes"] > 0, e
    assert listed[0]["heaps"] == [] and len(listed[1]["heaps"]) == 1, listed
    text = work.dvr("proc", "ls").stdout
    assert "alpha" in text and "beta" in text, text

    # The store's own commands see a store with process snapshots in it.
    work.dvr("ls")
    assert isinstance(work.dvr_json("ls")["snapshots"], list)
    work.dvr_json("stat")
    work.verify()

    work.dvr("proc", "rm", "alpha")
    assert [e["name"] for e in work.proc_ls()] == ["beta"]
    assert_dvr_error(work.dvr("proc", "restore", "alpha", "--detach", expect=None), r"alpha")
    work.dvr("gc")
    work.verify()
    pid = work.restore("beta")  # still whole after rm + gc of the other
    restored_continues(b, beta_at_dump, pid, gen=0)
    work.dvr("proc", "rm", "beta")
    assert work.proc_ls() == []
    work.dvr("gc")
    work.verify()
    assert alive(a.pid), "rm must not touch a running job"


# --- a real server

def redis_cli(target, *args, stdin=None, timeout=60):
    proc = subprocess.run([REDIS_CLI, *target, *[str(a) for a in args]], input=stdin, capture_output=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"redis-cli {args} -> {proc.returncode}: {proc.stdout[-2000:]!r} {proc.stderr[-2000:]!r}"
    return proc.stdout.decode().strip()


def wait_redis(target, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        proc = subprocess.run([REDIS_CLI, *target, "ping"], capture_output=True, text=True, timeout=10)
        if proc.stdout.strip() == "PONG":
            return
        time.sleep(0.05)
    raise AssertionError(f"redis-server at {target} did not answer within {timeout} s")


def resp(*words):
    out = [f"*{len(words)}\r\n".encode()]
    for w in words:
        b = w if isinstance(w, bytes) else str(w).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


def value_of(i):
    return f"value-{i}-" + "x" * (i % 61)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_redis_server_keeps_its_data_across_dump_and_restore(work, transport):
    if not (os.access(REDIS_SERVER, os.X_OK) and os.access(REDIS_CLI, os.X_OK)):
        pytest.skip(f"{REDIS_SERVER} or {REDIS_CLI} is missing (install-deps.sh installs redis-server)")
    if transport == "tcp" and not criu_dumps_inet_sockets():
        pytest.skip(f"CRIU {'.'.join(map(str, criu_version()))} cannot dump TCP sockets on Linux "
                    f"{'.'.join(map(str, kernel_version()))} (getsockopt SO_PASSCRED fails on inet sockets "
                    f"since 6.16; fixed in CRIU 4.2); the unix-socket variant covers the server")
    argv = [REDIS_SERVER, "--save", "", "--appendonly", "no", "--daemonize", "no", "--dir", work.root]
    if transport == "unix":
        sock = work.path("redis.sock")
        argv += ["--port", "0", "--unixsocket", sock, "--unixsocketperm", "700"]
        target = ["-s", str(sock)]
    else:
        port = free_port()
        argv += ["--port", port, "--bind", "127.0.0.1"]
        target = ["-p", str(port)]
        work.tokens.add(f"127.0.0.1:{port}")  # redis-server renames its command line
    output = work.path("redis.out")
    pid = work.dvr_run(argv, output)
    wait_redis(target)

    n = 50000
    load = b"".join(resp("SET", f"key:{i}", value_of(i)) for i in range(n))
    load += resp("RPUSH", "list", *range(1000))
    big = os.urandom(1 << 20)
    load += resp("SET", "big", big)
    out = redis_cli(target, "--pipe", stdin=load, timeout=120)
    assert "errors: 0" in out, out
    assert redis_cli(target, "DBSIZE") == str(n + 2)

    info = work.dump(pid, "redis")
    assert info["image_bytes"] > 4 * MIB, info
    with pytest.raises(AssertionError):
        wait_redis(target, timeout=1)

    restored = work.restore("redis")
    wait_redis(target)
    assert redis_cli(target, "DBSIZE") == str(n + 2)
    for i in (0, 1, 2, 4242, 31337, n - 1):
        assert redis_cli(target, "GET", f"key:{i}") == value_of(i)
    assert redis_cli(target, "LLEN", "list") == "1000"
    assert redis_cli(target, "LINDEX", "list", "999") == "999"
    assert redis_cli(target, "STRLEN", "big") == str(len(big))
    raw = subprocess.run([REDIS_CLI, *target, "--raw", "GET", "big"], capture_output=True).stdout
    assert raw[:len(big)] == big
    # It serves writes too.
    assert redis_cli(target, "SET", "after", "restore") == "OK"
    assert redis_cli(target, "GET", "after") == "restore"
    assert alive(restored)


def test_dump_of_dvrs_own_ancestor_or_of_a_thread_is_refused_at_once(work):
    """CRIU would freeze dvr itself with an ancestor (a hang: it waits for
    dvr's page server); a thread id names no process tree (CRIU stops on an
    internal BUG)."""
    proc = run(["bash", "-c", f'exec "{work.dvr_bin}" --store "{work.store}" proc dump $PPID --name self --leave-running'],
               expect=2, timeout=60)
    assert "dvr itself or one of its ancestors" in proc.stderr, describe(proc)
    threaded = subprocess.Popen([PYTHON, "-c", "import threading, time\n"
                                 "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\ntime.sleep(600)"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    work.children.append(threaded)
    work.pids.add(threaded.pid)
    deadline = time.monotonic() + 30
    while len(os.listdir(f"/proc/{threaded.pid}/task")) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    tid = next(int(t) for t in os.listdir(f"/proc/{threaded.pid}/task") if int(t) != threaded.pid)
    proc = work.dvr("proc", "dump", tid, "--name", "th", "--leave-running", expect=2)
    assert f"it is a thread of process {threaded.pid}" in proc.stderr, describe(proc)
    assert work.proc_ls() == []


def test_ctrl_c_to_a_foreground_restore_reaches_the_job(work):
    """A restore that waits for its job passes SIGINT/SIGTERM on to it, like a
    program run in the foreground: Ctrl-C used to end dvr and leave the job
    running detached."""
    job = work.start_job("counter", mib=4, wait_count=5)
    work.dump(job.pid, "fg")
    pidfile = work.path("fg.pid")
    with popen_killed_at_end([str(work.dvr_bin), "--store", str(work.store), "proc", "restore", "fg", "--pidfile", str(pidfile)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (pidfile.exists() and pidfile.read_text().strip()):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.02)
        pid = int(pidfile.read_text())
        work.pids.add(pid)
        job.wait_next(job.status())  # running
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT, (proc.returncode, err)
    assert wait_gone(pid), "the job outlived the restore it was waited for by"


def test_run_from_a_removed_working_directory_is_refused(work):
    """CRIU cannot dump a process whose working directory is gone: `dvr run`
    says so before anything starts, instead of a job no dump can take."""
    gone = work.path("gone")
    gone.mkdir()
    proc = run(["bash", "-c", f'cd "{gone}" && rmdir "{gone}" && exec "{work.dvr_bin}" run -- /bin/sleep 600'], expect=2)
    assert "working directory was removed" in proc.stderr and "--cwd" in proc.stderr, describe(proc)
