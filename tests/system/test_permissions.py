"""A store is private to its owner: directories 0700, files 0600, whatever the
umask of the process that created them, and someone else's store is refused."""

import os
import stat

import pytest
from dvrtest import describe, skip_unless_root, worker_error


def modes(root):
    """{relative path: (kind, mode)} of everything under root, root included."""
    out = {".": ("dir", stat.S_IMODE(os.lstat(root).st_mode))}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            kind = "dir" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode) else "other"
            out[os.path.relpath(full, root)] = (kind, stat.S_IMODE(st.st_mode))
    return out


def exercise(store, umask):
    """Creates every kind of file a store holds, from processes with `umask`."""
    def preexec():
        os.umask(umask)

    store.worker("snap", "s", "a", "b", preexec_fn=preexec)
    store.worker("loop", "s", "--count", "4", "--churn", preexec_fn=preexec)  # rm + gc inside
    store.worker("snap", "t", "c", preexec_fn=preexec)


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
def test_a_new_store_is_private_whatever_the_umask(store, umask):
    exercise(store, umask)
    found = modes(store.path)
    assert found["DVRSTORE"][0] == "file" and any(p.startswith("packs/") for p in found)
    assert any(p.startswith("sessions/t/") for p in found)
    wrong = {p: (kind, oct(mode)) for p, (kind, mode) in found.items()
             if (kind, mode) not in (("dir", 0o700), ("file", 0o600))}
    assert not wrong, f"not private (want dirs 0700, files 0600): {wrong}"
    uid = os.geteuid()
    assert all(os.lstat(store.path / p).st_uid == uid for p in found)


def test_an_existing_empty_directory_is_made_private(store):
    store.path.mkdir()
    store.path.chmod(0o755)
    store.snap("s", "a")
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o700


def test_a_store_owned_by_someone_else_is_refused(store):
    skip_unless_root("giving the store to another user")
    store.snap("s", "a")
    os.chown(store.path, 65534, 65534)
    try:
        proc = store.dvr("ls", expect=1)
        assert "owned by uid 65534" in proc.stderr and "not by you" in proc.stderr, describe(proc)
        proc = store.snap("s", "b", expect=3)
        assert worker_error(proc).startswith("error permission:"), describe(proc)
    finally:
        os.chown(store.path, 0, 0)
    store.check("s", "a")
