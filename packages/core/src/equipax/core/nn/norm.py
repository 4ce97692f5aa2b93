"""Normalisation layers: one-pass LayerNorm and RMSNorm, statistics in float32."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from equipax.core.nn.linear import expand_to
from equipax.core.partition import Axes

__all__ = ["LayerNorm", "RMSNorm"]


class LayerNorm(eqx.Module):
    """LayerNorm over the last axis with a learned scale (init 1) and optional bias."""

    scale: Float[Array, " embed"]
    bias: Float[Array, " embed"] | None
    dims: int = eqx.field(static=True)
    eps: float = eqx.field(static=True)

    def __init__(self, dims: int, *, use_bias: bool = False, eps: float = 1e-6) -> None:
        """Arguments:
        dims: size of the normalised (last) axis.
        use_bias: add a learned bias (init 0).
        eps: added to the variance.
        """
        self.dims = dims
        self.eps = eps
        self.scale = jnp.ones((dims,), jnp.float32)
        self.bias = jnp.zeros((dims,), jnp.float32) if use_bias else None

    def logical_axes(self) -> dict[str, Axes]:
        """Small vectors: replicated."""
        return {"scale": ("norm",), "bias": ("norm",)}

    def __call__(self, x: Float[Array, "*batch embed"]) -> Float[Array, "*batch embed"]:
        """Normalise `x`; returns `x.dtype`.

        Arguments:
            x: inputs.

        Returns:
            `(x - mean) / sqrt(var + eps) * scale (+ bias)`.
        """
        xf = x.astype(jnp.float32)
        # One pass, and square(x) *before* mean(x): the centred two-pass variance
        # makes XLA:CPU duplicate the backward fusions across deep stacks
        # (benchmarks/README.md, "The LayerNorm trap").
        mean_sq = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.maximum(mean_sq - jnp.square(mean), 0.0)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        y = y * expand_to(self.scale, y.ndim)
        if self.bias is not None:
            y = y + expand_to(self.bias, y.ndim)
        return y.astype(x.dtype)


class RMSNorm(eqx.Module):
    """RMSNorm over the last axis with a learned scale (init 1)."""

    scale: Float[Array, " embed"]
    dims: int = eqx.field(static=True)
    eps: float = eqx.field(static=True)

    def __init__(self, dims: int, *, eps: float = 1e-6) -> None:
        """Arguments:
        dims: size of the normalised (last) axis.
        eps: added to the mean square.
        """
        self.dims = dims
        self.eps = eps
        self.scale = jnp.ones((dims,), jnp.float32)

    def logical_axes(self) -> dict[str, Axes]:
        """A small vector: replicated."""
        return {"scale": ("norm",)}

    def __call__(self, x: Float[Array, "*batch embed"]) -> Float[Array, "*batch embed"]:
        """Normalise `x`; returns `x.dtype`.

        Arguments:
            x: inputs.

        Returns:
            `x / sqrt(mean(x^2) + eps) * scale`.
        """
        xf = x.astype(jnp.float32)
        mean_sq = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)
        y = xf * jax.lax.rsqrt(mean_sq + self.eps) * expand_to(self.scale, xf.ndim)
        return y.astype(x.dtype)
