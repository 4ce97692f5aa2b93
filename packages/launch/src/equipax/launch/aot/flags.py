"""Compiler flags as experiment knobs: `train.compiler.xla_flags` -> `XLA_FLAGS`, `train.compiler.libtpu_init_args` ->
`LIBTPU_INIT_ARGS` (docs/compile.md, "Compiler flags").

XLA reads `XLA_FLAGS` when JAX starts a backend, and libtpu reads `LIBTPU_INIT_ARGS` when it loads
(for `launch compile --topology`, at `get_topology_desc`): `launch run` and `launch compile` call
`apply_compiler_flags` before either happens. A flag already in the environment with the same name
is replaced by the knob's; other flags already there are kept. The knobs are written to the job
directory's config.json like every knob, and the command prints what it set.
"""

import os
import shlex
from collections.abc import MutableMapping

__all__ = ["apply_compiler_flags", "merge_flags", "SEED_C4_22B_LIBTPU_INIT_ARGS"]

# The seed's multislice runs (Pax C4Spmd22BAdam{1,2}xv4_128): MaxText sets the same kind of
# LIBTPU_INIT_ARGS in its launch scripts.
SEED_C4_22B_LIBTPU_INIT_ARGS = (
    "--xla_jf_spmd_threshold_for_windowed_einsum_mib=0 --xla_tpu_spmd_threshold_for_allgather_cse=10000 "
    "--xla_enable_async_all_gather=true --xla_tpu_enable_latency_hiding_scheduler=true TPU_MEGACORE=MEGACORE_DENSE"
)


def _name(flag: str) -> str:
    return flag.split("=", 1)[0]


def merge_flags(current: str, added: str) -> str:
    """`current` flags with `added` appended; a flag of `added` replaces one of the same name."""
    new = shlex.split(added)
    names = {_name(f) for f in new}
    kept = [f for f in shlex.split(current) if _name(f) not in names]
    return " ".join(kept + new)


def apply_compiler_flags(
    xla_flags: str, libtpu_init_args: str, environ: MutableMapping[str, str] | None = None
) -> dict[str, str]:
    """Add the knobs' flags to `XLA_FLAGS` and `LIBTPU_INIT_ARGS`; call before JAX starts a backend.

    Arguments:
        xla_flags: `train.compiler.xla_flags` (XLA's own flags, for every backend; XLA:CPU aborts on a flag
            it does not know, so TPU-only flags belong in `libtpu_init_args`).
        libtpu_init_args: `train.compiler.libtpu_init_args` (read by libtpu only: TPU runs and TPU compiles).
        environ: the environment to change (default: this process's).

    Returns:
        `{variable: its new value}` for each variable changed (empty when both knobs are empty).
    """
    env = os.environ if environ is None else environ
    changed: dict[str, str] = {}
    for var, added in (("XLA_FLAGS", xla_flags), ("LIBTPU_INIT_ARGS", libtpu_init_args)):
        if added.strip():
            env[var] = changed[var] = merge_flags(env.get(var, ""), added)
    return changed
