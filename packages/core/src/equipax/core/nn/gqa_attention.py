"""Grouped-query attention (GQA; MQA with one key/value head) with rotary positions.

`num_heads` query heads share `num_kv_heads` key/value heads: query head `h` reads key/value head
`h // (num_heads // num_kv_heads)`. The fast kernel groups the queries instead of repeating the
keys and values; `reference_gqa_attention` repeats them and calls the plain reference.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from equipax.core.nn.attention import reference_attention
from equipax.core.nn.linear import fan_in_init
from equipax.core.nn.rotary import apply_rotary
from equipax.core.partition import Axes

__all__ = ["cached_attention", "gqa_attention", "GroupedQueryAttention", "reference_gqa_attention"]

# Large finite negative, as in attention.py: -inf would give NaN gradients on masked rows.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _check_groups(q: Array, k: Array, kv_axis: int = 2) -> int:
    heads, kv_heads = q.shape[2], k.shape[kv_axis]
    if heads % kv_heads:
        raise ValueError(
            f"{heads} query heads cannot be grouped over {kv_heads} key/value heads: "
            "num_heads must be a multiple of num_kv_heads."
        )
    return heads // kv_heads


def reference_gqa_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq kv_heads head_dim"],
    v: Float[Array, "batch seq kv_heads head_dim"],
    *,
    causal: bool,
    logit_cap: float | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None,
) -> Float[Array, "batch seq heads head_dim"]:
    """Slow, obvious GQA: repeat each key/value head for its group, then plain attention.

    Arguments:
        q: queries.
        k, v: keys and values with `heads / kv_heads` times fewer heads.
        causal: mask keys after each query's position.
        logit_cap: if set, logits become `cap * tanh(logits / cap)` before masking.
        segment_ids: packed sequences: positions attend only within their own segment.

    Returns:
        Attention outputs in `v.dtype`.
    """
    groups = _check_groups(q, k)
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    return reference_attention(q, k, v, causal=causal, logit_cap=logit_cap, segment_ids=segment_ids)


def _grouped_attention(
    q: Array, k: Array, v: Array, mask: Array | None, logit_cap: float | None
) -> Array:
    """Softmax attention with queries grouped per key/value head.

    `q` is `[b q heads d]`; `k`, `v` are head-major `[b kv_heads k d]` (the KV cache layout:
    both products are then plain batched matmuls, with no copy of the keys); `mask` is bool
    `[b q k]`.
    """
    b, s, heads, d = q.shape
    kv_heads = k.shape[1]
    q = q * jnp.asarray(1.0 / math.sqrt(d), q.dtype)
    qg = q.reshape(b, s, kv_heads, heads // kv_heads, d)
    logits = jnp.einsum("bqngd,bnkd->bngqk", qg, k, preferred_element_type=jnp.float32)
    if logit_cap is not None:
        logits = logit_cap * jnp.tanh(logits / logit_cap)
    if mask is not None:
        logits = jnp.where(mask[:, None, None], logits, _MASK_VALUE)
    logits = logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    unnorm = jnp.exp(logits)
    denom = jnp.sum(unnorm, axis=-1)  # [b n g q]
    out = jnp.einsum(
        "bngqk,bnkd->bqngd", unnorm.astype(v.dtype), v, preferred_element_type=jnp.float32
    )
    out = out / jnp.transpose(denom, (0, 3, 1, 2))[..., None]
    return out.reshape(b, s, heads, d).astype(v.dtype)


def gqa_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq kv_heads head_dim"],
    v: Float[Array, "batch seq kv_heads head_dim"],
    *,
    causal: bool,
    logit_cap: float | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None,
) -> Float[Array, "batch seq heads head_dim"]:
    """Grouped-query softmax attention, fast path (no repeated keys/values).

    Arguments:
        q: queries.
        k, v: keys and values; `heads` must be a multiple of `kv_heads`.
        causal: mask keys after each query's position.
        logit_cap: if set, logits become `cap * tanh(logits / cap)` before masking.
        segment_ids: packed sequences: positions attend only within their own segment.

    Returns:
        Attention outputs in `v.dtype`.
    """
    _check_groups(q, k)
    q_len, k_len = q.shape[1], k.shape[1]
    mask: Array | None = None
    if causal:
        q_pos = jnp.arange(q_len)[:, None] + (k_len - q_len)
        mask = (jnp.arange(k_len)[None, :] <= q_pos)[None]
    if segment_ids is not None:
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        mask = same if mask is None else mask & same
    head_major = (0, 2, 1, 3)
    return _grouped_attention(
        q, jnp.transpose(k, head_major), jnp.transpose(v, head_major), mask, logit_cap
    )


def cached_attention(
    q: Float[Array, "batch seq heads head_dim"],
    keys: Float[Array, "batch kv_heads cache head_dim"],
    values: Float[Array, "batch kv_heads cache head_dim"],
    *,
    query_positions: Int[Array, "batch seq"],
    logit_cap: float | None = None,
) -> Float[Array, "batch seq heads head_dim"]:
    """Attention of new queries over a KV cache whose slot `j` holds position `j`.

    A query at position `p` sees the slots `j <= p` of its row; later slots (not yet written,
    or stale) are masked. Rows may be at different positions (prompts of different lengths).

    Arguments:
        q: queries of the new tokens.
        keys, values: the cache of one layer, head-major (`kv_heads` may be fewer than
            `heads`).
        query_positions: the position of each query in its row.
        logit_cap: if set, logits become `cap * tanh(logits / cap)` before masking.

    Returns:
        Attention outputs in `values.dtype`.
    """
    _check_groups(q, keys, kv_axis=1)
    slots = jnp.arange(keys.shape[2])
    mask: Bool[Array, "batch seq cache"] = slots[None, None, :] <= query_positions[:, :, None]
    return _grouped_attention(q, keys, values, mask, logit_cap)


class GroupedQueryAttention(eqx.Module):
    """Causal self-attention with grouped key/value heads, rotary positions and no biases."""

    q: Float[Array, "embed heads head_dim"]
    kv: Float[Array, "embed 2 kv_heads head_dim"]
    out: Float[Array, "heads head_dim embed"]
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)

    def __init__(
        self, model_dims: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
        key: PRNGKeyArray,
    ) -> None:
        """Arguments:
        model_dims: input and output width.
        num_heads: number of query heads.
        num_kv_heads: number of key/value heads (1 = multi-query attention); divides
            `num_heads`.
        head_dim: width of each head (even, for the rotation).
        key: PRNG key.
        """
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}."
            )
        k_q, k_kv, k_out = jr.split(key, 3)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q = fan_in_init(k_q, (model_dims, num_heads, head_dim), in_axes=(0,))
        self.kv = fan_in_init(k_kv, (model_dims, 2, num_kv_heads, head_dim), in_axes=(0,))
        self.out = fan_in_init(k_out, (num_heads, head_dim, model_dims), in_axes=(0, 1))

    def logical_axes(self) -> dict[str, Axes]:
        """Queries and key/value heads column-split by heads, the output row-split (Megatron).

        Query head `h` reads key/value head `h // group`, so splitting both head axes the same
        number of ways keeps each group on one device; key/value heads too few to split are
        replicated (`partition.spec_for`).
        """
        return {
            "q": ("embed", "heads", "head_dim"),
            "kv": ("embed", "qkv", "heads", "head_dim"),
            "out": ("heads", "head_dim", "embed"),
        }

    def project(
        self,
        x: Float[Array, "batch seq embed"],
        sin: Float[Array, "batch seq half"],
        cos: Float[Array, "batch seq half"],
    ) -> tuple[
        Float[Array, "batch seq heads head_dim"],
        Float[Array, "batch seq kv_heads head_dim"],
        Float[Array, "batch seq kv_heads head_dim"],
    ]:
        """Queries, keys and values of `x`, with queries and keys rotated (the KV cache holds
        the rotated keys).

        Arguments:
            x: normalised inputs.
            sin, cos: rotation angles of each token's position (`rotary_angles`).

        Returns:
            `(q, k, v)` in `x.dtype`.
        """
        q = jnp.einsum("bse,ehd->bshd", x, self.q.astype(x.dtype))
        kv = jnp.einsum("bse,etnd->bstnd", x, self.kv.astype(x.dtype))
        k, v = kv[:, :, 0], kv[:, :, 1]
        return apply_rotary(q, sin, cos), apply_rotary(k, sin, cos), v

    def output(
        self, o: Float[Array, "batch seq heads head_dim"]
    ) -> Float[Array, "batch seq embed"]:
        """The output projection of the attention result.

        Arguments:
            o: per-head attention outputs.

        Returns:
            Outputs in `o.dtype`.
        """
        return jnp.einsum("bshd,hde->bse", o, self.out.astype(o.dtype))

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        sin: Float[Array, "batch seq half"],
        cos: Float[Array, "batch seq half"],
        segment_ids: Int[Array, "batch seq"] | None = None,
    ) -> Float[Array, "batch seq embed"]:
        """Causal attention over the sequence; computes in `x.dtype`.

        Arguments:
            x: normalised inputs.
            sin, cos: rotation angles of each token's position (`rotary_angles`).
            segment_ids: packed sequences: attend only within each segment.

        Returns:
            Outputs of the same shape.
        """
        q, k, v = self.project(x, sin, cos)
        return self.output(gqa_attention(q, k, v, causal=True, segment_ids=segment_ids))
