"""The restore preflight: a process snapshot restores only where the programs
and libraries it ran with are at the same paths with the same content
(docs/criu.md, "Limits"); otherwise it names what differs and changes nothing."""

import os
import shutil



def test_restore_names_a_program_that_differs_and_changes_nothing(work):
    # The job runs from a copy of its binary, which is then changed.
    exe = work.path("job-copy")
    shutil.copy2(work.job_bin, exe)
    work.job_bin = str(exe)
    job = work.start_job("counter", mib=4)
    info = work.dump(job.pid, "p1")
    assert info["image_bytes"] > 0
    job.forget()
    stat = os.stat(exe)

    with open(exe, "ab") as f:  # another build of it
        f.write(b"\0" * 16)
    before = work.running()
    proc = work.dvr("proc", "restore", "p1", "--detach", expect=None)
    assert proc.returncode == 1, proc.stderr
    assert str(exe) in proc.stderr and "differ" in proc.stderr, proc.stderr
    work.assert_nothing_new_running(before, "a refused restore")

    os.truncate(exe, stat.st_size)  # the same size, but touched since the dump
    proc = work.dvr("proc", "restore", "p1", "--detach", expect=None)
    assert proc.returncode == 1 and "modified" in proc.stderr, proc.stderr

    os.utime(exe, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the very file again
    pid = work.restore("p1")
    job.pid = pid
    job.wait_count(1)

    ls = {e["name"]: e for e in work.proc_ls()}
    assert ls["p1"]["command"].startswith(str(exe))
