"""pyright (basic mode, configured in pyproject.toml) is clean on packages/."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO


@pytest.mark.slow
def test_pyright_clean_on_packages():
    exe = shutil.which("pyright", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("pyright is not installed in this environment (dev dependency group)")
    proc = subprocess.run([exe, "packages/"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 errors" in proc.stdout


def test_every_package_ships_py_typed():
    for pkg in ("core", "models", "data", "launch"):
        assert (REPO / "packages" / pkg / "src" / "equipax" / pkg / "py.typed").exists(), pkg
    # PEP 420 namespace: no equipax/__init__.py anywhere.
    assert not list((REPO / "packages").glob("*/src/equipax/__init__.py"))
