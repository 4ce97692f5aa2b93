"""Llama-style LM: RoPE and GQA against their slow references, the model (causal, scan ==
loop, remat, loss goes down), exact parameter counts at 7B/8B, config errors."""

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from jaxtyping import TypeCheckError

from equipax.core.flops import count_params, transformer_lm_flops_per_token
from equipax.core.nn import TransformerConfig, dot_product_attention, reference_attention
from equipax.core.nn.gqa_attention import (
    GroupedQueryAttention,
    cached_attention,
    gqa_attention,
    reference_gqa_attention,
)
from equipax.core.nn.rotary import apply_rotary, reference_rotary, rotary_angles
from equipax.models import lm_loss
from equipax.models.llama import LlamaConfig, LlamaLM, llama_flops_per_token, llama_param_counts

VOCAB = 64
CFG = LlamaConfig(
    vocab_size=VOCAB,
    max_seq_len=16,
    num_layers=2,
    model_dims=32,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    hidden_dims=48,
)
LLAMA3_8B = LlamaConfig(
    vocab_size=128256,
    max_seq_len=8192,
    num_layers=32,
    model_dims=4096,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    hidden_dims=14336,
    rope_theta=500_000.0,
)
LLAMA2_7B = LlamaConfig(
    vocab_size=32000,
    max_seq_len=4096,
    num_layers=32,
    model_dims=4096,
    num_heads=32,
    num_kv_heads=32,
    head_dim=128,
    hidden_dims=11008,
)

_forward = eqx.filter_jit(lambda model, ids: model(ids))


@pytest.fixture(scope="module")
def model():
    return LlamaLM(CFG, key=jr.key(0))


def _positions(batch, seq, offset=0):
    return jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32) + offset, (batch, seq))


def test_rope_matches_complex_reference_and_is_relative(key):
    x = jr.normal(key, (2, 7, 3, 16))
    pos = _positions(2, 7, offset=3)
    for theta in (10_000.0, 500_000.0):
        sin, cos = rotary_angles(pos, 16, theta)
        np.testing.assert_allclose(apply_rotary(x, sin, cos), reference_rotary(x, pos, theta), rtol=1e-5, atol=1e-5)
    # Position 0 is the identity; rotations keep norms.
    sin0, cos0 = rotary_angles(jnp.zeros((2, 7), jnp.int32), 16, 1e4)
    np.testing.assert_array_equal(apply_rotary(x, sin0, cos0), x)
    sin, cos = rotary_angles(pos, 16, 1e4)
    np.testing.assert_allclose(
        jnp.linalg.norm(apply_rotary(x, sin, cos), axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5
    )
    # q.k depends only on the distance between their positions.
    q, k = x[:1, :1], x[1:, :1]

    def dot(m, n):
        sq, cq = rotary_angles(jnp.full((1, 1), m, jnp.int32), 16, 1e4)
        sk, ck = rotary_angles(jnp.full((1, 1), n, jnp.int32), 16, 1e4)
        return jnp.sum(apply_rotary(q, sq, cq) * apply_rotary(k, sk, ck))

    np.testing.assert_allclose(dot(5, 2), dot(105, 102), rtol=1e-4)
    assert not np.isclose(float(dot(5, 2)), float(dot(5, 3)))


@pytest.mark.parametrize("kv_heads", [1, 2, 6])
def test_gqa_matches_reference(key, kv_heads):
    kq, kk, kv, ks = jr.split(key, 4)
    q = jr.normal(kq, (2, 9, 6, 8))
    k, v = jr.normal(kk, (2, 9, kv_heads, 8)), jr.normal(kv, (2, 9, kv_heads, 8))
    seg = jnp.sort(jr.randint(ks, (2, 9), 0, 3), axis=1)
    for kw in (dict(causal=True), dict(causal=False, logit_cap=2.0), dict(causal=True, segment_ids=seg)):
        np.testing.assert_allclose(
            gqa_attention(q, k, v, **kw), reference_gqa_attention(q, k, v, **kw), rtol=1e-5, atol=1e-5
        )
    # The reference repeats key/value head h // group for query head h.
    group = 6 // kv_heads
    by_hand = reference_attention(q, jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2), causal=True)
    np.testing.assert_allclose(reference_gqa_attention(q, k, v, causal=True), by_hand)
    if kv_heads == 6:  # plain multi-head attention
        np.testing.assert_allclose(
            gqa_attention(q, k, v, causal=True), dot_product_attention(q, k, v, causal=True), rtol=1e-5, atol=1e-5
        )
    with pytest.raises(ValueError, match="num_kv_heads"):
        gqa_attention(q, k[:, :, :1].repeat(4, axis=2), v[:, :, :1].repeat(4, axis=2), causal=True)


def test_cached_attention_is_causal_attention_over_slots(key):
    kq, kk, kv = jr.split(key, 3)
    q = jr.normal(kq, (2, 5, 4, 8))
    k, v = jr.normal(kk, (2, 5, 2, 8)), jr.normal(kv, (2, 5, 2, 8))
    want = reference_gqa_attention(q, k, v, causal=True)
    # Slots past the written ones hold junk: masked.
    junk = jnp.full((2, 3, 2, 8), 1e3)
    keys, values = (jnp.swapaxes(jnp.concatenate([t, junk], 1), 1, 2) for t in (k, v))
    got = cached_attention(q, keys, values, query_positions=_positions(2, 5))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # One query per row at different positions (per-row lengths).
    last = cached_attention(q[:, 4:], keys, values, query_positions=jnp.array([[4], [2]]))
    np.testing.assert_allclose(last[0], want[0, 4:], rtol=1e-5, atol=1e-5)
    q_row1 = q[1:, :3].at[:, 2].set(q[1:, 4])  # row 1's query sits at position 2
    short = reference_gqa_attention(q_row1, k[1:, :3], v[1:, :3], causal=True)
    np.testing.assert_allclose(last[1:, 0], short[:, 2], rtol=1e-5, atol=1e-5)


def test_attention_layer_shapes_mqa(key):
    layer = GroupedQueryAttention(32, 4, 1, 8, key=key)
    assert layer.kv.shape == (32, 2, 1, 8) and layer.q.shape == (32, 4, 8)
    sin, cos = rotary_angles(_positions(2, 6), 8, 1e4)
    y = layer(jr.normal(key, (2, 6, 32)), sin, cos)
    assert y.shape == (2, 6, 32)


def test_forward_is_causal_and_untied(model, key):
    ids = jr.randint(key, (2, 10), 0, VOCAB, dtype=jnp.int32)
    logits = _forward(model, ids)
    assert logits.shape == (2, 10, VOCAB) and logits.dtype == jnp.float32
    changed = _forward(model, ids.at[:, 6:].set((ids[:, 6:] + 1) % VOCAB))
    np.testing.assert_allclose(logits[:, :6], changed[:, :6], rtol=1e-5, atol=1e-5)
    assert not np.allclose(logits[:, 6:], changed[:, 6:])
    assert model.unembed.weight.shape == (32, VOCAB)
    assert model.embedding.weight.shape == (VOCAB, 32)
    # Shifting all positions changes nothing (RoPE is relative; no position table).
    shifted = model(ids, positions=_positions(2, 10, offset=5))
    np.testing.assert_allclose(shifted, logits, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(jnp.zeros((1, 17), jnp.int32))


def test_scan_equals_loop_and_remat_keeps_gradients(model, key):
    ids = jr.randint(key, (2, 8), 0, VOCAB, dtype=jnp.int32)
    batch = {"ids": ids, "labels": jnp.roll(ids, -1, axis=1), "weights": jnp.ones((2, 8))}
    loop = LlamaLM(dataclasses.replace(CFG, scan_layers=False, remat="full"), key=jr.key(0))
    np.testing.assert_allclose(_forward(loop, ids), _forward(model, ids), rtol=1e-5, atol=1e-5)
    assert loop.layers[1].attention.kv.shape == model.layers.attention.kv.shape[1:]

    def grads(m):
        return jax.jit(jax.grad(lambda m: lm_loss(m, batch)[0]))(m)

    scanned_remat = LlamaLM(dataclasses.replace(CFG, remat="dots_saveable"), key=jr.key(0))
    want = grads(model).layers.ffn.up.weight
    np.testing.assert_allclose(grads(scanned_remat).layers.ffn.up.weight, want, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(grads(loop).layers[1].ffn.up.weight, want[1], rtol=1e-4, atol=1e-6)


def test_lm_loss_starts_near_log_vocab_and_goes_down(model, key):
    ids = jr.randint(key, (4, 13), 0, VOCAB, dtype=jnp.int32)
    batch = {"ids": ids[:, :-1], "labels": ids[:, 1:], "weights": jnp.ones((4, 12))}
    opt = optax.adam(1e-2)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(lambda p: lm_loss(eqx.combine(p, static), batch)[0])(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for _ in range(8):
        params, opt_state, loss = step(params, opt_state)
        losses.append(float(loss))
    assert abs(losses[0] - math.log(VOCAB)) < 1.0, losses[0]
    assert losses[-1] < losses[0] - 0.5, losses


def test_param_counts_exact():
    assert llama_param_counts(LLAMA3_8B)["total"] == 8_030_261_248
    assert llama_param_counts(LLAMA2_7B)["total"] == 6_738_415_616
    # The analytic count is the model's: abstract init (no memory), small and full size.
    for cfg in (CFG, dataclasses.replace(CFG, scan_layers=False, num_kv_heads=1), LLAMA3_8B, LLAMA2_7B):
        abstract = eqx.filter_eval_shape(LlamaLM, cfg, key=jr.key(0))
        assert count_params(abstract) == llama_param_counts(cfg)["total"], cfg


def test_flops_match_the_gpt_accounting_when_heads_are_not_grouped():
    for remat in ("none", "full", "dots_saveable"):
        mha = dataclasses.replace(LLAMA2_7B, remat=remat)
        gpt = TransformerConfig(
            num_layers=32,
            model_dims=4096,
            num_heads=32,
            head_dim=128,
            hidden_dims=11008,
            gated=True,
            activation="silu",
            remat=remat,
        )
        want = transformer_lm_flops_per_token(gpt, vocab_size=32000, seq_len=4096)
        assert llama_flops_per_token(mha, seq_len=4096) == want
    # GQA only shrinks the key/value projections; 6N + attention stays the training rule.
    got = llama_flops_per_token(LLAMA3_8B, seq_len=8192)
    assert got["qkv_projection"] == 32 * 2 * 4096 * (32 + 16) * 128
    # Matmul weights: all but the input table and the 65 norm scales (the lookup is free).
    matmul_params = llama_param_counts(LLAMA3_8B)["total"] - 128256 * 4096 - 65 * 4096
    assert got["training"] == 6 * matmul_params + 3 * got["attention"]


def test_abstract_params_get_sharding_specs():
    from jax.sharding import AbstractMesh
    from jax.sharding import PartitionSpec as P

    from equipax.core.partition import param_specs

    mesh = AbstractMesh((2, 4, 2), ("data", "fsdp", "tensor"))
    for cfg in (LLAMA3_8B, dataclasses.replace(CFG, scan_layers=False, num_kv_heads=1)):
        abstract = eqx.filter_eval_shape(LlamaLM, cfg, key=jr.key(0))
        specs = param_specs(abstract, mesh)  # raises, naming the weight, if one is undeclared
        assert specs.embedding.weight == P("tensor", "fsdp")
        assert specs.unembed.weight == P("fsdp", "tensor")
    layers = param_specs(eqx.filter_eval_shape(LlamaLM, LLAMA3_8B, key=jr.key(0)), mesh).layers
    assert layers.attention.q == P(None, "fsdp", "tensor", None)
    assert layers.attention.kv == P(None, "fsdp", None, "tensor", None)
    assert layers.attention.out == P(None, "tensor", None, "fsdp")
    assert layers.ffn.gate.weight == P(None, "fsdp", "tensor")
    assert layers.ffn.down.weight == P(None, "tensor", "fsdp")
    assert layers.atten_norm.scale == P(None, None)
    # MQA: the single key/value head cannot be split over tensor, so it is replicated.
    unrolled = specs.layers[0]  # pyright: ignore[reportIndexIssue]
    assert unrolled.attention.kv == P("fsdp", None, None, None)
    assert unrolled.attention.q == P("fsdp", "tensor", None)


def test_config_errors_name_the_knob():
    for kw, knob in (
        (dict(num_heads=6, num_kv_heads=4), "num_kv_heads"),
        (dict(head_dim=7), "head_dim"),
        (dict(rope_theta=0.0), "rope_theta"),
        (dict(num_kv_heads=0), "num_kv_heads"),
        (dict(remat="some"), "remat"),
        (dict(vocab_size=1), "vocab_size"),
        (dict(dtype="float16"), "dtype"),
        (dict(embedding_init_std=0.0), "embedding_init_std"),
    ):
        # Literal knobs are caught earlier by the test suite's runtime type checker.
        with pytest.raises((ValueError, TypeCheckError), match=knob):
            LlamaConfig(**kw)


def test_embedding_init_std_sets_the_residual_streams_initial_scale():
    """The input embedding starts N(0, embedding_init_std^2) (default 1: unit-RMS residual
    stream, as torchtitan's Llama); nothing else in the model depends on the knob."""
    default = LlamaLM(CFG, key=jr.key(0))
    small = LlamaLM(dataclasses.replace(CFG, embedding_init_std=0.02), key=jr.key(0))
    assert float(jnp.std(default.embedding.weight)) == pytest.approx(1.0, rel=0.05)
    np.testing.assert_allclose(small.embedding.weight, 0.02 * default.embedding.weight, rtol=1e-5, atol=1e-7)
    rest = lambda m: jax.tree.leaves(eqx.filter((m.layers, m.final_norm, m.unembed), eqx.is_array))  # noqa: E731
    assert all(bool(jnp.array_equal(a, b)) for a, b in zip(rest(default), rest(small), strict=True))
