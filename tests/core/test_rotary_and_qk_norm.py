"""Rotary positions with Llama 3.1's frequency rescaling against an independent numpy implementation
of the "llama3" rule, and Qwen3's QK-norm as Qwen3 defines it (an RMSNorm over each head's queries
and keys, before the rotation); the attention module's two projection layouts and its KV cache."""

import math

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

from equipax.core.configs import RopeScalingConfig
from equipax.core.nn.rotary import apply_rotary, rotary_angles, rotary_frequencies
from equipax.core.nn.self_attention import Attention

LLAMA_31 = dict(head_dim=128, theta=500_000.0, factor=8.0, low=1.0, high=4.0, original=8192)
LLAMA_32 = dict(head_dim=64, theta=500_000.0, factor=32.0, low=1.0, high=4.0, original=8192)


def llama3_numpy(head_dim, theta, factor, low, high, original):
    """The llama3 rule frequency by frequency, in float64: keep the high frequencies (wavelength
    below original / high), divide the low ones (wavelength above original / low) by `factor`,
    and blend linearly in 1/wavelength between the two."""
    out = []
    for i in range(head_dim // 2):
        freq = 1.0 / theta ** (2 * i / head_dim)
        wavelength = 2 * math.pi / freq
        if wavelength < original / high:
            out.append(freq)
        elif wavelength > original / low:
            out.append(freq / factor)
        else:
            blend = (original / wavelength - low) / (high - low)
            out.append((1 - blend) * freq / factor + blend * freq)
    return np.array(out)


def _scaling(p):
    return RopeScalingConfig(
        factor=p["factor"], low_freq_factor=p["low"], high_freq_factor=p["high"], original_max_seq_len=p["original"]
    )


@pytest.mark.parametrize("p", [LLAMA_31, LLAMA_32], ids=["llama3.1", "llama3.2"])
def test_llama3_frequencies_match_an_independent_numpy_rule(p):
    got = np.asarray(rotary_frequencies(p["head_dim"], p["theta"], _scaling(p)))
    want = llama3_numpy(**p)
    np.testing.assert_allclose(got, want, rtol=2e-6)
    # The three regimes all occur at these sizes, so each branch of the rule is compared.
    plain = 1.0 / p["theta"] ** (np.arange(0, p["head_dim"], 2) / p["head_dim"])
    kept, divided = np.isclose(want, plain, rtol=1e-9), np.isclose(want, plain / p["factor"], rtol=1e-9)
    assert kept.any() and divided.any() and (~kept & ~divided).any()


def test_a_wrong_rule_fails_the_numpy_check():
    p = LLAMA_31
    swapped = RopeScalingConfig(factor=8.0, low_freq_factor=1.0, high_freq_factor=2.0, original_max_seq_len=8192)
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(
            np.asarray(rotary_frequencies(128, p["theta"], swapped)), llama3_numpy(**p), rtol=2e-6
        )


def test_factor_one_changes_nothing_and_angles_use_the_scaled_frequencies():
    one = RopeScalingConfig(factor=1.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192)
    np.testing.assert_allclose(rotary_frequencies(64, 5e5, one), rotary_frequencies(64, 5e5), rtol=1e-6)
    pos = jnp.array([[0, 1, 1000, 8191]])
    sin, cos = rotary_angles(pos, 128, LLAMA_31["theta"], _scaling(LLAMA_31))
    angles = np.asarray(pos, np.float64)[..., None] * llama3_numpy(**LLAMA_31)
    np.testing.assert_allclose(sin, np.sin(angles), atol=1e-3)  # float32 angles of up to ~8e3 radians
    np.testing.assert_allclose(cos, np.cos(angles), atol=1e-3)


def test_qk_norm_is_an_rms_norm_of_each_head_before_the_rotation(key):
    """Qwen3: q = rope(rms_norm(x W_q per head) * q_scale), k likewise; values untouched."""
    attn = Attention(32, 4, 8, num_kv_heads=2, fused_qkv=False, qk_norm=True, norm_eps=1e-6, key=key)
    k1, k2, k3 = jr.split(jr.key(7), 3)
    attn = eqx.tree_at(
        lambda a: (a.q_norm.scale, a.k_norm.scale), attn, (1 + 0.1 * jr.normal(k1, (8,)), 1 + 0.1 * jr.normal(k2, (8,)))
    )
    x = jr.normal(k3, (2, 5, 32))
    positions = jnp.broadcast_to(jnp.arange(5), (2, 5))
    rot = rotary_angles(positions, 8, 1e6)
    q, k, v = attn.project(x, rot)

    xn = np.asarray(x, np.float64)
    qw, kvw = np.asarray(attn.q, np.float64), np.asarray(attn.kv, np.float64)

    def rms(t, scale):
        return t / np.sqrt(np.mean(t * t, -1, keepdims=True) + 1e-6) * np.asarray(scale, np.float64)

    def rope(t):
        half = t.shape[-1] // 2
        freqs = 1e6 ** (-np.arange(half) * 2 / t.shape[-1])
        ang = np.arange(5)[None, :, None, None] * freqs
        t1, t2 = t[..., :half], t[..., half:]
        return np.concatenate([t1 * np.cos(ang) - t2 * np.sin(ang), t2 * np.cos(ang) + t1 * np.sin(ang)], -1)

    want_q = rope(rms(np.einsum("bse,ehd->bshd", xn, qw), attn.q_norm.scale))
    want_k = rope(rms(np.einsum("bse,ed->bsd", xn, kvw[:, 0].reshape(32, -1)).reshape(2, 5, 2, 8), attn.k_norm.scale))
    np.testing.assert_allclose(q, want_q, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(k, want_k, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(v, np.einsum("bse,end->bsnd", xn, kvw[:, 1]), rtol=1e-5, atol=1e-5)
    # Mutation: normalising after the rotation is not Qwen3's QK-norm (the scale is per dimension).
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(
            rms(rope(np.einsum("bse,ehd->bshd", xn, qw)), attn.q_norm.scale), want_q, rtol=1e-4, atol=1e-5
        )


def test_fused_and_separate_projections_compute_the_same_attention(key):
    fused = Attention(32, 4, 8, fused_qkv=True, use_bias=True, logit_cap=5.0, key=key)
    k1, k2 = jr.split(jr.key(3))
    fused = eqx.tree_at(lambda a: a.qkv_bias, fused, 0.1 * jr.normal(k1, (3, 4, 8)))
    split = Attention(32, 4, 8, fused_qkv=False, use_bias=True, logit_cap=5.0, key=key)
    split = eqx.tree_at(
        lambda a: (a.q, a.kv, a.q_bias, a.kv_bias, a.out),
        split,
        (fused.qkv[:, 0], fused.qkv[:, 1:], fused.qkv_bias[0], fused.qkv_bias[1:], fused.out),
    )
    x = jr.normal(k2, (2, 6, 32))
    np.testing.assert_allclose(fused(x)[0], split(x)[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("window", [None, 3])
def test_attention_with_a_cache_equals_attention_over_the_sequence(window, key):
    attn = Attention(32, 4, 8, num_kv_heads=2, fused_qkv=False, qk_norm=True, window=window, key=key)
    x = jr.normal(jr.key(5), (2, 7, 32))
    positions = jnp.broadcast_to(jnp.arange(7), (2, 7))
    rot = rotary_angles(positions, 8, 1e4)
    want, no_cache = attn(x, rotary=rot)
    assert no_cache is None
    cache = attn.init_cache(2, 10, jnp.float32)
    assert cache.keys.shape == (2, 10, 2, 8)  # key/value heads, not query heads
    first, cache = attn(x[:, :4], rotary=(rot[0][:, :4], rot[1][:, :4]), cache=cache, positions=positions[:, :4])
    outs = [first]
    for t in range(4, 7):
        sl = slice(t, t + 1)
        y, cache = attn(x[:, sl], rotary=(rot[0][:, sl], rot[1][:, sl]), cache=cache, positions=positions[:, sl])
        outs.append(y)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), want, rtol=1e-5, atol=1e-5)


def test_apply_rotary_is_unchanged_by_scaling_of_short_wavelengths(key):
    # The highest frequencies (short wavelengths) keep their value under the llama3 rule.
    x = jr.normal(key, (1, 3, 1, 128))
    pos = jnp.array([[0, 5, 17]])
    plain = apply_rotary(x, *rotary_angles(pos, 128, 5e5))
    scaled = apply_rotary(x, *rotary_angles(pos, 128, 5e5, _scaling(LLAMA_31)))
    np.testing.assert_allclose(plain[..., :8], scaled[..., :8], rtol=1e-6)
    assert not np.allclose(plain, scaled)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_rotations_gradient_is_the_automatic_one_bit_for_bit_and_the_references(dtype, key):
    """`apply_rotary`'s written gradient (the opposite rotation of the cotangent) against the
    gradient JAX derives from the same float32 rotation, and from the complex-number reference."""
    import jax

    from equipax.core.nn.rotary import _rotate, reference_rotary

    kx, kg = jr.split(key)
    x = jr.normal(kx, (2, 5, 3, 64)).astype(dtype)
    g = jr.normal(kg, x.shape).astype(dtype)
    pos = jnp.array([[0, 1, 2, 3, 4], [7, 300, 9000, 4, 0]])
    sin, cos = rotary_angles(pos, 64, 5e5)
    (written,) = jax.vjp(lambda x: apply_rotary(x, sin, cos), x)[1](g)
    (derived,) = jax.vjp(lambda x: _rotate(x, sin, cos), x)[1](g)
    assert written.dtype == dtype
    np.testing.assert_array_equal(np.asarray(written, np.float32), np.asarray(derived, np.float32))
    # The complex-number reference, at positions where its float32 angles agree with
    # `rotary_angles`' (they drift apart at thousands).
    (reference,) = jax.vjp(lambda y: reference_rotary(y, pos[:1], 5e5), x[:1])[1](g[:1])
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    first = np.asarray(written[:1], np.float32)
    np.testing.assert_allclose(first, np.asarray(reference, np.float32), atol=tol, rtol=tol)
    # A rotation: the gradient keeps each head vector's norm (in float32).
    if dtype == jnp.float32:
        np.testing.assert_allclose(jnp.linalg.norm(written, axis=-1), jnp.linalg.norm(g, axis=-1), rtol=1e-5)
