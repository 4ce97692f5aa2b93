"""Context parallelism: softmax attention over a sequence split along the `context` mesh axis
(docs/long_context.md).

Activations are `[batch seq ...]` with `seq` split over N devices. Attention is the one layer whose
positions meet every other position, so it needs the other devices' keys and values:

- "all_gather" (`all_gather_attention`): each device all-gathers the keys and values (and their
  positions and segment ids) inside `jax.shard_map` and attends its own queries over all of them.
  Simple and fast on a fast interconnect; holds the whole sequence's keys and values per device.
- "ring" (`equipax.core.nn.ring_attention`): the key/value blocks rotate around the axis and an
  online softmax merges them; O(S/N) keys and values per device.

Layouts. Both kernels mask by each token's *global* position (its index in the unsplit sequence),
never by its slot, so any order of the sequence works. With causal attention the contiguous split
is unbalanced (device N-1 attends over everything, device 0 over its own block); the zigzag layout
(`zigzag_permutation`) cuts the sequence into 2N chunks and gives device i chunks i and 2N-1-i, so
each device does the same work. The input reorders a batch once (`to_zigzag`) and carries the
global positions with it; everything outside attention is per-token and does not care.

Both equal `equipax.core.nn.attention.reference_attention` on the unpermuted sequence, outputs
and gradients (tests/core/test_context_parallel.py).
"""

import functools
import math
from collections.abc import Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from equipax.core.mesh_config import BATCH_AXES, CONTEXT, TENSOR
from equipax.core.nn.attention import _grouped_softmax, check_groups  # pyright: ignore[reportPrivateUsage]
from equipax.core.nn.attention_masks import attention_mask
from equipax.core.nn.ring_attention import RingConfig, ring_attention_shard
from equipax.core.nn.splash_ring_attention import SplashRingConfig, splash_ring_attention_shard

__all__ = [
    "ContextParallel",
    "all_gather_attention",
    "context_attention",
    "from_zigzag",
    "ring_attention",
    "slot_index",
    "splash_all_gather_attention",
    "splash_ring_attention",
    "to_zigzag",
    "zigzag_batch",
    "zigzag_inverse",
    "zigzag_permutation",
]

ContextParallel = Literal["all_gather", "ring"]


def zigzag_permutation(seq_len: int, num_shards: int) -> np.ndarray:
    """The global position held at each slot of the zigzag layout (`x[:, perm]` reorders).

    The sequence is cut into `2 * num_shards` chunks; shard `i` holds chunks `i` and
    `2 * num_shards - 1 - i`, so under a causal mask every shard has the same number of
    (query, key) pairs to compute.

    Arguments:
        seq_len: positions in the sequence (a multiple of `2 * num_shards`).
        num_shards: devices on the context axis.

    Raises:
        ValueError: `seq_len` is not a multiple of `2 * num_shards`.
    """
    if seq_len % (2 * num_shards):
        raise ValueError(
            f"The zigzag layout cuts a sequence into 2 x {num_shards} chunks; {seq_len} positions do not "
            f"divide into {2 * num_shards}. Use a sequence length that is a multiple of {2 * num_shards}."
        )
    chunks = np.arange(seq_len).reshape(2 * num_shards, -1)
    order = [c for i in range(num_shards) for c in (i, 2 * num_shards - 1 - i)]
    return chunks[order].reshape(-1)


def zigzag_inverse(seq_len: int, num_shards: int) -> np.ndarray:
    """The slot of each global position in the zigzag layout (`y[:, inverse]` restores order)."""
    return np.argsort(zigzag_permutation(seq_len, num_shards))


def to_zigzag(x: Array, num_shards: int, axis: int = 1) -> Array:
    """`x` with its `axis` (the sequence) in the zigzag layout of `num_shards` devices."""
    return jnp.take(x, zigzag_permutation(x.shape[axis], num_shards), axis=axis)


def from_zigzag(x: Array, num_shards: int, axis: int = 1) -> Array:
    """The inverse of `to_zigzag`: `x`'s `axis` back in sequence order."""
    return jnp.take(x, zigzag_inverse(x.shape[axis], num_shards), axis=axis)


def zigzag_batch(batch: Mapping[str, Any], num_shards: int) -> tuple[dict[str, Any], Int[Array, "batch seq"]]:
    """A token batch reordered into the zigzag layout (once per step, before the model), and each
    slot's global position: the `sequence_index` the attention masks compare.

    Every `[batch seq ...]` field (ids, labels, weights, segment ids) is reordered along its
    sequence, so each token keeps its label and weight (the loss is a sum over tokens and does not
    change). `positions` (the rotary or sinusoidal positions) are reordered too, or, when the
    batch has none, set to the global positions, so every token is rotated as in sequence order.

    Arguments:
        batch: `ids` `[batch seq]` and the fields that go with it.
        num_shards: devices on the context axis.

    Returns:
        `(reordered batch, sequence_index [batch seq] int32)`.
    """
    ids = jnp.asarray(batch["ids"])
    b, seq = ids.shape
    out = {
        k: to_zigzag(jnp.asarray(v), num_shards) if jnp.ndim(v) >= 2 and jnp.shape(v)[:2] == (b, seq) else v
        for k, v in batch.items()
    }
    index = jnp.broadcast_to(jnp.asarray(zigzag_permutation(seq, num_shards), jnp.int32), (b, seq))
    if out.get("positions") is None:
        out["positions"] = index
    return out, index


def slot_index(x: Array, sequence_index: Array | None) -> Int[Array, "batch seq"]:
    """Each slot's index in its unsplit row: `sequence_index`, or 0 .. seq-1 for rows of `x`
    (`[batch seq ...]`) in their own order. Taken before the sequence is split over `context`:
    each device's part then carries its global positions."""
    if sequence_index is not None:
        return sequence_index
    return jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32), x.shape[:2])


def _specs(mesh: Mesh, q: Array, k: Array, axis: str) -> tuple[P, P]:
    """`(qkv_spec, ids_spec)`: batch over the batch axes that divide it, the sequence over `axis`,
    heads over `tensor` when it divides both head counts (so each group stays on one device)."""
    batch = tuple(a for a in BATCH_AXES if mesh.shape.get(a, 1) > 1)
    if q.shape[0] % int(np.prod([mesh.shape[a] for a in batch], dtype=int)):
        batch = ()
    tp = mesh.shape.get(TENSOR, 1)
    heads = TENSOR if tp > 1 and q.shape[2] % tp == 0 and k.shape[2] % tp == 0 else None
    return P(batch or None, axis, heads, None), P(batch or None, axis)


def _gather(x: Array | None, axis: str) -> Array | None:
    return None if x is None else jax.lax.all_gather(x, axis, axis=1, tiled=True)


def _shard_map(local, mesh: Mesh, axis: str, q: Array, k: Array, v: Array, positions: Array, seg: Array | None):
    """`local` on each device's part of the sequence: in a shard_map of its own, or directly where
    the code is already manual over `axis` (a pipeline stage's shard_map, manual over `stage` and
    `context`, hands each device its part: a shard_map nested in it fails to transpose in JAX 0.11)."""
    abstract = jax.sharding.get_abstract_mesh()
    if not abstract.empty and axis in abstract.manual_axes:
        return local(q, k, v, positions, seg)
    qkv, ids = _specs(mesh, q, k, axis)
    return jax.shard_map(
        local, mesh=mesh, in_specs=(qkv, qkv, qkv, ids, None if seg is None else ids), out_specs=qkv, check_vma=False
    )(q, k, v, positions, seg)


def _check(q: Array, k: Array, mesh: Mesh | None, axis: str) -> int:
    check_groups(q.shape[2], k.shape[2])
    n = 1 if mesh is None else mesh.shape.get(axis, 1)
    if q.shape[1] % n:
        raise ValueError(f"{q.shape[1]} positions cannot be split over the {n} devices of the {axis!r} mesh axis.")
    return n


def all_gather_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq kv_heads head_dim"],
    v: Float[Array, "batch seq kv_heads head_dim"],
    *,
    positions: Int[Array, "batch seq"],
    causal: bool,
    logit_cap: float | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None,
    window: int | None = None,
    mesh: Mesh | None = None,
    axis: str = CONTEXT,
) -> Float[Array, "batch seq heads head_dim"]:
    """Context-parallel attention by all-gathering the keys and values over `axis`.

    Arguments:
        q, k, v: queries, keys and values, the sequence in any layout (split over `axis`).
        positions: each slot's global position (what the causal and window masks compare).
        causal, logit_cap, window: as `reference_attention`.
        segment_ids: packed documents, in the same layout.
        mesh: the device mesh; without one (or with `axis` of size 1) this is local attention.
        axis: the context mesh axis.

    Returns:
        Attention outputs in `v.dtype`, in the layout of `q`.
    """
    n = _check(q, k, mesh, axis)

    def local(q: Array, k: Array, v: Array, pos: Array, seg: Array | None) -> Array:
        if n > 1:
            k, v = jax.lax.all_gather(k, axis, axis=1, tiled=True), jax.lax.all_gather(v, axis, axis=1, tiled=True)
        kpos, kseg = (_gather(pos, axis), _gather(seg, axis)) if n > 1 else (pos, seg)
        mask = attention_mask(pos, kpos, causal=causal, window=window, query_segments=seg, key_segments=kseg)  # pyright: ignore[reportArgumentType]
        return _grouped_softmax(q, k, v, mask, logit_cap)

    if n == 1 or mesh is None:
        return local(q, k, v, positions, segment_ids)
    return _shard_map(local, mesh, axis, q, k, v, positions, segment_ids)


def splash_all_gather_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq kv_heads head_dim"],
    v: Float[Array, "batch seq kv_heads head_dim"],
    *,
    zigzag: bool,
    causal: bool,
    logit_cap: float | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None,
    window: int | None = None,
    mesh: Mesh | None = None,
    axis: str = CONTEXT,
    interpret: bool = False,
) -> Float[Array, "batch seq heads head_dim"]:
    """`all_gather_attention` with each device's attention in the Pallas splash kernel (TPU;
    `attention_impl='splash'` on a `context` axis).

    A splash mask is static, so the layout is too: the sequence is split over `axis` in the zigzag
    layout (`zigzag=True`: device i holds chunks i and 2N-1-i of 2N) or in contiguous blocks, as
    the input put it (`context_parallel_load_balance`). Each device gathers the keys, values and
    segment ids, puts them back in sequence order, and runs the kernel once per chunk of its
    queries, with the chunk's first position as the causal (or window) mask's offset; the
    device's chunks are known only inside the program (`lax.axis_index`), so a `lax.switch` picks
    among the N devices' kernels. Equals `reference_attention` on the unpermuted sequence
    (tests/core/test_context_parallel_splash.py, in the Pallas interpreter).

    Arguments:
        q, k, v: queries, keys and values, the sequence in the layout `zigzag` says, split over
            `axis`.
        zigzag: the zigzag layout (else contiguous blocks).
        causal, logit_cap, window: as `reference_attention`.
        segment_ids: packed documents, in the same layout.
        mesh: the device mesh; without one (or with `axis` of size 1) this is splash attention.
        axis: the context mesh axis.
        interpret: run the kernel in the Pallas interpreter (any platform; slow: for tests).

    Returns:
        Attention outputs in `v.dtype`, in the layout of `q`.
    """
    from equipax.core.nn.fused_attention import splash_local

    n = _check(q, k, mesh, axis)
    if window is not None and not causal:
        raise ValueError("a sliding window limits the causal prefix: pass causal=True with window.")
    seq = q.shape[1]
    zigzag = zigzag and n > 1
    if zigzag and seq % (2 * n):
        raise ValueError(f"the zigzag layout cuts {seq} positions into 2 x {n} chunks; they do not divide.")
    chunk = seq // (2 * n) if zigzag else seq // n
    q = q * jnp.asarray(1.0 / math.sqrt(q.shape[-1]), q.dtype)
    seg = jnp.zeros(q.shape[:2], jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    kw = dict(causal=causal, window=window, logit_cap=logit_cap, interpret=interpret)

    def local(q: Array, k: Array, v: Array, pos: Array, seg: Array) -> Array:
        del pos  # the layout is static here: each chunk's offset is its place in the sequence
        if n > 1:
            k, v, kseg = (jax.lax.all_gather(x, axis, axis=1, tiled=True) for x in (k, v, seg))
        else:
            kseg = seg
        if zigzag:  # back in sequence order, where a chunk's keys start at its offset
            k, v, kseg = (jnp.take(x, zigzag_inverse(seq, n), axis=1) for x in (k, v, kseg))

        def attend(device: int) -> Array:
            held = (device, 2 * n - 1 - device) if zigzag else (device,)
            parts = [
                splash_local(
                    q[:, j * chunk : (j + 1) * chunk],
                    k,
                    v,
                    seg[:, j * chunk : (j + 1) * chunk],
                    kseg,
                    offset=c * chunk,
                    **kw,  # pyright: ignore[reportArgumentType]
                )
                for j, c in enumerate(held)
            ]
            return jnp.concatenate(parts, axis=1)

        if not causal:  # a full mask has no offset: one kernel over the device's queries
            return splash_local(q, k, v, seg, kseg, **kw)  # pyright: ignore[reportArgumentType]
        if n == 1:
            return attend(0)
        return jax.lax.switch(jax.lax.axis_index(axis), [functools.partial(attend, d) for d in range(n)])

    positions = slot_index(q, None)
    if n == 1 or mesh is None:
        return local(q, k, v, positions, seg)
    return _shard_map(local, mesh, axis, q, k, v, positions, seg)


def splash_ring_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq kv_heads head_dim"],
    v: Float[Array, "batch seq kv_heads head_dim"],
    *,
    zigzag: bool,
    causal: bool,
    logit_cap: float | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None,
    window: int | None = None,
    mesh: Mesh | None = None,
    axis: str = CONTEXT,
    interpret: bool = False,
) -> Float[Array, "batch seq heads head_dim"]:
    """`ring_attention` with the Pallas splash kernel on every pair of query and key chunks a
    device meets (TPU; `attention_impl='splash'` with `context_parallel_strategy='ring'`).

    The keys and values rotate around `axis` as in `ring_attention`; each pair's kernel returns
    its output and log-sum-exp, merged per row in float32. A splash mask is static, so, as in
    `splash_all_gather_attention`, the layout is (`zigzag`, as the input put it), and each pair's
    kernel is picked by a `lax.switch` over the few masks a pair can have (a later chunk:
    skipped; the same chunk: causal; an earlier one: full, or windowed). The backward rotates the
    blocks again with their gradients, each pair's from splash's backward kernels given the merged
    output and log-sum-exp (`equipax.core.nn.ring_attention`). Equals `reference_attention` on
    the unpermuted sequence (tests/core/test_context_parallel_splash.py, in the Pallas interpreter).

    Arguments:
        q, k, v: queries, keys and values, the sequence in the layout `zigzag` says, split over
            `axis` into chunks of a multiple of 128 positions (the kernel's block).
        zigzag: the zigzag layout (else contiguous blocks).
        causal, logit_cap, window: as `reference_attention`.
        segment_ids: packed documents, in the same layout.
        mesh: the device mesh; without one (or with `axis` of size 1) this is splash attention.
        axis: the context mesh axis.
        interpret: run the kernel in the Pallas interpreter (any platform; slow: for tests).

    Returns:
        Attention outputs in `v.dtype`, in the layout of `q`.
    """
    n = _check(q, k, mesh, axis)
    if window is not None and not causal:
        raise ValueError("a sliding window limits the causal prefix: pass causal=True with window.")
    seq = q.shape[1]
    zigzag = zigzag and n > 1
    if zigzag and seq % (2 * n):
        raise ValueError(f"the zigzag layout cuts {seq} positions into 2 x {n} chunks; they do not divide.")
    cfg = SplashRingConfig(
        axis=axis if n > 1 else None,
        size=n,
        zigzag=zigzag,
        chunk=seq // (2 * n) if zigzag else seq // n,
        heads=q.shape[2],
        causal=causal,
        window=window,
        logit_cap=logit_cap,
        interpret=interpret,
    )
    q = q * jnp.asarray(1.0 / math.sqrt(q.shape[-1]), q.dtype)
    seg = jnp.zeros(q.shape[:2], jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)

    def local(q: Array, k: Array, v: Array, pos: Array, seg: Array) -> Array:
        del pos  # the layout is static here
        all_seg = _gather(seg, axis) if n > 1 else seg
        return splash_ring_attention_shard(cfg, q, k, v, seg, all_seg)  # pyright: ignore[reportArgumentType]

    positions = slot_index(q, None)
    if n == 1 or mesh is None:
        return local(q, k, v, positions, seg)
    return _shard_map(local, mesh, axis, q, k, v, positions, seg)


def ring_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq kv_heads head_dim"],
    v: Float[Array, "batch seq kv_heads head_dim"],
    *,
    positions: Int[Array, "batch seq"],
    causal: bool,
    logit_cap: float | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None,
    window: int | None = None,
    mesh: Mesh | None = None,
    axis: str = CONTEXT,
) -> Float[Array, "batch seq heads head_dim"]:
    """Context-parallel attention by rotating key/value blocks around `axis` (ring attention).

    Arguments and returns as `all_gather_attention`; see `equipax.core.nn.ring_attention` for the
    algorithm (online softmax, skipped blocks, a backward that rotates the gradients home).
    """
    n = _check(q, k, mesh, axis)
    cfg = RingConfig(axis=axis if n > 1 else None, size=n, causal=causal, window=window, logit_cap=logit_cap)

    def local(q: Array, k: Array, v: Array, pos: Array, seg: Array | None) -> Array:
        all_pos, all_seg = (_gather(pos, axis), _gather(seg, axis)) if n > 1 else (pos, seg)
        return ring_attention_shard(cfg, q, k, v, pos, seg, all_pos, all_seg)  # pyright: ignore[reportArgumentType]

    if n == 1 or mesh is None:
        return local(q, k, v, positions, segment_ids)
    return _shard_map(local, mesh, axis, q, k, v, positions, segment_ids)


def context_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq kv_heads head_dim"],
    v: Float[Array, "batch seq kv_heads head_dim"],
    *,
    strategy: ContextParallel,
    positions: Int[Array, "batch seq"],
    causal: bool,
    logit_cap: float | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None,
    window: int | None = None,
    mesh: Mesh | None = None,
    axis: str = CONTEXT,
) -> Float[Array, "batch seq heads head_dim"]:
    """`all_gather_attention` or `ring_attention`, as `strategy` says (`context_parallel`)."""
    kernel = ring_attention if strategy == "ring" else all_gather_attention
    return kernel(
        q,
        k,
        v,
        positions=positions,
        causal=causal,
        logit_cap=logit_cap,
        segment_ids=segment_ids,
        window=window,
        mesh=mesh,
        axis=axis,
    )
