"""Simulated devices: `--cpu-devices N` makes this process see N CPU devices.

JAX fixes its device list when the first computation runs, so this must happen before any
JAX operation; the `launch` command is a fresh process, and every command that accepts
`--cpu-devices` calls `use_cpu_devices` first (which also quiets libtpu on a host without TPUs:
`quiet_absent_tpu`).
"""

import os
from collections.abc import MutableMapping
from pathlib import Path

import jax

from equipax.core.knobs import ConfigError
from equipax.core.mesh import MeshConfig

__all__ = ["check_cpu_devices", "quiet_absent_tpu", "use_cpu_devices", "QUIETED_TPU"]

# Set (to "1") where `quiet_absent_tpu` gave libtpu its variables, so a compile for a real slice
# (`equipax.launch.aot.tpu.prepare_libtpu`) knows it may replace them.
QUIETED_TPU = "EQUIPAX_QUIETED_LIBTPU"


def _has_tpu_chips(dev: Path = Path("/dev")) -> bool:
    """TPU VMs expose their chips as /dev/accel<N> (v4, v5e) or /dev/vfio/<N> (v5p, v6e)."""
    return any(dev.glob("accel*")) or any(p.name.isdigit() for p in (dev / "vfio").glob("*"))


def quiet_absent_tpu(environ: MutableMapping[str, str] | None = None, *, dev: Path = Path("/dev")) -> bool:
    """Keep libtpu quiet on a host without TPU chips; call before JAX starts.

    With JAX_PLATFORMS unset (or naming tpu) JAX loads libtpu, which on a host that is not a TPU
    VM looks for the VM's metadata, finds none and prints "Failed to find host bounds" and an
    INVALID_ARGUMENT trace on stderr before anything the user must read; it then finds no chip and
    JAX goes on with the other platforms. Where there is no chip and no TPU variable is set, this
    gives libtpu the variables that answer its question (as for a compile-only libtpu), so it
    finds no chip silently. A TPU VM (chips present, or its variables set) is left alone.

    Returns:
        Whether the variables were set.
    """
    env = os.environ if environ is None else environ
    platforms = env.get("JAX_PLATFORMS", "")
    if platforms and "tpu" not in platforms.split(","):
        return False  # libtpu is not loaded
    if any(env.get(v) for v in ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "TPU_WORKER_ID")):
        return False
    if _has_tpu_chips(dev):
        return False
    env.update(TPU_ACCELERATOR_TYPE="v4-8", TPU_WORKER_HOSTNAMES="localhost", TPU_WORKER_ID="0")
    env[QUIETED_TPU] = "1"
    return True


def use_cpu_devices(n: int | None) -> None:
    """Run on `n` simulated CPU devices (None: the devices JAX finds); libtpu kept quiet where
    there is no TPU (`quiet_absent_tpu`).

    Raises:
        ConfigError: `n` < 1, or JAX already started with a different device count.
    """
    quiet_absent_tpu()
    if n is None:
        return
    if n < 1:
        raise ConfigError(f"--cpu-devices must be >= 1; got {n}.")
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        devices = jax.devices()
        if devices[0].platform == "cpu" and len(devices) == n:
            return
        raise ConfigError(
            f"--cpu-devices {n}: JAX already started in this process with {len(devices)} "
            f"{devices[0].platform} device(s). Run the `launch` command in a fresh process."
        ) from None


def check_cpu_devices(n: int | None, mesh: MeshConfig, *, num_processes: int = 1) -> None:
    """Refuse `--cpu-devices n` at once when the experiment's mesh cannot use that many devices.

    Creating thousands of simulated devices takes a minute; the mesh's need is known before.

    Raises:
        ConfigError: `n` < 1, or the mesh cannot use `n` x `num_processes` devices.
    """
    quiet_absent_tpu()
    if n is None:
        return
    if n < 1:
        raise ConfigError(f"--cpu-devices must be >= 1; got {n}.")
    total = n * num_processes
    # A -1 axis takes any multiple of the fixed axes (`num_devices` counts it as 1).
    if total == mesh.num_devices or (mesh.flexible and total % mesh.num_devices == 0):
        return
    processes = f" x {num_processes} processes" if num_processes > 1 else ""
    need = f"a multiple of {mesh.num_devices}" if mesh.flexible else str(mesh.num_devices)
    fix = (
        ""
        if mesh.flexible or mesh.num_devices % num_processes
        else f"use --cpu-devices {mesh.num_devices // num_processes}, or "
    )
    raise ConfigError(
        f"--cpu-devices {n}{processes} gives {total} devices, but the experiment's mesh (ici_mesh_shape="
        f"{mesh.ici_mesh_shape} x dcn_mesh_shape={mesh.dcn_mesh_shape}) needs {need}: {fix}change the mesh "
        "(`launch show --exp NAME` prints it)."
    )
