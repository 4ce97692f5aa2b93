"""KV-cache decoding: cached == uncached `generate` (greedy) for every LM family (Pax's GPT,
Llama 3.1 with RoPE scaling, Qwen3 with QK-norm and tied embeddings, Mistral with a sliding window
shorter than the decoded length), per-row prompt lengths, EOS and length limits, sampling by seed,
top-k / top-p."""

import dataclasses
import functools

import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

from equipax.core.configs import RopeScalingConfig
from equipax.core.nn import TransformerConfig
from equipax.models import LMConfig, TransformerLM, generate
from equipax.models.decode import decode, for_decoding, init_cache, sample_logits

VOCAB = 64
WIDTH, NEW = 8, 8  # every decode here uses these shapes: one compile per model and knob set
LM_CFG = LMConfig(
    vocab_size=VOCAB,
    max_seq_len=WIDTH + NEW,
    transformer=TransformerConfig(num_layers=2, model_dims=32, num_heads=2, head_dim=16, hidden_dims=64, use_bias=True),
)


def _decoder(tie=False, scaling=None, theta=10_000.0, **block):
    """A Llama-style block (RoPE, RMSNorm, SwiGLU, GQA 4/2) with the family's options."""
    return LMConfig(
        vocab_size=VOCAB,
        max_seq_len=WIDTH + NEW,
        transformer=TransformerConfig(
            num_layers=2,
            model_dims=32,
            num_heads=4,
            num_kv_heads=2,
            head_dim=8,
            hidden_dims=48,
            activation="silu",
            gated=True,
            norm="rmsnorm",
            norm_eps=1e-5,
            fused_qkv=False,
            atten_logit_cap=None,
            **block,
        ),
        output_logit_cap=None,
        position="rope",
        rope_theta=theta,
        rope_scaling=scaling,
        tie_embeddings=tie,
        embedding_multiplier=None,
        embedding_init_std=1.0,
    )


CONFIGS = {
    "lm": LM_CFG,
    "llama": _decoder(scaling=RopeScalingConfig(factor=4.0, original_max_seq_len=8)),
    "qwen3": _decoder(tie=True, theta=1e6, qk_norm=True),
    "mistral": _decoder(sliding_window=4),  # decoded rows run to 16 positions: past the window
}
SEEDS = {name: i + 1 for i, name in enumerate(CONFIGS)}
MODELS = {name: TransformerLM(cfg, key=jr.key(SEEDS[name])) for name, cfg in CONFIGS.items()}


def _rebuilt(name, **block):
    """Family `name`'s model with block knobs changed; the same weights where the shapes agree."""
    cfg = CONFIGS[name]
    return TransformerLM(
        dataclasses.replace(cfg, transformer=dataclasses.replace(cfg.transformer, **block)), key=jr.key(SEEDS[name])
    )


ROWS = ([1, 2, 3, 4, 5, 6, 7, 8], [9, 8, 7], [20, 21, 22, 23, 24])


def _padded(rows, fill=63):
    """Right-padded with junk (the padding must not matter) and the lengths."""
    prompts = np.full((len(rows), WIDTH), fill, np.int32)
    for b, row in enumerate(rows):
        prompts[b, : len(row)] = row
    return jnp.asarray(prompts), jnp.array([len(r) for r in rows], jnp.int32)


@functools.cache
def _decoded(name):
    """A model and its greedy decode of ROWS (computed once)."""
    model = MODELS[name]
    prompts, lengths = _padded(ROWS)
    tokens, num = decode(model, prompts, lengths, max_new_tokens=NEW)
    return model, np.asarray(tokens), np.asarray(num)


@pytest.fixture(scope="module", params=list(CONFIGS))
def every_family(request):
    return _decoded(request.param)


@pytest.fixture(scope="module", params=["lm", "llama"])
def family(request):
    return _decoded(request.param)


def test_cached_greedy_equals_uncached_generate_per_row(every_family):
    """Prompts of different lengths in one batch: each row is the uncached reference's
    greedy continuation of that prompt alone."""
    model, tokens, num = every_family
    assert tokens.shape == (3, NEW) and tokens.dtype == np.int32
    np.testing.assert_array_equal(num, [NEW] * 3)  # WIDTH + NEW = max_seq_len: the limit holds
    for b, row in enumerate(ROWS):
        ref = generate(model, jnp.array(row, jnp.int32), NEW)
        np.testing.assert_array_equal(tokens[b], np.asarray(ref)[len(row) :])


def test_batch_equals_one_by_one(family):
    model, tokens, _ = family
    row = ROWS[1]
    alone, _ = decode(model, jnp.array([row], jnp.int32), jnp.array([len(row)]), max_new_tokens=NEW)
    np.testing.assert_array_equal(alone[0], tokens[1])


@pytest.mark.parametrize("name", ["lm", "mistral"])
def test_unrolled_stack_decodes_like_scanned(name):
    _, tokens, _ = _decoded(name)
    got, _ = decode(_rebuilt(name, scan_layers=False), *_padded(ROWS), max_new_tokens=NEW)
    np.testing.assert_array_equal(got, tokens)


@pytest.mark.parametrize("name", ["lm", "llama"])
def test_for_decoding_holds_the_projections_in_the_compute_dtype(name):
    """`for_decoding` (made once where `launch decode` loads a model) holds a bfloat16 model's
    projection weights in bfloat16, cast as each matmul casts them, so no `decode` call converts
    them again; norms and the embedding (looked up in float32) stay float32. The same tokens."""
    model = TransformerLM(dataclasses.replace(CONFIGS[name], dtype="bfloat16"), key=jr.key(SEEDS[name]))
    held = for_decoding(model)
    attention, mlp = held.stack.layers.attention, held.stack.layers.ffn
    matrices = [attention.out, mlp.up.weight, mlp.down.weight]
    matrices += [attention.qkv] if name == "lm" else [attention.q, attention.kv, held.unembed.weight]
    assert all(w.dtype == jnp.bfloat16 for w in matrices)
    assert held.embedding.weight.dtype == jnp.float32 and held.final_norm.scale.dtype == jnp.float32
    assert held.stack.layers.atten_norm.scale.dtype == jnp.float32
    prompts, lengths = _padded(ROWS)
    want, _ = decode(model, prompts, lengths, max_new_tokens=NEW)
    got, _ = decode(held, prompts, lengths, max_new_tokens=NEW)
    np.testing.assert_array_equal(got, want)
    assert for_decoding(held).stack.layers.attention.out is held.stack.layers.attention.out  # kept as is


def test_each_row_gets_its_own_room_in_max_seq_len(family):
    """Asking for more than the widest prompt leaves: each row still gets `max_seq_len - its
    length` tokens (the uncached reference's), not the room of the batch's widest prompt."""
    model, _, _ = family
    tokens, num = decode(model, *_padded(ROWS), max_new_tokens=WIDTH + NEW, pad_id=0)
    room = [WIDTH + NEW - len(row) for row in ROWS]  # 8, 13 and 11
    np.testing.assert_array_equal(num, room)
    for b, row in enumerate(ROWS):
        ref = generate(model, jnp.array(row, jnp.int32), room[b])
        np.testing.assert_array_equal(tokens[b, : room[b]], np.asarray(ref)[len(row) :])
        assert not np.asarray(tokens[b, room[b] :]).any()  # padded after its room


def test_eos_stops_each_row_and_pads(family):
    model, free, _ = family
    eos = int(free[0, 3])  # row 0 emits it by step 3; the others maybe earlier, maybe never
    tokens, num = decode(model, *_padded(ROWS), max_new_tokens=NEW, eos_id=eos, pad_id=1)
    for b in range(3):
        hits = np.flatnonzero(free[b] == eos)
        want = int(hits[0]) + 1 if hits.size else NEW
        assert int(num[b]) == want
        np.testing.assert_array_equal(tokens[b, :want], free[b, :want])
        assert np.all(np.asarray(tokens[b, want:]) == 1)
    assert int(num[0]) <= 4


def test_length_limits_and_bad_arguments(family):
    model, _, _ = family
    prompts, lengths = _padded(ROWS)
    with pytest.raises(ValueError, match="max_seq_len=16"):  # as wide as the model reads: no room left
        decode(model, jnp.zeros((3, WIDTH + NEW), jnp.int32), lengths, max_new_tokens=1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        decode(model, prompts, lengths, max_new_tokens=0)
    with pytest.raises(ValueError, match="key"):
        decode(model, prompts, lengths, max_new_tokens=NEW, temperature=1.0)
    with pytest.raises(ValueError, match="top_p"):
        decode(model, prompts, lengths, max_new_tokens=NEW, top_p=0.0)
    with pytest.raises(ValueError, match="eos_id"):
        decode(model, prompts, lengths, max_new_tokens=NEW, eos_id=VOCAB)
    with pytest.raises(ValueError, match="max_seq_len"):
        init_cache(model, 1, WIDTH + NEW + 1)
    with pytest.raises(ValueError, match="prompt length"):
        decode(model, prompts, lengths.at[1].set(0), max_new_tokens=NEW)
    with pytest.raises(ValueError, match="prompt length"):
        decode(model, prompts, lengths.at[1].set(WIDTH + 1), max_new_tokens=NEW)


def test_sampling_reproducible_by_seed_and_matches_generate(family):
    model, _, _ = family
    prompts, lengths = _padded([ROWS[0]])
    kw = dict(max_new_tokens=NEW, temperature=1.0)
    a, _ = decode(model, prompts, lengths, key=jr.key(7), **kw)
    b, _ = decode(model, prompts, lengths, key=jr.key(7), **kw)
    c, _ = decode(model, prompts, lengths, key=jr.key(8), **kw)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    # The key schedule of the uncached reference: the same samples.
    ref = generate(model, prompts[0], NEW, temperature=1.0, key=jr.key(7))
    np.testing.assert_array_equal(a[0], ref[WIDTH:])


def test_top_k_one_and_tiny_top_p_are_greedy():
    model = MODELS["lm"]
    prompts, lengths = _padded(ROWS)
    greedy, _ = decode(model, prompts, lengths, max_new_tokens=NEW)
    kw = dict(max_new_tokens=NEW, temperature=1.0, key=jr.key(3))
    k1, _ = decode(model, prompts, lengths, top_k=1, **kw)
    p0, _ = decode(model, prompts, lengths, top_p=1e-6, **kw)
    np.testing.assert_array_equal(k1, greedy)
    np.testing.assert_array_equal(p0, greedy)


def test_cache_holds_kv_heads():
    cache = init_cache(MODELS["llama"], 3, 10)
    assert cache.keys.shape == (2, 3, 10, 2, 8) and cache.max_len == 10  # pyright: ignore[reportAttributeAccessIssue]
    assert init_cache(MODELS["lm"], 3, 10).values.shape == (2, 3, 10, 2, 16)  # pyright: ignore[reportAttributeAccessIssue]


def test_a_window_the_decode_ignored_would_change_the_tokens():
    """Mutation: the same Mistral weights without the window (attending to the whole prefix)
    decode other tokens, so the cached == uncached check above sees the window in both paths."""
    _, tokens, _ = _decoded("mistral")
    got, _ = decode(_rebuilt("mistral", sliding_window=None), *_padded(ROWS), max_new_tokens=NEW)
    assert not np.array_equal(np.asarray(got), tokens)


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


def test_decode_compiles_with_the_tpu_options_only_on_a_tpu():
    """`decode_program` picks the loop by the platform that holds the weights: the XLA:TPU options
    (tests/launch/test_decode_tpu.py) never reach another backend, which would refuse them."""
    from equipax.models import decode as dec

    model = TransformerLM(LM_CFG, key=jr.key(0))
    assert dec.decode_program(model) is dec._DECODE_DEFAULT
    assert dec._DECODE["tpu"] is not dec._DECODE_DEFAULT


def test_the_decode_program_holds_no_host_callback():
    """The prompt lengths are checked on the host before the call (`decode` raises ValueError,
    test_length_limits_and_bad_arguments above), not by a host callback inside the loop's program,
    which a TPU program pays for on every call (benchmarks/README.md, "sixth session")."""
    from equipax.models import decode as dec

    model = TransformerLM(LM_CFG, key=jr.key(0))
    prompts, lengths = jnp.zeros((2, 4), jnp.int32), jnp.array([1, 4], jnp.int32)
    lowered = dec.decode_program(model).lower(
        model, prompts, lengths, None, 3, 0.0, None, None, jnp.int32(-1), jnp.int32(0)
    )
    assert "callback" not in lowered.as_text()
