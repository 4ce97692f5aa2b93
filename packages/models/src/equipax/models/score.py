"""Scoring continuations with a language model: the log-likelihood of each choice given its
context, for multiple-choice evals (`equipax.data.metrics`, `launch eval --multiple-choice`).

`continuation_rows` lays each `(context, continuation)` pair of token ids out as one LM row (ids,
next-token labels, and weight 1 exactly on the positions that predict a continuation token), so a
batch of them is scored by one forward pass (`row_log_likelihoods`). `continuation_log_likelihood`
is the slow, obvious reference: it runs the model on every prefix and reads the next token's
log-probability, one token at a time; the tests hold the batched rows to it.
"""

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

__all__ = ["continuation_log_likelihood", "continuation_rows", "row_log_likelihoods"]


def continuation_rows(
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]], *, seq_len: int, pad_id: int
) -> dict[str, np.ndarray]:
    """One LM row per `(context, continuation)` pair of token ids, `seq_len` tokens each.

    The row is `context + continuation` without its last token, the labels the same shifted by one;
    weights are 1 where the label is a continuation token. A pair longer than `seq_len + 1` tokens
    keeps the end of its context (the continuation is never cut: one that does not fit with at
    least one context token is a ValueError naming its length).

    Returns:
        `{"ids", "labels"}` int32 and `"weights"` float32, each `[len(pairs), seq_len]`.
    """
    n = len(pairs)
    ids = np.full((n, seq_len), pad_id, np.int32)
    labels = np.full((n, seq_len), pad_id, np.int32)
    weights = np.zeros((n, seq_len), np.float32)
    for row, (context, continuation) in enumerate(pairs):
        if not context or not continuation:
            raise ValueError(f"pair {row}: the context and the continuation each need at least one token.")
        if len(continuation) > seq_len:
            raise ValueError(
                f"pair {row}: the continuation has {len(continuation)} tokens, more than the row's "
                f"seq_len={seq_len} can score after a context token; shorten it or score with a longer seq_len."
            )
        tokens = [*context, *continuation][-(seq_len + 1) :]
        width = len(tokens) - 1
        ids[row, :width], labels[row, :width] = tokens[:-1], tokens[1:]
        weights[row, width - len(continuation) : width] = 1.0
    return {"ids": ids, "labels": labels, "weights": weights}


@eqx.filter_jit
def row_log_likelihoods(
    model: Any, ids: Int[Array, "batch seq"], labels: Int[Array, "batch seq"], weights: Float[Array, "batch seq"]
) -> Float[Array, " batch"]:
    """Each row's summed log-probability of its labels where `weights` is 1 (`continuation_rows`)."""
    logits = model(ids).astype(jnp.float32)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]
    return jnp.sum(picked * weights, axis=-1)


def continuation_log_likelihood(model: Any, context: Sequence[int], continuation: Sequence[int]) -> float:
    """The reference: `sum_t log p(continuation[t] | context + continuation[:t])`, one forward per
    token on the prefix alone (no padding, no weights, no batching)."""
    total, prefix = 0.0, list(context)
    for token in continuation:
        logits = model(jnp.asarray([prefix], jnp.int32))[0, -1].astype(jnp.float32)
        total += float(jax.nn.log_softmax(logits)[token])
        prefix.append(token)
    return total
