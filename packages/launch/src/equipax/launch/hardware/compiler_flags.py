"""Compiler flags as experiment knobs: `train.compiler.xla_flags` -> `XLA_FLAGS`, `train.compiler.libtpu_init_args` ->
`LIBTPU_INIT_ARGS` (docs/compile.md, "Compiler flags").

XLA reads `XLA_FLAGS` when JAX starts a backend, and libtpu reads `LIBTPU_INIT_ARGS` when it loads
(for `launch compile --topology`, at `get_topology_desc`): `launch run` and `launch compile` call
`apply_compiler_flags` before either happens. A flag already in the environment with the same name
is replaced by the knob's; other flags already there are kept. The knobs are written to the job
directory's config.json like every knob, and the command prints what it set.

Both libraries end the process on a flag they do not know (XLA: a fatal "Unknown flag in
XLA_FLAGS"; libtpu: "Unknown command line flag"), with no word of which knob set it, and libtpu
loads even for a CPU run when JAX_PLATFORMS is unset. `check_compiler_flags` finds that out first,
in a child process that starts the CPU backend and loads libtpu for a compile-only topology (no
chip is opened), and turns it into an error naming the knob; a flag set that passed is remembered
(in the machine's cache, `~/.cache/equipax/compiler_flags.json` by default:
`equipax.launch.store.machine_cache`), so a rerun does not probe again.
"""

import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from equipax.core.knobs import ConfigError

__all__ = ["apply_compiler_flags", "check_compiler_flags", "merge_flags", "SEED_C4_22B_LIBTPU_INIT_ARGS"]

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


# The child: start XLA's CPU backend (which parses XLA_FLAGS), and load libtpu for a one-host v4
# topology when it is installed and LIBTPU_INIT_ARGS is set (libtpu parses its flags as it loads).
_PROBE = """
import os
import jax
jax.devices("cpu")
import importlib.util
if os.environ.get("LIBTPU_INIT_ARGS") and importlib.util.find_spec("libtpu") is not None:
    from jax.experimental import topologies
    topologies.get_topology_desc(platform="tpu", topology_name="v4:2x2x1", chip_config_name="megacore",
                                 chips_per_host_bounds=(2, 2, 1), num_slices=1)
"""


def _cache() -> Path | None:
    from equipax.launch.store.machine_cache import cache_root

    root = cache_root()
    return root / "compiler_flags.json" if root is not None else None


def _key(environ: Mapping[str, str]) -> str:
    from importlib.metadata import version

    text = json.dumps(
        [version("jax"), version("jaxlib"), environ.get("XLA_FLAGS", ""), environ.get("LIBTPU_INIT_ARGS", "")]
    )
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _known_good() -> set[str]:
    path = _cache()
    if path is None:
        return set()
    try:
        return set(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return set()


def _remember(key: str) -> None:
    path = _cache()
    if path is None:
        return  # caching is off (EQUIPAX_CACHE_DIR=""): the next run probes again
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(sorted(_known_good() | {key})[-200:]))
        tmp.replace(path)
    except OSError:
        pass  # a read-only home: the next run probes again


def check_compiler_flags(changed: Mapping[str, str], *, xla_flags: str, libtpu_init_args: str) -> None:
    """Refuse, before JAX starts in this process, flags XLA or libtpu do not know.

    Arguments:
        changed: what `apply_compiler_flags` set (nothing to check when it set nothing: the
            environment's own flags are the user's shell's business).
        xla_flags, libtpu_init_args: the knobs' values, to say whether a bad flag came from a knob
            or from the environment.

    Raises:
        ConfigError: a flag is unknown (the message names it, the knob or variable, and the fix).
    """
    if not changed:
        return
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    key = _key(env)
    if key in _known_good():
        return
    env.setdefault("TPU_ACCELERATOR_TYPE", "v4-8")
    env.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    env.setdefault("TPU_WORKER_ID", "0")
    env.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        probe = subprocess.run(
            [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, errors="replace", timeout=300
        )
    except (OSError, subprocess.TimeoutExpired):
        return  # the probe could not run: the process itself will say what it finds
    if probe.returncode == 0:
        _remember(key)
        return
    xla = re.search(r"Unknown flags? in XLA_FLAGS: (.*)", probe.stderr)
    tpu = re.findall(r"Unknown command line flag '([^']*)'", probe.stderr)
    if xla:
        bad = xla.group(1).strip()
        source = (
            "train.compiler.xla_flags"
            if any(_name(b) in {_name(f) for f in shlex.split(xla_flags)} for b in shlex.split(bad))
            else "XLA_FLAGS in the environment"
        )
        raise ConfigError(
            f"{source}: XLA does not know the flag(s) {bad} (XLA_FLAGS={env.get('XLA_FLAGS', '')!r}); XLA would "
            "end the process as JAX starts. Correct or remove it; TPU-only flags belong in "
            "train.compiler.libtpu_init_args."
        )
    if tpu:
        names = {_name(f).lstrip("-") for f in shlex.split(libtpu_init_args)}
        source = (
            "train.compiler.libtpu_init_args" if any(t in names for t in tpu) else "LIBTPU_INIT_ARGS in the environment"
        )
        raise ConfigError(
            f"{source}: libtpu does not know the flag(s) {', '.join('--' + t for t in tpu)} "
            f"(LIBTPU_INIT_ARGS={env.get('LIBTPU_INIT_ARGS', '')!r}); libtpu would end the process when it "
            "loads (even a CPU run loads it unless JAX_PLATFORMS=cpu). Correct or remove it; flags XLA "
            "itself knows on every backend belong in train.compiler.xla_flags."
        )
