"""A Llama-style LM as a configuration of the one `TransformerLM`: RoPE against its slow
reference, the model (causal, untied, scan == loop, remat, loss goes down), exact parameter
counts at 7B/8B against the traced model, FLOPs, sharding specs and config errors.

(The attention kernels' GQA parity is in tests/core/test_attention_kernels.py.)"""

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
from equipax.core.nn import TransformerConfig
from equipax.core.nn.rotary import apply_rotary, reference_rotary, rotary_angles
from equipax.models import LMConfig, TransformerLM, lm_loss


def llama(
    *,
    vocab_size,
    max_seq_len,
    num_layers,
    model_dims,
    num_heads,
    num_kv_heads,
    head_dim,
    hidden_dims,
    rope_theta=10_000.0,
    **transformer,
):
    """The Llama block's choices (as the Llama experiments' `decoder_lm` preset writes them)."""
    block = TransformerConfig(
        num_layers=num_layers,
        model_dims=model_dims,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        hidden_dims=hidden_dims,
        activation="silu",
        gated=True,
        norm="rmsnorm",
        norm_eps=1e-5,
        fused_qkv=False,
        atten_logit_cap=None,
        **transformer,
    )
    return LMConfig(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        transformer=block,
        output_logit_cap=None,
        position="rope",
        rope_theta=rope_theta,
        tie_embeddings=False,
        embedding_multiplier=None,
        embedding_init_std=1.0,
    )


def replace_block(cfg, **kw):
    return dataclasses.replace(cfg, transformer=dataclasses.replace(cfg.transformer, **kw))


VOCAB = 64
CFG = llama(
    vocab_size=VOCAB,
    max_seq_len=16,
    num_layers=2,
    model_dims=32,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    hidden_dims=48,
)
LLAMA3_8B = llama(
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
LLAMA2_7B = llama(
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
    return TransformerLM(CFG, key=jr.key(0))


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


def test_forward_is_causal_and_untied(model, key):
    ids = jr.randint(key, (2, 10), 0, VOCAB, dtype=jnp.int32)
    logits = _forward(model, ids)
    assert logits.shape == (2, 10, VOCAB) and logits.dtype == jnp.float32
    changed = _forward(model, ids.at[:, 6:].set((ids[:, 6:] + 1) % VOCAB))
    np.testing.assert_allclose(logits[:, :6], changed[:, :6], rtol=1e-5, atol=1e-5)
    assert not np.allclose(logits[:, 6:], changed[:, 6:])
    assert model.unembed is not None and model.unembed.weight.shape == (32, VOCAB)
    assert model.embedding.weight.shape == (VOCAB, 32)
    # Shifting all positions changes nothing (RoPE is relative; no position table).
    shifted = model(ids, positions=_positions(2, 10, offset=5))
    np.testing.assert_allclose(shifted, logits, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(jnp.zeros((1, 17), jnp.int32))


def test_scan_equals_loop_and_remat_keeps_gradients(model, key):
    ids = jr.randint(key, (2, 8), 0, VOCAB, dtype=jnp.int32)
    batch = {"ids": ids, "labels": jnp.roll(ids, -1, axis=1), "weights": jnp.ones((2, 8))}
    loop = TransformerLM(replace_block(CFG, scan_layers=False, remat="full"), key=jr.key(0))
    np.testing.assert_allclose(_forward(loop, ids), _forward(model, ids), rtol=1e-5, atol=1e-5)
    assert loop.stack.layers[1].attention.kv.shape == model.stack.layers.attention.kv.shape[1:]

    def grads(m):
        return jax.jit(jax.grad(lambda m: lm_loss(m, batch)[0]))(m)

    scanned_remat = TransformerLM(replace_block(CFG, remat="dots_saveable"), key=jr.key(0))
    want = grads(model).stack.layers.ffn.up.weight
    np.testing.assert_allclose(grads(scanned_remat).stack.layers.ffn.up.weight, want, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(grads(loop).stack.layers[1].ffn.up.weight, want[1], rtol=1e-4, atol=1e-6)


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
    assert LLAMA3_8B.param_counts()["total"] == 8_030_261_248
    assert LLAMA2_7B.param_counts()["total"] == 6_738_415_616
    # The analytic count is the model's: abstract init (no memory), small and full size.
    for cfg in (CFG, replace_block(CFG, scan_layers=False, num_kv_heads=1), LLAMA3_8B, LLAMA2_7B):
        abstract = eqx.filter_eval_shape(TransformerLM, cfg, key=jr.key(0))
        assert count_params(abstract) == cfg.param_counts()["total"], cfg


def test_flops_match_the_gpt_accounting_when_heads_are_not_grouped():
    for remat in ("none", "full", "dots_saveable"):
        mha = replace_block(LLAMA2_7B, remat=remat)
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
        assert mha.flops_per_token(seq_len=4096) == want
    # GQA only shrinks the key/value projections; 6N + attention stays the training rule.
    got = LLAMA3_8B.flops_per_token(seq_len=8192)
    assert got["qkv_projection"] == 32 * 2 * 4096 * (32 + 16) * 128
    # Matmul weights: all but the input table and the 65 norm scales (the lookup is free).
    matmul_params = LLAMA3_8B.param_counts()["total"] - 128256 * 4096 - 65 * 4096
    assert got["training"] == 6 * matmul_params + 3 * got["attention"]


def test_abstract_params_get_sharding_specs():
    from jax.sharding import AbstractMesh
    from jax.sharding import PartitionSpec as P

    from equipax.core.partition import param_specs

    mesh = AbstractMesh((2, 4, 2), ("data", "fsdp", "tensor"))
    for cfg in (LLAMA3_8B, replace_block(CFG, scan_layers=False, num_kv_heads=1)):
        abstract = eqx.filter_eval_shape(TransformerLM, cfg, key=jr.key(0))
        specs = param_specs(abstract, mesh)  # raises, naming the weight, if one is undeclared
        assert specs.embedding.weight == P("tensor", "fsdp")
        assert specs.unembed.weight == P("fsdp", "tensor")
    layers = param_specs(eqx.filter_eval_shape(TransformerLM, LLAMA3_8B, key=jr.key(0)), mesh).stack.layers
    assert layers.attention.q == P(None, "fsdp", "tensor", None)
    assert layers.attention.kv == P(None, "fsdp", None, "tensor", None)
    assert layers.attention.out == P(None, "tensor", None, "fsdp")
    assert layers.ffn.gate.weight == P(None, "fsdp", "tensor")
    assert layers.ffn.down.weight == P(None, "tensor", "fsdp")
    assert layers.atten_norm.scale == P(None, None)
    # MQA: the single key/value head cannot be split over tensor, so it is replicated.
    unrolled = specs.stack.layers[0]  # pyright: ignore[reportIndexIssue]
    assert unrolled.attention.kv == P("fsdp", None, None, None)
    assert unrolled.attention.q == P("fsdp", "tensor", None)


def test_config_errors_name_the_knob():
    for kw, knob in (
        (dict(num_heads=6, num_kv_heads=4), "num_kv_heads"),
        (dict(head_dim=7), "head_dim"),
        (dict(num_kv_heads=0), "num_kv_heads"),
        (dict(remat="some"), "remat"),
        (dict(norm_eps=0.0), "norm_eps"),
        (dict(sliding_window=0), "sliding_window"),
        (dict(fused_qkv=True), "fused_qkv"),
    ):
        # Literal knobs are caught earlier by the test suite's runtime type checker.
        with pytest.raises((ValueError, TypeCheckError), match=knob):
            replace_block(CFG, **kw)
    for kw, knob in (
        (dict(rope_theta=0.0), "rope_theta"),
        (dict(vocab_size=1), "vocab_size"),
        (dict(dtype="float16"), "dtype"),
        (dict(embedding_init_std=0.0), "embedding_init_std"),
        (dict(embedding_multiplier=-1.0), "embedding_multiplier"),
    ):
        with pytest.raises((ValueError, TypeCheckError), match=knob):
            dataclasses.replace(CFG, **kw)


def test_embedding_init_std_sets_the_residual_streams_initial_scale():
    """The input embedding starts N(0, embedding_init_std^2) (default 1: unit-RMS residual
    stream, as torchtitan's Llama); nothing else in the model depends on the knob."""
    default = TransformerLM(CFG, key=jr.key(0))
    small = TransformerLM(dataclasses.replace(CFG, embedding_init_std=0.02), key=jr.key(0))
    assert float(jnp.std(default.embedding.weight)) == pytest.approx(1.0, rel=0.05)
    np.testing.assert_allclose(small.embedding.weight, 0.02 * default.embedding.weight, rtol=1e-5, atol=1e-7)
    rest = lambda m: jax.tree.leaves(eqx.filter((m.stack, m.final_norm, m.unembed), eqx.is_array))  # noqa: E731
    assert all(bool(jnp.array_equal(a, b)) for a, b in zip(rest(default), rest(small), strict=True))
