"""Every softmax kernel against the reference for grouped-query heads, packed segments and sliding
windows; the reference's window against a banded mask built in numpy; mutations show the checks fail.

cuDNN's call is checked through the same `jax.nn.dot_product_attention` entry point lowered by XLA
(no GPU here); splash runs in the Pallas interpreter (blocks of 128 positions)."""

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

from equipax.core.nn.attention import cached_attention, dot_product_attention, reference_attention
from equipax.core.nn.fused_attention import cudnn_attention, splash_attention, splash_block_sizes


def _qkv(key, b, s, heads, kv_heads, d=16):
    kq, kk, kv = jr.split(key, 3)
    return (jr.normal(kq, (b, s, heads, d)), jr.normal(kk, (b, s, kv_heads, d)), jr.normal(kv, (b, s, kv_heads, d)))


def _segments(b, s):
    cuts = jnp.array([[s // 3], [s // 2]])[:b]
    return (jnp.arange(s)[None, :] >= cuts).astype(jnp.int32)


def numpy_attention(q, k, v, *, window=None, segment_ids=None, logit_cap=None):
    """Causal softmax attention in float64 numpy, one query head at a time, with the band
    `p - window < j <= p` (and segments) written out as an explicit boolean matrix."""
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    b, s, heads, d = q.shape
    group = heads // k.shape[2]
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    out = np.zeros_like(q)
    for row in range(b):
        allowed = j <= i
        if window is not None:
            allowed &= j > i - window
        if segment_ids is not None:
            seg = np.asarray(segment_ids[row])
            allowed &= seg[:, None] == seg[None, :]
        for h in range(heads):
            logits = q[row, :, h] @ k[row, :, h // group].T / np.sqrt(d)
            if logit_cap is not None:
                logits = logit_cap * np.tanh(logits / logit_cap)
            logits = np.where(allowed, logits, -np.inf)
            p = np.exp(logits - logits.max(-1, keepdims=True))
            out[row, :, h] = (p / p.sum(-1, keepdims=True)) @ v[row, :, h // group]
    return out


HEADS = [pytest.param(4, 4, id="mha"), pytest.param(4, 2, id="gqa"), pytest.param(4, 1, id="mqa")]
CASES = [
    pytest.param({}, id="causal"),
    pytest.param({"window": 5}, id="window"),
    pytest.param({"window": 5, "segments": True}, id="window-segments"),
    pytest.param({"window": 7, "logit_cap": 2.0}, id="window-cap"),
]


def _kw(case, b, s):
    case = dict(case)
    seg = _segments(b, s) if case.pop("segments", False) else None
    return {**case, "segment_ids": seg}


@pytest.mark.parametrize("heads,kv_heads", HEADS)
@pytest.mark.parametrize("case", CASES)
def test_reference_and_xla_kernel_match_a_banded_numpy_mask(heads, kv_heads, case, key):
    q, k, v = _qkv(key, 2, 24, heads, kv_heads)
    kw = _kw(case, 2, 24)
    want = numpy_attention(q, k, v, **kw)
    np.testing.assert_allclose(reference_attention(q, k, v, causal=True, **kw), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dot_product_attention(q, k, v, causal=True, **kw), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", HEADS[1:])
@pytest.mark.parametrize("case", [CASES[0], CASES[2]])
def test_cudnn_call_matches_the_reference_for_gqa_windows_and_segments(heads, kv_heads, case, key):
    q, k, v = _qkv(key, 2, 24, heads, kv_heads)
    kw = _kw(case, 2, 24)
    kw.pop("logit_cap", None)
    out = cudnn_attention(q, k, v, causal=True, implementation="xla", **kw)
    np.testing.assert_allclose(out, reference_attention(q, k, v, causal=True, **kw), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "case",
    [
        pytest.param({"window": 40, "segments": True}, id="gqa-window-segments"),
        pytest.param({"window": 100, "logit_cap": 3.0}, id="gqa-window-cap"),
    ],
)
def test_splash_kernel_matches_the_reference_for_gqa_and_windows(case, key):
    q, k, v = _qkv(key, 1, 128, 4, 2)
    kw = _kw(case, 1, 128)
    splash = jax.jit(lambda q, k, v: splash_attention(q, k, v, causal=True, interpret=True, **kw))
    want = reference_attention(q, k, v, causal=True, **kw)
    np.testing.assert_allclose(splash(q, k, v), want, rtol=1e-5, atol=1e-5)
    g = jax.grad(
        lambda q, k, v: jnp.sum(jnp.sin(splash_attention(q, k, v, causal=True, interpret=True, **kw))),
        argnums=(0, 1, 2),
    )(q, k, v)
    g_ref = jax.grad(
        lambda q, k, v: jnp.sum(jnp.sin(reference_attention(q, k, v, causal=True, **kw))), argnums=(0, 1, 2)
    )(q, k, v)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_splash_with_its_long_sequence_blocks_matches_the_reference(key):
    """At 2048 positions the kernel runs 1024-blocks of queries and keys, 512 keys per compute
    step (the v5e's fastest, `splash_block_sizes`): two query blocks, two key blocks, two compute
    steps each, causal and windowed masks across block edges, forward and backward."""
    assert splash_block_sizes(2048, 2048, 128) == (1024, 1024, 512)
    assert splash_block_sizes(1536, 1536, 128) == (512, 512, 512)  # 1024 does not divide it
    assert splash_block_sizes(2048, 2048, 256) == (512, 512, 512)  # wide heads: not measured
    assert splash_block_sizes(2048, 100, 128) is None
    q, k, v = _qkv(key, 1, 2048, 2, 1)
    for kw in ({}, {"window": 1500}):
        run = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))  # noqa: E731
        splash = lambda q, k, v, kw=kw: splash_attention(q, k, v, causal=True, interpret=True, **kw)  # noqa: E731
        ref = lambda q, k, v, kw=kw: reference_attention(q, k, v, causal=True, **kw)  # noqa: E731
        np.testing.assert_allclose(jax.jit(splash)(q, k, v), ref(q, k, v), rtol=1e-5, atol=1e-5)
        g = jax.jit(jax.grad(run(splash), argnums=(0, 1, 2)))(q, k, v)
        g_ref = jax.grad(run(ref), argnums=(0, 1, 2))(q, k, v)
        for a, b in zip(g, g_ref):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("window", [None, 6])
def test_cached_attention_over_slots_equals_the_reference(window, key):
    q, k, v = _qkv(key, 2, 16, 4, 2)
    want = reference_attention(q, k, v, causal=True, window=window)
    slots = lambda t: jnp.pad(t, ((0, 0), (0, 8), (0, 0), (0, 0)))  # noqa: E731  (8 slots not yet written)
    positions = jnp.broadcast_to(jnp.arange(16), (2, 16))
    got = cached_attention(q, slots(k), slots(v), query_positions=positions, window=window)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_window_one_too_wide_or_a_wrong_group_fails_the_checks(key):
    """Mutations: the comparisons above fail for a window off by one and for key/value heads read
    in the wrong grouping (each query head h reading key/value head h % kv_heads)."""
    q, k, v = _qkv(key, 2, 24, 4, 2)
    want = numpy_attention(q, k, v, window=5)
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(dot_product_attention(q, k, v, causal=True, window=6), want, rtol=1e-5, atol=1e-5)
    wrong = [0, 1, 0, 1]  # query head h reads key/value head h % 2 instead of h // 2
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(
            reference_attention(q, k[:, :, wrong], v[:, :, wrong], causal=True, window=5), want, rtol=1e-5, atol=1e-5
        )


def test_window_needs_causal(key):
    q, k, v = _qkv(key, 1, 8, 2, 2)
    with pytest.raises(ValueError, match="causal=True"):
        reference_attention(q, k, v, causal=False, window=3)


def test_cached_attention_masks_unwritten_slots_and_rows_at_their_own_positions(key):
    kq, kk, kv = jr.split(key, 3)
    q = jr.normal(kq, (2, 5, 4, 8))
    k, v = jr.normal(kk, (2, 5, 2, 8)), jr.normal(kv, (2, 5, 2, 8))
    want = reference_attention(q, k, v, causal=True)
    # Slots past the written ones hold junk: masked.
    junk = jnp.full((2, 3, 2, 8), 1e3)
    keys, values = (jnp.concatenate([t, junk], 1) for t in (k, v))
    got = cached_attention(q, keys, values, query_positions=jnp.broadcast_to(jnp.arange(5), (2, 5)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # One query per row at different positions (per-row lengths).
    last = cached_attention(q[:, 4:], keys, values, query_positions=jnp.array([[4], [2]]))
    np.testing.assert_allclose(last[0], want[0, 4:], rtol=1e-5, atol=1e-5)
    q_row1 = q[1:, :3].at[:, 2].set(q[1:, 4])  # row 1's query sits at position 2
    short = reference_attention(q_row1, k[1:, :3], v[1:, :3], causal=True)
    np.testing.assert_allclose(last[1:, 0], short[:, 2], rtol=1e-5, atol=1e-5)


def test_heads_that_do_not_group_are_refused(key):
    q, k, v = _qkv(key, 1, 4, 6, 4)
    with pytest.raises(ValueError, match="num_kv_heads"):
        dot_product_attention(q, k, v, causal=True)
