"""Review of the whole-process snapshot feature (issue #5): regression tests
for bugs found in `dvr proc dump|restore` (libdvr/src/proc.cpp), the CRIU
plugin (criu-plugin/dvr_plugin.cpp) and the heap snapshots it takes
(libdvr/src/proc_heaps.cpp). Real CRIU, small jobs (4 MiB).

Run: DVR_BIN=build/dvr DVR_TEST_JOB=build/dvr-test-job /usr/bin/python3 -m pytest -q tests/proc/test_review.py
"""

import os
import signal
import subprocess
import time

from conftest import PYTHON, Job, alive, ns_pid, wait_gone

# Runs argv[1:] with an unconnected TCP socket inherited: CRIU 4.1 cannot dump
# it on Linux >= 6.16 (a dump that fails after the plugin took its heap
# snapshots). Where CRIU can dump it, the dump succeeds and the test says so.
WITH_TCP_SOCKET = ("import os, socket, sys; s = socket.socket(); os.set_inheritable(s.fileno(), True); "
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


def kill(pid):
    os.kill(pid, signal.SIGKILL)
    assert wait_gone(pid)


def test_failed_dump_with_replace_leaves_the_existing_snapshot_intact(work):
    """BUG: `dvr proc dump --replace` lets the plugin replace the heap snapshot
    SESSION/proc.NAME while CRIU runs, and on a CRIU failure dvr skips the
    cleanup when --replace is given (proc.cpp: `if (!options.replace)
    drop_heaps()`). The existing process snapshot NAME keeps its old CRIU images
    but its heap snapshot now holds the failed dump's heap: restoring NAME
    brings back the old process with the new heap. (The import failure path,
    catch(...) -> drop_heaps(), is the mirror image: with --replace it deletes
    the heap snapshot the existing NAME still needs.)"""
    a = heap_job(work, "a")
    work.dump(a.pid, "snap", leave_running=True)
    manifest = work.store / "sessions" / "job" / "proc.snap.snap"
    before = manifest.read_bytes()
    kill(a.pid)

    # Another job on the same heap, which CRIU cannot dump (a TCP socket).
    b = heap_job(work, "b", wrapper=(PYTHON, "-c", WITH_TCP_SOCKET))
    b.mutate()
    proc = work.dvr("proc", "dump", b.pid, "--name", "snap", "--replace", "--leave-running", expect=None)
    if proc.returncode == 0:
        import pytest
        pytest.skip("this CRIU dumps TCP sockets; no failing dump to test with")
    kill(b.pid)

    changed = manifest.read_bytes() != before
    # What that means: the restored job has its old memory but the new heap.
    a.forget()
    pid = work.restore("snap")
    s = a.wait(what="the restored job's report")
    kill(pid)
    a.assert_intact(s, gen=0)
    assert not changed, (
        "the failed `dump --replace` changed the heap snapshot job/proc.snap of the existing process snapshot 'snap'\n"
        + proc.stderr)


def test_dump_does_not_hang_when_the_job_is_inside_a_snapshot(work):
    """BUG (hang): while a job's session is inside Session::snapshot() it holds
    the store's lock (exclusively, until after publish_notes()). CRIU freezes
    the job there and the plugin's snapshot_heaps() waits for that lock
    forever: `dvr proc dump` never returns and the job stays frozen. The job is
    parked inside publish_notes() here (its note's temporary file is a FIFO
    nobody opens), which a freeze can hit by chance in any job that
    snapshots."""
    job = heap_job(work, "a", extra=("--tracking", "write_protect"))
    heap = work.store / "heaps" / "job" / "heap"
    fifo = heap.parent / f".heap.track.tmp{ns_pid(job.pid)[-1]}"
    os.mkfifo(fifo, 0o600)
    os.kill(job.pid, signal.SIGHUP)  # the job snapshots its session; blocks holding the store lock
    try:
        proc = work.dvr("proc", "dump", job.pid, "--name", "x", "--leave-running", expect=None, timeout=10)
        hung = False
    except subprocess.TimeoutExpired:
        hung = True
    finally:
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # let the job go on
        os.close(fd)
    assert not hung, "`dvr proc dump` did not return within 10 s: the plugin waits for the store lock the frozen job holds"
    assert alive(job.pid), proc.stderr


def test_restore_that_cannot_write_its_pid_file_leaves_nothing_running(work):
    """BUG: restore() writes --pidfile only after CRIU restored the job. When the
    file cannot be written, dvr exits with an error ("cannot write PID file")
    while the restored job runs on, and the caller, told the restore failed,
    does not know its PID. The PID file should be opened before CRIU runs (or
    the restored tree killed on that failure)."""
    job = work.start_job("counter", mib=4)
    work.dump(job.pid, "c")
    before = work.running()
    proc = work.dvr("proc", "restore", "c", "--detach", "--pidfile", work.path("no-such-dir") / "job.pid", expect=None)
    if proc.returncode != 0:
        work.assert_nothing_new_running(before, f"restore failed (exit {proc.returncode}: {proc.stderr.strip()})")


def test_failed_restore_leaves_the_heap_file_as_it_was(work):
    """BUG: the plugin's init(RESTORE) rewrites every heap file to its dump-time
    content before CRIU restores anything; when CRIU then fails, the heap file
    stays rewritten: whatever the (dead) job had written since the dump — the
    point of a persistent heap — is lost, though dvr reports a failed restore
    ("nothing of it is left running") and docs/criu.md promises that nothing is
    half-done. Here CRIU fails because the job's working directory is gone."""
    cwd = work.path("cwd")
    cwd.mkdir()
    job = heap_job(work, "a", cwd=cwd)
    work.dump(job.pid, "snap", leave_running=True)
    job.mutate()  # the heap file moves on after the dump
    kill(job.pid)
    heap = work.store / "heaps" / "job" / "heap"
    before = heap.read_bytes()
    cwd.rmdir()
    proc = work.dvr("proc", "restore", "snap", "--detach", expect=None)
    assert proc.returncode != 0, "expected CRIU to fail without the job's working directory:\n" + proc.stdout
    assert heap.read_bytes() == before, "a failed restore rewrote the heap file:\n" + proc.stderr


def test_failed_import_without_leave_running_does_not_lose_the_job(work):
    """BUG: without --leave-running CRIU kills the tree when it has written the
    images, and only then does dvr import them into the store. When the import
    fails (here: the store's file system fills up), dump() throws and WorkDir
    deletes the images: the job is gone and so is its only copy. docs/criu.md:
    "A failed dump adds nothing to the store ... and leaves the process
    running". Dump with --leave-running always and kill the tree after the
    snapshot is committed (or keep the images when the import fails)."""
    small = work.path("small")
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "none", str(small)], check=True)
    try:
        work.store = small / "store"  # room for CRIU's images (~8.5 MiB), not for a second copy
        job = work.start_job("counter", mib=8)
        proc = work.dvr("proc", "dump", job.pid, "--name", "a", expect=None)
        if proc.returncode != 0:
            assert alive(job.pid), ("the dump failed after CRIU had killed the job, and its images were deleted:\n"
                                    + proc.stderr)
    finally:
        work.kill_all()
        subprocess.run(["umount", "-l", str(small)])


def test_waiting_restore_does_not_keep_the_images_while_the_job_runs(work):
    """BUG (resource): restore() without --detach waits for the restored job
    inside the scope of its WorkDir, so the rebuilt CRIU images (a full copy of
    the job's memory; in RAM when the store is on tmpfs) stay in
    STORE/proc-work for as long as the job runs — days, for a training job.
    They are useless once CRIU returned: remove them before waiting."""
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
