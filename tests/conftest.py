"""Shared fixtures. No top-level imports of equipax: the jaxtyping import hook
(pytest --jaxtyping-packages, see pyproject.toml) must install before they load."""

import os

# Tests run on the CPU in float32, whatever else is installed.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")


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
