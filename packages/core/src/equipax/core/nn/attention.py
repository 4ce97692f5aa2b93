"""Softmax attention kernels (reference and fast paths) and causal self-attention."""

import math
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int, PRNGKeyArray

from equipax.core.nn.fused_attention import (
    AttentionImpl, cudnn_attention, mesh_platform, resolve_attention_impl, segment_mask, splash_attention,
)
from equipax.core.nn.linear import expand_to, fan_in_init
from equipax.core.nn.mixed import einsum_f32
from equipax.core.nn.linear_attention import linear_attention
from equipax.core.partition import Axes

__all__ = [
    "CausalSelfAttention",
    "dot_product_attention",
    "jax_nn_attention",
    "reference_attention",
    "softmax_attention",
]

# Large finite negative: -inf would give NaN gradients through fully masked rows.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _cap(logits: Array, cap: float | None) -> Array:
    return logits if cap is None else cap * jnp.tanh(logits / cap)


def _causal_mask(q_len: int, k_len: int) -> Array:
    """Bool `[1 1 q k]`: query i sees keys j <= i (queries aligned to the end of keys)."""
    q_pos = jnp.arange(q_len)[:, None] + (k_len - q_len)
    k_pos = jnp.arange(k_len)[None, :]
    return (k_pos <= q_pos)[None, None]


def reference_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq heads head_dim"],
    v: Float[Array, "batch seq heads head_dim"],
    *,
    causal: bool,
    logit_cap: float | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None,
) -> Float[Array, "batch seq heads head_dim"]:
    """Slow, obvious softmax attention; the fast path is tested against it.

    Arguments:
        q, k, v: queries, keys and values.
        causal: mask keys after each query's position.
        logit_cap: if set, logits become `cap * tanh(logits / cap)` before masking.
        segment_ids: packed sequences: positions attend only within their own segment.

    Returns:
        Attention outputs in `v.dtype`.
    """
    qf, kf, vf = (t.astype(jnp.float32) for t in (q, k, v))
    logits = jnp.einsum("bqhd,bkhd->bhqk", qf, kf) / math.sqrt(q.shape[-1])
    logits = _cap(logits, logit_cap)
    if causal:
        logits = jnp.where(_causal_mask(q.shape[1], k.shape[1]), logits, _MASK_VALUE)
    if segment_ids is not None:
        logits = jnp.where(segment_mask(segment_ids), logits, _MASK_VALUE)
    probs = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, vf).astype(v.dtype)


def dot_product_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq heads head_dim"],
    v: Float[Array, "batch seq heads head_dim"],
    *,
    causal: bool,
    logit_cap: float | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None,
) -> Float[Array, "batch seq heads head_dim"]:
    """Softmax attention, fast path: plain einsums (faster than jax.nn's on CPU).

    Scales `q` instead of the `[q k]` logits, keeps matmul inputs in their own dtype with
    float32 accumulation (`einsum_f32`: the backward matmuls take the inputs' dtype too), and
    normalises after the value product (`[q d]` divides instead of `[q k]`).

    Arguments:
        q, k, v: queries, keys and values.
        causal: mask keys after each query's position.
        logit_cap: if set, logits become `cap * tanh(logits / cap)` before masking.
        segment_ids: packed sequences: positions attend only within their own segment.

    Returns:
        Attention outputs in `v.dtype`.
    """
    q = q * jnp.asarray(1.0 / math.sqrt(q.shape[-1]), q.dtype)
    logits = einsum_f32("bqhd,bkhd->bhqk", q, k)
    logits = _cap(logits, logit_cap)
    if causal:
        logits = jnp.where(_causal_mask(q.shape[1], k.shape[1]), logits, _MASK_VALUE)
    if segment_ids is not None:
        logits = jnp.where(segment_mask(segment_ids), logits, _MASK_VALUE)
    logits = logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    unnorm = jnp.exp(logits)
    denom = jnp.sum(unnorm, axis=-1)  # [b h q]
    out = einsum_f32("bhqk,bkhd->bqhd", unnorm.astype(v.dtype), v)
    out = out / jnp.transpose(denom, (0, 2, 1))[..., None]
    return out.astype(v.dtype)


def jax_nn_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq heads head_dim"],
    v: Float[Array, "batch seq heads head_dim"],
    *,
    causal: bool,
    logit_cap: float | None = None,
) -> Float[Array, "batch seq heads head_dim"]:
    """Softmax attention through `jax.nn.dot_product_attention` (XLA or cuDNN as JAX picks).

    Slower than `dot_product_attention` on CPU (PERF-NOTES); kept for benchmarks and
    accelerators. It has no tanh logit cap.

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
    k: Float[Array, "batch seq heads head_dim"],
    v: Float[Array, "batch seq heads head_dim"],
    *,
    causal: bool,
    logit_cap: float | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None,
    impl: AttentionImpl = "xla",
    mesh: Mesh | None = None,
) -> Float[Array, "batch seq heads head_dim"]:
    """Softmax attention with the kernel `impl` (`model.transformer.attention_impl`) picks.

    Arguments:
        q, k, v: queries, keys and values.
        causal: mask keys after each query's position.
        logit_cap: if set, logits become `cap * tanh(logits / cap)` before masking.
        segment_ids: packed sequences: positions attend only within their own segment.
        impl: "xla" (`dot_product_attention`), "cudnn" (GPU), "splash" (TPU) or "auto"
            (equipax.core.nn.fused_attention).
        mesh: the device mesh: its platform decides "auto", and splash runs per device on it.

    Returns:
        Attention outputs in `v.dtype`.

    Raises:
        ConfigError: `impl` cannot run on the mesh's platform, dtype or sequence length.
    """
    chosen = resolve_attention_impl(impl, mesh_platform(mesh), seq_len=q.shape[1], dtype=q.dtype,
                                    logit_cap=logit_cap)
    if chosen == "cudnn":
        return cudnn_attention(q, k, v, causal=causal, segment_ids=segment_ids)
    if chosen == "splash":
        return splash_attention(q, k, v, causal=causal, logit_cap=logit_cap, segment_ids=segment_ids,
                                mesh=mesh)
    return dot_product_attention(q, k, v, causal=causal, logit_cap=logit_cap, segment_ids=segment_ids)


class CausalSelfAttention(eqx.Module):
    """Multi-head causal self-attention with a fused QKV projection."""

    qkv: Float[Array, "embed 3 heads head_dim"]
    qkv_bias: Float[Array, "3 heads head_dim"] | None
    out: Float[Array, "heads head_dim embed"]
    out_bias: Float[Array, " embed"] | None
    num_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    atten_logit_cap: float | None = eqx.field(static=True)
    kernel: Literal["softmax", "linear"] = eqx.field(static=True)
    impl: AttentionImpl = eqx.field(static=True)

    def __init__(
        self,
        model_dims: int,
        num_heads: int,
        head_dim: int,
        *,
        atten_logit_cap: float | None,
        use_bias: bool = False,
        kernel: Literal["softmax", "linear"] = "softmax",
        impl: AttentionImpl = "xla",
        key: PRNGKeyArray,
    ) -> None:
        """Arguments:
        model_dims: input and output width.
        num_heads: number of attention heads.
        head_dim: width of each head.
        atten_logit_cap: soft cap on attention logits (`None` = no cap).
        use_bias: biases on the QKV and output projections.
        kernel: "softmax" (`dot_product_attention`) or "linear" (`linear_attention`,
            which has no logits to cap).
        impl: the softmax kernel (`softmax_attention`): "xla", "cudnn", "splash" or "auto".
        key: PRNG key.
        """
        k_qkv, k_out = jr.split(key)
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.atten_logit_cap = atten_logit_cap
        self.kernel = kernel
        self.impl = impl
        self.qkv = fan_in_init(k_qkv, (model_dims, 3, num_heads, head_dim), in_axes=(0,))
        self.out = fan_in_init(k_out, (num_heads, head_dim, model_dims), in_axes=(0, 1))
        self.qkv_bias = jnp.zeros((3, num_heads, head_dim)) if use_bias else None
        self.out_bias = jnp.zeros((model_dims,)) if use_bias else None

    def logical_axes(self) -> dict[str, Axes]:
        """QKV is column-split by heads, the output projection row-split (Megatron)."""
        return {
            "qkv": ("embed", "qkv", "heads", "head_dim"),
            "qkv_bias": ("qkv", "heads", "head_dim"),
            "out": ("heads", "head_dim", "embed"),
            "out_bias": ("embed",),
        }

    def __call__(
        self, x: Float[Array, "batch seq embed"], segment_ids: Int[Array, "batch seq"] | None = None,
        *, mesh: Mesh | None = None,
    ) -> Float[Array, "batch seq embed"]:
        """Attend over the sequence; computes in `x.dtype`.

        Arguments:
            x: inputs.
            segment_ids: packed sequences: attend only within each segment (softmax kernel only).
            mesh: the device mesh (for `impl`: see `softmax_attention`); None = JAX's default backend.

        Returns:
            Outputs of the same shape.
        """
        qkv = jnp.einsum("bse,ethd->bsthd", x, self.qkv.astype(x.dtype))
        if self.qkv_bias is not None:
            qkv = qkv + expand_to(self.qkv_bias.astype(x.dtype), qkv.ndim)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        if self.kernel == "linear":
            if segment_ids is not None:
                raise ValueError(
                    "Linear attention has no segment mask: packed batches (segment_ids) need "
                    "attention='softmax', or set data.packing=False."
                )
            o = linear_attention(q, k, v, causal=True)
        else:
            o = softmax_attention(q, k, v, causal=True, logit_cap=self.atten_logit_cap,
                                  segment_ids=segment_ids, impl=self.impl, mesh=mesh)
        y = jnp.einsum("bshd,hde->bse", o, self.out.astype(x.dtype))
        if self.out_bias is not None:
            y = y + expand_to(self.out_bias.astype(x.dtype), y.ndim)
        return y
