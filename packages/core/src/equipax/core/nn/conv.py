"""Image layers on channels-last batches: 2-D convolution, BatchNorm with running statistics,
max pooling.

Images are `[batch height width channels]` (Flax's layout, the tutorial's); kernels are
`[height width in out]`. BatchNorm keeps its running mean and variance in an `eqx.nn.State`
(build models with `eqx.nn.make_with_state`): training normalises with the batch's statistics
and returns updated running statistics; inference normalises with the running statistics and
returns the state unchanged.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from equipax.core.nn.linear import expand_to, fan_in_init
from equipax.core.partition import Axes

__all__ = ["BatchNorm", "Conv2d", "max_pool"]


class Conv2d(eqx.Module):
    """A 2-D convolution, stride 1, `SAME` padding (Flax `nn.Conv(features, (kh, kw))`)."""

    weight: Float[Array, "kh kw cin cout"]
    bias: Float[Array, " cout"] | None
    in_channels: int = eqx.field(static=True)
    out_channels: int = eqx.field(static=True)
    kernel_size: tuple[int, int] = eqx.field(static=True)

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: tuple[int, int] = (3, 3),
        *,
        use_bias: bool = True,
        key: PRNGKeyArray,
    ) -> None:
        """Arguments:
        in_channels: channels of the input.
        out_channels: channels of the output.
        kernel_size: `(height, width)` of the kernel.
        use_bias: add a learned bias (initialised to zero).
        key: PRNG key for the kernel (truncated normal, variance 1/fan_in, as Flax's LeCun).
        """
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = (int(kernel_size[0]), int(kernel_size[1]))
        shape = (*self.kernel_size, in_channels, out_channels)
        self.weight = fan_in_init(key, shape, in_axes=(0, 1, 2))
        self.bias = jnp.zeros((out_channels,), jnp.float32) if use_bias else None

    def logical_axes(self) -> dict[str, Axes]:
        """Kernel and bias (replicated by `LOGICAL_TO_MESH`: convolutions here are small)."""
        return {"weight": ("kernel_height", "kernel_width", "in_channels", "out_channels"), "bias": ("out_channels",)}

    def __call__(self, x: Float[Array, "batch height width cin"]) -> Float[Array, "batch height width cout"]:
        """Convolve; the output has the input's height and width.

        Arguments:
            x: images.

        Returns:
            Feature maps with `out_channels` channels.
        """
        y = jax.lax.conv_general_dilated(
            x,
            self.weight.astype(x.dtype),
            window_strides=(1, 1),
            padding="SAME",
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        )
        if self.bias is not None:
            y = y + expand_to(self.bias.astype(y.dtype), y.ndim)
        return y


class BatchNorm(eqx.Module):
    """BatchNorm over all axes but the last, with running statistics in an `eqx.nn.State`.

    Flax's defaults: running averages `momentum * running + (1 - momentum) * batch`, the
    biased batch variance, learned scale (init 1) and bias (init 0).
    """

    scale: Float[Array, " channels"]
    bias: Float[Array, " channels"]
    running: eqx.nn.StateIndex
    channels: int = eqx.field(static=True)
    momentum: float = eqx.field(static=True)
    eps: float = eqx.field(static=True)

    def __init__(self, channels: int, *, momentum: float = 0.99, eps: float = 1e-5) -> None:
        """Arguments:
        channels: size of the last axis.
        momentum: weight of the old running statistics in each update.
        eps: added to the variance.
        """
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"BatchNorm momentum must be in [0, 1); got {momentum}.")
        self.channels = channels
        self.momentum = momentum
        self.eps = eps
        self.scale = jnp.ones((channels,), jnp.float32)
        self.bias = jnp.zeros((channels,), jnp.float32)
        self.running = eqx.nn.StateIndex((jnp.zeros((channels,), jnp.float32), jnp.ones((channels,), jnp.float32)))

    def logical_axes(self) -> dict[str, Axes]:
        """Small vectors: replicated (the running statistics are model state, not parameters)."""
        return {"scale": ("norm",), "bias": ("norm",)}

    def __call__(
        self, x: Float[Array, "*batch channels"], state: eqx.nn.State, *, inference: bool
    ) -> tuple[Float[Array, "*batch channels"], eqx.nn.State]:
        """Normalise `x` per channel.

        Arguments:
            x: activations, channels last.
            state: holds the running `(mean, var)`.
            inference: use (and keep) the running statistics instead of the batch's.

        Returns:
            `(normalised x, state)`; in training, the state has updated running statistics.
        """
        running_mean, running_var = state.get(self.running)
        xf = x.astype(jnp.float32)
        if inference:
            mean, var = running_mean, running_var
        else:
            axes = tuple(range(x.ndim - 1))
            mean = jnp.mean(xf, axis=axes)
            var = jnp.maximum(jnp.mean(jnp.square(xf), axis=axes) - jnp.square(mean), 0.0)
            m = self.momentum
            new = (
                m * running_mean + (1 - m) * jax.lax.stop_gradient(mean),
                m * running_var + (1 - m) * jax.lax.stop_gradient(var),
            )
            state = state.set(self.running, new)
        inv = jax.lax.rsqrt(var + self.eps) * self.scale
        y = (xf - expand_to(mean, x.ndim)) * expand_to(inv, x.ndim) + expand_to(self.bias, x.ndim)
        return y.astype(x.dtype), state


def max_pool(
    x: Float[Array, "batch height width channels"], window: tuple[int, int] = (2, 2)
) -> Float[Array, "batch out_height out_width channels"]:
    """Max over non-overlapping `window` patches (stride = window, `VALID` padding).

    Arguments:
        x: feature maps.
        window: `(height, width)` of each patch.

    Returns:
        Feature maps of `height // wh` x `width // ww`.
    """
    dims = (1, *window, 1)
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, dims, dims, "VALID")
