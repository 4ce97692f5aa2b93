"""equipax as a library: the user scripts in examples/ pass pyright strict, and they train."""

import json
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import REPO


def _pyright() -> str:
    exe = shutil.which("pyright", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("pyright is not installed in this environment (dev dependency group)")
    return exe


# Errors pyright strict reports in the examples that come from JAX's own annotations (its
# `device` parameters are typed with a name pyright cannot resolve), not from equipax.
JAX_CAUSED = ("device: Unknown",)


def test_examples_pass_pyright_strict():
    proc = subprocess.run(
        [_pyright(), "-p", "examples", "--outputjson"], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    diagnostics = json.loads(proc.stdout)["generalDiagnostics"]
    errors = [
        d for d in diagnostics if d["severity"] == "error" and not any(marker in d["message"] for marker in JAX_CAUSED)
    ]
    assert not errors, "\n".join(f"{d['file']}:{d['range']['start']['line'] + 1}: {d['message']}" for d in errors)


def _example(name: str):
    return runpy.run_path(str(REPO / "examples" / f"{name}.py"), run_name="example")


def test_custom_model_example_trains():
    first, last = _example("custom_model")["main"](steps=40)
    assert last < 0.5 * first


def test_lm_example_trains():
    loss = _example("train_lm")["main"](steps=12)
    assert np.isfinite(loss)


# ------------------------------------------------------------------ the loss contract


# ------------------------------------------------------------------ numpy ids, public API
