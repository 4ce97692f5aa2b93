"""Mixed-precision matmuls: bfloat16 inputs, float32 results, bfloat16 backward passes.

`jnp.einsum(..., preferred_element_type=float32)` on bfloat16 inputs gives float32 logits, but its
automatic derivative multiplies the float32 cotangent with the bfloat16 operands: a float32
matmul in the backward pass (several times slower on TPU and GPU tensor cores). `einsum_f32`
keeps the float32 result and rounds the cotangent to the inputs' dtype first. Used for the
attention logits and value product; the LM's output logits instead come out of a bfloat16 matmul
and are cast (a float32-output matmul over the vocabulary costs 2 GiB per chip on c4_22b_2x).
"""

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array

__all__ = ["einsum_f32"]


def einsum_f32(spec: str, a: Array, b: Array) -> Array:
    """`jnp.einsum(spec, a, b)` accumulated and returned in float32; gradients in `a`/`b`'s dtypes.

    Arguments:
        spec: the einsum subscripts of two operands.
        a, b: the operands (usually both bfloat16, or both float32).

    Returns:
        The float32 product.
    """
    return _einsum_f32(spec, a, b)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _einsum_f32(spec: str, a: Array, b: Array) -> Array:
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _fwd(spec: str, a: Array, b: Array) -> tuple[Array, tuple[Array, Array]]:
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32), (a, b)


def _bwd(spec: str, res: tuple[Array, Array], g: Array) -> tuple[Array, Array]:
    a, b = res
    # The derivative of the einsum in the operands' own dtype: its matmuls take that dtype.
    out, vjp = jax.vjp(lambda a, b: jnp.einsum(spec, a, b), a, b)
    return vjp(g.astype(out.dtype))


_einsum_f32.defvjp(_fwd, _bwd)
