"""Crash consistency of autosave, of incremental snapshots of scattered pages
(overlays) and of clones.

The worker's `autosave` mode is an application with autosave on: each step
writes a few scattered bytes and pages, every few steps it takes a named
snapshot, and checkpoint_point() takes "autosave-N" and removes the oldest
autosaves beyond --keep. The content of "autosave-N" and "named-N" is a pure
function of the name (see snapshot_worker.cpp), so `check` verifies any of them
from any process. A restarted worker first restores the session's latest()
snapshot and compares it, as an application recovering from the crash would.

These tests SIGKILL that worker at random moments and then check, from fresh
processes, that the store holds exactly what the printed progress allows,
restores it bit-exact and names the newest snapshot for recovery; and they kill
processes holding clones, and run rm + gc + new snapshots under a live clone.
Set DVR_CRASH_SEED to replay a run; the seed is printed on failure.
"""

import json
import os
import random
import re
import subprocess
import threading
import time
from collections import Counter

import pytest
from dvrtest import describe, kill

SESSION = "auto"
KEEP = 3


def seeded_rng():
    seed = int(os.environ.get("DVR_CRASH_SEED", random.randrange(1 << 31)))
    print(f"DVR_CRASH_SEED={seed}")
    return random.Random(seed), seed


class Worker:
    """A running worker whose stdout lines are collected as they are printed."""

    def __init__(self, store, *args, stdin=subprocess.DEVNULL, env=None):
        self.proc = subprocess.Popen([str(a) for a in store.worker_args(*args)], stdin=stdin, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
        self.lines = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            # The worker writes each line with one write(): a line without its
            # newline can only be one cut by the kill (it never is).
            if line.endswith("\n"):
                self.lines.append(line[:-1])

    def wait_for(self, predicate, timeout=30):
        """Waits until predicate(lines) holds; False if the worker exited or time ran out first."""
        deadline = time.monotonic() + timeout
        while not predicate(self.lines):
            if self.proc.poll() is not None:
                self._reader.join(timeout=30)
                return predicate(self.lines)
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0002)
        return True

    def kill(self):
        """SIGKILLs it; returns (exit status, stdout lines, stderr)."""
        kill(self.proc)
        self._reader.join(timeout=30)
        return self.proc.returncode, self.lines, self.proc.stderr.read()

    def finish(self, timeout=120):
        """Waits for a normal exit; returns the stdout lines."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill(self.proc)
            raise AssertionError(f"worker still running after {timeout} s: {self.proc.args}")
        self._reader.join(timeout=30)
        err = self.proc.stderr.read()
        out = "\n".join(self.lines)
        assert self.proc.returncode == 0, describe(subprocess.CompletedProcess(self.proc.args, self.proc.returncode, out, err))
        return self.lines


def run_and_kill(store, args, delay, after=None, env=None):
    """Starts the worker; once after(lines) holds (at once if None), waits `delay` s and SIGKILLs it.

    Returns the stdout lines printed before it died."""
    w = Worker(store, *args, env=env)
    if after:
        w.wait_for(after)
    time.sleep(delay)
    code, lines, err = w.kill()
    # -9: killed as intended; 0: it finished before the kill. Anything else is a failure.
    assert code in (-9, 0), f"worker failed before the kill (exit {code}):\n{err}\n--- stdout\n" + "\n".join(lines)
    return lines


def autosave_number(name):
    m = re.fullmatch(r"autosave-([1-9][0-9]*)", name)
    return int(m.group(1)) if m else None


def autosaves(names):
    return sorted((n for n in names if autosave_number(n)), key=autosave_number)


def possible_stores(before, lines, keep):
    """What the store may hold after a worker that started on the snapshots
    `before` printed `lines` and was killed: (the possible sets of snapshot
    names, the last snapshot printed as committed or None, the snapshot
    announced but not printed as committed or None)."""
    names = set(before)
    pending = None  # a snapshot announced ("> ...") but not printed as committed
    removable = []  # autosaves the last checkpoint removes, oldest first, not yet printed as removed
    newest = None
    for line in lines:
        word, _, arg = line.partition(" ")
        if line.startswith("> checkpoint ") or line.startswith("> snapshot "):
            assert not removable, f"retention left {removable} when the worker went on: {lines}"
            pending = line.split()[-1]
            if pending.startswith("autosave-"):
                found = autosaves(names | {pending})
                removable = found[:max(0, len(found) - keep)]
        elif word == "committed":
            assert arg == pending, f"committed {arg} while {pending} was announced: {lines}"
            names.add(arg)
            newest, pending = arg, None
        elif word == "removed":
            assert removable and arg == removable[0], f"retention removed {arg}, expected the oldest of {removable}: {lines}"
            names.discard(removable.pop(0))
        elif line.startswith("> gc"):
            assert not removable, f"retention left {removable} when the worker went on: {lines}"
    # What the kill may have cut short: the announced snapshot (and its
    # retention), or the printing of retention's removals.
    outcomes = [frozenset(names - set(removable[:j])) for j in range(len(removable) + 1)]
    if pending:
        committed = names | {pending}
        found = autosaves(committed) if pending.startswith("autosave-") else []
        gone = found[:max(0, len(found) - keep)]
        outcomes = [frozenset(names)] + [frozenset(committed - set(gone[:j])) for j in range(len(gone) + 1)]
    return outcomes, newest, pending


def recover(store, session):
    proc = store.dvr("recover", session, "--json", expect=None)
    rec = json.loads(proc.stdout)
    assert proc.returncode == (0 if rec["latest"] else 1) and rec["skipped"] == [], describe(proc)
    return rec["latest"]["name"] if rec["latest"] else None


def autosave_kill_loop(store, rng, seed, iterations, worker_args, kill_point, keep, gc_every_other=True, env=None):
    """Runs and kills the autosave worker `iterations` times on one store,
    checking the store after each kill. kill_point(rng) -> (after, delay) for
    run_and_kill. Returns (the snapshots at the end, the named ones committed,
    `ls` entries of the snapshots the killed workers committed, evidence of
    what the kills interrupted)."""
    before = set()
    latest = None
    named = set()  # every named snapshot committed so far: never removed
    taken = []
    evidence = {"killed in": Counter(), "unprinted commit": 0, "unprinted removal": 0}
    for it in range(iterations):
        after, delay = kill_point(rng)
        lines = run_and_kill(store, ["autosave", SESSION, "--count", "100000", "--keep", keep, *worker_args], delay, after, env)
        context = f"iteration {it} (DVR_CRASH_SEED={seed}, kill {delay * 1000:.1f} ms after {'a trigger' if after else 'the start'})"
        last = lines[-1] if lines else "(start)"
        evidence["killed in"][" ".join(last.split()[:2]) if last.startswith(">") else last.split()[0]] += 1

        # The worker restored what `dvr recover` named after the previous kill.
        if latest and lines:
            assert lines[:2] in ([f"> restore {latest}"], [f"> restore {latest}", f"recovered {latest}"]), (
                f"{context}: `dvr recover` named {latest}, the worker began with {lines[:3]}")

        if not before and (not store.path.exists() or not any(store.path.iterdir())):
            # Killed before the worker created the store (no directory yet, or
            # one still empty): nothing can have been committed. dvr refuses
            # an empty directory ("no store at ..."), so there is nothing to list.
            assert not any(l.startswith("committed") for l in lines), f"{context}: {lines}"
            evidence["killed in"]["(before the store)"] += 1
            continue
        report = store.verify()
        assert report["ok"] and not report["problems"], f"{context}: {report}"
        listed = store.ls(SESSION, missing_ok=True)
        assert not [s for s in listed if s["damaged"]], f"{context}: damaged after kill: {listed}"
        names = {s["name"] for s in listed}

        outcomes, newest, pending = possible_stores(before, lines, keep)
        assert names in outcomes, (f"{context}: the store holds {sorted(names)}; after {lines[-4:]} "
                                   f"it may hold one of {[sorted(o) for o in outcomes]}")
        if pending and pending in names:
            newest = pending
            evidence["unprinted commit"] += 1
        printed = before | {l.split()[1] for l in lines if l.startswith("committed ")}
        evidence["unprinted removal"] += len([n for n in printed if n not in names and f"removed {n}" not in lines])
        assert named <= names, f"{context}: named snapshots lost: {sorted(named - names)}"
        named |= {n for n in names if n.startswith("named-")}
        auto = autosaves(names)
        assert len(auto) <= max(keep, len(autosaves(before))) + 1, f"{context}: {len(auto)} autosaves kept: {auto}"

        # `dvr recover` names the newest committed snapshot (the last in `ls`).
        newest = newest or latest
        latest = recover(store, SESSION)
        newest_listed = listed[-1]["name"] if listed else None
        assert latest == newest_listed == newest, (
            f"{context}: recover names {latest}, newest listed {newest_listed}, newest committed {newest}")

        # What this run added, and every autosave, restore bit-exact.
        fresh = sorted((names - before) | set(auto), key=lambda n: [s["name"] for s in listed].index(n))
        if fresh:
            store.check(SESSION, *fresh)
        taken += [s for s in listed if s["name"] not in before]
        before = names
        if gc_every_other and it % 2 == 1:
            store.gc()
            assert store.verify()["ok"], f"{context}: damage after gc"
            assert store.tmp_files() == [], f"{context}: gc left {store.tmp_files()}"
    return before, named, taken, evidence


def finish_cleanly(store, keep, worker_args=(), env=None):
    """A last run that is not killed: it recovers and ends with exactly `keep` autosaves."""
    latest = recover(store, SESSION)
    lines = Worker(store, "autosave", SESSION, "--count", 5, "--keep", keep, *worker_args, env=env).finish()
    assert lines[1] == f"recovered {latest}", lines[:3]
    names = store.names(SESSION)
    assert len(autosaves(names)) == keep, sorted(names)
    store.gc()
    report = store.verify()
    assert report["ok"], report
    store.check(SESSION)  # everything, in the order taken
    return names


def test_sigkill_autosave_worker_keeps_committed_snapshots_retention_and_recovery(crash_store):
    """(a) Kill an application with autosave on at random instants: mid
    snapshot, mid retention, mid restore at startup, between steps."""
    store = crash_store
    rng, seed = seeded_rng()
    started = time.monotonic()
    final, named, taken, evidence = autosave_kill_loop(
        store, rng, seed, 20, ["--every-ms", 2], lambda rng: (None, rng.uniform(0.005, 0.200)), KEEP)
    names = finish_cleanly(store, KEEP, ["--every-ms", 2])
    assert named <= names
    print(f"20 kills in {time.monotonic() - started:.1f} s; {len(names)} snapshots at the end "
          f"({len(named)} named); evidence: {evidence}")


@pytest.mark.parametrize("tracking", ["write_protect", "hash"])
def test_sigkill_during_incremental_snapshots_of_scattered_pages(crash_store, tracking):
    """(c) Kill inside the snapshots that follow small scattered writes, which
    are stored as overlay pages on the base's chunks (256 KiB chunks here, so
    up to 16 per chunk), with keep=1 and the worker's own gc every other step:
    the only copy of a chunk's base bytes often belongs to an autosave that
    retention already removed. With write-protect tracking the written pages
    come from the kernel; in hash mode from comparing page hashes with the base."""
    store = crash_store
    env = {"DVR_TRACKING": "hash"} if tracking == "hash" else {}
    rng, seed = seeded_rng()
    started = time.monotonic()

    def in_a_snapshot(rng):
        # Wait for the k-th announced snapshot, then kill within the few
        # milliseconds it, its retention or the gc after it takes.
        k = rng.randrange(1, 25)
        return (lambda lines: sum(l.startswith("> ") for l in lines) >= k), rng.uniform(0, 0.004)

    args = ["--every-ms", 1, "--chunk-size", 256 * 1024, "--gc-every", 2, "--named-every", 5]
    final, named, taken, evidence = autosave_kill_loop(store, rng, seed, 25, args, in_a_snapshot, 1, gc_every_other=False, env=env)
    names = finish_cleanly(store, 1, args, env)
    assert named <= names
    assert store.stat()["chunk_size"] == 256 * 1024
    # The snapshots were incremental, taken the intended way (after a restore
    # too: the first one of each run).
    incremental = [s for s in taken if s["chunks_read"] < s["chunks"]]
    assert len(incremental) >= len(taken) // 2, [(s["name"], s["chunks_read"], s["chunks"]) for s in taken]
    # (Only the very first snapshot, in an empty store, had no base to track from.)
    kinds = Counter(s["tracking"] for s in taken)
    assert kinds[tracking] >= len(taken) - (tracking != "hash"), kinds
    print(f"25 kills in {time.monotonic() - started:.1f} s; evidence: {evidence}")


# --- clones

def make_history(store):
    """Autosaves and named snapshots (overlays on 256 KiB chunks), then two
    snapshots of the plain worker content (fresh data of their own)."""
    store.worker("autosave", SESSION, "--count", 12, "--keep", KEEP, "--chunk-size", 256 * 1024)
    store.snap(SESSION, "base-1", "base-2")
    names = store.names(SESSION)
    assert names == {"named-4", "named-8", "named-12", "autosave-10", "autosave-11", "autosave-12", "base-1", "base-2"}, names
    return names


def pins(store):
    """The pinned manifests (each pin also has a lock file, checked by pin_files())."""
    d = store.path / "pins"
    return sorted(f for f in os.listdir(d) if f.endswith(".snap")) if d.is_dir() else []


def pin_files(store):
    """Everything in pins/: every pin must come with its lock file and nothing else."""
    d = store.path / "pins"
    files = sorted(os.listdir(d)) if d.is_dir() else []
    snaps = [f[:-5] for f in files if f.endswith(".snap")]
    assert files == sorted([s + ".snap" for s in snaps] + [s + ".lock" for s in snaps]), files
    return files


def hold_clone(store, name):
    """A worker holding a clone of `name` (checked and written to) until its stdin closes."""
    w = Worker(store, "clone", SESSION, name, stdin=subprocess.PIPE)
    if not w.wait_for(lambda lines: f"holding {name}" in lines):
        code, lines, err = w.kill()
        pytest.fail(f"clone worker for {name} did not get to hold it (exit {code}):\n{err}\n" + "\n".join(lines))
    return w


def release_clone(w, name):
    """Closes its stdin: it compares the clone once more, then closes it."""
    w.proc.stdin.close()
    lines = w.finish()
    assert lines[-1] == f"ok clone {SESSION}/{name}", lines


def test_killed_clone_holders_leave_pins_that_gc_removes_without_freeing_live_data(crash_store):
    """(b) SIGKILL processes holding clones (and processes opening one, at
    random instants): their pins stay until gc, which removes them and frees
    nothing a snapshot needs; once a dead clone's snapshot is removed, gc gives
    its space back."""
    store = crash_store
    rng, seed = seeded_rng()
    make_history(store)

    held = {n: hold_clone(store, n) for n in ("autosave-11", "named-8", "base-2")}
    assert len(pins(store)) == 3, pins(store)
    # The clones' writes are private: the snapshots are unchanged.
    store.check(SESSION, *held)
    for w in held.values():
        assert w.kill()[0] == -9
    assert len(pins(store)) == 3, "a killed clone's pin disappeared before gc"
    # Pins of dead processes still keep their data while they are there.
    store.dvr("rm", f"{SESSION}/autosave-11")
    store.worker("autosave", SESSION, "--count", 4, "--keep", KEEP)  # new data; retention removes more
    store.check(SESSION)

    # Kills while a clone is being opened (checked, pinned, mapped).
    for it in range(12):
        lines = run_and_kill(store, ["clone", SESSION, "base-1", "--hold-ms", 50], rng.uniform(0, 0.012))
        assert not lines or lines[0] == "cloned base-1", f"DVR_CRASH_SEED={seed} kill {it}: {lines}"

    gc = store.gc()
    assert pin_files(store) == [] and store.tmp_files() == [], (pin_files(store), store.tmp_files(), gc)
    assert gc["temp_files_removed"] >= 3, gc
    report = store.verify()
    assert report["ok"], report
    store.check(SESSION)  # every snapshot, after gc freed what only the dead pins held

    # A dead clone of a snapshot that is then removed holds nothing after gc.
    w = hold_clone(store, "base-2")
    w.kill()
    store.gc()  # nothing else left to reclaim
    store.dvr("rm", f"{SESSION}/base-2")
    gc = store.gc()
    assert pin_files(store) == [], pin_files(store)
    assert gc["bytes_after"] < gc["bytes_before"], f"the space of base-2 was not reclaimed: {gc}"
    store.check(SESSION)
    assert store.verify()["ok"]


@pytest.mark.parametrize("target", ["base-2", "autosave-11"])
def test_live_clone_survives_rm_gc_and_new_snapshots_of_its_snapshot(crash_store, target):
    """(b) A clone alive in another process keeps what it maps: `dvr rm` of its
    snapshot, gc, new snapshots that reuse the freed space (one of them with
    the removed snapshot's content, which dedups against the pinned data) and
    gc again; the clone process compares its content afterwards, and so does
    `check` for every snapshot once the clone is gone."""
    store = crash_store
    rng, seed = seeded_rng()
    names = make_history(store)
    # Remove what shares the target's data too, so that only the clone needs it:
    # base-2's fresh units are its own; an autosave's overlays and base chunks
    # are shared by the other autosaves and named snapshots.
    doomed = sorted(n for n in names if re.match(r"(autosave|named)-", n)) if target.startswith("autosave-") else [target]
    w = hold_clone(store, target)
    try:
        store.check(SESSION, target)  # the clone's writes are private
        store.dvr("rm", *[f"{SESSION}/{n}" for n in doomed])
        gc = store.gc()
        assert len(pins(store)) == 1, f"gc removed the pin of a live clone: {gc}"
        assert gc["bytes_after"] < gc["bytes_before"], f"gc freed nothing, so it could not have freed the clone's data either: {gc}"
        # New data after the gc: retention removes autosaves (and gc runs
        # after each, while the worker is killed at random), fresh snapshots
        # fill freed space, and the removed snapshot's content comes back.
        for it in range(4):
            run_and_kill(store, ["autosave", SESSION, "--count", 100000, "--keep", 1, "--gc-every", 1], rng.uniform(0.01, 0.08))
            assert store.verify()["ok"], f"DVR_CRASH_SEED={seed} kill {it}"
        store.worker("autosave", SESSION, "--count", 4, "--keep", 2)
        store.snap(SESSION, "fill-0001", "fill-0002")
        # The workers restart the autosave numbering once all autosaves are
        # gone, so they may have taken an autosave of that name again.
        if target in [s["name"] for s in store.ls(SESSION, missing_ok=True)]:
            store.dvr("rm", f"{SESSION}/{target}")
        store.snap(SESSION, target)
        store.dvr("rm", f"{SESSION}/fill-0001")
        store.gc()
        assert store.verify()["ok"]
        release_clone(w, target)
    finally:
        kill(w.proc)
    assert pin_files(store) == [], "a clone closed normally left its pin or lock file"
    store.gc()
    store.check(SESSION)
    assert store.verify()["ok"]
