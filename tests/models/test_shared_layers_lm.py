"""Shared layers in the language model: the parameters are counted once (the analytic count
`launch show` prints equals the built model's) while the FLOPs are those of every layer, and
KV-cache decoding equals the uncached reference (tests/core/test_shared_layers.py: the stack)."""

import dataclasses

import jax.numpy as jnp
import jax.random as jr
import numpy as np

from equipax.core.nn import TransformerConfig

BLOCK = TransformerConfig(num_layers=4, model_dims=16, num_heads=2, head_dim=8, hidden_dims=32)


def test_the_parameters_are_counted_once_and_the_flops_per_layer():
    from equipax.core.flops import count_params, lm_param_counts, transformer_lm_flops_per_token
    from equipax.models import LMConfig, TransformerLM

    plain = LMConfig(vocab_size=64, max_seq_len=16, transformer=BLOCK)
    albert = dataclasses.replace(plain, transformer=dataclasses.replace(BLOCK, num_hidden_groups=1))
    counts = lm_param_counts(albert.transformer, 64, tie_embeddings=True)
    assert count_params(TransformerLM(albert, key=jr.key(0))) == counts["total"]
    assert counts["total"] == lm_param_counts(BLOCK, 64, tie_embeddings=True)["total"] - 3 * counts["per_layer"]
    flops = transformer_lm_flops_per_token
    assert flops(albert.transformer, vocab_size=64, seq_len=16) == flops(BLOCK, vocab_size=64, seq_len=16)  # 4 run


def test_cached_decoding_of_a_shared_model_equals_the_uncached_reference():
    from equipax.models import LMConfig, TransformerLM, generate
    from equipax.models.decode import decode

    cfg = LMConfig(vocab_size=64, max_seq_len=16, transformer=dataclasses.replace(BLOCK, num_hidden_groups=2))
    model = TransformerLM(cfg, key=jr.key(0))
    row = [3, 9, 4, 1]
    tokens, _ = decode(model, jnp.asarray([row + [0] * 4], jnp.int32), jnp.asarray([4]), max_new_tokens=6)
    np.testing.assert_array_equal(np.asarray(tokens)[0], np.asarray(generate(model, jnp.asarray(row), 6))[4:])
