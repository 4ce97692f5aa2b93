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


def test_fast_compile_is_left_out_of_xla_flags_where_the_cheaper_options_are_on():
    """JAX hashes XLA_FLAGS' text into its persistent-cache keys: a child given FAST_COMPILE on top
    of the cheaper options (which already compile at that LLVM level) would compile again what a
    child without it compiled. At JAX's default options the flag still applies."""
    from helpers.toy import FAST_COMPILE, with_xla_flags

    cheap = with_xla_flags({"JAX_DISABLE_MOST_OPTIMIZATIONS": "1", "XLA_FLAGS": "--xla_dump_to=x"}, FAST_COMPILE)
    assert cheap["XLA_FLAGS"] == "--xla_dump_to=x"
    assert with_xla_flags({"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}, f"{FAST_COMPILE} --xla_a=1") == {
        "JAX_DISABLE_MOST_OPTIMIZATIONS": "1",
        "XLA_FLAGS": "--xla_a=1",
    }
    assert with_xla_flags({"JAX_DISABLE_MOST_OPTIMIZATIONS": "0"}, FAST_COMPILE)["XLA_FLAGS"] == FAST_COMPILE
    assert with_xla_flags({}, FAST_COMPILE)["XLA_FLAGS"] == FAST_COMPILE
