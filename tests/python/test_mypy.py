"""The package passes `mypy --strict` on its own code (issue #17, item 4):
python/memdvr/*.py checked against the stubs of its extension modules
(_core.pyi, _mpi.pyi), with the configuration in pyproject.toml ([tool.mypy]:
IPython and mpi4py carry no types). Debian's mypy (python3-mypy)."""

import importlib.util
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_package_passes_mypy_strict(tmp_path):
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (Debian: apt install python3-mypy; bash install-deps.sh installs it)")
    proc = subprocess.run(
        ["/usr/bin/python3", "-m", "mypy", "--strict", "--config-file", str(ROOT / "pyproject.toml"),
         "--cache-dir", str(tmp_path / "mypy-cache"), "--no-error-summary", "-p", "memdvr"],
        cwd=ROOT / "python", capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"mypy --strict found errors:\n{proc.stdout}{proc.stderr}"
    assert proc.stdout.strip() == "", proc.stdout
