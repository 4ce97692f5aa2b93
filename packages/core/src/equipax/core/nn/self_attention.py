"""Causal self-attention for every LM family: one module, one projection-kernel-output path.

`Attention` has `num_heads` query heads over `num_kv_heads` key/value heads (grouped-query
attention; multi-head is `num_kv_heads == num_heads`, multi-query one key/value head). Its options
are those of the families built from it:

- parameter layout: one fused `[embed 3 heads head_dim]` QKV projection (Pax's GPT) or separate
  query and key/value projections (Llama, Qwen, Mistral); both feed the same kernels;
- biases on the projections; an RMSNorm of each head's queries and keys (Qwen3's QK-norm);
- rotary positions: the caller passes each token's `(sin, cos)` (`rotary_angles`), applied to
  queries and keys after the QK-norm;
- the kernel: softmax (`softmax_attention`, behind `attention_impl`) with an optional tanh logit
  cap and sliding window, or linear attention;
- a KV cache (`AttentionCache`): decoding calls the same module with the cache, which takes this
  call's keys and values and is attended over with `cached_attention`;
- context parallelism: on a mesh with a `context` axis the sequence is split over it and the
  softmax kernel is `context_attention` (`context_parallel`: all-gather or ring), masked by each
  token's index in the unsplit row (`sequence_index`; docs/long_context.md); with `impl="splash"`
  (TPU) it is `splash_all_gather_attention` (the kernel per chunk of queries over the gathered
  keys) or `splash_ring_attention` (the kernel per pair of query and key chunks as the blocks rotate).
"""

from typing import Literal

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

from equipax.core.mesh_config import CONTEXT
from equipax.core.nn.attention import cached_attention, check_groups, softmax_attention
from equipax.core.nn.context_parallel import (
    ContextParallel,
    context_attention,
    slot_index,
    splash_all_gather_attention,
    splash_ring_attention,
)
from equipax.core.nn.fused_attention import AttentionImpl, mesh_platform, resolve_attention_impl
from equipax.core.nn.linear import expand_to, fan_in_init
from equipax.core.nn.linear_attention import linear_attention
from equipax.core.nn.norm import RMSNorm
from equipax.core.nn.quantization import Quantization, QuantizedWeight, makes_quantized_copy, project
from equipax.core.nn.remat import ATTENTION_OUT
from equipax.core.nn.rotary import apply_rotary
from equipax.core.partition import Axes

__all__ = ["Attention", "AttentionCache", "Rotary"]

Rotary = tuple[Float[Array, "batch seq half"], Float[Array, "batch seq half"]]
"""`(sin, cos)` of each token's rotation angles (`equipax.core.nn.rotary.rotary_angles`)."""


class AttentionCache(eqx.Module):
    """One layer's keys and values for decoding; slot `j` of a row holds its token at position `j`.

    Slot-major (`[batch slots kv_heads head_dim]`), as the step's keys and values come: a token's
    keys are written in place, with no change of layout (a head-major cache made XLA:TPU copy the
    layer's cache each token, 0.97x a plain loop at batch 1: benchmarks/README.md, "Decode on the
    chip"); with grouped-query attention it holds `num_kv_heads` heads, not `num_heads`. A stack of
    layers holds one with a leading layer axis (scanned layers) or a tuple of them.
    """

    keys: Float[Array, "*layers batch slots kv_heads head_dim"]
    values: Float[Array, "*layers batch slots kv_heads head_dim"]

    @property
    def max_len(self) -> int:
        """Number of slots per row."""
        return self.keys.shape[-3]


class Attention(eqx.Module):
    """Causal self-attention with grouped key/value heads (module docstring for the options)."""

    qkv: Float[Array, "embed 3 heads head_dim"] | QuantizedWeight | None
    qkv_bias: Float[Array, "3 heads head_dim"] | None
    q: Float[Array, "embed heads head_dim"] | QuantizedWeight | None
    q_bias: Float[Array, "heads head_dim"] | None
    kv: Float[Array, "embed 2 kv_heads head_dim"] | QuantizedWeight | None
    kv_bias: Float[Array, "2 kv_heads head_dim"] | None
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None
    out: Float[Array, "heads head_dim embed"] | QuantizedWeight
    out_bias: Float[Array, " embed"] | None
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    logit_cap: float | None = eqx.field(static=True)
    window: int | None = eqx.field(static=True)
    kernel: Literal["softmax", "linear"] = eqx.field(static=True)
    impl: AttentionImpl = eqx.field(static=True)
    context_parallel: ContextParallel = eqx.field(static=True)
    context_zigzag: bool = eqx.field(static=True)
    quantization: Quantization = eqx.field(static=True)

    def __init__(
        self,
        model_dims: int,
        num_heads: int,
        head_dim: int,
        *,
        num_kv_heads: int | None = None,
        fused_qkv: bool = True,
        use_bias: bool = False,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        logit_cap: float | None = None,
        window: int | None = None,
        kernel: Literal["softmax", "linear"] = "softmax",
        impl: AttentionImpl = "xla",
        context_parallel: ContextParallel = "all_gather",
        context_zigzag: bool = True,
        quantization: Quantization = "none",
        key: PRNGKeyArray,
    ) -> None:
        """Arguments:
        model_dims: input and output width.
        num_heads: query heads.
        head_dim: width of each head (even, for rotary positions).
        num_kv_heads: key/value heads, dividing `num_heads`; None = `num_heads`.
        fused_qkv: one QKV projection (needs `num_kv_heads == num_heads`), else separate query
            and key/value projections.
        use_bias: biases on the projections.
        qk_norm: RMSNorm (eps `norm_eps`) over each head's queries and keys.
        norm_eps: the QK-norm's epsilon.
        logit_cap: soft cap on the attention logits (`None` = no cap).
        window: each query sees itself and the `window - 1` positions before it (None = all).
        kernel: "softmax" (`softmax_attention`) or "linear" (`linear_attention`, which has no
            logits to cap, no window and no segment mask).
        impl: the softmax kernel (`softmax_attention`): "xla", "cudnn", "splash" or "auto".
        context_parallel: the kernel on a mesh with a `context` axis: "all_gather" or "ring"
            (`equipax.core.nn.context_parallel`).
        context_zigzag: the input's layout of the sequence on a `context` axis, zigzag (else
            contiguous blocks; `context_parallel_load_balance`): what `impl="splash"` needs to
            know statically there (`splash_all_gather_attention`, `splash_ring_attention`); the
            other kernels mask by
            the positions they are given.
        quantization: how the four projections compute (`equipax.core.nn.quantization.project`);
            the attention scores and context are never quantized.
        key: PRNG key.
        """
        kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        check_groups(num_heads, kv_heads)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, kv_heads, head_dim
        self.logit_cap, self.window, self.kernel, self.impl = logit_cap, window, kernel, impl
        self.context_parallel, self.context_zigzag = context_parallel, context_zigzag
        self.quantization = quantization
        self.q = self.q_bias = self.kv = self.kv_bias = self.qkv = self.qkv_bias = None
        if fused_qkv:
            if kv_heads != num_heads:
                raise ValueError(
                    f"fused_qkv=True needs num_kv_heads == num_heads, got {kv_heads} < {num_heads}; "
                    "pass fused_qkv=False for grouped-query attention."
                )
            k_qkv, k_out = jr.split(key)
            self.qkv = fan_in_init(k_qkv, (model_dims, 3, num_heads, head_dim), in_axes=(0,))
            self.qkv_bias = jnp.zeros((3, num_heads, head_dim)) if use_bias else None
        else:
            k_q, k_kv, k_out = jr.split(key, 3)
            self.q = fan_in_init(k_q, (model_dims, num_heads, head_dim), in_axes=(0,))
            self.kv = fan_in_init(k_kv, (model_dims, 2, kv_heads, head_dim), in_axes=(0,))
            self.q_bias = jnp.zeros((num_heads, head_dim)) if use_bias else None
            self.kv_bias = jnp.zeros((2, kv_heads, head_dim)) if use_bias else None
        self.q_norm = RMSNorm(head_dim, eps=norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps=norm_eps) if qk_norm else None
        self.out = fan_in_init(k_out, (num_heads, head_dim, model_dims), in_axes=(0, 1))
        self.out_bias = jnp.zeros((model_dims,)) if use_bias else None

    def logical_axes(self) -> dict[str, Axes]:
        """Projections column-split by heads, the output projection row-split (Megatron).

        Query head `h` reads key/value head `h // group`, so splitting both head axes the same
        number of ways keeps each group on one device; key/value heads too few to split are
        replicated (`partition.spec_for`).
        """
        return {
            "qkv": ("embed", "qkv", "heads", "head_dim"),
            "qkv_bias": ("qkv", "heads", "head_dim"),
            "q": ("embed", "heads", "head_dim"),
            "q_bias": ("heads", "head_dim"),
            "kv": ("embed", "qkv", "heads", "head_dim"),
            "kv_bias": ("qkv", "heads", "head_dim"),
            "out": ("heads", "head_dim", "embed"),
            "out_bias": ("embed",),
        }

    def project(
        self, x: Float[Array, "batch seq embed"], rotary: Rotary | None = None
    ) -> tuple[
        Float[Array, "batch seq heads head_dim"],
        Float[Array, "batch seq kv_heads head_dim"],
        Float[Array, "batch seq kv_heads head_dim"],
    ]:
        """Queries, keys and values of `x`: projected, QK-normed and rotated (a KV cache holds the
        rotated keys).

        Arguments:
            x: normalised inputs.
            rotary: `(sin, cos)` of each token's position, or None (no rotation).

        Returns:
            `(q, k, v)` in `x.dtype`.
        """
        dtype = x.dtype
        if self.qkv is not None:
            qkv = project(x, self.qkv, 1, self.quantization)  # [b s 3 heads head_dim]
            if self.qkv_bias is not None:
                qkv = qkv + expand_to(self.qkv_bias.astype(dtype), qkv.ndim)
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        else:
            assert self.q is not None and self.kv is not None
            q = project(x, self.q, 1, self.quantization)  # [b s heads head_dim]
            kv = project(x, self.kv, 1, self.quantization)  # [b s 2 kv_heads head_dim]
            if self.q_bias is not None and self.kv_bias is not None:
                q = q + expand_to(self.q_bias.astype(dtype), q.ndim)
                kv = kv + expand_to(self.kv_bias.astype(dtype), kv.ndim)
            k, v = kv[:, :, 0], kv[:, :, 1]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rotary is not None:
            sin, cos = rotary
            q, k = apply_rotary(q, sin, cos), apply_rotary(k, sin, cos)
        return q, k, v

    def with_quantized_weights(self, keep_float: bool = False) -> "Attention":
        """This layer with its projections replaced by the int8 `QuantizedWeight`s it serves with,
        or with `keep_float` by the copies a train step computes with (`quantize_weights`); itself
        when its `quantization` makes no copy or they are already quantized."""
        if not makes_quantized_copy(self.quantization, keep_float) or isinstance(self.out, QuantizedWeight):
            return self
        # name: (the weight's rank without stacked-layer axes, its input axes)
        ranks = {"qkv": (4, 1), "q": (3, 1), "kv": (4, 1), "out": (3, 2)}
        names = [n for n in ranks if getattr(self, n) is not None]
        new, q = [], self.quantization
        for n in names:
            w, (rank, contract) = getattr(self, n), ranks[n]
            stack = w.ndim - rank
            new.append(QuantizedWeight.of(w, stack=stack, contract=contract, quantization=q, keep_float=keep_float))
        return eqx.tree_at(lambda m: [getattr(m, n) for n in names], self, new)

    def output(self, o: Float[Array, "batch seq heads head_dim"]) -> Float[Array, "batch seq embed"]:
        """The output projection of the per-head attention result (`o.dtype`)."""
        y = project(o, self.out, 2, self.quantization)
        if self.out_bias is not None:
            y = y + expand_to(self.out_bias.astype(y.dtype), y.ndim)
        return y

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        segment_ids: Int[Array, "batch seq"] | None = None,
        *,
        rotary: Rotary | None = None,
        mesh: Mesh | None = None,
        cache: AttentionCache | None = None,
        positions: Int[Array, "batch seq"] | None = None,
        sequence_index: Int[Array, "batch seq"] | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], AttentionCache | None]:
        """Attend over the sequence (or, with a cache, over the cache); computes in `x.dtype`.

        Arguments:
            x: normalised inputs.
            segment_ids: packed sequences: attend only within each segment (softmax kernel only).
            rotary: `(sin, cos)` of each token's position, or None.
            mesh: the device mesh (for `impl`: see `softmax_attention`); None = JAX's default backend.
            cache: decoding: this layer's keys and values so far. This call's keys and values are
                written to the slots `positions`, and each query attends over the slots up to its
                own position (a prompt in one call, then one token per call).
            positions: with `cache`, each token's position (its slot).
            sequence_index: each token's index in its unsplit row, when the row is reordered for
                context parallelism (the zigzag layout); None = 0 .. seq-1. The causal and window
                masks compare these.

        Returns:
            `(outputs, cache)`: outputs of the same shape as `x`, and the cache with this call's
            keys and values written (None without a cache).
        """
        q, k, v = self.project(x, rotary)
        # Whether the kernel named its own residuals for remat (splash: its output and
        # log-sum-exp, `equipax.core.nn.remat`); the other kernels' context is named below.
        named = False
        if cache is not None:
            if self.kernel != "softmax":
                raise ValueError(
                    f"KV-cache decoding needs softmax attention; this layer has attention="
                    f"{self.kernel!r}. Use equipax.models.generate (no cache) for it."
                )
            if positions is None:
                raise ValueError("decoding with a cache needs each token's position (positions=...).")
            rows = jnp.arange(x.shape[0])[:, None]
            keys = cache.keys.at[rows, positions].set(k.astype(cache.keys.dtype))
            values = cache.values.at[rows, positions].set(v.astype(cache.values.dtype))
            cache = AttentionCache(keys=keys, values=values)
            o = cached_attention(
                q, keys, values, query_positions=positions, logit_cap=self.logit_cap, window=self.window
            )
        elif self.kernel == "linear":
            if segment_ids is not None:
                raise ValueError(
                    "Linear attention has no segment mask: packed batches (segment_ids) need "
                    "attention='softmax', or set data.packing=False."
                )
            o = linear_attention(q, k, v, causal=True)
        elif self.impl == "splash" and mesh is not None and mesh.shape.get(CONTEXT, 1) > 1:
            resolve_attention_impl(
                "splash", mesh_platform(mesh), seq_len=x.shape[1], dtype=q.dtype, logit_cap=self.logit_cap
            )  # a TPU (a ConfigError naming the knob elsewhere)
            splash = splash_ring_attention if self.context_parallel == "ring" else splash_all_gather_attention
            o = splash(
                q,
                k,
                v,
                zigzag=self.context_zigzag,
                causal=True,
                logit_cap=self.logit_cap,
                segment_ids=segment_ids,
                window=self.window,
                mesh=mesh,
            )
            named = True
        elif sequence_index is not None or (mesh is not None and mesh.shape.get(CONTEXT, 1) > 1):
            sequence_index = slot_index(x, sequence_index)
            o = context_attention(
                q,
                k,
                v,
                strategy=self.context_parallel,
                positions=sequence_index,
                causal=True,
                logit_cap=self.logit_cap,
                segment_ids=segment_ids,
                window=self.window,
                mesh=mesh,
            )
        else:
            impl = resolve_attention_impl(
                self.impl, mesh_platform(mesh), seq_len=x.shape[1], dtype=q.dtype, logit_cap=self.logit_cap
            )
            o = softmax_attention(
                q,
                k,
                v,
                causal=True,
                logit_cap=self.logit_cap,
                segment_ids=segment_ids,
                window=self.window,
                impl=impl,
                mesh=mesh,
            )
            named = impl == "splash"
        # The context, before the output projection: what remat='save_context' keeps (named once).
        return self.output(o if named else checkpoint_name(o, ATTENTION_OUT)), cache

    def init_cache(self, batch_size: int, max_len: int, dtype: DTypeLike) -> AttentionCache:
        """An empty (zero) cache of `batch_size` rows of `max_len` slots for this layer."""
        shape = (batch_size, max_len, self.num_kv_heads, self.head_dim)
        return AttentionCache(keys=jnp.zeros(shape, dtype), values=jnp.zeros(shape, dtype))
