"""The %dvr magics (memdvr.magics) and examples/jupyter_sweep.ipynb run in a real kernel."""

import json
import os
import pathlib
import re
import sys
import time

import numpy as np
import pytest

import memdvr

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "examples" / "jupyter_sweep.ipynb"
PACKAGE_DIR = str(pathlib.Path(memdvr.__file__).resolve().parents[1])  # .../build/python


# ------------------------------------------------------------ magics without a kernel

@pytest.fixture
def shell(tmp_path):
    pytest.importorskip("IPython", reason="IPython is not installed")
    from IPython.core.interactiveshell import InteractiveShell
    sh = InteractiveShell.instance()
    sh.run_line_magic("load_ext", "memdvr")
    sh.run_line_magic("dvr", "session notebook")
    sh.run_line_magic("dvr", f"store {tmp_path / 'store'}")
    yield sh
    sh.run_line_magic("dvr", "session notebook-closed")  # closes the session, releases arrays
    for var in ("data", "cfg", "other"):
        sh.user_ns.pop(var, None)


def test_memdvr_alone_does_not_import_ipython():
    import subprocess
    code = "import sys, memdvr; print('IPython' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": PACKAGE_DIR})
    assert out.stdout.strip() == "False"


def test_magics_snapshot_restore_in_place(shell, capsys):
    from IPython.core.error import UsageError
    ns = shell.user_ns
    ns["data"] = np.arange(300_000, dtype=np.float32).reshape(300, 1000)
    ns["cfg"] = {"lr": 0.1, "tags": ["a"]}
    data = ns["data"]
    shell.run_line_magic("dvr", "snapshot loaded data cfg")
    data[:10] = -1
    ns["cfg"]["lr"] = 9
    shell.run_line_magic("dvr", "snapshot changed")  # the same variables as last time
    shell.run_line_magic("dvr", "restore loaded")
    assert ns["data"] is data  # tracked in place: the same array object
    assert data[0, 1] == 1 and data[-1, -1] == 299_999
    assert ns["cfg"] == {"lr": 0.1, "tags": ["a"]}
    listing = shell.run_line_magic("dvr", "ls")  # a table object (text and HTML)
    out = repr(listing)
    assert re.search(r"^loaded .* data cfg( |$)", out, re.M) and re.search(r"^changed ", out, re.M)
    assert listing.names() == ["loaded", "changed"] and listing["loaded"].variables == ("data", "cfg")
    diff = shell.run_line_magic("dvr", "diff loaded changed")
    out = repr(diff)
    row = next(line.split() for line in out.splitlines() if line.startswith("data "))
    assert int(row[3]) > 0 and diff["data"].bytes_differ == int(row[3])
    assert "dvr-magics" not in out and "obj." not in out and diff["cfg"].bytes_differ > 0
    with pytest.raises(UsageError, match="no snapshot 'notebook/nope'"):
        shell.run_line_magic("dvr", "restore nope")
    with pytest.raises(UsageError, match="unknown variable.*missing_var"):
        shell.run_line_magic("dvr", "snapshot x missing_var")
    with pytest.raises(UsageError, match="unknown command"):
        shell.run_line_magic("dvr", "frobnicate")


def test_magics_rebound_array_of_other_size(shell, capsys):
    ns = shell.user_ns
    ns["data"] = np.ones((100, 100), np.float64)
    shell.run_line_magic("dvr", "snapshot a data")
    ns["data"] = np.zeros(50, np.int32)  # re-bound, another size: re-tracked
    shell.run_line_magic("dvr", "snapshot b data")
    ns["data"][:] = 7
    capsys.readouterr()
    shell.run_line_magic("dvr", "restore a")
    out = capsys.readouterr().out
    assert "note: 'data'" in out and "not in place" in out
    assert ns["data"].shape == (100, 100) and ns["data"].dtype == np.float64
    assert (ns["data"] == 1).all()
    shell.run_line_magic("dvr", "restore b")
    assert ns["data"].dtype == np.int32 and (ns["data"] == 0).all()
    # Non-trackable objects go through put(): a read-only array and a strided view.
    ro = np.arange(10.0)
    ro.flags.writeable = False
    ns["other"] = ro
    ns["cfg"] = np.arange(20)[::2]
    shell.run_line_magic("dvr", "snapshot c other cfg")
    ns["other"], ns["cfg"] = None, None
    shell.run_line_magic("dvr", "restore c")
    assert (ns["other"] == np.arange(10.0)).all() and (ns["cfg"] == np.arange(0, 20, 2)).all()


# ------------------------------------------------------------ the notebook in a real kernel

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


def test_notebook_runs_in_real_kernel(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed")
    nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed")
    pytest.importorskip("ipykernel", reason="ipykernel is not installed")
    from jupyter_client.manager import KernelManager

    # Our kernelspec first on JUPYTER_PATH, so "python3" is Debian's interpreter
    # whatever else is installed; the kernel inherits this environment.
    monkeypatch.setenv("JUPYTER_PATH", _kernel_env(tmp_path))
    monkeypatch.setenv("PYTHONPATH", PACKAGE_DIR)
    monkeypatch.setenv("MEMDVR_NOTEBOOK_STORE", str(tmp_path / "store"))
    monkeypatch.setenv("MEMDVR_NOTEBOOK_MIB", "64")
    monkeypatch.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")

    nb = nbformat.read(str(NOTEBOOK), as_version=4)
    for cell in nb.cells:  # the committed notebook has no outputs
        assert cell.get("outputs", []) == [] and cell.get("execution_count") is None
    km = KernelManager(kernel_name="python3")
    assert km.kernel_spec.argv[0] == "/usr/bin/python3", km.kernel_spec.argv
    client = nbclient.NotebookClient(nb, timeout=240, kernel_name="python3", km=km,
                                     resources={"metadata": {"path": str(tmp_path)}})
    t0 = time.perf_counter()
    client.execute()
    elapsed = time.perf_counter() - t0
    print(f"notebook executed in {elapsed:.1f} s")
    nbformat.write(nb, str(tmp_path / "executed.ipynb"))  # for a look after a failure

    texts = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for out in cell.outputs:
            assert out.output_type != "error", f"{out.get('ename')}: {out.get('evalue')}"
            if out.output_type == "stream":
                assert out.name == "stdout", f"stderr output: {out.text}"
                texts.append(out.text)
    text = "".join(texts)
    assert re.search(r"^loaded 64 MiB in [0-9.]+ ms, checksum [0-9a-f]{16}$", text, re.M), text
    assert re.search(r"^snapshot 'loaded': data \(64\.0 MiB, in place\), params \(object\)", text, re.M)
    for k in range(4):
        assert re.search(rf"^trial {k}: score [0-9.]+, checksum after restore OK", text, re.M), text
    assert len(re.findall(r"^restored 'loaded' in [0-9.]+ ms: data \(64\.0 MiB, in place\), "
                          r"params \(object\)$", text, re.M)) == 4, text
    assert re.search(r"^restore time: [0-9.]+ ms per trial", text, re.M), text
    assert re.search(r"^reload time: [0-9.]+ ms per trial", text, re.M), text
    m = re.search(r"^speed-up: ([0-9.]+)x, time saved over 4 trials: -?[0-9.]+ s$", text, re.M)
    assert m, text
    assert float(m.group(1)) > 0
    # The snapshot landed in the store the test chose.
    store = memdvr.Store(tmp_path / "store", create=False)
    assert [i.name for i in store.list("notebook")] == ["loaded"]


def test_magics_background_snapshot(shell, capsys):
    ns = shell.user_ns
    ns["big"] = np.random.default_rng(3).random((16 << 20) // 8)
    at_call = ns["big"].copy()
    shell.run_line_magic("dvr", "snapshot bg big --background")
    out = capsys.readouterr().out
    assert "snapshot 'bg'" in out
    ns["big"][:] = 0  # right after: not in the snapshot
    shell.run_line_magic("dvr", "wait")
    out2 = capsys.readouterr().out
    if "started in the background" in out:
        assert "is in the store" in out2
    else:
        assert "taken at once" in out and "no background snapshot" in out2
    shell.run_line_magic("dvr", "restore bg")
    assert np.array_equal(ns["big"], at_call)
