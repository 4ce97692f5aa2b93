"""The suite's own compile settings (tests/conftest.py): cheaper XLA options everywhere, JAX's
default where a test is marked `xla_default_level`."""

import os
import subprocess
import sys

import pytest


def _most_optimizations_disabled() -> bool:
    from jax._src import compiler

    return bool(compiler._DISABLE_MOST_OPTIMIZATIONS.value)


@pytest.mark.skipif(os.environ.get("EQUIPAX_TEST_XLA_DEFAULT") == "1", reason="the whole suite at the default")
def test_the_suite_and_its_children_compile_with_the_cheaper_options():
    assert _most_optimizations_disabled()
    child = subprocess.run(
        [sys.executable, "-c", "from jax._src import compiler; print(compiler._DISABLE_MOST_OPTIMIZATIONS.value)"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert child.stdout.strip() == "True", child.stdout + child.stderr


@pytest.mark.xla_default_level
def test_a_marked_test_compiles_at_the_default_options():
    assert not _most_optimizations_disabled()
