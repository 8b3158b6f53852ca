"""Packaging (pyproject.toml, scikit-build-core): pip builds memdvr from the
source tree with Debian's packages (--no-build-isolation) into a target
directory, and the installed copy works on its own: imported from there (not
from the build tree), snapshot and restore of a numpy array, `python -m memdvr`.

Slow-ish (a full wheel build of libdvr and memdvr._core, about 30 s on 2
cores), so CTest runs it as a test of its own, `python_packaging`; it writes
only under pytest's tmp_path, never into the source tree."""

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PYTHON = "/usr/bin/python3"

# What a build could leave in the source tree if it were not kept out of it.
BUILD_LITTER = re.compile(r"(^_skbuild$|^dist$|^wheelhouse$|\.egg-info$|\.whl$|^build$)")


def _litter():
    found = set()
    for d in (REPO, REPO / "python"):
        found |= {str(p.relative_to(REPO)) for p in d.iterdir() if BUILD_LITTER.search(p.name)}
    return found


def _project_version():
    text = (REPO / "CMakeLists.txt").read_text()
    m = re.search(r"project\([^)]*VERSION\s+([0-9.]+)", text)
    assert m, "no project(... VERSION x.y.z) in CMakeLists.txt"
    return m.group(1)


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONUSERBASE", "PYTHONSTARTUP", "CMAKE_ARGS")
           and not k.startswith(("PIP_", "SKBUILD"))}
    env["PIP_CONFIG_FILE"] = os.devnull  # no user or site pip.conf (index URLs, ...)
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """pip install --no-build-isolation --target: returns the target directory."""
    for mod in ("pip", "scikit_build_core"):
        r = subprocess.run([PYTHON, "-c", f"import {mod}"], capture_output=True, text=True)
        assert r.returncode == 0, (
            f"{PYTHON} cannot import {mod} (run install-deps.sh): {r.stderr}")
    tmp = tmp_path_factory.mktemp("packaging")
    target, build = tmp / "site", tmp / "build"
    litter_before = _litter()
    cmd = [PYTHON, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-index",
           "--no-cache-dir", "--disable-pip-version-check", "--no-input",
           "--target", str(target), f"--config-settings=build-dir={build}", str(REPO)]
    start = time.monotonic()
    r = subprocess.run(cmd, cwd=tmp, env=_clean_env(), capture_output=True, text=True,
                       timeout=540)
    elapsed = time.monotonic() - start
    assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stdout[-6000:]}\n{r.stderr[-6000:]}"
    print(f"pip install --target: {elapsed:.0f} s")
    assert (build / "CMakeCache.txt").is_file(), "the build did not happen in build-dir"
    assert _litter() == litter_before, "the build wrote into the source tree"
    return target


def _run(target, code, cwd):
    return subprocess.run([PYTHON, "-c", textwrap.dedent(code)], cwd=cwd,
                          env=_clean_env(PYTHONPATH=str(target), DVR_STORE=str(cwd / "store")),
                          capture_output=True, text=True, timeout=120)


def test_wheel_contents(installed):
    pkg = installed / "memdvr"
    names = sorted(p.name for p in pkg.iterdir() if p.name != "__pycache__")
    cores = [n for n in names if n.startswith("_core.") and n.endswith(".so")]
    assert len(cores) == 1, names
    assert set(names) == {"__init__.py", "__main__.py", "magics.py", "history.py", "_core.pyi", "py.typed",
                          cores[0]}, names
    # libdvr is linked into the module: nothing else of ours to find at run time.
    dyn = subprocess.run(["readelf", "-d", str(pkg / cores[0])], capture_output=True,
                         text=True, check=True).stdout
    assert "libdvr" not in dyn, dyn
    assert "RPATH" not in dyn and "RUNPATH" not in dyn, dyn
    # Nothing but the package and its metadata lands in site-packages.
    version = _project_version()
    assert {p.name for p in installed.iterdir()} == {"memdvr", f"memdvr-{version}.dist-info"}
    meta = (installed / f"memdvr-{version}.dist-info" / "METADATA").read_text()
    assert "Name: memdvr\n" in meta
    assert f"Version: {version}\n" in meta
    assert "Requires-Python: >=3.11\n" in meta
    assert "Requires-Dist: numpy\n" in meta
    assert "Provides-Extra: jupyter\n" in meta


def test_import_snapshot_restore(installed, tmp_path):
    r = _run(installed, f"""
        import os, sys
        import numpy as np
        import memdvr
        target = os.path.realpath({str(installed)!r})
        assert os.path.realpath(memdvr.__file__).startswith(target + os.sep), memdvr.__file__
        assert os.path.realpath(memdvr._core.__file__).startswith(target + os.sep)
        assert memdvr.__version__ == {_project_version()!r}, memdvr.__version__
        store = memdvr.Store({str(tmp_path / "store")!r})
        s = memdvr.Session(store, "pkg")
        a = np.random.default_rng(7).random(300_000)
        original = a.copy()
        s.track("a", a)
        info = s.snapshot("base", label="packaged")
        assert info.logical_bytes == a.nbytes
        a[::3] = -1.0
        s.restore("base")
        np.testing.assert_array_equal(a, original)
        assert [x.name for x in store.list("pkg")] == ["base"]
        print("ok", memdvr.__file__)
        """, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("ok "), r.stdout


def test_python_m_memdvr(installed, tmp_path):
    env = _clean_env(PYTHONPATH=str(installed), DVR_STORE=str(tmp_path / "store"))
    r = subprocess.run([PYTHON, "-m", "memdvr", "--help"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "usage: python -m memdvr" in r.stdout
    # The default store is $DVR_STORE: a snapshot taken there is listed.
    r = _run(installed, """
        import numpy as np, memdvr
        s = memdvr.Session(memdvr.Store(), "cli")
        s.track("x", np.arange(1000.0))
        s.snapshot("one")
        """, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run([PYTHON, "-m", "memdvr", "ls", "--json"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert [(x["session"], x["name"]) for x in json.loads(r.stdout)["snapshots"]] == [("cli", "one")]
