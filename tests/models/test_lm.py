"""Transformer LM: forward, loss, training signal, generation."""

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

from equipax.core import flops
from equipax.core.knobs import ConfigError
from equipax.core.nn import TransformerConfig
from equipax.models import LMConfig, TransformerLM, generate, lm_loss

VOCAB = 64
CFG = LMConfig(
    vocab_size=VOCAB,
    max_seq_len=16,
    transformer=TransformerConfig(num_layers=2, model_dims=16, num_heads=2, head_dim=8, hidden_dims=32),
)

# Module-level jitted entry points: compiled once per model structure for the whole file.
_forward = eqx.filter_jit(lambda model, ids: model(ids))
_loss = eqx.filter_jit(lm_loss)


@pytest.fixture(scope="module")
def model():
    return TransformerLM(CFG, key=jr.key(0))


def _batch(key, batch=4, seq=12):
    tokens = jr.randint(key, (batch, seq + 1), 0, VOCAB, dtype=jnp.int32)
    return {"ids": tokens[:, :-1], "labels": tokens[:, 1:], "weights": jnp.ones((batch, seq), jnp.float32)}


def test_forward_shape_and_dtype(model):
    ids = jnp.arange(20, dtype=jnp.int32).reshape(2, 10)
    logits = _forward(model, ids)
    assert logits.shape == (2, 10, VOCAB) and logits.dtype == jnp.float32
    assert float(jnp.max(jnp.abs(logits))) <= 30.0
    # bfloat16 compute: same parameters (kept in f32), f32 logits, close numbers.
    bf16 = TransformerLM(dataclasses.replace(CFG, dtype="bfloat16"), key=jr.key(0))
    assert bf16.embedding.weight.dtype == jnp.float32
    out = _forward(bf16, ids)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, logits, atol=0.15)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(jnp.zeros((1, 17), jnp.int32))


def test_lm_is_causal(model, key):
    ids = jr.randint(key, (2, 10), 0, VOCAB, dtype=jnp.int32)
    ids2 = ids.at[:, 6:].set((ids[:, 6:] + 1) % VOCAB)
    a, b = _forward(model, ids), _forward(model, ids2)
    np.testing.assert_allclose(a[:, :6], b[:, :6], rtol=1e-5, atol=1e-5)
    assert not np.allclose(a[:, 6:], b[:, 6:])


def test_param_count_matches_analytic(model):
    want = flops.lm_param_counts(CFG.transformer, CFG.vocab_size)["total"]
    assert flops.count_params(model) == want


def test_initial_loss_near_log_vocab(model, key):
    loss, aux = _loss(model, _batch(key))
    assert abs(float(loss) - math.log(VOCAB)) < 1.0, float(loss)
    assert float(aux["weight_sum"]) == 4 * 12
    np.testing.assert_allclose(aux["loss_sum"] / aux["weight_sum"], loss, rtol=1e-6)
    np.testing.assert_allclose(aux["accuracy"], aux["correct_sum"] / 48, rtol=1e-6)
    assert 0.0 <= float(aux["accuracy"]) <= 1.0


def test_zero_weights_exclude_tokens(model, key):
    k1, k2 = jr.split(key)
    batch = _batch(k1)
    masked = dict(batch, weights=batch["weights"].at[:, 8:].set(0.0))
    loss, aux = _loss(model, masked)
    assert float(aux["weight_sum"]) == 4 * 8
    # Garbage labels at padded positions change nothing.
    junk = jr.randint(k2, (4, 4), 0, VOCAB, dtype=jnp.int32)
    loss2, aux2 = _loss(model, dict(masked, labels=masked["labels"].at[:, 8:].set(junk)))
    np.testing.assert_allclose(loss, loss2, rtol=1e-6)
    np.testing.assert_allclose(aux["correct_sum"], aux2["correct_sum"])
    # And equals the loss computed by hand over the kept positions only.
    logp = jax.nn.log_softmax(_forward(model, batch["ids"]), axis=-1)
    nll = -jnp.take_along_axis(logp, batch["labels"][..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(loss, jnp.mean(nll[:, :8]), rtol=1e-5)
    full_loss, _ = _loss(model, batch)
    assert not np.isclose(float(full_loss), float(loss))


def test_adam_steps_reduce_loss(model, key):
    batch = _batch(key)
    opt = optax.adam(1e-2)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state):
        def loss_fn(p):
            return lm_loss(eqx.combine(p, static), batch)[0]

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for _ in range(10):
        params, opt_state, loss = step(params, opt_state)
        losses.append(float(loss))
    assert all(np.isfinite(losses))
    assert losses[-1] < losses[0] - 0.5, losses


def test_generate_greedy_is_deterministic(model):
    prompt = jnp.array([1, 2, 3], jnp.int32)
    out = generate(model, prompt, 5)
    out2 = generate(model, prompt, 5, temperature=0.0, key=jr.key(7))
    assert out.shape == (8,) and out.dtype == jnp.int32
    np.testing.assert_array_equal(out[:3], prompt)
    np.testing.assert_array_equal(out, out2)
    assert bool(jnp.all((out >= 0) & (out < VOCAB)))
    # Causality: each generated token is the argmax of the full forward one step before.
    logits = _forward(model, out[None])[0]
    np.testing.assert_array_equal(out[3:], jnp.argmax(logits[2:-1], axis=-1))


def test_generate_slides_past_max_seq_len_and_samples(model):
    prompt = jnp.array([5, 6], jnp.int32)
    out = generate(model, prompt, 20)  # 22 tokens > max_seq_len = 16
    assert out.shape == (22,)
    assert bool(jnp.all((out >= 0) & (out < VOCAB)))
    # After the window slides, token t is greedy on the last 16 tokens before it.
    window = out[21 - 16 : 21]
    np.testing.assert_array_equal(out[21], jnp.argmax(_forward(model, window[None])[0, -1]))
    s1 = generate(model, prompt, 20, temperature=1.0, key=jr.key(1))
    s2 = generate(model, prompt, 20, temperature=1.0, key=jr.key(1))
    s3 = generate(model, prompt, 20, temperature=1.0, key=jr.key(2))
    np.testing.assert_array_equal(s1, s2)
    assert not np.array_equal(s1, s3)
    assert bool(jnp.all((s1 >= 0) & (s1 < VOCAB)))
    with pytest.raises(ValueError, match="key"):
        generate(model, prompt, 3, temperature=1.0)


def test_lm_config_validation():
    with pytest.raises(ValueError, match="vocab_size"):
        LMConfig(vocab_size=1)
    with pytest.raises(ValueError, match="output_logit_cap"):
        LMConfig(output_logit_cap=-1.0)
    with pytest.raises(ValueError, match="max_seq_len"):
        LMConfig(max_seq_len=0)
    assert LMConfig().transformer == TransformerConfig()


def test_linear_lm_is_causal_and_trains(key):
    model = TransformerLM(LINEAR_LM, key=jr.key(0))
    soft = TransformerLM(
        dataclasses.replace(LINEAR_LM, transformer=dataclasses.replace(LINEAR_LM.transformer, attention="softmax")),
        key=jr.key(0),
    )
    tokens = jr.randint(key, (4, 13), 0, 64, dtype=jnp.int32)
    batch = {"ids": tokens[:, :-1], "labels": tokens[:, 1:], "weights": jnp.ones((4, 12))}
    # Same parameters, different kernel: the knob really switches the attention.
    logits = _forward(model, batch["ids"])
    assert not np.allclose(logits, _forward(soft, batch["ids"]), atol=1e-3)
    changed = batch["ids"].at[:, 8:].set(0)
    np.testing.assert_allclose(logits[:, :8], _forward(model, changed)[:, :8], atol=1e-5)

    opt = optax.adam(1e-2)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(lambda p: lm_loss(eqx.combine(p, static), batch)[0])(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for _ in range(10):
        params, opt_state, loss = step(params, opt_state)
        losses.append(float(loss))
    assert all(np.isfinite(losses))
    assert losses[-1] < losses[0] - 0.5, losses


def test_lm_with_a_missing_kernel_fails_on_cpu_and_auto_equals_xla(key):
    from equipax.models import LMConfig, TransformerLM

    tcfg = TransformerConfig(num_layers=1, model_dims=16, num_heads=2, head_dim=8, hidden_dims=32)
    cfg = LMConfig(vocab_size=32, max_seq_len=16, transformer=tcfg)
    ids = jnp.arange(32, dtype=jnp.int32).reshape(2, 16) % 32
    forward = eqx.filter_jit(lambda m, ids: m(ids))

    def model(impl):
        return TransformerLM(
            dataclasses.replace(cfg, transformer=dataclasses.replace(tcfg, attention_impl=impl)), key=key
        )

    np.testing.assert_array_equal(forward(model("auto"), ids), forward(model("xla"), ids))
    with pytest.raises(ConfigError, match="attention_impl='splash' is a TPU kernel"):
        forward(model("splash"), ids)


def test_language_model_takes_numpy_ids_and_checks_rank(key):
    from equipax.core.nn import TransformerConfig
    from equipax.models import LMConfig, TransformerLM, generate

    cfg = LMConfig(
        vocab_size=16,
        max_seq_len=8,
        transformer=TransformerConfig(num_layers=1, model_dims=8, num_heads=2, head_dim=4, hidden_dims=16),
    )
    model = TransformerLM(cfg, key=key)
    ids = np.arange(6, dtype=np.int32)
    assert model(ids[None]).shape == (1, 6, 16)
    assert generate(model, ids[:2], 3).shape == (5,)
    from equipax.models.lm import token_ids

    with pytest.raises(ValueError, match=r"shape \[batch seq\]; got shape \(6,\)"):
        token_ids(ids)


LINEAR_LM = LMConfig(
    vocab_size=64,
    max_seq_len=16,
    transformer=TransformerConfig(
        num_layers=2, model_dims=16, num_heads=2, head_dim=8, hidden_dims=32, attention="linear"
    ),
)
