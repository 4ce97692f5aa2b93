"""Content checksums of a checkpoint: every saved array and every saved JSON item.

A checkpoint records, next to orbax's files, a checksum of each array it holds (computed on the
device where the array lives, so nothing is gathered to one host) and of its JSON items. A
restore recomputes them from what was read back; a mismatch means the files changed after they
were written (bit rot, a bad copy) and the checkpoint is treated like an unreadable one.

The array checksum is two position-weighted sums of the array's raw bits, modulo `2**32`: element
`i` with bits `w` and an odd weight `h(i)` adds `w * h(i)` to one and `w * h(i)**2` to the other.
Any single flipped bit changes both sums (an odd multiple of a power of two below `2**32` is not 0
modulo `2**32`); integer addition is exact in any order, so the value does not depend on the
sharding, the device or the host count (an array saved on 8 devices verifies when restored onto
1). Not a cryptographic hash: it detects damage, not tampering.

Two implementations compute the same sums: one program on the devices (`_checksums`, for arrays on
an accelerator or split over several processes: nothing is gathered), and numpy on the host
(`host_checksum`). A state of at most `HOST_CHECKSUM_MAX_BYTES` wholly in this host's memory (CPU
devices, numpy) takes numpy: the device program's compile, 0.5-3 s on a 2-core host for the states
of `benchmarks/train_step.py`'s presets, was paid once per save and once per restore in every
process, where numpy sums such a state in hundredths of a second. A larger state takes the
program: compiled once, it runs multi-threaded, 2-7x faster than numpy on 239 MB
(benchmarks/README.md).
"""

import hashlib
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from equipax.core.trees import flat_arrays
from equipax.launch.store.storage import AnyPath

__all__ = [
    "ALGORITHM",
    "HOST_CHECKSUM_MAX_BYTES",
    "array_checksums",
    "ChecksumMismatch",
    "differences",
    "host_checksum",
    "json_checksum",
    "on_this_host",
    "tree_digest",
    "unverified_warning",
    "verify",
]

ALGORITHM = "sum32x2-v2"


def _bits(x: jax.Array) -> jax.Array:
    """The array's raw bits as uint32 words (16- and 8-bit elements widened, 64-bit split)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    width = jnp.dtype(x.dtype).itemsize
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[width]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _checksum(x: jax.Array) -> jax.Array:
    words = _bits(x)
    # The flat position of each element, built from per-axis iotas (no reshape: a sharded array
    # stays where it is and XLA reduces it in place).
    index = jnp.zeros(words.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(words.ndim)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis) * jnp.uint32(stride % 2**32)
        stride *= words.shape[axis]
    weight = (index * jnp.uint32(0x9E3779B1) + jnp.uint32(0x7F4A7C15)) | jnp.uint32(1)
    weighted = words * weight
    return jnp.stack([jnp.sum(weighted, dtype=jnp.uint32), jnp.sum(weighted * weight, dtype=jnp.uint32)])


@jax.jit
def _checksums(leaves: list[jax.Array]) -> jax.Array:
    return jnp.stack([_checksum(x) for x in leaves]) if leaves else jnp.zeros((0, 2), jnp.uint32)


# Elements per numpy pass of `host_checksum`: its temporaries stay at a few megabytes.
_HOST_CHUNK = 1 << 20
_WEIGHT_MUL, _WEIGHT_ADD, _ONE = np.uint32(0x9E3779B1), np.uint32(0x7F4A7C15), np.uint32(1)


def _host_words(x: Any) -> np.ndarray:
    """`_bits` on the host: the raw bits as a flat uint32 vector in the same order."""
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    a = np.asarray(x)
    if a.dtype == np.bool_:
        a = a.astype(np.uint8)
    width = a.dtype.itemsize
    # A 64-bit element is two words, its low half first (as XLA's bitcast to uint32 on the device).
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.dtype("<u4")}[width]
    return np.ascontiguousarray(a).reshape(-1).view(unsigned)


def host_checksum(x: Any) -> tuple[int, int]:
    """The two sums of `x` (a numpy array, or a JAX array readable on this host) computed by numpy.

    Equal to the device program's (`_checksum`) for every dtype: the same words in the same order,
    the same uint32 arithmetic, which wraps modulo `2**32` in both.
    """
    words = _host_words(x)
    first = second = 0
    for start in range(0, words.size, _HOST_CHUNK):
        part = words[start : start + _HOST_CHUNK].astype(np.uint32)
        index = np.arange(start, start + part.size, dtype=np.uint64).astype(np.uint32)  # mod 2**32
        weight = (index * _WEIGHT_MUL + _WEIGHT_ADD) | _ONE
        weighted = part * weight
        first = (first + int(weighted.sum(dtype=np.uint32))) % 2**32
        second = (second + int((weighted * weight).sum(dtype=np.uint32))) % 2**32
    return first, second


# The most bytes of arrays in this host's memory that `array_checksums` sums with numpy (see the
# module's docstring): numpy's single-threaded passes take ~0.05 s for this much, the program's
# compile 0.5-3 s.
HOST_CHECKSUM_MAX_BYTES = 32 * 2**20


def _nbytes(x: Any) -> int:
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.eval_shape(jax.random.key_data, x)
    return int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize


def on_this_host(x: Any) -> bool:
    """Whether `x`'s memory is this host's (numpy, or a JAX array wholly on this process's CPU
    devices; or a `jax.ShapeDtypeStruct` sharded so): a small state of such arrays is summed with
    numpy (`array_checksums`)."""
    if isinstance(x, np.ndarray | np.generic):
        return True
    sharding = x.sharding if isinstance(x, jax.Array | jax.ShapeDtypeStruct) else None
    return (
        sharding is not None and sharding.is_fully_addressable and all(d.platform == "cpu" for d in sharding.device_set)
    )


def _by_numpy(leaves: list[Any]) -> bool:
    """Whether `array_checksums` sums these leaves with numpy rather than the device program."""
    return all(map(on_this_host, leaves)) and sum(map(_nbytes, leaves)) <= HOST_CHECKSUM_MAX_BYTES


def lower_checksums(flat: dict[str, Any]) -> Any:
    """The device program `array_checksums` runs on arrays of `flat`'s shapes, dtypes and shardings
    (arrays or `jax.ShapeDtypeStruct`s), lowered (`.compile()` it ahead of the first checkpoint);
    None where `array_checksums` would take numpy."""
    leaves = [flat[k] for k in sorted(flat)]
    return None if _by_numpy(leaves) else _checksums.lower(leaves)


def array_checksums(flat: dict[str, Any]) -> dict[str, str]:
    """`{path: checksum}` of a checkpoint's flat arrays: by numpy (`host_checksum`) when they are
    all in this host's memory and at most `HOST_CHECKSUM_MAX_BYTES`, otherwise by one small device
    program and one small read.

    Every process of a multi-host job must call it (the sums over sharded arrays are collectives).
    """
    names = sorted(flat)
    leaves = [flat[k] for k in names]
    if _by_numpy(leaves):
        sums: Any = [host_checksum(x) for x in leaves]
    else:
        sums = _checksums(leaves)
        if isinstance(sums, jax.Array) and not sums.is_fully_addressable:
            sums = sums.addressable_data(0)
        sums = np.asarray(sums)
    return {k: f"{int(a):08x}{int(b):08x}" for k, (a, b) in zip(names, sums)}


def json_checksum(obj: Any) -> str:
    """The checksum of a JSON item (as orbax writes it: the value, independent of key order)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def differences(expected: dict[str, Any], found: dict[str, Any]) -> list[str]:
    """The names whose recorded and recomputed checksums differ (missing on either side included)."""
    return [k for k in sorted(set(expected) | set(found)) if expected.get(k) != found.get(k)]


class ChecksumMismatch(Exception):
    """What was read back is not what was saved (the files changed after the save)."""


def verify(
    digests: dict[str, Any], flat: dict[str, Any], data_state: dict[str, Any], loop_state: dict[str, Any]
) -> None:
    """Raise ChecksumMismatch unless what was restored has the checksums recorded at save time."""
    if digests.get("algorithm") != ALGORITHM:
        return  # recorded by another version: nothing to compare with
    bad = differences(digests.get("arrays", {}), array_checksums(flat))
    bad += [
        name
        for name, value in (("data", data_state), ("loop", loop_state))
        if digests.get(name) not in (None, json_checksum(value))
    ]
    if bad:
        raise ChecksumMismatch(
            f"{len(bad)} saved item(s) do not match the checksums recorded when it was saved "
            f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}): its files changed after the save"
        )


def tree_digest(tree: Any, sums: dict[str, str] | None = None) -> str:
    """A short hash of all array leaves (to compare runs bit for bit in logs/tests): SHA-256 of
    each leaf's path and checksum (`array_checksums`, or `sums` where they were computed for these
    leaves already). The sums run where the arrays are: nothing is gathered or copied to the host
    (hashing every byte on the host took 1-9.5 s per GB on a 2-core host, after copying the state
    off the accelerator: benchmarks/README.md, "Start-up"). Like the checksums, the digest does not
    depend on the sharding or the host count."""
    sums = array_checksums(flat_arrays(tree)) if sums is None else sums
    h = hashlib.sha256()
    for k in sorted(sums):
        h.update(f"{k}\0{sums[k]}\0".encode())
    return h.hexdigest()[:16]


def unverified_warning(step: int, directory: AnyPath) -> str:
    """What a restore says of a checkpoint without its `digests` item (checksums recorded at save)."""
    return (
        f"warning: the checkpoint of step {step} in {directory} has no checksums (its digests item is "
        "missing: written before checkpoints recorded them, or removed since), so what it restores is not "
        "verified against what was saved."
    )
