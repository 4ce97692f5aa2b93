"""Softmax attention kernels (a slow reference, the XLA fast path, the KV-cache kernel and the
dispatch behind `attention_impl`) for queries grouped over fewer key/value heads.

`num_heads` query heads share `num_kv_heads` key/value heads: query head `h` reads key/value head
`h // (num_heads / num_kv_heads)` (multi-head attention is one head per group, multi-query one
key/value head). The reference repeats the keys and values for each group and masks a dense
`[q k]` matrix; the fast kernels group the queries instead. Every kernel takes the same arguments
as `reference_attention` and agrees with it (tests: GQA, packed segments, sliding windows, caps).

The attention layer itself is `equipax.core.nn.self_attention.Attention`.
"""

import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

from equipax.core.nn.attention_masks import MASK_VALUE, attention_mask, self_attention_mask
from equipax.core.nn.fused_attention import (
    AttentionImpl,
    cudnn_attention,
    mesh_platform,
    resolve_attention_impl,
    splash_attention,
)
from equipax.core.nn.mixed import einsum_f32

__all__ = [
    "cached_attention",
    "check_groups",
    "dot_product_attention",
    "jax_nn_attention",
    "reference_attention",
    "softmax_attention",
]


def _cap(logits: Array, cap: float | None) -> Array:
    return logits if cap is None else cap * jnp.tanh(logits / cap)


def check_groups(num_heads: int, num_kv_heads: int) -> int:
    """Query heads per key/value head (ValueError unless `num_kv_heads` divides `num_heads`)."""
    if num_heads % num_kv_heads:
        raise ValueError(
            f"{num_heads} query heads cannot be grouped over {num_kv_heads} key/value heads: "
            "num_heads must be a multiple of num_kv_heads."
        )
    return num_heads // num_kv_heads


def reference_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq kv_heads head_dim"],
    v: Float[Array, "batch seq kv_heads head_dim"],
    *,
    causal: bool,
    logit_cap: float | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None,
    window: int | None = None,
) -> Float[Array, "batch seq heads head_dim"]:
    """Slow, obvious softmax attention; the fast kernels are tested against it.

    Arguments:
        q: queries.
        k, v: keys and values; `heads` must be a multiple of `kv_heads`.
        causal: mask keys after each query's position.
        logit_cap: if set, logits become `cap * tanh(logits / cap)` before masking.
        segment_ids: packed sequences: positions attend only within their own segment.
        window: with `causal`, each query sees itself and the `window - 1` keys before it.

    Returns:
        Attention outputs in `v.dtype`.
    """
    groups = check_groups(q.shape[2], k.shape[2])
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    qf, kf, vf = (t.astype(jnp.float32) for t in (q, k, v))
    logits = jnp.einsum("bqhd,bkhd->bhqk", qf, kf) / math.sqrt(q.shape[-1])
    logits = _cap(logits, logit_cap)
    mask = self_attention_mask(q.shape[1], k.shape[1], causal=causal, window=window, segment_ids=segment_ids)
    if mask is not None:
        logits = jnp.where(mask[:, None], logits, MASK_VALUE)
    probs = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, vf).astype(v.dtype)


def _grouped_softmax(q: Array, k: Array, v: Array, mask: Array | None, logit_cap: float | None) -> Array:
    """Softmax attention with the queries grouped per key/value head (no repeated keys).

    `q` is `[b q heads d]`; `k`, `v` are `[b k kv_heads d]` (a KV cache's too); `mask` is bool
    `[b q k]`. Scales `q` instead of the `[q k]` logits, keeps matmul inputs in their own dtype
    with float32 accumulation (`einsum_f32`: the backward matmuls take the inputs' dtype too), and
    normalises after the value product (`[q d]` divides instead of `[q k]`). With one query head
    per key/value head the group axis is left out (XLA:CPU then runs the same matmuls as plain
    multi-head attention, to the bit).
    """
    b, s, heads, d = q.shape
    kv_heads = k.shape[2]
    q = q * jnp.asarray(1.0 / math.sqrt(d), q.dtype)
    if heads == kv_heads:
        qs, ls, kv, keep = "bqhd", "bhqk", "bkhd", (slice(None), None)
    else:
        q = q.reshape(b, s, kv_heads, heads // kv_heads, d)
        qs, ls, kv, keep = "bqngd", "bngqk", "bknd", (slice(None), None, None)
    logits = _cap(einsum_f32(f"{qs},{kv}->{ls}", q, k), logit_cap)
    if mask is not None:
        logits = jnp.where(mask[keep], logits, MASK_VALUE)
    logits = logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    unnorm = jnp.exp(logits)
    denom = jnp.sum(unnorm, axis=-1)  # [b h q] or [b n g q]
    out = einsum_f32(f"{ls},{kv}->{qs}", unnorm.astype(v.dtype), v)
    # The denominator per (batch, query, head...): move the query axis after the batch.
    out = out / jnp.moveaxis(denom, -1, 1)[..., None]
    return out.reshape(b, s, heads, d).astype(v.dtype)


def dot_product_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq kv_heads head_dim"],
    v: Float[Array, "batch seq kv_heads head_dim"],
    *,
    causal: bool,
    logit_cap: float | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None,
    window: int | None = None,
) -> Float[Array, "batch seq heads head_dim"]:
    """Softmax attention, fast path ("xla"): plain einsums, faster than jax.nn's on CPU.

    Arguments:
        q: queries.
        k, v: keys and values; `heads` must be a multiple of `kv_heads` (grouped-query attention
            without copying the keys and values).
        causal: mask keys after each query's position.
        logit_cap: if set, logits become `cap * tanh(logits / cap)` before masking.
        segment_ids: packed sequences: positions attend only within their own segment.
        window: with `causal`, each query sees itself and the `window - 1` keys before it.

    Returns:
        Attention outputs in `v.dtype`.
    """
    check_groups(q.shape[2], k.shape[2])
    mask = self_attention_mask(q.shape[1], k.shape[1], causal=causal, window=window, segment_ids=segment_ids)
    return _grouped_softmax(q, k, v, mask, logit_cap)


def cached_attention(
    q: Float[Array, "batch seq heads head_dim"],
    keys: Float[Array, "batch cache kv_heads head_dim"],
    values: Float[Array, "batch cache kv_heads head_dim"],
    *,
    query_positions: Int[Array, "batch seq"],
    logit_cap: float | None = None,
    window: int | None = None,
) -> Float[Array, "batch seq heads head_dim"]:
    """Attention of new queries over a KV cache whose slot `j` holds position `j`.

    A query at position `p` sees the slots `j <= p` of its row (and, with a window, only
    `j > p - window`); later slots (not yet written, or stale) are masked. Rows may be at
    different positions (prompts of different lengths).

    Arguments:
        q: queries of the new tokens.
        keys, values: the cache of one layer, slot-major (`kv_heads` may be fewer than `heads`).
        query_positions: the position of each query in its row.
        logit_cap: if set, logits become `cap * tanh(logits / cap)` before masking.
        window: each query sees itself and the `window - 1` positions before it.

    Returns:
        Attention outputs in `values.dtype`.
    """
    check_groups(q.shape[2], keys.shape[2])
    slots = jnp.arange(keys.shape[1])[None]
    mask = attention_mask(query_positions, slots, causal=True, window=window)
    return _grouped_softmax(q, keys, values, mask, logit_cap)


def jax_nn_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq kv_heads head_dim"],
    v: Float[Array, "batch seq kv_heads head_dim"],
    *,
    causal: bool,
    logit_cap: float | None = None,
) -> Float[Array, "batch seq heads head_dim"]:
    """Softmax attention through `jax.nn.dot_product_attention` (XLA or cuDNN as JAX picks).

    Slower than `dot_product_attention` on CPU (benchmarks/README.md); kept for benchmarks. It
    has no tanh logit cap.

    Arguments:
        q, k, v: queries, keys and values.
        causal: mask keys after each query's position.
        logit_cap: must be `None`.

    Returns:
        Attention outputs in `v.dtype`.

    Raises:
        ValueError: `logit_cap` is set.
    """
    if logit_cap is not None:
        raise ValueError(
            f"jax_nn_attention cannot apply a logit cap (got logit_cap={logit_cap}): "
            "jax.nn.dot_product_attention has no tanh cap. Use dot_product_attention or "
            "pass logit_cap=None."
        )
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal).astype(v.dtype)


def softmax_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq kv_heads head_dim"],
    v: Float[Array, "batch seq kv_heads head_dim"],
    *,
    causal: bool,
    logit_cap: float | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None,
    window: int | None = None,
    impl: AttentionImpl = "xla",
    mesh: Mesh | None = None,
) -> Float[Array, "batch seq heads head_dim"]:
    """Softmax attention with the kernel `impl` (`model.transformer.attention_impl`) picks.

    Arguments:
        q: queries.
        k, v: keys and values; `heads` must be a multiple of `kv_heads`.
        causal: mask keys after each query's position.
        logit_cap: if set, logits become `cap * tanh(logits / cap)` before masking.
        segment_ids: packed sequences: positions attend only within their own segment.
        window: with `causal`, each query sees itself and the `window - 1` keys before it.
        impl: "xla" (`dot_product_attention`), "cudnn" (GPU), "splash" (TPU) or "auto"
            (equipax.core.nn.fused_attention).
        mesh: the device mesh: its platform decides "auto", and splash runs per device on it.

    Returns:
        Attention outputs in `v.dtype`.

    Raises:
        ConfigError: `impl` cannot run on the mesh's platform, dtype or sequence length.
    """
    chosen = resolve_attention_impl(impl, mesh_platform(mesh), seq_len=q.shape[1], dtype=q.dtype, logit_cap=logit_cap)
    if chosen == "cudnn":
        return cudnn_attention(q, k, v, causal=causal, segment_ids=segment_ids, window=window)
    if chosen == "splash":
        return splash_attention(
            q, k, v, causal=causal, logit_cap=logit_cap, segment_ids=segment_ids, window=window, mesh=mesh
        )
    return dot_product_attention(q, k, v, causal=causal, logit_cap=logit_cap, segment_ids=segment_ids, window=window)
