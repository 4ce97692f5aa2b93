"""Token embedding table, shared with the output softmax (tied weights, as Pax does)."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from equipax.core.partition import Axes

__all__ = ["Embedding"]


class Embedding(eqx.Module):
    """Lookup table `[vocab embed]` that can also produce tied output logits."""

    weight: Float[Array, "vocab embed"]
    vocab_size: int = eqx.field(static=True)
    model_dims: int = eqx.field(static=True)

    def __init__(self, vocab_size: int, model_dims: int, *, key: PRNGKeyArray) -> None:
        """Arguments:
        vocab_size: number of token ids.
        model_dims: embedding width.
        key: PRNG key; entries are N(0, 1/model_dims) as in Pax's shared softmax.
        """
        self.vocab_size = vocab_size
        self.model_dims = model_dims
        std = 1.0 / math.sqrt(model_dims)
        self.weight = std * jax.random.normal(key, (vocab_size, model_dims), jnp.float32)

    def logical_axes(self) -> dict[str, Axes]:
        """The table is split over the vocabulary (tensor) and the embedding (fsdp)."""
        return {"weight": ("vocab", "embed")}

    def __call__(self, ids: Int[Array, "*batch"]) -> Float[Array, "*batch embed"]:
        """Look up embeddings.

        Arguments:
            ids: integer token ids in `[0, vocab_size)`.

        Returns:
            Float32 embeddings.
        """
        return jnp.take(self.weight, ids, axis=0)

    def attend(self, x: Float[Array, "*batch embed"]) -> Float[Array, "*batch vocab"]:
        """Tied-softmax logits `x @ weight.T`, computed in `x.dtype`.

        Arguments:
            x: hidden states.

        Returns:
            Unnormalised logits over the vocabulary.
        """
        return jnp.einsum("...e,ve->...v", x, self.weight.astype(x.dtype))
