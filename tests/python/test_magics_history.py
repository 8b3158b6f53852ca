"""The %dvr magics of the automatic history in an IPython shell (no kernel):
what is captured and how, rm/info/label/diff, trailing comments, HTML escaping,
hints for misspelt names. The real-kernel runs are in test_history_kernel.py."""

import mmap

import numpy as np
import pytest

import memdvr

IPython = pytest.importorskip("IPython", reason="IPython is not installed")
from IPython.core.error import UsageError  # noqa: E402


@pytest.fixture
def sh(tmp_path):
    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "memdvr")
    shell.run_line_magic("dvr", f"store {tmp_path / 'store'}")
    shell.run_line_magic("dvr", "session notebook")
    before = set(shell.user_ns)
    yield shell
    shell.run_line_magic("dvr", "auto off")
    shell.run_line_magic("dvr", "session history-test-closed")  # closes the session
    for var in set(shell.user_ns) - before:
        shell.user_ns.pop(var, None)


def cell(sh, src):
    """Runs ``src`` as a cell (IPython's events fire); raises what the cell raised."""
    r = sh.run_cell(src, store_history=True)
    err = r.error_before_exec or r.error_in_exec
    if err is not None:
        raise err
    return r.result


def names(sh):
    return sh.run_line_magic("dvr", "ls").names()


def test_comments_are_not_arguments(sh, tmp_path, capsys):
    other = tmp_path / "other-store"
    cell(sh, f"%dvr store {other}   # a comment, with 'quotes' and --flags")
    assert f"memdvr store {other} " in capsys.readouterr().out
    cell(sh, "%dvr auto on")
    cell(sh, "%dvr session nb2  # another session: the history goes on there")
    assert "session 'nb2'" in capsys.readouterr().out
    assert sh.run_line_magic("dvr", "auto").on
    cell(sh, "%dvr auto off")
    listing = cell(sh, "%dvr ls  # nothing yet")
    assert len(listing) == 0 and "no snapshots in session 'nb2'" in repr(listing)
    with pytest.raises(UsageError, match="close the quotes"):
        sh.run_line_magic("dvr", "label x 'unclosed")


def test_auto_commits_only_changes_and_moves_arrays_to_pages(sh):
    cell(sh, "%dvr auto on")
    cell(sh, "import numpy as np\nbig = np.arange(1 << 20, dtype=np.float64)\nheld = np.ones(1 << 16)\n"
             "keep = [held]")
    n0 = names(sh)
    big, held = sh.user_ns["big"], sh.user_ns["held"]
    # Only the namespace held `big`: moved to page-aligned memory, same values.
    assert big.ctypes.data % mmap.PAGESIZE == 0 and big[12345] == 12345
    # `held` is also in a list: tracked where it is, never moved.
    assert sh.user_ns["keep"][0] is held
    cell(sh, "print(big[:3])")  # changes nothing: no commit
    assert names(sh) == n0
    cell(sh, "big[::512 * 100] += 1")  # about 1% of the pages
    n1 = names(sh)
    assert len(n1) == len(n0) + 1
    info = sh.run_line_magic("dvr", "info")
    pages = len(range(0, 1 << 20, 51200))
    assert info.info.name == n1[-1] and info.head
    row = {v.name: v for v in info.variables}["big"]
    assert (row.kind, row.change) == ("array", "changed") and 0 < row.bytes_changed <= pages * 8
    # Each written page is stored once (a page-aligned region), plus the
    # history's own small object.
    assert info.info.stored_bytes <= 2 * pages * 4096 + 64 * 1024
    assert {v.name: v.change for v in info.variables}["held"] == "unchanged"


def test_checkout_in_place_views_rebinds_and_removed(sh, capsys):
    cell(sh, "%dvr auto on")
    cell(sh, "import numpy as np\nx = np.zeros((256, 256))\nrow = x[3]\nt = x.T\nlabel = 'v1'")
    first = names(sh)[-1]
    x = sh.user_ns["x"]
    cell(sh, "x[3, :] = 5\nlabel = 'v2'\nnew_var = 1")
    cell(sh, "y = np.ones(100_000, np.float32)")
    capsys.readouterr()
    cell(sh, f"%dvr checkout {first}")
    out = capsys.readouterr().out
    ns = sh.user_ns
    assert ns["x"] is x and not x.any()  # in place
    assert np.shares_memory(ns["row"], x) and np.shares_memory(ns["t"], x)  # views again
    assert ns["t"].shape == (256, 256) and ns["t"].strides == x.T.strides
    assert ns["label"] == "v1" and "new_var" not in ns and "y" not in ns
    assert "removed (not in " in out and "new_var" in out and f"HEAD is now {first}" in out
    # Re-bound to another shape: recreated at the checkout.
    cell(sh, "x = np.zeros(10)\nz = 2")
    second = names(sh)[-1]
    cell(sh, f"%dvr checkout {first}")
    assert ns["x"].shape == (256, 256) and "z" not in ns
    cell(sh, f"%dvr checkout {second}")
    assert ns["x"].shape == (10,) and ns["z"] == 2
    log = sh.run_line_magic("dvr", "log")
    assert log.head == second and len(log.children(first)) == 2 and second in log.children(first)


def test_array_subclasses_and_small_arrays_are_pickled(sh):
    cell(sh, "%dvr auto on")
    cell(sh, "import numpy as np\nmasked = np.ma.array(np.arange(100_000.0), mask=np.arange(100_000) % 2 == 0)\n"
             "small = np.arange(10)\nro = np.arange(100_000.0)\nro.flags.writeable = False")
    base = names(sh)[-1]
    masked = sh.user_ns["masked"]
    info = sh.run_line_magic("dvr", f"info {base}")
    kinds = {v.name: v.kind for v in info.variables}
    assert kinds["masked"] == "object" and kinds["small"] == "object" and kinds["ro"] == "object"
    cell(sh, "masked[1] = -5\nsmall[0] = 99")
    cell(sh, f"%dvr checkout {base}")
    ns = sh.user_ns
    assert type(ns["masked"]) is np.ma.MaskedArray and ns["masked"] is not masked
    assert ns["masked"][1] == 1 and ns["masked"].mask[0] and not ns["masked"].mask[1]
    assert ns["small"][0] == 0 and not ns["ro"].flags.writeable and ns["ro"][5] == 5.0


def test_unpicklable_noted_once_and_kept_by_checkout(sh, capsys):
    cell(sh, "%dvr auto on")
    cell(sh, "gen = (i for i in range(5))\nv = 1")
    base = names(sh)[-1]
    cell(sh, "v = 2")
    cell(sh, "v = 3")
    out = capsys.readouterr().out
    assert out.count("not captured: 'gen'") == 1
    g = sh.user_ns["gen"]
    cell(sh, f"%dvr checkout {base}")
    out = capsys.readouterr().out
    assert sh.user_ns["gen"] is g and sh.user_ns["v"] == 1
    assert "left as they are (not captured by" in out and "gen" in out
    status = sh.run_line_magic("dvr", "auto")
    assert status.on and status.skipped == ("gen",) and status.head == base


def test_rm_info_label_diff_names_and_hints(sh, capsys):
    cell(sh, "%dvr auto on")
    cell(sh, "import numpy as np\nparams = {'lr': 0.1, 'w': np.ones(50_000)}\ndata = np.zeros(100_000)")
    a = names(sh)[-1]
    cell(sh, "params['lr'] = 0.2\ndata[:10] = 1")
    b = names(sh)[-1]
    cell(sh, "extra = '<b>bold</b> & <script>'  # \x1b[31m red")
    c = names(sh)[-1]
    diff = sh.run_line_magic("dvr", f"diff {a} {b}")
    text = repr(diff)
    assert {r.name for r in diff} == {"params", "data"}  # variables, never obj.* regions
    assert "obj." not in text and "dvr-history" not in text and diff["data"].bytes_differ > 0
    info = sh.run_line_magic("dvr", f"info {b}")
    kinds = {v.name: (v.kind, v.change) for v in info.variables}
    assert kinds["params"] == ("object", "changed") and kinds["data"] == ("array", "changed")
    assert kinds["np"] == ("module", "unchanged")
    assert "obj." not in repr(info) and "params['lr'] = 0.2" in repr(info)
    # HTML escapes labels and cell sources.
    html = sh.run_line_magic("dvr", "log")._repr_html_()
    assert "&lt;b&gt;bold&lt;/b&gt; &amp; &lt;script&gt;" in html and "<script>" not in html
    assert "<script>" not in sh.run_line_magic("dvr", f"info {c}")._repr_html_()
    # Text output escapes control characters (the cell's source holds an ESC).
    assert "\x1b" not in repr(sh.run_line_magic("dvr", "log")) and "\\x1b[31m" in repr(
        sh.run_line_magic("dvr", "log"))
    assert "\x1b" not in repr(sh.run_line_magic("dvr", f"info {c}"))
    assert "\x1b" not in repr(sh.run_line_magic("dvr", "ls"))
    # Labels: shown by ls, log and info, kept in the store.
    cell(sh, f"%dvr label {a} baseline params  # a comment")
    assert sh.run_line_magic("dvr", "ls")[a].label == "baseline params"
    assert "baseline params" in repr(sh.run_line_magic("dvr", "log"))
    assert sh.run_line_magic("dvr", f"info {a}").label == "baseline params"
    assert "lr" not in sh.run_line_magic("dvr", f"info {a}").label
    store = memdvr.Store(sh.run_line_magic("dvr", "ls").store, create=False)
    assert "notebook.labels" in store.sessions()
    cell(sh, f"%dvr label {a}")
    assert sh.run_line_magic("dvr", "ls")[a].label != "baseline params"
    # Misspelt names: the closest existing ones.
    with pytest.raises(UsageError, match=f"did you mean {b}"):
        sh.run_line_magic("dvr", f"checkout {b}x")
    with pytest.raises(UsageError, match="is the HEAD"):
        sh.run_line_magic("dvr", f"rm {c}")
    cell(sh, f"%dvr rm {b}  # gone")
    assert b not in names(sh) and f"removed {b}" in capsys.readouterr().out
    with pytest.raises(UsageError, match="no snapshot"):
        sh.run_line_magic("dvr", f"info {b}")
    # c's parent is gone: it shows as a root of the tree.
    assert sh.run_line_magic("dvr", "log")[-1].graph == ""
    with pytest.raises(UsageError, match="unknown command 'frob'"):
        sh.run_line_magic("dvr", "frob")


def test_named_commit_undo_and_auto_off(sh, capsys):
    cell(sh, "%dvr auto on")
    with pytest.raises(UsageError, match="nothing to undo"):
        sh.run_line_magic("dvr", "undo")
    cell(sh, "k = 1")
    cell(sh, "k = 2")
    cell(sh, "%dvr snapshot two  # a named commit of the whole namespace")
    assert "commit 'two' of the whole namespace" in capsys.readouterr().out
    with pytest.raises(UsageError, match="automatic history is on"):
        sh.run_line_magic("dvr", "snapshot sel k")
    cell(sh, "k = 3")
    cell(sh, "%dvr undo")
    assert sh.user_ns["k"] == 2 and sh.run_line_magic("dvr", "auto").head == "two"
    cell(sh, "%dvr undo")
    assert sh.user_ns["k"] == 2  # 'two' and the cell before it hold the same k
    cell(sh, "%dvr undo")
    assert sh.user_ns["k"] == 1
    with pytest.raises(UsageError, match="first commit of its branch"):
        sh.run_line_magic("dvr", "undo")
    cell(sh, "%dvr auto off")
    before = names(sh)
    cell(sh, "k = 10")
    assert names(sh) == before
    # Manual snapshots again once the history is off.
    cell(sh, "%dvr snapshot manual k")
    cell(sh, "k = 11")
    cell(sh, "%dvr restore manual")
    assert sh.user_ns["k"] == 10


def test_trial_restores_manual_snapshot_even_when_raising(sh, capsys):
    cell(sh, "import numpy as np\narr = np.arange(200_000.0)")
    cell(sh, "%dvr snapshot base arr")
    with pytest.raises(ZeroDivisionError):
        cell(sh, "%%dvr trial base\narr[:] = -1\n1 / 0")
    assert sh.user_ns["arr"][7] == 7.0 and "restored 'base'" in capsys.readouterr().out
    with pytest.raises(UsageError, match="no snapshot 'nope'"):
        cell(sh, "%%dvr trial nope\narr[:] = 0")
    assert sh.user_ns["arr"][7] == 7.0  # the cell did not run
    with pytest.raises(UsageError, match="name the snapshot to go back to"):
        cell(sh, "%%dvr trial\narr[:] = 0")
    with pytest.raises(UsageError, match="cell magic is"):
        cell(sh, "%%dvr ls\nx = 1")


def test_a_relative_store_stays_where_it_was_given_after_chdir(sh, tmp_path, monkeypatch, capsys):
    """`%dvr store REL` is taken from the working directory at that moment: a
    cell that changes directory does not move the store (it used to open a
    second, empty store there at the next `%dvr session`)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    cell(sh, "%dvr store mystore")
    assert f"memdvr store {tmp_path / 'a' / 'mystore'} " in capsys.readouterr().out
    cell(sh, "import numpy as np\nx = np.ones(100_000)")
    cell(sh, "%dvr snapshot s1 x")
    monkeypatch.chdir(tmp_path / "b")
    cell(sh, "%dvr session other")
    cell(sh, "%dvr session notebook")
    cell(sh, "x[:] = 0")
    cell(sh, "%dvr restore s1")
    assert sh.user_ns["x"][5] == 1.0
    assert not (tmp_path / "b" / "mystore").exists()


def test_manual_snapshot_info_rm_twice_and_a_session_name_too_long_for_its_labels(sh, capsys):
    cell(sh, "import numpy as np\nx = np.ones(100_000)\nd = {'a': 1, 'w': np.zeros(40_000)}")
    cell(sh, "%dvr snapshot s1 x d")
    cell(sh, "%dvr snapshot s2 x")
    # Taken without the history's metadata: sizes and kinds from the regions.
    info = sh.run_line_magic("dvr", "info s1")
    got = {v.name: (v.kind, v.size) for v in info.variables}
    assert got["x"] == ("array", 800_000), got
    assert got["d"][0] == "object" and got["d"][1] > 0, got
    # A name given twice is removed once.
    capsys.readouterr()
    cell(sh, "%dvr rm s2 s2")
    assert "removed s2 " in capsys.readouterr().out and "s2" not in names(sh)
    # NAME.labels must be a valid session name too.
    with pytest.raises(UsageError, match="at most 121 characters"):
        sh.run_line_magic("dvr", "session " + "s" * 125)
    assert sh.run_line_magic("dvr", "ls").names() == ["s1"]
