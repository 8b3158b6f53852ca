"""`dvr proc check`: one line per capability dvr proc depends on (status, name,
what was found or what to do), the TCP probes (a tiny process listening on
127.0.0.1, then one holding an established connection, each really dumped
and restored), `--json`, and the exit status (docs/criu.md)."""

import re
import time

from dvrtest import criu_dumps_inet_sockets, describe, kernel_version
from schema_check import check as check_schema

REQUIRED = ["root", "criu", "kernel", "plugin", "inet sockets", "tcp listen"]
OPTIONAL = ["tcp established", "page stream", "page fill", "write tracking"]
LINE = re.compile(r"^(ok|missing|skipped) +(\S+(?: \S+)?) +(.*)$")


def capability_lines(stdout):
    """{name: (status, detail)} of the capability lines of `dvr proc check`
    (a detail's further lines are indented under its first)."""
    found, last = {}, None
    for line in stdout.splitlines():
        m = LINE.match(line)
        if m and m.group(2).strip() in REQUIRED + OPTIONAL:
            last = m.group(2).strip()
            found[last] = (m.group(1), m.group(3))
        elif last and line.startswith(" " * 20):
            found[last] = (found[last][0], found[last][1] + "\n" + line.strip())
        else:
            last = None
    return found


def fake_criu(tmp_path, version):
    """A criu that says it is `version`, passes `criu check`, and fails every
    dump as CRIU 4.1 does on an inet socket under Linux >= 6.16."""
    path = tmp_path / "criu"
    path.write_text(
        "#!/bin/sh\n"
        f"case \"$1\" in --version) echo 'Version: {version}'; exit 0 ;; check) echo 'Looks good.'; exit 0 ;; esac\n"
        "D=.; O=criu.log\n"
        "while [ $# -gt 0 ]; do case \"$1\" in -D) D=$2; shift ;; -o) O=$2; shift ;; esac; shift; done\n"
        "echo \"(00.01) Error (criu/sockets.c:690): Can't get 1:16 opt: Operation not supported\" >> \"$D/$O\"\n"
        "exit 1\n")
    path.chmod(0o755)
    return path


def test_check_reports_every_capability_and_probes_tcp(work, tmp_path):
    env = {"TMPDIR": str(tmp_path)}  # where the probes keep their images
    t0 = time.monotonic()
    proc = work.dvr("proc", "check", expect=None, env=env)
    took = time.monotonic() - t0
    lines = capability_lines(proc.stdout)
    assert set(lines) == set(REQUIRED + OPTIONAL), describe(proc)
    if not criu_dumps_inet_sockets():
        assert proc.returncode == 1, describe(proc)
        assert lines["inet sockets"][0] == "missing" and "install-deps.sh" in lines["inet sockets"][1], describe(proc)
        return
    assert proc.returncode == 0, describe(proc)
    for name in REQUIRED + ["tcp established"]:
        assert lines[name][0] == "ok", f"{name}: {lines[name]}\n{describe(proc)}"
    assert "dumped and restored" in lines["tcp listen"][1]
    assert "--tcp-established" in lines["tcp established"][1]
    # Root on Linux may write a stopped process's memory: restores fill it.
    assert lines["page fill"][0] == "ok" and "process_vm_writev" in lines["page fill"][1], describe(proc)
    assert proc.stdout.rstrip().endswith("ready: processes can be dumped and restored"), describe(proc)
    # A guard against a probe that waits for something that never comes (each
    # probe takes a second or two), not a speed figure: loaded machines are slow.
    assert took < 90, f"dvr proc check took {took:.1f} s"

    report = work.dvr_json("proc", "check", env=env)
    check_schema(report, "proc_check")  # docs/cli-schema.json
    assert report["ok"] is True and report["problems"] == [], report
    caps = {c["name"]: c for c in report["capabilities"]}
    assert set(caps) == set(REQUIRED + OPTIONAL), report
    for c in caps.values():
        assert set(c) == {"name", "status", "ok", "required", "detail"}, c
        assert c["status"] == ("ok" if c["ok"] else c["status"]) and c["detail"], c
        assert c["required"] is (c["name"] in REQUIRED), c
    assert caps["tcp listen"]["status"] == "ok" and caps["tcp established"]["status"] == "ok", report
    assert report["plugin"].endswith("dvr_criu.so") and report["criu_version"], report
    assert list(tmp_path.iterdir()) == [], "the probes left files behind"


def test_check_with_criu_4_1_names_the_tcp_problem_and_what_to_do(work, tmp_path):
    env = {"DVR_CRIU": str(fake_criu(tmp_path, "4.1.1")), "TMPDIR": str(tmp_path)}
    proc = work.dvr("proc", "check", expect=None, env=env)
    assert proc.returncode == 1, describe(proc)
    lines = capability_lines(proc.stdout)
    assert lines["criu"][0] == "ok" and "4.1.1" in lines["criu"][1], describe(proc)
    if kernel_version() >= (6, 16):
        status, detail = lines["inet sockets"]
        assert status == "missing", describe(proc)
        assert "TCP servers cannot be dumped with CRIU < 4.2 on this kernel" in detail, describe(proc)
        assert "run install-deps.sh, which builds CRIU 4.2 from Debian's source" in detail, describe(proc)
    status, detail = lines["tcp listen"]
    assert status == "missing" and "Can't get 1:16 opt" in detail and "install-deps.sh" in detail, describe(proc)
    assert lines["tcp established"][0] == "skipped", describe(proc)
    assert lines["page stream"][0] == "missing" and "optional" in lines["page stream"][1], describe(proc)
    assert lines["page fill"][0] == "skipped" and "page stream" in lines["page fill"][1], describe(proc)
    assert "not ready" in proc.stdout, describe(proc)
    assert proc.stderr.startswith("dvr: ") and "Can't get 1:16 opt" in proc.stderr, describe(proc)
    # The failed probe's CRIU log is kept (its path is in the message), its images are not.
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("dvr-check-")]
    assert kept and all(f.suffix == ".log" for d in kept for f in d.iterdir()), kept
    report = work.dvr_json("proc", "check", expect=1, env=env)
    check_schema(report, "proc_check")
    assert report["ok"] is False and any("1:16" in p for p in report["problems"]), report
