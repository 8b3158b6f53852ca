"""Safe printing: a label full of terminal escapes, newlines, BEL and C1
controls, arrived through a stream (send | receive) and through a file
(export, import), prints as one escaped line in `dvr ls`, `log`, `info`,
`proc ls` and `python -m memdvr`'s text output, by the one rule of
docs/cli.md ("Text output"), and round-trips exactly in --json.

Needs $DVR_BIN (the built dvr; CTest sets it) and the built memdvr on PYTHONPATH."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import memdvr

# ESC ] 0 ; TITLE BEL (retitles an xterm), a newline and CR that would forge a
# listing line, ESC [ 2 J (clear screen), C1 CSI (U+009B), a bidirectional
# override, a backslash.
EVIL = "a\nfake/line  2026-12-02 00:00:00  1 KiB\r\x1b]0;pwned\x07\x1b[2J\u009b31m\u202eback\\slash"
ESCAPED = "a\\nfake/line  2026-12-02 00:00:00  1 KiB\\r\\x1b]0;pwned\\x07\\x1b[2J\\u009b31m\\u202eback\\\\slash"
# The command of a crafted process snapshot: its metadata is one line a key.
EVIL_COMMAND = "sleep 1\r\x1b]0;pwned\x07\x1b[2J\u009b31m"
ESCAPED_COMMAND = "sleep 1\\r\\x1b]0;pwned\\x07\\x1b[2J\\u009b31m"


@pytest.fixture(scope="module")
def dvr_bin():
    path = os.environ.get("DVR_BIN")
    if not path or not os.access(path, os.X_OK):
        pytest.fail(f"$DVR_BIN must name the built dvr (got {path!r}); run through CTest or set DVR_BIN=BUILD/dvr")
    return path


def run(argv, expect=0, stdin=None):
    proc = subprocess.run([str(a) for a in argv], capture_output=True, timeout=300, stdin=stdin)
    assert proc.returncode == expect, (argv, proc.returncode, proc.stdout, proc.stderr)
    return proc.stdout.decode("utf-8", "surrogateescape")


def dvr(dvr_bin, store, *args, stdin=None):
    return run([dvr_bin, "--store", store, *args], stdin=stdin)


def py(store, *args):
    return run([sys.executable, "-m", "memdvr", "--store", store, *args])


def assert_safe(text, expected, what):
    """No control character but the line breaks, and `expected` whole on one line."""
    bad = [c for c in text if (ord(c) < 0x20 and c != "\n") or 0x7F <= ord(c) < 0xA0 or c == "\u202e"]
    assert not bad, f"{what} printed raw control characters {bad!r}:\n{text}"
    lines = [line for line in text.split("\n") if expected in line]
    assert len(lines) == 1, f"{what} does not print the label escaped on one line:\n{text}"


@pytest.fixture
def stores(tmp_path, dvr_bin):
    """Store A holds evil/e1 (the label) and proc/p1 (the command); B got both
    through send | receive, C through export and import."""
    a = str(tmp_path / "a")
    st = memdvr.Store(a)
    with memdvr.Session(st, "evil") as s:
        arr = s.array("data", (4096,), np.uint8)
        arr[:] = 9
        s.snapshot("e1", label=EVIL)
        del arr
    meta = f"dvr-proc 1\npid=4242\nown_pid_namespace=1\ncommand={EVIL_COMMAND}\n".encode()
    # A process snapshot forged through the core module (memdvr.Session refuses
    # the session name "proc"; dvr proc dump would need CRIU).
    with memdvr.Session._wrap(memdvr._core.Session(st._core, "proc", None), st) as s:
        buf = np.frombuffer(bytearray(meta), dtype=np.uint8)
        s.track("dvr-proc.meta", buf)
        s.snapshot("p1", label="process 4242: " + EVIL_COMMAND)
        s.untrack("dvr-proc.meta")
    b, c = str(tmp_path / "b"), str(tmp_path / "c")
    for ref in ("evil/e1", "proc/p1"):
        sent = subprocess.run([dvr_bin, "--store", a, "send", ref], capture_output=True, timeout=300, stdin=subprocess.DEVNULL)
        assert sent.returncode == 0, sent.stderr
        received = subprocess.run([dvr_bin, "--store", b, "receive"], input=sent.stdout, capture_output=True, timeout=300)
        assert received.returncode == 0, received.stderr
        f = tmp_path / (ref.replace("/", "-") + ".dvr")
        dvr(dvr_bin, a, "export", ref, "-o", f)
        dvr(dvr_bin, c, "import", f)
    return b, c


def test_received_and_imported_labels_print_escaped_and_round_trip_in_json(dvr_bin, stores):
    for store in stores:
        for args in (("ls",), ("ls", "evil"), ("log", "evil"), ("info", "evil/e1")):
            assert_safe(dvr(dvr_bin, store, *args), ESCAPED, f"dvr {' '.join(args)}")
            assert_safe(py(store, *args), ESCAPED, f"python -m memdvr {' '.join(args)}")
        ls = json.loads(dvr(dvr_bin, store, "ls", "evil", "--json"))
        assert [s["label"] for s in ls["snapshots"]] == [EVIL]
        assert json.loads(dvr(dvr_bin, store, "info", "evil/e1", "--json"))["label"] == EVIL
        assert json.loads(py(store, "info", "evil/e1", "--json"))["label"] == EVIL
        # The library's view is the exact text too.
        assert memdvr.Store(store).info("evil", "e1").label == EVIL

        procs = dvr(dvr_bin, store, "proc", "ls")
        assert_safe(procs, ESCAPED_COMMAND, "dvr proc ls")
        assert "p1" in procs
        listed = json.loads(dvr(dvr_bin, store, "proc", "ls", "--json"))["processes"]
        assert [(p["name"], p["command"]) for p in listed] == [("p1", EVIL_COMMAND)]
        assert_safe(dvr(dvr_bin, store, "proc", "info", "p1"), ESCAPED_COMMAND, "dvr proc info")


def test_one_rule_in_every_front_end():
    # The C++ rule (dvr::escape_text, through the binding) is what memdvr's
    # text output uses: spot checks of each class of the rule.
    cases = {
        "tab\there": "tab\\there",
        "\x00\x1f\x7f": "\\x00\\x1f\\x7f",
        "\u0085\u009f": "\\u0085\\u009f",
        "\u2028\u2029\u200e\u2066": "\\u2028\\u2029\\u200e\\u2066",
        "caf\u00e9 \u2713": "caf\u00e9 \u2713",
        "back\\slash": "back\\\\slash",
    }
    for text, want in cases.items():
        assert memdvr._printable(text) == want, text
    # Bytes that are not UTF-8 (as a str decoded with surrogateescape, or as bytes).
    assert memdvr._printable(b"bad\xfe\xc0\xaf") == "bad\\xfe\\xc0\\xaf"
    assert memdvr._printable(b"bad\xfe".decode("utf-8", "surrogateescape")) == "bad\\xfe"
