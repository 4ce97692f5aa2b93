"""Attention kernels: linear attention vs its O(N^2) formulation, softmax fast paths vs the
reference, the `attention` knob of the transformer config, and its FLOP accounting."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jaxtyping import TypeCheckError

from equipax.core import flops
from equipax.core.nn import (
    TransformerConfig,
    dot_product_attention,
    elu_feature_map,
    jax_nn_attention,
    linear_attention,
    reference_attention,
    reference_linear_attention,
)

N = 13  # a prime: chunk sizes 1 and 13 divide it, 4 and 5 do not, 64 exceeds it


def _qkv(key, shape=(2, N, 3, 8), scale=1.0):
    return tuple(scale * jr.normal(k, shape) for k in jr.split(key, 3))


def _grads(fn, q, k, v, **kw):
    def loss(q, k, v):
        return jnp.sum(jnp.sin(fn(q, k, v, **kw)))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)


def test_linear_reference_matches_numpy(key):
    q, k, v = (np.asarray(t, np.float64)[0, :, 0] for t in _qkv(key, (1, 5, 1, 3)))

    def phi(x):
        return np.where(x > 0, x + 1, np.exp(x))

    w = phi(q) @ phi(k).T
    for causal in (False, True):
        wm = np.tril(w) if causal else w
        want = wm @ v / (wm.sum(-1, keepdims=True) + 1e-6)
        got = reference_linear_attention(*_qkv(key, (1, 5, 1, 3)), causal=causal)[0, :, 0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("causal, chunk_size", [(False, 64), (True, 1), (True, 4), (True, 5), (True, 13), (True, 64)])
def test_linear_attention_matches_naive(key, causal, chunk_size):
    q, k, v = _qkv(key)
    ref = reference_linear_attention(q, k, v, causal=causal)
    fast = linear_attention(q, k, v, causal=causal, chunk_size=chunk_size)
    assert fast.shape == v.shape and fast.dtype == v.dtype
    np.testing.assert_allclose(fast, ref, rtol=1e-5, atol=1e-5)
    g_ref = _grads(reference_linear_attention, q, k, v, causal=causal)
    g_fast = _grads(linear_attention, q, k, v, causal=causal, chunk_size=chunk_size)
    for a, b in zip(g_fast, g_ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_causal_linear_attention_ignores_the_future(key):
    q, k, v = _qkv(key)
    k2 = k.at[:, 7:].set(100.0)
    v2 = v.at[:, 7:].set(-100.0)
    a = linear_attention(q, k, v, causal=True, chunk_size=4)
    b = linear_attention(q, k2, v2, causal=True, chunk_size=4)
    np.testing.assert_allclose(a[:, :7], b[:, :7], rtol=1e-6, atol=1e-6)
    assert not np.allclose(a[:, 7:], b[:, 7:])


def test_linear_attention_is_a_convex_mix_of_values(key):
    # phi > 0, so each output is a weighted mean of values: inside their range.
    q, k, _ = _qkv(key)
    v = jnp.ones((2, N, 3, 8)) * jnp.arange(N, dtype=jnp.float32)[None, :, None, None]
    out = linear_attention(q, k, v, causal=True, chunk_size=4)
    assert np.all(np.asarray(elu_feature_map(q)) > 0)
    assert np.all(np.asarray(out) >= -1e-6)
    assert np.all(np.asarray(out) <= np.arange(N, dtype=np.float32)[None, :, None, None] + 1e-4)
    np.testing.assert_allclose(out[:, 0], 0.0, atol=1e-6)  # the first query sees only v_0 = 0


def test_linear_attention_rejects_bad_chunk_size(key):
    q, k, v = _qkv(key)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        linear_attention(q, k, v, causal=True, chunk_size=0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("logit_cap", [None, 5.0])
def test_softmax_fast_paths_match_reference(key, causal, logit_cap):
    q, k, v = _qkv(key, scale=3.0)
    ref = reference_attention(q, k, v, causal=causal, logit_cap=logit_cap)
    fns = [dot_product_attention] + ([jax_nn_attention] if logit_cap is None else [])
    for fn in fns:
        np.testing.assert_allclose(fn(q, k, v, causal=causal, logit_cap=logit_cap), ref, rtol=1e-5, atol=1e-5)
        g_ref = _grads(reference_attention, q, k, v, causal=causal, logit_cap=logit_cap)
        g_fast = _grads(fn, q, k, v, causal=causal, logit_cap=logit_cap)
        for a, b in zip(g_fast, g_ref):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_jax_nn_attention_refuses_a_logit_cap(key):
    q, k, v = _qkv(key)
    with pytest.raises(ValueError, match="cannot apply a logit cap"):
        jax_nn_attention(q, k, v, causal=True, logit_cap=5.0)


_forward = eqx.filter_jit(lambda model, ids: model(ids))


def test_transformer_config_attention_knob():
    assert TransformerConfig().attention == "softmax"
    # Under the test suite's jaxtyping/beartype hook the Literal annotation rejects it first;
    # without the hook, __post_init__ does.
    with pytest.raises((ValueError, TypeCheckError), match="attention"):
        TransformerConfig(attention="performer")  # type: ignore[arg-type]


def test_linear_attention_flops_are_linear_in_seq_len():
    cfg = TransformerConfig(num_layers=1, num_heads=2, head_dim=4, attention="linear")
    per_token = [
        flops.transformer_lm_flops_per_token(cfg, vocab_size=8, seq_len=n)["attention"] for n in (8, 64, 1024, 8192)
    ]
    # State update + read-out 2 * 2 h hd^2, plus the causal half of a chunk's products.
    assert per_token[0] == 2 * 2 * 2 * 16 + 2 * 2 * 8 * 2 * 4 / 2
    assert per_token[1] == per_token[2] == per_token[3] == 2 * 2 * 2 * 16 + 2 * 2 * 64 * 2 * 4 / 2
    soft = dataclasses.replace(cfg, attention="softmax")
    assert flops.transformer_lm_flops_per_token(soft, vocab_size=8, seq_len=8192)["attention"] > (100 * per_token[3])
