"""Simulated devices: `--cpu-devices N` makes this process see N CPU devices.

JAX fixes its device list when the first computation runs, so this must happen before any
JAX operation; the `launch` command is a fresh process, and every command that accepts
`--cpu-devices` calls `use_cpu_devices` first.
"""

import jax

from equipax.core.config import ConfigError


def use_cpu_devices(n: int | None) -> None:
    """Run on `n` simulated CPU devices (no-op for None).

    Raises:
        ConfigError: `n` < 1, or JAX already started with a different device count.
    """
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
