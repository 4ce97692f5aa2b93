"""Dense layer with an `(in, out)` kernel acting on batched arrays."""

from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, PRNGKeyArray

from equipax.core.nn.quantization import Quantization, QuantizedWeight, makes_quantized_copy, project
from equipax.core.partition import Axes

__all__ = ["expand_to", "fan_in_init", "Linear"]


def fan_in_init(
    key: PRNGKeyArray, shape: tuple[int, ...], *, in_axes: Sequence[int], dtype: DTypeLike = jnp.float32
) -> Array:
    """Truncated-normal init with variance 1/fan_in, fan_in = product of `in_axes` dims.

    Arguments:
        key: PRNG key.
        shape: parameter shape.
        in_axes: the axes contracted with the input.
        dtype: parameter dtype.

    Returns:
        The initialised parameter.
    """
    in_axes = tuple(a % len(shape) for a in in_axes)
    out_axes = tuple(a for a in range(len(shape)) if a not in in_axes)
    init = jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=in_axes, out_axis=out_axes)
    return init(key, shape, dtype)


def expand_to(v: Array, ndim: int) -> Array:
    """Add leading unit axes so `v` broadcasts against an `ndim` array without rank promotion."""
    return v.reshape((1,) * (ndim - v.ndim) + v.shape)


class Linear(eqx.Module):
    """`y = x @ weight (+ bias)` over the last axis of `x`.

    The owner names the logical axes of the kernel (`axes=("embed", "hidden")` for an MLP up
    projection, `("hidden", "embed")` for the down projection); the bias takes the output axis.
    A `quantization` other than "none" computes the matmul quantized
    (`equipax.core.nn.quantization.project`); the weight stays float, or is its int8
    `QuantizedWeight` in a served model (`with_quantized_weights`).
    """

    weight: Float[Array, "in out"] | QuantizedWeight
    bias: Float[Array, " out"] | None
    in_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)
    axes: tuple[str | None, str | None] | None = eqx.field(static=True)
    quantization: Quantization = eqx.field(static=True)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool = False,
        dtype: DTypeLike = jnp.float32,
        axes: tuple[str | None, str | None] | None = None,
        quantization: Quantization = "none",
        key: PRNGKeyArray,
    ) -> None:
        """Arguments:
        in_features: size of the input's last axis.
        out_features: size of the output's last axis.
        use_bias: add a learned bias (initialised to zero).
        dtype: parameter dtype.
        axes: logical axes `(in, out)` of the weight, for sharding (`equipax.core.partition`);
            `None` leaves them undeclared, and sharding the layer then raises an error.
        quantization: how the matmul computes: "none", "int8", "int8w" or "fp8"
            (`equipax.core.nn.quantization`).
        key: PRNG key for the weight.
        """
        self.quantization = quantization
        self.in_features = in_features
        self.out_features = out_features
        self.axes = axes
        self.weight = fan_in_init(key, (in_features, out_features), in_axes=(0,), dtype=dtype)
        self.bias = jnp.zeros((out_features,), dtype) if use_bias else None

    def logical_axes(self) -> dict[str, Axes]:
        """Logical axes of `weight` and `bias` (none if the owner passed no `axes`)."""
        if self.axes is None:
            return {}
        return {"weight": self.axes, "bias": self.axes[1:]}

    def with_quantized_weights(self, keep_float: bool = False) -> "Linear":
        """This layer with its weight replaced by the int8 `QuantizedWeight` it serves with, or with
        `keep_float` by the copy a train step computes with (`quantize_weights`); itself when its
        `quantization` makes no copy or the weight is already quantized."""
        if not makes_quantized_copy(self.quantization, keep_float) or isinstance(self.weight, QuantizedWeight):
            return self
        w = self.weight
        copy = QuantizedWeight.of(
            w, stack=w.ndim - 2, contract=1, quantization=self.quantization, keep_float=keep_float
        )
        return eqx.tree_at(lambda m: m.weight, self, copy)

    def __call__(self, x: Float[Array, "*batch in"]) -> Float[Array, "*batch out"]:
        """Apply the layer; computes in `x.dtype`.

        Arguments:
            x: inputs, features on the last axis.

        Returns:
            Outputs with `out_features` on the last axis.
        """
        y = project(x, self.weight, 1, self.quantization)
        if self.bias is not None:
            y = y + expand_to(self.bias.astype(y.dtype), y.ndim)
        return y
