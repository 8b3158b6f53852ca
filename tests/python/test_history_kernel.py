"""The automatic notebook history (%dvr auto, checkout, undo, log, %%dvr trial) in
real kernels (nbclient): 22 cells with two branches, a checkout, an undo, trial
cells (one that raises), unpicklable objects, then a new kernel that checks out
past commits from the store alone."""

import json
import os
import pathlib

import pytest

import memdvr

PACKAGE_DIR = str(pathlib.Path(memdvr.__file__).resolve().parents[1])  # .../build/python


def _kernel_env(tmp_path):
    """JUPYTER_PATH with a python3 kernelspec that runs /usr/bin/python3 (Debian's ipykernel)."""
    kdir = tmp_path / "jupyter" / "kernels" / "python3"
    kdir.mkdir(parents=True)
    (kdir / "kernel.json").write_text(json.dumps({
        "argv": ["/usr/bin/python3", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (memdvr test)",
        "language": "python",
    }))
    return str(tmp_path / "jupyter")


@pytest.fixture
def run_notebook(tmp_path, monkeypatch):
    """run_notebook(cells) executes the cells in a fresh kernel and returns the
    executed notebook; a cell given as (source, "raises") may raise."""
    nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed")
    nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed")
    pytest.importorskip("ipykernel", reason="ipykernel is not installed")
    from jupyter_client.manager import KernelManager

    monkeypatch.setenv("JUPYTER_PATH", _kernel_env(tmp_path))
    monkeypatch.setenv("PYTHONPATH", PACKAGE_DIR)
    monkeypatch.setenv("MEMDVR_TEST_STORE", str(tmp_path / "store"))
    monkeypatch.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    runs = []

    def run(cells):
        nb = nbformat.v4.new_notebook()
        for c in cells:
            src, raises = (c, False) if isinstance(c, str) else (c[0], c[1] == "raises")
            cell = nbformat.v4.new_code_cell(src)
            if raises:
                cell.metadata["tags"] = ["raises-exception"]
            nb.cells.append(cell)
        km = KernelManager(kernel_name="python3")
        assert km.kernel_spec.argv[0] == "/usr/bin/python3", km.kernel_spec.argv
        nbclient.NotebookClient(nb, timeout=240, kernel_name="python3", km=km,
                                resources={"metadata": {"path": str(tmp_path)}}).execute()
        nbformat.write(nb, str(tmp_path / f"executed-{len(runs)}.ipynb"))  # for a look after a failure
        runs.append(nb)
        return nb

    return run


def _outputs(nb):
    """Per cell: (stdout text, stderr text, [error outputs])."""
    res = []
    for cell in nb.cells:
        out = "".join(o.text for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")
        err = "".join(o.text for o in cell.outputs if o.output_type == "stream" and o.name == "stderr")
        res.append((out, err, [o for o in cell.outputs if o.output_type == "error"]))
    return res


def _checks(nb):
    """The CHECK {json} lines the cells printed, in order."""
    found = []
    for out, _, _ in _outputs(nb):
        for line in out.splitlines():
            if line.startswith("CHECK "):
                found.append(json.loads(line[len("CHECK "):]))
    return found


SETUP = [
    "%load_ext memdvr",
    "import os, json\nimport numpy as np\nstore_dir = os.environ['MEMDVR_TEST_STORE']",
    "%dvr store $store_dir   # the store of this test: a trailing comment is no argument",
    "%dvr auto on  # a commit after every cell from here",
]

CHECK_STATE = ("print('CHECK', json.dumps({'a0': float(a[0]), 'a1000': float(a[1000]), "
               "'a_sum': float(a.sum()), 'vars': sorted(k for k in ('a', 'b', 'c', 'cfg', 'box', "
               "'scale', 'Box', 'gen', 'f') if k in globals()), "
               "'lr': cfg['lr'] if 'cfg' in globals() else None, "
               "'b': float(b.sum()) if 'b' in globals() else None}))")


def test_history_branches_checkout_undo_trial_restart(run_notebook):
    n = 1_000_000  # float64: 8 MB, a tracked region
    first = run_notebook(SETUP + [
        f"a = np.arange({n}, dtype=np.float64)",                                    # 5
        "a[:1000] = -1\ncfg = {'lr': 0.1}",                                        # 6
        "gen = (i for i in range(3))\nf = lambda x: x",                             # 7 unpicklable
        "def scale(x, k=2):\n    return x * k\n\nclass Box:\n"
        "    def __init__(self, v):\n        self.v = v\n\nbox = Box(scale(3))",   # 8
        "a[1000:2000] = scale(a[1000:2000])\ncfg['lr'] = 0.2",                      # 9
        CHECK_STATE,                                                                # 10 no commit
        "%dvr checkout 6",                                                          # 11
        CHECK_STATE,                                                                # 12
        "b = np.full(100_000, 7.0)  # a branch from cell-6",                        # 13
        "a[:10] = 42",                                                              # 14
        "%dvr undo",                                                                # 15
        CHECK_STATE,                                                                # 16
        ("%%dvr trial\na[:] = 0\nb[:] = 0\nc = 1\nraise ValueError('trial failed')", "raises"),  # 17
        CHECK_STATE,                                                                # 18
        "%%dvr trial 13\nc = 2\nb[:] = 1\nprint('in trial', float(b.sum()))",       # 19
        CHECK_STATE,                                                                # 20
        "log = %dvr log\nls = %dvr ls\n"
        "print('CHECK', json.dumps({'head': log.head, 'names': [e.name for e in log], "
        "'parents': {e.name: e.parent for e in log}, 'kids6': log.children('cell-6'), "
        "'html': '<table>' in log._repr_html_() and '<table>' in ls._repr_html_(), "
        "'ls': ls.names(), 'vars9': list(ls['cell-9'].variables)}))\nprint(log)",  # 21
        "%dvr checkout 9",                                                          # 22
        CHECK_STATE,                                                                # 23
        "info = %dvr info 9\nprint('CHECK', json.dumps({v.name: [v.kind, v.change, v.bytes_changed] "
        "for v in info.variables}))",                                               # 24
    ])
    outs = _outputs(first)
    for k, (out, err, errors) in enumerate(outs, start=1):
        if k != 17:
            assert not errors, f"cell {k}: {errors[0].ename}: {errors[0].evalue}"
        assert "was not committed" not in err, f"cell {k}: {err}"
    # The trial that raised: the user's exception is the cell's error.
    assert [e.ename for e in outs[16][2]] == ["ValueError"] and outs[16][2][0].evalue == "trial failed"
    assert "trial done: back to cell-13" in outs[16][0]
    # Unpicklable objects: a note once, for each.
    notes = "".join(o[0] for o in outs)
    assert notes.count("not captured: 'gen'") == 1 and notes.count("not captured: 'f'") == 1
    checks = _checks(first)
    assert len(checks) == 8
    s10, s12, s16, s18, s20, log, s23, info9 = checks
    base = float(sum(range(n)))
    # cell 10: after cell 9
    assert s10["a0"] == -1 and s10["a1000"] == 2000 and s10["lr"] == 0.2
    assert s10["vars"] == ["Box", "a", "box", "cfg", "f", "gen", "scale"]
    # cell 12: back at cell-6: cell 9's write undone, later variables gone
    assert s12["a0"] == -1 and s12["a1000"] == 1000 and s12["lr"] == 0.1
    assert s12["vars"] == ["a", "cfg"]
    assert s12["a_sum"] == base - sum(range(1000)) - 1000
    # cell 16: undo of cell 14 -> cell-13 (the branch's first commit)
    assert s16["a0"] == -1 and s16["b"] == 700_000 and s16["vars"] == ["a", "b", "cfg"]
    # cell 18: the trial that raised changed nothing that stays
    assert s18 == s16
    # cell 20: the trial with BASE 13: same again, and `c` is gone
    assert s20 == s16
    assert "in trial 100000.0" in outs[18][0]
    # cell 21: the tree: cell-6 has two children (cell-7 ... and the branch cell-13)
    assert log["head"] == "cell-13"
    assert log["kids6"] == ["cell-7", "cell-13"]
    assert log["parents"]["cell-13"] == "cell-6" and log["parents"]["cell-14"] == "cell-13"
    assert log["parents"]["cell-9"] == "cell-8" and log["parents"]["cell-5"] == "cell-4"
    assert log["html"] is True
    # cells 10, 12, 16, 18, 20 changed nothing (no commit); 11, 15 were checkouts
    assert log["ls"] == ["cell-4", "cell-5", "cell-6", "cell-7", "cell-8", "cell-9", "cell-13", "cell-14"]
    assert set(log["vars9"]) >= {"a", "cfg", "box", "scale", "Box"} and "gen" not in log["vars9"]
    assert "├─ cell-7" in outs[20][0] and "└─ cell-13" in outs[20][0] and "<- HEAD" in outs[20][0]
    # cell 23: checkout 9 from the branch: a, cfg, box, scale, Box back; b gone
    assert s23["a1000"] == 2000 and s23["a0"] == -1 and s23["lr"] == 0.2
    assert s23["vars"] == ["Box", "a", "box", "cfg", "scale"]
    # cell 24: what cell 9 changed
    assert info9["a"][:2] == ["array", "changed"] and 0 < info9["a"][2] <= 1000 * 8
    assert info9["cfg"][:2] == ["object", "changed"]
    assert info9["box"][:2] == ["object", "unchanged"] and info9["scale"][:2] == ["source", "unchanged"]
    assert info9["gen"][0] == "skipped"

    # A new kernel: the commits come from the store alone.
    second = run_notebook(SETUP[:3] + [
        "%dvr checkout 8",                                                          # 4
        CHECK_STATE + "\nprint('CHECK', json.dumps({'box': box.v, 'cls': type(box) is Box, "
        "'scale': scale(5)}))",                                                     # 5
        "%dvr auto on",                                                             # 6
        "z = scale(a[:3]).tolist()",                                                # 7 -> cell-7.2
        "log = %dvr log\nprint('CHECK', json.dumps({'head': log.head, "
        "'parent': {e.name: e.parent for e in log}['cell-7.2'], 'z': z}))",         # 8
        "%dvr checkout 14",                                                         # 9
        CHECK_STATE,                                                                # 10
    ])
    outs2 = _outputs(second)
    for k, (out, err, errors) in enumerate(outs2, start=1):
        assert not errors, f"cell {k} of the new kernel: {errors[0].ename}: {errors[0].evalue}"
    c5, c5b, c8, c10 = _checks(second)
    assert c5["a0"] == -1 and c5["a1000"] == 1000 and c5["lr"] == 0.1
    assert c5["vars"] == ["Box", "a", "box", "cfg", "scale"]
    assert c5b == {"box": 6, "cls": True, "scale": 10}
    assert "not captured by cell-8 and not defined now: gen, f" in outs2[3][0]
    assert c8 == {"head": "cell-7.2", "parent": "cell-8", "z": [-2.0, -2.0, -2.0]}
    assert c10["a0"] == 42 and c10["a1000"] == 1000 and c10["b"] == 700_000
    assert c10["vars"] == ["a", "b", "cfg"]
    store = memdvr.Store(os.environ["MEMDVR_TEST_STORE"], create=False)
    names = [i.name for i in store.list("notebook")]
    assert "cell-7.2" in names and names.count("cell-7") == 1
