"""Periodic process dumps (`dvr proc dump PID --every D --keep N`, `dvr run
--dump-every`) and the texts of `dvr proc info / ls / rm`.

A series is NAME-YYYYMMDDTHHMMSSZ; each dump is compared with the previous
one (its `parent`), the newest N are kept, and the dumper stops when the job
exits or on SIGINT/SIGTERM (leaving the job running)."""

import json
import os
import re
import signal
import subprocess
import time

from dvrtest import alive, describe, popen_killed_at_end, wait_gone
from schema_check import check

SERIES = re.compile(r"tick-\d{8}T\d{6}Z(-\d+)?")


def sigkill(pid):
    os.kill(pid, signal.SIGKILL)
    assert wait_gone(pid)


def read_events(proc, want, timeout=120):
    """JSON lines from a running `dvr ... --json` until want(events) is true."""
    events = []
    deadline = time.monotonic() + timeout
    while not want(events):
        assert time.monotonic() < deadline, f"gave up waiting; events so far: {events}"
        line = proc.stdout.readline()
        assert line, f"dvr ended early (status {proc.wait()}): {proc.stderr.read()}; events: {events}"
        doc = json.loads(line)
        check(doc, f"proc_event_{doc['event']}")
        events.append(doc)
    return events


def series(work):
    return [e for e in work.proc_ls() if SERIES.fullmatch(e["name"])]


def test_every_keeps_the_newest_incremental_dumps_and_ends_with_the_job(work):
    job = work.start_job("counter", mib=4, wait_count=5)
    proc = subprocess.Popen([str(work.dvr_bin), "--store", str(work.store), "proc", "dump", str(job.pid), "--name", "tick",
                             "--every", "1s", "--keep", "2", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # With --keep 2 the third dump removes the first.
        events = read_events(proc, lambda ev: any(e["event"] == "removed" for e in ev))
        dumps = [e for e in events if e["event"] == "dump"]
        assert all(SERIES.fullmatch(d["name"]) for d in dumps), dumps
        assert len({d["name"] for d in dumps}) == 3, dumps
        # Each compared with the one before (only what changed is stored).
        assert dumps[1]["parent"] == dumps[0]["name"] and dumps[2]["parent"] == dumps[1]["name"], dumps
        assert all(d["leave_running"] is True for d in dumps), dumps
        removed = [e["name"] for e in events if e["event"] == "removed"]
        assert removed == [dumps[0]["name"]], [(e["event"], e["name"]) for e in events]
        assert alive(job.pid), "a periodic dump stopped the job"
        sigkill(job.pid)
        assert wait_gone(job.pid)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    events += [json.loads(line) for line in out.splitlines()]
    end = events[-1]
    assert end["event"] == "end" and "exited" in end["why"] and end["kept"] == 2, end
    names = [e["name"] for e in events if e["event"] == "dump"]
    assert end["dumps"] == len(names) and end["removed"] == len(names) - 2, events
    assert [e["name"] for e in series(work)] == names[-2:]


def test_every_stops_on_sigterm_and_leaves_the_job_running(work):
    job = work.start_job("counter", mib=4, wait_count=5)
    proc = subprocess.Popen([str(work.dvr_bin), "--store", str(work.store), "proc", "dump", str(job.pid), "--name", "tick",
                             "--every", "1h"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"dumped process {job.pid} as proc/tick-"), line + proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "stopped by" in out and "the process keeps running" in out and "1 dump(s) taken" in out, out
    assert alive(job.pid), "SIGTERM to the dumper reached the job"
    assert len(series(work)) == 1


def test_every_refuses_a_process_that_is_gone_and_bad_values(work):
    job = work.start_job("counter", mib=4, wait_count=5)
    sigkill(job.pid)
    assert wait_gone(job.pid)
    proc = work.dvr("proc", "dump", job.pid, "--name", "tick", "--every", "1s", expect=1)
    assert f"no process {job.pid}" in proc.stderr, describe(proc)
    proc = work.dvr("proc", "dump", "1", "--name", "tick", "--every", "soon", expect=2)
    assert "--every" in proc.stderr and "duration" in proc.stderr, describe(proc)
    proc = work.dvr("proc", "dump", "1", "--name", "tick", "--keep", "2", expect=2)
    assert "--keep goes with --every" in proc.stderr, describe(proc)


def test_run_dump_every_dumps_until_the_job_exits(work):
    status = work.path("runjob.status")
    argv = [str(work.job_bin), "counter", "--mib", "4", "--status", str(status)]
    proc = subprocess.Popen([str(work.dvr_bin), "--store", str(work.store), "run", "--dump-every", "1s", "--keep", "3",
                             "--name", "tick", "--json", "--output", str(work.path("runjob.out")), "--", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        events = read_events(proc, lambda ev: sum(e["event"] == "dump" for e in ev) >= 2)
        pid = events[0]["pid"]
        work.pids.add(pid)
        assert all(e["pid"] == pid for e in events if e["event"] == "dump"), events
        sigkill(pid)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    end = json.loads(out.strip().splitlines()[-1])
    assert end["event"] == "end" and end["dumps"] >= 2, end
    proc = work.dvr("run", "--dump-every", "1s", "--", "true", expect=2)
    assert "--name" in proc.stderr, describe(proc)


def test_proc_info_ls_and_rm_texts(work):
    job = work.start_job("counter", mib=4, wait_count=5)
    work.dump(job.pid, "one", leave_running=True)
    text = work.dvr("proc", "info", "one").stdout
    for what in ("proc/one", "time", "CRIU", "kernel", "heaps", "images", "proc restore one`"):
        assert what in text, text
    info = work.dvr_json("proc", "info", "one")
    check(info, "proc_info")
    assert info["time"].endswith("Z") and info["kernel"], info
    check(work.dvr_json("proc", "ls"), "proc_ls")
    assert info["criu_version"] in text and info["kernel"] in text, text
    assert work.dvr_json("proc", "info", "proc/one")["name"] == "one"  # the form ls and rm print
    job2 = work.start_job("counter", mib=4, wait_count=5)
    proc = work.dvr("run", "--json", "--output", work.path("run2.out"), "--", str(work.job_bin), "counter", "--mib", "4",
                    "--status", str(work.path("run2.status")))
    doc = json.loads(proc.stdout)
    check(doc, "run")
    work.pids.add(doc["pid"])
    work.dump(job2.pid, "two", leave_running=True)
    doc = work.dvr_json("proc", "rm", "proc/two")
    check(doc, "proc_rm")
    assert doc["removed"] == ["two"]
    proc = work.dvr("proc", "rm", "one", "one")
    assert "removed proc/one" in proc.stdout and proc.stdout.count("removed") == 1, describe(proc)
    assert "no process snapshots" in work.dvr("proc", "ls").stdout


def test_a_dvr_run_job_stops_on_sigterm_and_sigint_like_the_program(work):
    """A job is PID 1 of its own namespace, where the kernel drops signals at
    their default disposition; `dvr run` preloads libdvr_init.so so that
    `kill PID` and SIGINT end it as they end the program elsewhere."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        job = work.start_job("counter", mib=4, wait_count=5)
        os.kill(job.pid, sig)
        assert wait_gone(job.pid), f"a `dvr run` job ignored {sig.name}"
    # A program that sets the signal back to SIG_DFL itself (dash does so for
    # SIGTERM as it starts) gets the same handler instead.
    pid = work.dvr_run(["/bin/sh", "-c", "sleep 600; :"], work.path("sh.out"))
    caught = lambda: int(next(l for l in open(f"/proc/{pid}/status") if l.startswith("SigCgt:")).split()[1], 16)
    deadline = time.monotonic() + 30
    while not caught() & (1 << (signal.SIGTERM - 1)) and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(pid, signal.SIGTERM)
    assert wait_gone(pid), "a `dvr run -- /bin/sh -c ...` job ignored SIGTERM"
    # The handler is part of the process: a restored job stops the same way.
    job = work.start_job("counter", mib=4, wait_count=5)
    work.dump(job.pid, "sig")
    pid = work.restore("sig")
    job.wait_next(job.status())  # it runs again
    os.kill(pid, signal.SIGTERM)
    assert wait_gone(pid), "a restored `dvr run` job ignored SIGTERM"


def test_run_dump_every_passes_sigterm_on_to_the_job(work):
    status = work.path("fwd.status")
    argv = [str(work.job_bin), "counter", "--mib", "4", "--status", str(status)]
    proc = subprocess.Popen([str(work.dvr_bin), "--store", str(work.store), "run", "--dump-every", "1h", "--name", "tick",
                             "--output", str(work.path("fwd.out")), "--", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pid = int(proc.stdout.readline())
        work.pids.add(pid)
        line = proc.stdout.readline()
        assert line.startswith(f"dumped process {pid} as proc/tick-"), line + proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "passed on to process" in out, out
    assert wait_gone(pid), "the job kept running after dvr run passed SIGTERM on"


def test_ctrl_c_while_a_dump_of_the_series_runs_is_a_stop_not_a_failure(work):
    """Ctrl-C reaches the whole process group, CRIU included: a dump that it
    cut short ends the series like a stop between dumps (exit 0, the `end`
    event), and the job keeps running."""
    job = work.start_job("counter", mib=256, wait_count=5)
    with popen_killed_at_end([str(work.dvr_bin), "--store", str(work.store), "proc", "dump", str(job.pid), "--name", "tick",
                              "--every", "1h", "--json"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True) as proc:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if subprocess.run(["pgrep", "-g", str(proc.pid), "-x", "criu"], capture_output=True).returncode == 0:
                break
            time.sleep(0.005)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    end = json.loads(out.strip().splitlines()[-1])
    assert end["event"] == "end" and "stopped by" in end["why"], end
    assert alive(job.pid)
    # No failure left for `dvr serve` to show.
    run_dir = work.store / "run"
    assert not run_dir.exists() or not [f for f in run_dir.iterdir() if "last_error" in f.read_text()]


def test_a_series_name_too_long_for_its_dumps_is_refused_before_the_job_starts(work):
    running = work.running()
    proc = work.dvr("run", "--dump-every", "1m", "--name", "p" * 104, "--", str(work.job_bin), "counter", "--mib", "1",
                    "--status", str(work.path("never.status")), expect=2)
    assert "too long" in proc.stderr and "at most 99" in proc.stderr, describe(proc)
    work.assert_nothing_new_running(running, "after the refused dvr run")
    assert not work.path("never.status").exists()
    proc = work.dvr("run", "--dump-every", "infs", "--name", "x", "--", "true", expect=2)
    assert "duration" in proc.stderr, describe(proc)
