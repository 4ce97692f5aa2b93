"""Position-wise feed-forward block, plain or gated (GLU)."""

from typing import Literal

import equinox as eqx
import jax
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray

from equipax.core.nn.linear import Linear
from equipax.core.nn.quantization import Quantization

__all__ = ["Activation", "FeedForward"]

Activation = Literal["gelu", "relu", "silu"]

_ACTIVATIONS = {"gelu": jax.nn.gelu, "relu": jax.nn.relu, "silu": jax.nn.silu}


class FeedForward(eqx.Module):
    """`act(x W_up) W_down`, or gated `(act(x W_gate) * (x W_up)) W_down`."""

    up: Linear
    gate: Linear | None
    down: Linear
    activation: Activation = eqx.field(static=True)

    def __init__(
        self,
        model_dims: int,
        hidden_dims: int,
        *,
        activation: Activation,
        gated: bool,
        use_bias: bool = False,
        quantization: Quantization = "none",
        key: PRNGKeyArray,
    ) -> None:
        """Arguments:
        model_dims: input and output width.
        hidden_dims: hidden width.
        activation: nonlinearity applied to the (gate) projection.
        gated: use a GLU-style gate (three matrices instead of two).
        use_bias: biases on every projection.
        quantization: how the projections compute (`Linear`).
        key: PRNG key.
        """
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
        k_up, k_gate, k_down = jr.split(key, 3)
        self.activation = activation
        # Up and gate are column-split over the hidden units, down is row-split (Megatron).
        up_axes, down_axes = ("embed", "hidden"), ("hidden", "embed")
        q = quantization
        self.up = Linear(model_dims, hidden_dims, use_bias=use_bias, axes=up_axes, quantization=q, key=k_up)
        self.gate = (
            Linear(model_dims, hidden_dims, use_bias=use_bias, axes=up_axes, quantization=q, key=k_gate)
            if gated
            else None
        )
        self.down = Linear(hidden_dims, model_dims, use_bias=use_bias, axes=down_axes, quantization=q, key=k_down)

    def __call__(self, x: Float[Array, "*batch embed"]) -> Float[Array, "*batch embed"]:
        """Apply the block.

        Arguments:
            x: inputs.

        Returns:
            Outputs of the same shape and dtype.
        """
        act = _ACTIVATIONS[self.activation]
        h = act(self.up(x)) if self.gate is None else act(self.gate(x)) * self.up(x)
        return self.down(h)
