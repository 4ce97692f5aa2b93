"""KV-cache decoding: cached == uncached `generate` (greedy) for both LM families, per-row
prompt lengths, EOS and length limits, sampling by seed, top-k / top-p."""

import dataclasses

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

from equipax.core.nn import TransformerConfig
from equipax.models import LMConfig, TransformerLM, generate
from equipax.models.decode import decode, init_cache, sample_logits
from equipax.models.llama import LlamaConfig, LlamaLM

VOCAB = 64
LM_CFG = LMConfig(
    vocab_size=VOCAB,
    max_seq_len=24,
    transformer=TransformerConfig(
        num_layers=2, model_dims=32, num_heads=2, head_dim=16, hidden_dims=64, use_bias=True
    ),
)
LLAMA_CFG = LlamaConfig(
    vocab_size=VOCAB, max_seq_len=24, num_layers=2, model_dims=32, num_heads=4,
    num_kv_heads=2, head_dim=8, hidden_dims=48,
)


def _models():
    lm = TransformerLM(LM_CFG, key=jr.key(1))
    llama = LlamaLM(LLAMA_CFG, key=jr.key(2))
    return {"lm": lm, "llama": llama}


MODELS = _models()


@pytest.fixture(params=["lm", "llama"])
def model(request):
    return MODELS[request.param]


def _greedy_reference(model, prompt, n):
    return np.asarray(generate(model, jnp.asarray(prompt, jnp.int32), n))[len(prompt):]


def test_cached_greedy_equals_uncached_generate(model):
    prompt = np.array([3, 14, 15, 9, 2, 6], np.int32)
    tokens, num = decode(model, jnp.asarray(prompt)[None], jnp.array([6]), max_new_tokens=10)
    assert tokens.shape == (1, 10) and tokens.dtype == jnp.int32
    assert int(num[0]) == 10
    np.testing.assert_array_equal(tokens[0], _greedy_reference(model, prompt, 10))


def test_unrolled_stack_decodes_like_scanned(model):
    if isinstance(model, LlamaLM):
        unrolled = LlamaLM(dataclasses.replace(LLAMA_CFG, scan_layers=False), key=jr.key(2))
    else:
        cfg = dataclasses.replace(
            LM_CFG, transformer=dataclasses.replace(LM_CFG.transformer, scan_layers=False)
        )
        unrolled = TransformerLM(cfg, key=jr.key(1))
    prompts = jnp.array([[5, 6, 7, 8]], jnp.int32)
    a, _ = decode(model, prompts, jnp.array([4]), max_new_tokens=8)
    b, _ = decode(unrolled, prompts, jnp.array([4]), max_new_tokens=8)
    np.testing.assert_array_equal(a, b)


def test_batch_of_different_lengths_equals_one_by_one(model):
    rows = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [20, 21, 22, 23, 24]]
    width = max(map(len, rows))
    # Right-padded with junk: the padding must not matter.
    prompts = np.full((len(rows), width), 63, np.int32)
    for b, row in enumerate(rows):
        prompts[b, : len(row)] = row
    lengths = jnp.array([len(r) for r in rows])
    tokens, num = decode(model, jnp.asarray(prompts), lengths, max_new_tokens=9)
    np.testing.assert_array_equal(num, [9, 9, 9])
    for b, row in enumerate(rows):
        alone, _ = decode(model, jnp.array([row], jnp.int32), jnp.array([len(row)]),
                          max_new_tokens=9)
        np.testing.assert_array_equal(tokens[b], alone[0])
        np.testing.assert_array_equal(tokens[b], _greedy_reference(model, row, 9))


def test_eos_stops_each_row_and_pads(model):
    prompts = jnp.array([[4, 5, 6], [7, 8, 0]], jnp.int32)
    lengths = jnp.array([3, 2])
    free, _ = decode(model, prompts, lengths, max_new_tokens=8)
    eos = int(free[0, 3])  # row 0 emits it at step 3; row 1 maybe never, maybe earlier
    tokens, num = decode(model, prompts, lengths, max_new_tokens=8, eos_id=eos, pad_id=1)
    for b in range(2):
        row = np.asarray(free[b])
        hits = np.flatnonzero(row == eos)
        want = int(hits[0]) + 1 if hits.size else 8
        assert int(num[b]) == want
        np.testing.assert_array_equal(tokens[b, :want], row[:want])
        assert np.all(np.asarray(tokens[b, want:]) == 1)
    assert int(num[0]) <= 4


def test_length_limits_and_bad_arguments(model):
    prompts = jnp.zeros((1, 20), jnp.int32)
    tokens, num = decode(model, prompts, jnp.array([20]), max_new_tokens=4)  # 24 = max_seq_len
    assert tokens.shape == (1, 4) and int(num[0]) == 4
    with pytest.raises(ValueError, match="max_seq_len"):
        decode(model, prompts, jnp.array([20]), max_new_tokens=5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        decode(model, prompts, jnp.array([20]), max_new_tokens=0)
    with pytest.raises(ValueError, match="key"):
        decode(model, prompts, jnp.array([20]), max_new_tokens=2, temperature=1.0)
    with pytest.raises(ValueError, match="top_p"):
        decode(model, prompts, jnp.array([20]), max_new_tokens=2, top_p=0.0)
    with pytest.raises(ValueError, match="max_seq_len"):
        init_cache(model, 1, 25)
    with pytest.raises(Exception, match="prompt length"):
        decode(model, prompts, jnp.array([0]), max_new_tokens=2)


def test_sampling_reproducible_by_seed_and_matches_generate(model):
    prompts = jnp.array([[1, 2, 3, 4]], jnp.int32)
    kw = dict(max_new_tokens=12, temperature=1.0)
    a, _ = decode(model, prompts, jnp.array([4]), key=jr.key(7), **kw)
    b, _ = decode(model, prompts, jnp.array([4]), key=jr.key(7), **kw)
    c, _ = decode(model, prompts, jnp.array([4]), key=jr.key(8), **kw)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    # Same key schedule as the uncached reference: the same samples.
    ref = generate(model, prompts[0], 12, temperature=1.0, key=jr.key(7))
    np.testing.assert_array_equal(a[0], ref[4:])
    # top_k=1 and a tiny top_p are greedy whatever the key.
    greedy, _ = decode(model, prompts, jnp.array([4]), max_new_tokens=12)
    k1, _ = decode(model, prompts, jnp.array([4]), key=jr.key(3), top_k=1, **kw)
    p0, _ = decode(model, prompts, jnp.array([4]), key=jr.key(3), top_p=1e-6, **kw)
    np.testing.assert_array_equal(k1, greedy)
    np.testing.assert_array_equal(p0, greedy)


def test_cache_holds_kv_heads():
    cache = init_cache(MODELS["llama"], 3, 10)
    assert cache.keys.shape == (2, 3, 10, 2, 8) and cache.max_len == 10
    assert init_cache(MODELS["lm"], 3, 10).values.shape == (2, 3, 10, 2, 16)


def test_sample_logits_top_k_and_top_p_restrict_support():
    probs = jnp.array([[0.05, 0.5, 0.15, 0.3]])
    logits = jnp.log(jnp.tile(probs, (512, 1)))
    keys = jr.split(jr.key(0), 4)

    def support(**kw):
        return set(np.unique(np.asarray(sample_logits(logits, keys[0], temperature=1.0, **kw))))

    assert support() == {0, 1, 2, 3}
    assert support(top_k=2) == {1, 3}
    assert support(top_k=3) == {1, 2, 3}
    assert support(top_p=0.7) == {1, 3}  # 0.5 < 0.7 <= 0.8
    assert support(top_p=0.85) == {1, 2, 3}
    assert support(top_p=0.4) == {1}
    np.testing.assert_array_equal(sample_logits(logits[:2], None), [1, 1])
    # Temperature sharpens: at T=0.05 essentially always the argmax.
    cold = sample_logits(logits, keys[1], temperature=0.05)
    assert float(jnp.mean(cold == 1)) > 0.99
    # Empirical frequencies follow the probabilities at T=1.
    many = sample_logits(jnp.log(jnp.tile(probs, (8192, 1))), keys[2], temperature=1.0)
    freq = np.bincount(np.asarray(many), minlength=4) / 8192
    np.testing.assert_allclose(freq, probs[0], atol=0.03)

