"""Rotary position embeddings (RoPE, Su et al. 2021), as in Llama / GPT-NeoX.

Each head vector is split into two halves `(x1, x2)`; pair `i` (`x1[i], x2[i]`) is rotated by
the angle `position * theta**(-2i / head_dim)`. This is the "rotate half" layout of GPT-NeoX and
Hugging Face Llama; Meta's original code rotates adjacent pairs instead, which is the same map up
to a fixed permutation of each head's query/key columns.

Llama 3.1 and 3.2 rescale the frequencies for a longer context (`RopeScalingConfig`, kind
"llama3"): `llama3_frequencies`, checked against an independent numpy implementation of the rule.
"""

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from equipax.core.configs import RopeScalingConfig

__all__ = ["apply_rotary", "llama3_frequencies", "reference_rotary", "rotary_angles", "rotary_frequencies"]


def llama3_frequencies(inv_freq: Float[Array, " half"], scaling: RopeScalingConfig) -> Float[Array, " half"]:
    """Llama 3.1's rescaled inverse frequencies (`RopeScalingConfig` says the rule).

    Arguments:
        inv_freq: the unscaled inverse frequencies.
        scaling: factor, band edges and original context.

    Returns:
        Float32 inverse frequencies: high frequencies kept, low ones divided by `factor`, the band
        between interpolated.
    """
    low_wavelen = scaling.original_max_seq_len / scaling.low_freq_factor
    high_wavelen = scaling.original_max_seq_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_seq_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    between = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, between, scaled).astype(jnp.float32)


def rotary_frequencies(head_dim: int, theta: float, scaling: RopeScalingConfig | None = None) -> Float[Array, " half"]:
    """Inverse frequencies `theta**(-2i / head_dim)` for `i < head_dim / 2`, optionally rescaled.

    Arguments:
        head_dim: width of each head; must be even.
        theta: the base frequency (`rope_theta`: 1e4 for Llama 2, 5e5 for Llama 3).
        scaling: `model.rope_scaling` (Llama 3.1's "llama3" rule), or None.

    Returns:
        Float32 inverse frequencies.
    """
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}.")
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    inv_freq = jnp.power(jnp.float32(theta), -exponents)
    return inv_freq if scaling is None else llama3_frequencies(inv_freq, scaling)


def rotary_angles(
    positions: Int[Array, "batch seq"], head_dim: int, theta: float, scaling: RopeScalingConfig | None = None
) -> tuple[Float[Array, "batch seq half"], Float[Array, "batch seq half"]]:
    """`(sin, cos)` of each position's rotation angles, computed once per forward pass.

    Arguments:
        positions: each token's position (its index in the sequence or document).
        head_dim: width of each head; must be even.
        theta: the base frequency.
        scaling: `model.rope_scaling`, or None.

    Returns:
        Float32 `sin` and `cos` of `positions * rotary_frequencies(head_dim, theta, scaling)`.
    """
    inv_freq = rotary_frequencies(head_dim, theta, scaling)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq[None, None, :]
    return jnp.sin(angles), jnp.cos(angles)


def apply_rotary(
    x: Float[Array, "batch seq heads head_dim"],
    sin: Float[Array, "batch seq half"],
    cos: Float[Array, "batch seq half"],
) -> Float[Array, "batch seq heads head_dim"]:
    """Rotate each head vector of `x` by its position's angles (fast path).

    Arguments:
        x: queries or keys.
        sin, cos: from `rotary_angles`.

    Returns:
        Rotated vectors in `x.dtype` (the rotation is computed in float32). Its gradient is the
        inverse rotation of the cotangent, computed the same way (`_rotary_bwd`).
    """
    return _rotary(x, sin, cos)


def _rotate(x: Array, sin: Array, cos: Array) -> Array:
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    s, c = sin[:, :, None, :], cos[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


# The rotation's transpose is the rotation by the opposite angles, and it is written as one: in
# float32 from the cotangent in `x.dtype` to the gradient in `x.dtype`. Differentiated automatically,
# the float32 rotation's transpose left XLA:TPU with float32 halves and their concatenation as
# passes of their own over each layer's queries and keys (qwen3_0_6b on the v5e: 1.7% of the step,
# benchmarks/README.md "eighth session"). The numbers are the same: each element is the same two
# float32 products summed.
@jax.custom_vjp
def _rotary(x: Array, sin: Array, cos: Array) -> Array:
    return _rotate(x, sin, cos)


def _rotary_fwd(x: Array, sin: Array, cos: Array) -> tuple[Array, tuple[Array, Array]]:
    return _rotate(x, sin, cos), (sin, cos)


def _rotary_bwd(residuals: tuple[Array, Array], g: Array) -> tuple[Array, None, None]:
    sin, cos = residuals
    return _rotate(g, -sin, cos), None, None


_rotary.defvjp(_rotary_fwd, _rotary_bwd)


def reference_rotary(
    x: Float[Array, "batch seq heads head_dim"], positions: Int[Array, "batch seq"], theta: float
) -> Float[Array, "batch seq heads head_dim"]:
    """Slow, obvious RoPE: each pair `(x1[i], x2[i])` as the complex number `x1 + i x2`,
    multiplied by `exp(i * position * theta**(-2i / head_dim))`.

    Arguments:
        x: queries or keys.
        positions: each token's position.
        theta: the base frequency.

    Returns:
        Rotated vectors in `x.dtype`.
    """
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    z = xf[..., :half] + 1j * xf[..., half:]
    freqs = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) * 2.0 / x.shape[-1]))
    angle = positions.astype(jnp.float32)[:, :, None, None] * freqs[None, None, None, :]
    rotated = z * jnp.exp(1j * angle)
    return jnp.concatenate([rotated.real, rotated.imag], axis=-1).astype(x.dtype)
