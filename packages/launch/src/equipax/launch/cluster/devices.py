"""Simulated devices: `--cpu-devices N` makes this process see N CPU devices.

JAX fixes its device list when the first computation runs, so this must happen before any
JAX operation; the `launch` command is a fresh process, and every command that accepts
`--cpu-devices` calls `use_cpu_devices` first (which also quiets libtpu on a host without TPUs:
`equipax.launch.hardware.tpu.quiet_absent_tpu`).
"""

import contextlib
import threading

import jax

from equipax.core.knobs import ConfigError
from equipax.core.mesh import MeshConfig
from equipax.launch.hardware.tpu import quiet_absent_tpu

__all__ = ["check_cpu_devices", "open_devices_early", "use_cpu_devices"]


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


def open_devices_early() -> threading.Thread:
    """Start JAX's backend (opening the accelerator) on a background thread and return it.

    Opening a TPU takes seconds of libtpu's own work, and `launch run` needs the devices only after
    it has imported the training code (orbax, the models, the summaries): started here, once the
    compiler flags and `jax.distributed` are set (both are read when the backend starts), the two
    overlap, and the first call that needs the devices (`jax.device_count()`) waits for this one
    under JAX's own lock. libtpu holds Python's lock through much of its start, so what is gained
    is the imports' time (on the v5e: 1.3 s of a 9-s opening). A platform that cannot start is
    not remembered by JAX: that first call tries again and raises the error the command reports
    (docs/errors.md). `benchmarks/device_open.py` measures the overlap."""

    def open_() -> None:
        with contextlib.suppress(Exception):  # raised again, with its message, where first needed
            jax.devices()

    thread = threading.Thread(target=open_, name="equipax-open-devices", daemon=True)
    thread.start()
    return thread
