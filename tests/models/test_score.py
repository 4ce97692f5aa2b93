"""Scoring continuations (`equipax.models.score`): the batched rows (one forward pass, padding and
weights) equal the slow reference that runs the model on every prefix, including a context cut
to fit the row; a mutant that scores the wrong positions is caught."""

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

from equipax.core.nn import TransformerConfig
from equipax.models import LMConfig, TransformerLM
from equipax.models.score import continuation_log_likelihood, continuation_rows, row_log_likelihoods

CFG = LMConfig(
    vocab_size=40,
    max_seq_len=16,
    transformer=TransformerConfig(num_layers=2, model_dims=16, num_heads=2, head_dim=8, hidden_dims=32),
    position="rope",
    tie_embeddings=False,
)
PAIRS = [([1, 5, 7], [9, 3]), ([2], [4, 4, 4, 6]), (list(range(3, 20)), [8, 1])]  # the last is cut to fit
SEQ = 12


@pytest.fixture(scope="module")
def model():
    return TransformerLM(CFG, key=jr.key(0))


def _batched(model, rows):
    return np.asarray(row_log_likelihoods(model, *(jnp.asarray(rows[k]) for k in ("ids", "labels", "weights"))))


@pytest.fixture(scope="module")
def reference(model):
    """The reference's scores of PAIRS, computed once for the module's tests. The model's forward
    pass is jitted: one program per prefix length, where the eager model compiled each of its ops
    for each length (190 programs; this module: 12.1 -> 8.4 s of CPU); the same forward pass on
    the same prefixes."""
    forward = eqx.filter_jit(model)
    # The context keeps its end where the pair is longer than the row: seq_len + 1 tokens in all.
    return np.asarray(
        [continuation_log_likelihood(forward, [*c, *t][-(SEQ + 1) : -len(t)], t) for c, t in PAIRS], np.float64
    )


def test_batched_rows_equal_the_prefix_by_prefix_reference(model, reference):
    rows = continuation_rows(PAIRS, seq_len=SEQ, pad_id=0)
    assert rows["weights"].sum(axis=1).tolist() == [2, 4, 2]
    np.testing.assert_allclose(_batched(model, rows), reference, rtol=1e-5, atol=1e-5)


def test_mutation_scoring_the_inputs_instead_of_the_next_tokens_is_caught(model, reference):
    rows = continuation_rows(PAIRS, seq_len=SEQ, pad_id=0)
    mutant = dict(rows, labels=rows["ids"])  # off by one: each position scores its own token
    assert not np.allclose(_batched(model, mutant), reference, rtol=1e-5, atol=1e-5)


def test_pairs_that_cannot_be_scored_say_why():
    with pytest.raises(ValueError, match="the continuation has 13 tokens, more than the row's seq_len=12"):
        continuation_rows([([1], list(range(13)))], seq_len=SEQ, pad_id=0)
    with pytest.raises(ValueError, match="at least one token"):
        continuation_rows([([], [1])], seq_len=SEQ, pad_id=0)
