"""Shared fixtures. No top-level imports of equipax: the jaxtyping import hook
(pytest --jaxtyping-packages, see pyproject.toml) must install before they load."""

import os
import sys
from pathlib import Path

# Tests run on the CPU in float32, whatever else is installed.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")

# Bytecode: where PYTHONDONTWRITEBYTECODE is set, every Python process the suite starts (the xdist
# workers, each `launch` subprocess, each multi-host rank) compiles the sources of jax, orbax and
# equipax again: ~2.7 s of CPU per process, measured (4.3 s to import them without .pyc files,
# 1.6 s with). The suite's processes share one bytecode cache under .pytest_cache instead, outside
# the source tree. Set here, before pytest-xdist starts its workers, so they and their children
# inherit it.
_PYCACHE = Path(__file__).resolve().parents[1] / ".pytest_cache" / "pycache"
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
os.environ.setdefault("PYTHONPYCACHEPREFIX", str(_PYCACHE))
sys.dont_write_bytecode = False
sys.pycache_prefix = sys.pycache_prefix or os.environ["PYTHONPYCACHEPREFIX"]


@pytest.fixture
def key():
    return jax.random.key(0)


def assert_trees_close(a, b, *, rtol=1e-5, atol=1e-6):
    """Assert two pytrees have equal structure and numerically close leaves."""
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb, f"tree structures differ:\n{ta}\n{tb}"
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


@pytest.fixture
def trees_close():
    return assert_trees_close


@pytest.fixture(scope="module")
def one_step():
    """(initial state, state after one train step, metrics, batch, optimizer) of a tiny CNN."""
    from helpers import cnn

    return cnn.one_step()


def pytest_collection_modifyitems(config, items):
    """The suite runs on pytest-xdist workers (`-n` in pyproject.toml's addopts, `--dist loadgroup`):
    tests sharing a module-scoped fixture (a trained job, a built venv) stay on one worker, so the
    fixture is built once; every other test goes to whichever worker is free."""
    for item in items:
        fixturedefs = getattr(item, "_fixtureinfo", None)
        if fixturedefs is None:
            continue
        if any(defs and defs[-1].scope == "module" for defs in fixturedefs.name2fixturedefs.values()):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


@pytest.fixture(autouse=True)
def _compiler_flags_restored():
    """In-process `launch run` / `pgle collect` set XLA_FLAGS and LIBTPU_INIT_ARGS (and, on a host
    without TPUs, libtpu's TPU_* variables) in this process's environment (as they must, before JAX
    starts); each test gets back the values it started with,
    so one test's flags never reach another's child processes."""
    saved = {
        var: os.environ.get(var)
        for var in (
            "XLA_FLAGS",
            "LIBTPU_INIT_ARGS",
            "TPU_ACCELERATOR_TYPE",
            "TPU_WORKER_HOSTNAMES",
            "TPU_WORKER_ID",
            "EQUIPAX_QUIETED_LIBTPU",
        )
    }
    yield
    for var, value in saved.items():
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value
