"""Pre-LN transformer block and layer stack (scanned or unrolled, with remat policies).

A stack with `pipeline_stages > 1` is built as `equipax.core.nn.pipeline.PipelinedStack`
(`make_stack`); its knobs are validated here with the rest of the config.
"""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.random as jr
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int, PRNGKeyArray

from equipax.core.configs import TransformerConfig
from equipax.core.nn.attention import CausalSelfAttention
from equipax.core.nn.fused_attention import AttentionImpl
from equipax.core.nn.mlp import FeedForward
from equipax.core.nn.norm import LayerNorm, RMSNorm
from equipax.core.nn.tensor_parallel import shard_map_block
from equipax.core.partition import Axes, constrain_batch_and_last

__all__ = [
    "make_norm",
    "run_stacked_layers",
    "TransformerBlock",
    "TransformerConfig",
    "TransformerStack",
]

def make_norm(cfg: TransformerConfig) -> LayerNorm | RMSNorm:
    """The normalisation layer `cfg.norm` of width `cfg.model_dims`.

    Arguments:
        cfg: transformer config.

    Returns:
        A fresh norm layer.
    """
    if cfg.norm == "layernorm":
        return LayerNorm(cfg.model_dims, use_bias=cfg.use_bias)
    return RMSNorm(cfg.model_dims)


def _attention_impl(cfg: TransformerConfig) -> AttentionImpl:
    """`cfg.attention_impl`, except that "auto" means "xla" inside a pipeline stage or a
    `tensor_parallel="shard_map"` block (splash runs in its own shard_map, which cannot nest there)."""
    nested = cfg.pipeline_stages > 1 or cfg.tensor_parallel != "gspmd"
    return "xla" if cfg.attention_impl == "auto" and nested else cfg.attention_impl


class TransformerBlock(eqx.Module):
    """Pre-LN block: `x + attn(norm(x))`, then `x + ffn(norm(x))`."""

    atten_norm: LayerNorm | RMSNorm
    attention: CausalSelfAttention
    ffn_norm: LayerNorm | RMSNorm
    ffn: FeedForward

    def __init__(self, cfg: TransformerConfig, *, key: PRNGKeyArray) -> None:
        """Arguments:
        cfg: transformer config.
        key: PRNG key.
        """
        k_att, k_ffn = jr.split(key)
        self.atten_norm = make_norm(cfg)
        self.attention = CausalSelfAttention(
            cfg.model_dims,
            cfg.num_heads,
            cfg.head_dim,
            atten_logit_cap=cfg.atten_logit_cap,
            use_bias=cfg.use_bias,
            kernel=cfg.attention,
            impl=_attention_impl(cfg),
            key=k_att,
        )
        self.ffn_norm = make_norm(cfg)
        self.ffn = FeedForward(
            cfg.model_dims,
            cfg.hidden_dims,
            activation=cfg.activation,
            gated=cfg.gated,
            use_bias=cfg.use_bias,
            key=k_ffn,
        )

    def __call__(
        self, x: Float[Array, "batch seq embed"], segment_ids: Int[Array, "batch seq"] | None = None,
        *, mesh: Mesh | None = None,
    ) -> Float[Array, "batch seq embed"]:
        """Apply the block.

        Arguments:
            x: inputs.
            segment_ids: packed sequences: attention stays within each segment.
            mesh: the device mesh, for the attention kernel (`attention_impl`).

        Returns:
            Outputs of the same shape and dtype.
        """
        x = x + self.attention(self.atten_norm(x), segment_ids, mesh=mesh)
        return x + self.ffn(self.ffn_norm(x))


def _block_apply(
    remat: str, static: TransformerBlock, mesh: Mesh | None = None,
    segment_ids: Array | None = None, shard_map: bool = False,
) -> Callable[[TransformerBlock, Array], Array]:
    """`(block params, x) -> block(x)`, wrapped in the remat policy.

    With a `mesh`, the output's batch dimension is pinned to (data, fsdp) and its width to
    `tensor` (the residual stream that remat saves per layer is split, not replicated); with
    `shard_map`, the block runs as `shard_map_block` (explicit collectives) on that mesh.
    """

    def apply(params: TransformerBlock, x: Array) -> Array:
        block = eqx.combine(params, static)
        if shard_map and mesh is not None:
            if segment_ids is not None:
                raise ValueError(
                    "tensor_parallel='shard_map' does not take packed batches (segment_ids) yet; "
                    "use tensor_parallel='gspmd' or data.packing=False."
                )
            return shard_map_block(block, x, mesh)
        return constrain_batch_and_last(block(x, segment_ids, mesh=mesh), mesh)

    if remat == "full":
        return jax.checkpoint(apply, policy=None)
    if remat == "dots_saveable":
        return jax.checkpoint(
            apply, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        )
    return apply


def run_stacked_layers(
    params: TransformerBlock, static: TransformerBlock, x: Array, *, remat: str,
    scan: bool, mesh: Mesh | None = None, segment_ids: Array | None = None,
    shard_map: bool = False,
) -> Array:
    """Apply blocks whose parameters are stacked on a leading layer axis, in order.

    Arguments:
        params: the array part of the stacked block (`eqx.partition(..., eqx.is_array)`).
        static: the rest of the block.
        x: the activations entering the first layer.
        remat: the remat policy applied to each layer.
        scan: `jax.lax.scan` over the layers (one compiled body) or an unrolled loop.
        mesh, segment_ids, shard_map: as for `TransformerStack.__call__`.

    Returns:
        The activations leaving the last layer.
    """
    apply = _block_apply(remat, static, mesh, segment_ids, shard_map)
    if scan:
        x, _ = jax.lax.scan(lambda h, p: (apply(p, h), None), x, params)
        return x
    num_layers = jax.tree.leaves(params)[0].shape[0]
    for i in range(num_layers):
        x = apply(jax.tree.map(lambda w: w[i], params), x)
    return x


class TransformerStack(eqx.Module):
    """`num_layers` transformer blocks, scanned over stacked params or run in a loop.

    With `cfg.scan_layers`, `layers` is ONE `TransformerBlock` whose array leaves carry a
    leading `[num_layers]` axis; otherwise a tuple of blocks. Both layouts built from the
    same key hold the same numbers (layer `i` is initialised from `split(key)[i]`).
    """

    layers: TransformerBlock | tuple[TransformerBlock, ...]
    cfg: TransformerConfig = eqx.field(static=True)

    def __init__(self, cfg: TransformerConfig, *, key: PRNGKeyArray) -> None:
        """Arguments:
        cfg: transformer config.
        key: PRNG key.
        """
        self.cfg = cfg
        keys = jr.split(key, cfg.num_layers)
        if cfg.scan_layers:
            self.layers = eqx.filter_vmap(lambda k: TransformerBlock(cfg, key=k))(keys)
        else:
            self.layers = tuple(TransformerBlock(cfg, key=k) for k in keys)

    def logical_axes(self) -> dict[str, Axes]:
        """Scanned: every array of the one stacked block has a leading `layers` axis."""
        return {"layers": ("layers",)} if isinstance(self.layers, TransformerBlock) else {}

    def __call__(
        self, x: Float[Array, "batch seq embed"], *, mesh: Mesh | None = None,
        segment_ids: Int[Array, "batch seq"] | None = None,
    ) -> Float[Array, "batch seq embed"]:
        """Run all layers in order.

        Arguments:
            x: inputs.
            mesh: the device mesh: activations are pinned to the batch axes on it, and
                `tensor_parallel="shard_map"` runs on it. Without it, the same numbers on
                one device.
            segment_ids: packed sequences: attention stays within each segment.

        Returns:
            Outputs of the same shape and dtype.
        """
        shard_map = self.cfg.tensor_parallel == "shard_map"
        if isinstance(self.layers, TransformerBlock):
            params, static = eqx.partition(self.layers, eqx.is_array)
            return run_stacked_layers(params, static, x, remat=self.cfg.remat, scan=True, mesh=mesh,
                                      segment_ids=segment_ids, shard_map=shard_map)
        for block in self.layers:
            params, static = eqx.partition(block, eqx.is_array)
            x = _block_apply(self.cfg.remat, static, mesh, segment_ids, shard_map)(params, x)
        return x
