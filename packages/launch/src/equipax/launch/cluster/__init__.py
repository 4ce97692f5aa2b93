"""Start-up of multi-process runs: devices, `jax.distributed`, local clusters."""

__all__: list[str] = []
