"""The pre-norm transformer block and layer stack of every LM family (scanned or unrolled, with
remat policies, shard_map tensor parallelism and the residual-stream sharding constraint).

`TransformerConfig` says which family's block it is (docs/extending.md): GPT's LayerNorm, fused
QKV, GELU and logit cap, or Llama's RMSNorm, grouped-query attention and SwiGLU, Qwen3's QK-norm,
Mistral's sliding window, and a mixture-of-experts feed-forward (Mixtral, Qwen3-MoE:
`num_experts > 0`, equipax.core.nn.moe) whose per-layer `MoEStats` the stack returns
(`TransformerStack.forward`).
A stack with `pipeline_stages > 1` is built as
`equipax.core.nn.pipeline.PipelinedStack` (`make_stack`); its knobs are validated with the rest of
the config. Decoding runs the same blocks with a KV cache (`TransformerStack.cached`).
"""

from collections.abc import Callable
from typing import TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, Key, PRNGKeyArray

from equipax.core.configs import TransformerConfig
from equipax.core.nn.fused_attention import block_attention_impl, mesh_platform
from equipax.core.nn.mlp import FeedForward
from equipax.core.nn.moe import MoEFeedForward, MoEStats
from equipax.core.nn.moe_parallel import apply_moe
from equipax.core.nn.norm import LayerNorm, RMSNorm
from equipax.core.nn.quantization import Quantization, check_quantization_platform, quantize_weights
from equipax.core.nn.remat import remat_policy
from equipax.core.nn.self_attention import Attention, AttentionCache, Rotary
from equipax.core.nn.tensor_parallel import shard_map_block
from equipax.core.partition import Axes, constrain_batch_and_last

__all__ = [
    "make_feed_forward",
    "make_norm",
    "run_cached_layers",
    "run_stacked_layers",
    "StackCache",
    "stacked_init",
    "TransformerBlock",
    "TransformerConfig",
    "TransformerStack",
]

_ModuleT = TypeVar("_ModuleT")

StackCache = AttentionCache | tuple[AttentionCache, ...]
"""A stack's KV cache: one `AttentionCache` with a leading layer axis (stacked layers), or one
per layer (unrolled)."""


def make_norm(cfg: TransformerConfig) -> LayerNorm | RMSNorm:
    """The normalisation layer `cfg.norm` of width `cfg.model_dims` (epsilon `cfg.norm_eps`).

    Arguments:
        cfg: transformer config.

    Returns:
        A fresh norm layer.
    """
    if cfg.norm == "layernorm":
        return LayerNorm(cfg.model_dims, use_bias=cfg.use_bias, eps=cfg.norm_eps)
    return RMSNorm(cfg.model_dims, eps=cfg.norm_eps)


def make_feed_forward(
    cfg: TransformerConfig, *, key: PRNGKeyArray, quantization: Quantization = "none"
) -> FeedForward | MoEFeedForward:
    """The block's feed-forward layer: the one place a block's MLP is chosen.

    Arguments:
        cfg: transformer config (`hidden_dims`, `activation`, `gated`, `use_bias`; with
            `num_experts > 0` the mixture-of-experts knobs).
        key: PRNG key.
        quantization: how the dense feed-forward's matmuls compute (`Linear`); a mixture of
            experts computes in float (the model config refuses it with a quantization).

    Returns:
        A fresh feed-forward layer (`MoEFeedForward` when `cfg.num_experts > 0`).
    """
    if cfg.num_experts:
        return MoEFeedForward(
            cfg.model_dims,
            cfg.expert_hidden_dims,
            cfg.num_experts,
            cfg.num_experts_per_tok,
            norm_topk_prob=cfg.norm_topk_prob,
            capacity_factor=cfg.capacity_factor,
            shared_hidden_dims=cfg.shared_expert_intermediate_size,
            activation=cfg.activation,
            router_bias=cfg.router_bias_update_rate > 0,
            key=key,
        )
    return FeedForward(
        cfg.model_dims,
        cfg.hidden_dims,
        activation=cfg.activation,
        gated=cfg.gated,
        use_bias=cfg.use_bias,
        quantization=quantization,
        key=key,
    )


class TransformerBlock(eqx.Module):
    """Pre-norm block: `x + attn(norm(x))`, then `x + ffn(norm(x))`."""

    atten_norm: LayerNorm | RMSNorm
    attention: Attention
    ffn_norm: LayerNorm | RMSNorm
    ffn: FeedForward | MoEFeedForward

    def __init__(self, cfg: TransformerConfig, *, key: PRNGKeyArray, quantization: Quantization = "none") -> None:
        """Arguments:
        cfg: transformer config.
        key: PRNG key.
        quantization: how the attention projections and the feed-forward's matmuls compute
            (`equipax.core.nn.quantization`; the LM's `model.quantization`).
        """
        k_att, k_ffn = jr.split(key)
        self.atten_norm = make_norm(cfg)
        self.attention = Attention(
            cfg.model_dims,
            cfg.num_heads,
            cfg.head_dim,
            num_kv_heads=cfg.num_kv_heads,
            fused_qkv=cfg.fused_qkv,
            use_bias=cfg.use_bias,
            qk_norm=cfg.qk_norm,
            norm_eps=cfg.norm_eps,
            logit_cap=cfg.atten_logit_cap,
            window=cfg.sliding_window,
            kernel=cfg.attention,
            impl=block_attention_impl(cfg),
            context_parallel=cfg.context_parallel_strategy,
            context_zigzag=cfg.context_parallel_load_balance,
            quantization=quantization,
            key=k_att,
        )
        self.ffn_norm = make_norm(cfg)
        self.ffn = make_feed_forward(cfg, key=k_ffn, quantization=quantization)

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        segment_ids: Int[Array, "batch seq"] | None = None,
        *,
        rotary: Rotary | None = None,
        mesh: Mesh | None = None,
        cache: AttentionCache | None = None,
        positions: Int[Array, "batch seq"] | None = None,
        reduce: Callable[[Array], Array] | None = None,
        sequence_index: Int[Array, "batch seq"] | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], AttentionCache | None, MoEStats | None]:
        """Apply the block.

        Arguments:
            x: inputs.
            segment_ids: packed sequences: attention stays within each segment.
            rotary: `(sin, cos)` of each token's position (rotary positions), or None.
            mesh: the device mesh, for the attention kernel (`attention_impl`).
            cache, positions: decoding with a KV cache (`Attention.__call__`).
            reduce: applied to each sub-layer's output before it is added to the residual
                stream: the all-reduce of a tensor-parallel block's row-split projections
                (`shard_map_block`); None = as computed.
            sequence_index: each token's index in its unsplit row (a context-parallel layout
                reorders rows; `Attention.__call__`); None = 0 .. seq-1.

        Returns:
            `(outputs, cache, stats)`: outputs of the same shape and dtype, the updated cache (None
            without one), and a mixture-of-experts feed-forward's `MoEStats` (None for a dense one).
        """
        check_quantization_platform(self.attention.quantization, mesh_platform(mesh))
        y, cache = self.attention(
            self.atten_norm(x),
            segment_ids,
            rotary=rotary,
            mesh=mesh,
            cache=cache,
            positions=positions,
            sequence_index=sequence_index,
        )
        # The residual stream entering the MLP: what remat='save_attention_out' keeps beside the context.
        x = checkpoint_name(x + (y if reduce is None else reduce(y)), "mlp_in")
        stats = None
        if isinstance(self.ffn, MoEFeedForward):
            y, stats = apply_moe(self.ffn, self.ffn_norm(x), mesh)
        else:
            y = self.ffn(self.ffn_norm(x))
        return x + (y if reduce is None else reduce(y)), cache, stats


def _block_apply(
    remat: str,
    static: TransformerBlock,
    mesh: Mesh | None = None,
    segment_ids: Array | None = None,
    shard_map: bool = False,
    rotary: Rotary | None = None,
    sequence_index: Array | None = None,
) -> Callable[[TransformerBlock, Array], tuple[Array, MoEStats | None]]:
    """`(block params, x) -> (block(x), MoE stats or None)`, wrapped in the remat policy.

    With a `mesh`, the output's batch dimension is pinned to the batch axes and its width to
    `tensor` (the residual stream that remat saves per layer is split, not replicated); with
    `shard_map`, the block runs as `shard_map_block` (explicit collectives) on that mesh.
    """

    def apply(params: TransformerBlock, x: Array) -> tuple[Array, MoEStats | None]:
        block = eqx.combine(params, static)
        if shard_map and mesh is not None:  # dense blocks only (the config refuses MoE here)
            y = shard_map_block(block, x, mesh, segment_ids=segment_ids, rotary=rotary, sequence_index=sequence_index)
            return y, None
        y, _, stats = block(x, segment_ids, rotary=rotary, mesh=mesh, sequence_index=sequence_index)
        return constrain_batch_and_last(y, mesh), stats

    if remat == "none":
        return apply
    return jax.checkpoint(apply, policy=remat_policy(remat))


def _layer(params: TransformerBlock, i: int | Array) -> TransformerBlock:
    return jax.tree.map(lambda w: w[i], params)


def run_stacked_layers(
    params: TransformerBlock,
    static: TransformerBlock,
    x: Array,
    *,
    remat: str,
    scan: bool,
    mesh: Mesh | None = None,
    segment_ids: Array | None = None,
    shard_map: bool = False,
    rotary: Rotary | None = None,
    sequence_index: Array | None = None,
    repeats: int = 1,
) -> tuple[Array, MoEStats | None]:
    """Apply blocks whose parameters are stacked on a leading layer axis, in order; int8 and fp8
    projections' weights are rounded once, for every layer, before the loop (`quantize_weights`).

    Arguments:
        params, static: the stacked block's arrays (`eqx.partition(..., eqx.is_array)`), the rest.
        x: the activations entering the first layer.
        remat: the remat policy applied to each layer.
        scan: `jax.lax.scan` over the layers (one compiled body) or an unrolled loop.
        mesh, segment_ids, shard_map, rotary, sequence_index: as for `TransformerStack.__call__`.
        repeats: shared layers (`num_hidden_groups`): each stacked block applies this many times in a
            row (layer `i` is block `i // repeats`); the scan then runs over the layer index and reads
            its block from the closed-over parameters (the backward sums its gradient, no copies).

    Returns:
        `(the activations leaving the last layer, MoEStats stacked over the layers or None)`.
    """
    num_layers = jax.tree.leaves(params)[0].shape[0] * repeats
    if not shard_map:  # (a shard_map block rounds its own slices of the weights)
        params, static = eqx.partition(quantize_weights(eqx.combine(params, static), True), eqx.is_array)
    apply = _block_apply(remat, static, mesh, segment_ids, shard_map, rotary, sequence_index)
    if scan and repeats == 1:
        return jax.lax.scan(lambda h, p: apply(p, h), x, params)
    if scan:
        blocks = jnp.arange(num_layers, dtype=jnp.int32) // repeats
        return jax.lax.scan(lambda h, b: apply(_layer(params, b), h), x, blocks)
    stats = []
    for i in range(num_layers):
        x, s = apply(_layer(params, i // repeats), x)
        stats.append(s)
    return x, _stack_stats(stats)


def _stack_stats(stats: list[MoEStats | None]) -> MoEStats | None:
    """Per-layer stats stacked on a leading layer axis (None for dense layers)."""
    if not stats or stats[0] is None:
        return None
    return jax.tree.map(lambda *xs: jnp.stack(xs), *stats)


def run_cached_layers(
    layers: TransformerBlock | tuple[TransformerBlock, ...],
    x: Array,
    cache: StackCache,
    positions: Array,
    *,
    scan: bool,
    rotary: Rotary | None = None,
    repeats: int = 1,
) -> tuple[Array, StackCache]:
    """Apply the blocks in order with their KV caches (decoding; no remat, one device's numbers).

    Arguments:
        layers: one stacked block (leading layer axis) or a tuple of blocks.
        x: the activations entering the first layer.
        cache: the matching cache: stacked for a stacked block, else one per block.
        positions: each token's position (its cache slot).
        scan: for a stacked block, `jax.lax.scan` over the layers or an unrolled loop.
        rotary: `(sin, cos)` of each token's position, or None.
        repeats: shared layers: each block serves this many consecutive layers, each layer with
            its own cache (`run_stacked_layers`).

    Returns:
        `(activations leaving the last layer, the updated cache)`.
    """
    if isinstance(layers, tuple):
        assert isinstance(cache, tuple)
        new: list[AttentionCache] = []
        for block, c in zip([b for b in layers for _ in range(repeats)], cache, strict=True):
            x, updated, _ = block(x, rotary=rotary, cache=c, positions=positions)
            assert updated is not None
            new.append(updated)
        return x, tuple(new)
    assert isinstance(cache, AttentionCache)
    params, static = eqx.partition(layers, eqx.is_array)

    def step(h: Array, p: TransformerBlock, c: AttentionCache) -> tuple[Array, AttentionCache]:
        h, updated, _ = eqx.combine(p, static)(h, rotary=rotary, cache=c, positions=positions)
        assert updated is not None
        return h, updated

    if scan and repeats == 1:
        return jax.lax.scan(lambda h, pc: step(h, *pc), x, (params, cache))
    num_layers = cache.keys.shape[0]
    if scan:
        blocks = jnp.arange(num_layers, dtype=jnp.int32) // repeats
        return jax.lax.scan(lambda h, bc: step(h, _layer(params, bc[0]), bc[1]), x, (blocks, cache))
    caches = []
    for i in range(num_layers):
        x, c = step(x, _layer(params, i // repeats), _layer(cache, i))  # pyright: ignore[reportArgumentType]
        caches.append(c)
    return x, jax.tree.map(lambda *cs: jnp.stack(cs), *caches)


def init_stack_cache(
    layers: TransformerBlock | tuple[TransformerBlock, ...],
    batch_size: int,
    max_len: int,
    dtype: DTypeLike,
    repeats: int = 1,
) -> StackCache:
    """A zero cache for `layers` (stacked block: one cache with a leading layer axis), one per
    layer: with shared layers, `repeats` per block."""
    if isinstance(layers, tuple):
        return tuple(b.attention.init_cache(batch_size, max_len, dtype) for b in layers for _ in range(repeats))
    num_layers = jax.tree.leaves(eqx.filter(layers, eqx.is_array))[0].shape[0] * repeats
    one = layers.attention.init_cache(batch_size, max_len, dtype)
    return jax.tree.map(lambda a: jnp.zeros((num_layers, *a.shape), a.dtype), one)


def stacked_init(make: Callable[[PRNGKeyArray], _ModuleT], keys: Key[Array, " n"]) -> _ModuleT:
    """`make(keys[i])` for every key, as ONE module whose array leaves are stacked on a leading axis.

    Holds exactly the numbers of `eqx.filter_vmap(make)(keys)` (layer `i` from `keys[i]`), built
    by a `jax.lax.map` over the keys: compiled, each layer's random draws are one loop body at the
    layer's own shapes rather than one batched draw over all layers, which XLA:TPU compiled ~3x
    slower (c4_1b at 6 layers: 41 vs 13 CPU-seconds, benchmarks/README.md) and which held an
    extra 0.58 GB of temporaries.

    Arguments:
        make: key -> module (a transformer block).
        keys: one key per stacked entry, `[n]`.
    """
    static = eqx.filter(eqx.filter_eval_shape(make, keys[0]), eqx.is_array, inverse=True)
    arrays = jax.lax.map(lambda k: eqx.filter(make(k), eqx.is_array), keys)
    return eqx.combine(arrays, static)


class TransformerStack(eqx.Module):
    """`num_layers` transformer blocks, scanned over stacked params or run in a loop.

    With `cfg.scan_layers`, `layers` is ONE `TransformerBlock` whose array leaves carry a
    leading `[num_layers]` axis; otherwise a tuple of blocks. Both layouts built from the
    same key hold the same numbers (layer `i` is initialised from `split(key)[i]`).

    Shared layers (`cfg.num_hidden_groups`, ALBERT's): the stack holds `layer_groups` blocks
    (leading axis, or tuple, of that length) and layer `i` applies block `i // (num_layers /
    layer_groups)`; block `g` is initialised from `split(key, layer_groups)[g]`.
    """

    layers: TransformerBlock | tuple[TransformerBlock, ...]
    cfg: TransformerConfig = eqx.field(static=True)

    def __init__(self, cfg: TransformerConfig, *, key: PRNGKeyArray, quantization: Quantization = "none") -> None:
        """Arguments:
        cfg: transformer config.
        key: PRNG key.
        quantization: how the blocks' projections compute (`TransformerBlock`).
        """
        self.cfg = cfg
        keys = jr.split(key, cfg.layer_groups)
        if cfg.scan_layers:
            self.layers = stacked_init(lambda k: TransformerBlock(cfg, key=k, quantization=quantization), keys)
        else:
            self.layers = tuple(TransformerBlock(cfg, key=k, quantization=quantization) for k in keys)

    @property
    def _repeats(self) -> int:
        """Layers each held block serves (1 without shared layers)."""
        return self.cfg.num_layers // self.cfg.layer_groups

    def logical_axes(self) -> dict[str, Axes]:
        """Scanned: every array of the one stacked block has a leading `layers` axis."""
        return {"layers": ("layers",)} if isinstance(self.layers, TransformerBlock) else {}

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        *,
        mesh: Mesh | None = None,
        segment_ids: Int[Array, "batch seq"] | None = None,
        rotary: Rotary | None = None,
        sequence_index: Int[Array, "batch seq"] | None = None,
    ) -> Float[Array, "batch seq embed"]:
        """Run all layers in order (`forward` without the mixture-of-experts stats).

        Arguments:
            x: inputs.
            mesh: the device mesh: activations are pinned to the batch axes on it, and
                `tensor_parallel="shard_map"` runs on it. Without it, the same numbers on
                one device.
            segment_ids: packed sequences: attention stays within each segment.
            rotary: `(sin, cos)` of each token's position (rotary positions), or None.
            sequence_index: each token's index in its unsplit row, for a context-parallel layout
                (`Attention.__call__`); None = 0 .. seq-1.

        Returns:
            Outputs of the same shape and dtype.
        """
        return self.forward(x, mesh=mesh, segment_ids=segment_ids, rotary=rotary, sequence_index=sequence_index)[0]

    def forward(
        self,
        x: Float[Array, "batch seq embed"],
        *,
        mesh: Mesh | None = None,
        segment_ids: Int[Array, "batch seq"] | None = None,
        rotary: Rotary | None = None,
        sequence_index: Int[Array, "batch seq"] | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], MoEStats | None]:
        """Run all layers in order.

        Arguments:
            x, mesh, segment_ids, rotary, sequence_index: as for `__call__`.

        Returns:
            `(outputs of the same shape and dtype, MoEStats with a leading layer axis)`; the
            stats are None for dense feed-forwards.
        """
        shard_map = self.cfg.tensor_parallel == "shard_map"
        if isinstance(self.layers, TransformerBlock):
            params, static = eqx.partition(self.layers, eqx.is_array)
            return run_stacked_layers(
                params,
                static,
                x,
                remat=self.cfg.remat,
                scan=True,
                mesh=mesh,
                segment_ids=segment_ids,
                shard_map=shard_map,
                rotary=rotary,
                sequence_index=sequence_index,
                repeats=self._repeats,
            )
        stats = []
        for block in (b for b in self.layers for _ in range(self._repeats)):
            params, static = eqx.partition(block if shard_map else quantize_weights(block, True), eqx.is_array)
            apply = _block_apply(self.cfg.remat, static, mesh, segment_ids, shard_map, rotary, sequence_index)
            x, s = apply(params, x)
            stats.append(s)
        return x, _stack_stats(stats)

    def cached(
        self,
        x: Float[Array, "batch seq embed"],
        cache: StackCache,
        positions: Int[Array, "batch seq"],
        *,
        rotary: Rotary | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], StackCache]:
        """Run all layers with a KV cache (decoding: a prompt, then one token per call).

        Arguments:
            x: inputs.
            cache: the stack's cache (`init_cache`).
            positions: each token's position (its cache slot).
            rotary: `(sin, cos)` of each token's position, or None.

        Returns:
            `(outputs, the updated cache)`.
        """
        return run_cached_layers(self.layers, x, cache, positions, scan=True, rotary=rotary, repeats=self._repeats)

    def init_cache(self, batch_size: int, max_len: int, dtype: DTypeLike) -> StackCache:
        """A zero KV cache for `batch_size` rows of `max_len` tokens, in `dtype`."""
        return init_stack_cache(self.layers, batch_size, max_len, dtype, repeats=self._repeats)
