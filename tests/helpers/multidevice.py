"""Run code in a fresh process that sees N simulated CPU devices (set before JAX starts)."""

import os
import subprocess
import sys
import textwrap

from helpers.toy import FAST_COMPILE, suite_compile_cache_env, with_xla_flags

__all__ = ["FAST_COMPILE", "run_with_devices"]


def run_with_devices(code: str, devices: int = 8, timeout: float = 300, xla_flags: str = "") -> str:
    """Execute `code` in a new Python process with `devices` CPU devices; return its stdout.

    `xla_flags` are appended to `XLA_FLAGS` (e.g. `--xla_backend_optimization_level=0`: XLA:CPU
    compiles several times faster, for children that compile many small programs).

    The child runs with the same runtime checks as the test suite (rank promotion raises,
    warnings are errors) and on the suite's compile cache. Fails the calling test with the child's
    output on a non-zero exit.
    """
    env = with_xla_flags(
        dict(os.environ, **suite_compile_cache_env(), JAX_NUM_CPU_DEVICES=str(devices), JAX_PLATFORMS="cpu"), xla_flags
    )
    prelude = (
        "import warnings; warnings.simplefilter('error')\n"
        "import jax; jax.config.update('jax_numpy_rank_promotion', 'raise')\n"
        f"assert jax.device_count() == {devices}, jax.devices()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise AssertionError(f"child failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc.stdout
