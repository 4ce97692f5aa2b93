"""A checkpoint's copy off a TPU, in waves that fit libtpu's premapped host buffer.

libtpu moves data between the host and a TPU through a host buffer it pins when it opens the
chip, `TPU_PREMAPPED_BUFFER_SIZE` bytes (4 GiB unless set). A transfer that does not fit in what
is free of it takes a path of its own, several times slower. orbax starts the device-to-host copy
of every array of a checkpoint at once: 24 arrays of 256 MiB (6 GiB; c4_1b at 6 layers' state is
6.2) left the TPU v5e in 3.67 s all at once and in 2.22 s in waves of 2 GiB, and with a 1-GiB
buffer in 9.99 s against 2.17 s in waves of 1 GiB (benchmarks/README.md, "eleventh session").

`transfer_in_waves` wraps orbax's `transfer_arrays_to_host` (the step of a save that copies the
arrays to host memory and blocks until they are there) so that on a TPU it copies them in waves
of at most half the buffer, each waited for before the next starts. What is written is unchanged:
the same function returns the same host copies, in order. Elsewhere (CPU, GPU) and in an orbax
without that function, nothing changes.
"""

import functools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax

__all__ = ["LIBTPU_DEFAULT_BUFFER_BYTES", "transfer_in_waves", "wave_bytes", "waves"]

# libtpu's premapped host buffer where `TPU_PREMAPPED_BUFFER_SIZE` is not set.
LIBTPU_DEFAULT_BUFFER_BYTES = 4 * 2**30


def wave_bytes(environ: Mapping[str, str] | None = None) -> int:
    """Bytes per wave: half of libtpu's premapped buffer (`TPU_PREMAPPED_BUFFER_SIZE`, else 4 GiB),
    leaving room for the transfers the run makes meanwhile (a batch, the metrics)."""
    env = os.environ if environ is None else environ
    try:
        buffer = int(env.get("TPU_PREMAPPED_BUFFER_SIZE", LIBTPU_DEFAULT_BUFFER_BYTES))
    except ValueError:
        buffer = LIBTPU_DEFAULT_BUFFER_BYTES
    return max(buffer, 2**20) // 2


def waves(sizes: Sequence[int], limit: int) -> Iterator[list[int]]:
    """Indices of `sizes`, in order, in consecutive groups of at most `limit` bytes together (an
    item larger than `limit` is a group of its own)."""
    group: list[int] = []
    total = 0
    for i, size in enumerate(sizes):
        if group and total + size > limit:
            yield group
            group, total = [], 0
        group.append(i)
        total += size
    if group:
        yield group


def _local_bytes(array: Any) -> int:
    """The bytes of `array` on this process's devices (every addressable shard; a host array's own)."""
    if not isinstance(array, jax.Array):
        return int(getattr(array, "nbytes", 0))
    return sum(shard.data.nbytes for shard in array.addressable_shards)


def _on_tpu(arrays: Sequence[Any]) -> bool:
    return any(isinstance(a, jax.Array) and any(d.platform == "tpu" for d in a.devices()) for a in arrays)


def _in_waves(original: Callable[..., Sequence[Any]]) -> Callable[..., list[Any]]:
    @functools.wraps(original)
    def transfer(arrays: Sequence[Any], *args: Any, **kwargs: Any) -> list[Any]:
        if not _on_tpu(arrays):
            return list(original(arrays, *args, **kwargs))
        out: list[Any] = []
        for group in waves([_local_bytes(a) for a in arrays], wave_bytes()):
            out.extend(original([arrays[i] for i in group], *args, **kwargs))
        return out

    setattr(transfer, "equipax_waves", True)  # noqa: B010  (a marker: installed once)
    return transfer


def transfer_in_waves() -> None:
    """Install the waves on orbax's device-to-host copy (once; an orbax without it is left alone)."""
    try:
        from orbax.checkpoint._src.serialization import replica_slices
    except ImportError:
        return
    current = getattr(replica_slices, "transfer_arrays_to_host", None)
    if current is None or getattr(current, "equipax_waves", False):
        return
    replica_slices.transfer_arrays_to_host = _in_waves(current)
