"""ruff (configured in pyproject.toml) finds nothing to report and nothing to reformat."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO


def _ruff() -> str:
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("ruff is not installed in this environment (dev dependency group)")
    return exe


def test_ruff_check_is_clean():
    proc = subprocess.run(
        [_ruff(), "check", "--output-format", "concise", "."], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_format_leaves_the_code_as_it_is():
    proc = subprocess.run([_ruff(), "format", "--check", "."], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, "run `uv run ruff format`:\n" + proc.stdout + proc.stderr
