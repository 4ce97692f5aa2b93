"""Pre-LN transformer block and layer stack (scanned or unrolled, with remat policies)."""

import dataclasses
from collections.abc import Callable
from typing import Literal

import equinox as eqx
import jax
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray

from equipax.core.nn.attention import CausalSelfAttention
from equipax.core.nn.mlp import FeedForward
from equipax.core.nn.norm import LayerNorm, RMSNorm

_ACTIVATIONS = ("gelu", "relu", "silu")
_NORMS = ("layernorm", "rmsnorm")
_REMATS = ("none", "full", "dots_saveable")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    """Hyperparameters of a decoder-only transformer stack."""

    num_layers: int = 4
    model_dims: int = 256
    num_heads: int = 4
    head_dim: int = 64
    hidden_dims: int = 1024
    activation: Literal["gelu", "relu", "silu"] = "gelu"
    gated: bool = False
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    use_bias: bool = False
    atten_logit_cap: float | None = 50.0
    scan_layers: bool = True
    remat: Literal["none", "full", "dots_saveable"] = "none"

    def __post_init__(self):
        for name in ("num_layers", "model_dims", "num_heads", "head_dim", "hidden_dims"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"TransformerConfig.{name} must be a positive int, got {value!r}; "
                    f"set {name}=<int >= 1>."
                )
        for name, allowed in (
            ("activation", _ACTIVATIONS),
            ("norm", _NORMS),
            ("remat", _REMATS),
        ):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(
                    f"TransformerConfig.{name} must be one of {allowed}, got {value!r}."
                )
        cap = self.atten_logit_cap
        if cap is not None and not cap > 0:
            raise ValueError(
                f"TransformerConfig.atten_logit_cap must be > 0 or None (no cap), got {cap!r}."
            )


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


class TransformerBlock(eqx.Module):
    """Pre-LN block: `x + attn(norm(x))`, then `x + ffn(norm(x))`."""

    atten_norm: LayerNorm | RMSNorm
    attention: CausalSelfAttention
    ffn_norm: LayerNorm | RMSNorm
    ffn: FeedForward

    def __init__(self, cfg: TransformerConfig, *, key: PRNGKeyArray):
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

    def __call__(self, x: Float[Array, "batch seq embed"]) -> Float[Array, "batch seq embed"]:
        """Apply the block.

        Arguments:
            x: inputs.

        Returns:
            Outputs of the same shape and dtype.
        """
        x = x + self.attention(self.atten_norm(x))
        return x + self.ffn(self.ffn_norm(x))


def _block_apply(
    remat: str, static: TransformerBlock
) -> Callable[[TransformerBlock, Array], Array]:
    """`(block params, x) -> block(x)`, wrapped in the remat policy."""

    def apply(params: TransformerBlock, x: Array) -> Array:
        return eqx.combine(params, static)(x)

    if remat == "full":
        return jax.checkpoint(apply, policy=None)
    if remat == "dots_saveable":
        return jax.checkpoint(
            apply, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        )
    return apply


class TransformerStack(eqx.Module):
    """`num_layers` transformer blocks, scanned over stacked params or run in a loop.

    With `cfg.scan_layers`, `layers` is ONE `TransformerBlock` whose array leaves carry a
    leading `[num_layers]` axis; otherwise a tuple of blocks. Both layouts built from the
    same key hold the same numbers (layer `i` is initialised from `split(key)[i]`).
    """

    layers: TransformerBlock | tuple[TransformerBlock, ...]
    cfg: TransformerConfig = eqx.field(static=True)

    def __init__(self, cfg: TransformerConfig, *, key: PRNGKeyArray):
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

    def __call__(self, x: Float[Array, "batch seq embed"]) -> Float[Array, "batch seq embed"]:
        """Run all layers in order.

        Arguments:
            x: inputs.

        Returns:
            Outputs of the same shape and dtype.
        """
        if isinstance(self.layers, TransformerBlock):
            params, static = eqx.partition(self.layers, eqx.is_array)
            apply = _block_apply(self.cfg.remat, static)

            def body(h: Array, layer_params: TransformerBlock) -> tuple[Array, None]:
                return apply(layer_params, h), None

            x, _ = jax.lax.scan(body, x, params)
            return x
        for block in self.layers:
            params, static = eqx.partition(block, eqx.is_array)
            x = _block_apply(self.cfg.remat, static)(params, x)
        return x
