"""Layers, attention kernels, transformer stack and FLOP/parameter counts."""

import contextlib
import dataclasses
import io

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

from equipax.core import flops
from equipax.core.nn import (
    Attention,
    Embedding,
    FeedForward,
    LayerNorm,
    Linear,
    RMSNorm,
    TransformerBlock,
    TransformerConfig,
    TransformerStack,
    dot_product_attention,
    reference_attention,
)
from equipax.core.nn.transformer import stacked_init

TINY = TransformerConfig(num_layers=2, model_dims=16, num_heads=2, head_dim=8, hidden_dims=32, atten_logit_cap=None)


def test_layer_shapes(key):
    ks = jr.split(key, 5)
    x = jr.normal(ks[0], (2, 5, 16))
    lin = Linear(16, 24, use_bias=True, key=ks[1])
    assert lin.weight.shape == (16, 24)
    assert lin(x).shape == (2, 5, 24)
    assert lin(x[0, 0]).shape == (24,)

    emb = Embedding(50, 16, key=ks[2])
    ids = jnp.array([[1, 2, 3], [4, 5, 49]], jnp.int32)
    assert emb(ids).shape == (2, 3, 16)
    np.testing.assert_array_equal(emb(ids)[1, 2], emb.weight[49])
    assert emb.attend(x).shape == (2, 5, 50)
    np.testing.assert_allclose(emb.attend(x), x @ emb.weight.T, rtol=1e-5, atol=1e-5)

    plain = FeedForward(16, 32, activation="relu", gated=False, key=ks[3])
    gated = FeedForward(16, 32, activation="gelu", gated=True, key=ks[3])
    assert plain.gate is None and gated.gate is not None
    for ffn in (plain, gated):
        assert eqx.filter_eval_shape(ffn, x).shape == x.shape

    attn = Attention(16, 2, 8, logit_cap=50.0, use_bias=True, key=ks[4])
    assert attn.qkv is not None and attn.qkv.shape == (16, 3, 2, 8)
    assert attn.out.shape == (2, 8, 16)
    assert eqx.filter_eval_shape(attn, x)[0].shape == x.shape
    gqa = Attention(16, 4, 8, num_kv_heads=1, fused_qkv=False, key=ks[4])  # multi-query
    assert gqa.q is not None and gqa.kv is not None and gqa.qkv is None
    assert (gqa.q.shape, gqa.kv.shape) == ((16, 4, 8), (16, 2, 1, 8))
    assert eqx.filter_eval_shape(gqa, x)[0].shape == x.shape


def test_gated_ffn_matches_formula(key):
    k1, k2 = jr.split(key)
    x = jr.normal(k1, (2, 3, 8))
    ffn = FeedForward(8, 12, activation="silu", gated=True, key=k2)
    assert ffn.gate is not None
    want = (jax.nn.silu(x @ ffn.gate.weight) * (x @ ffn.up.weight)) @ ffn.down.weight
    np.testing.assert_allclose(ffn(x), want, rtol=1e-5, atol=1e-5)


def test_linear_init_is_fan_in_scaled(key):
    lin = Linear(1024, 256, key=key)
    std = float(jnp.std(lin.weight))
    assert abs(std - 1024**-0.5) < 0.1 * 1024**-0.5


def _np_layernorm(x, scale, bias, eps):
    x = np.asarray(x, np.float64)
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * scale + bias


def test_layernorm_matches_numpy(key):
    k1, k2, k3 = jr.split(key, 3)
    # An offset mean checks the one-pass variance is still accurate in float32.
    x = 3.0 + 2.0 * jr.normal(k1, (2, 7, 32))
    ln = LayerNorm(32, use_bias=True)
    ln = eqx.tree_at(lambda m: (m.scale, m.bias), ln, (jr.normal(k2, (32,)), jr.normal(k3, (32,))))
    assert ln.bias is not None
    want = _np_layernorm(x, np.asarray(ln.scale), np.asarray(ln.bias), ln.eps)
    np.testing.assert_allclose(ln(x), want, rtol=1e-4, atol=1e-4)
    # bf16 inputs come back as bf16, stats still in f32.
    assert ln(x.astype(jnp.bfloat16)).dtype == jnp.bfloat16
    assert LayerNorm(32).bias is None


def test_rmsnorm_matches_numpy(key):
    k1, k2 = jr.split(key)
    x = jr.normal(k1, (3, 4, 16))
    rms = eqx.tree_at(lambda m: m.scale, RMSNorm(16), jr.normal(k2, (16,)))
    xn = np.asarray(x, np.float64)
    want = xn / np.sqrt((xn**2).mean(-1, keepdims=True) + rms.eps) * np.asarray(rms.scale)
    np.testing.assert_allclose(rms(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("logit_cap", [None, 5.0])
def test_fast_attention_matches_reference(key, causal, logit_cap):
    kq, kk, kv = jr.split(key, 3)
    shape = (2, 9, 3, 8)
    q, k, v = (3.0 * jr.normal(kk_, shape) for kk_ in (kq, kk, kv))
    ref = reference_attention(q, k, v, causal=causal, logit_cap=logit_cap)
    fast = dot_product_attention(q, k, v, causal=causal, logit_cap=logit_cap)
    np.testing.assert_allclose(fast, ref, rtol=1e-5, atol=1e-5)

    def loss(fn, q, k, v):
        return jnp.sum(jnp.sin(fn(q, k, v, causal=causal, logit_cap=logit_cap)))

    g_ref = jax.jit(jax.grad(lambda *a: loss(reference_attention, *a), argnums=(0, 1, 2)))(q, k, v)
    g_fast = jax.jit(jax.grad(lambda *a: loss(dot_product_attention, *a), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(g_fast, g_ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_reference_attention_matches_numpy(key):
    kq, kk, kv = jr.split(key, 3)
    q, k, v = (jr.normal(x, (1, 4, 1, 2)) for x in (kq, kk, kv))
    qn, kn, vn = (np.asarray(t, np.float64)[0, :, 0] for t in (q, k, v))
    logits = qn @ kn.T / np.sqrt(2)
    logits = 2.0 * np.tanh(logits / 2.0)
    logits = np.where(np.tril(np.ones((4, 4), bool)), logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ vn
    got = reference_attention(q, k, v, causal=True, logit_cap=2.0)[0, :, 0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fn", [reference_attention, dot_product_attention])
def test_causal_mask_blocks_the_future(key, fn):
    kq, kk, kv, kn = jr.split(key, 4)
    q, k, v = (jr.normal(x, (1, 8, 2, 4)) for x in (kq, kk, kv))
    out = fn(q, k, v, causal=True)
    # Change keys/values at positions >= 5: outputs before 5 must not move.
    noise = jr.normal(kn, (1, 3, 2, 4))
    k2 = k.at[:, 5:].add(noise)
    v2 = v.at[:, 5:].add(noise)
    out2 = fn(q, k2, v2, causal=True)
    np.testing.assert_array_equal(out[:, :5], out2[:, :5])
    assert not np.allclose(out[:, 5:], out2[:, 5:])
    # Without the mask, the past does see the change.
    assert not np.allclose(fn(q, k, v, causal=False)[:, :5], fn(q, k2, v2, causal=False)[:, :5])


def test_self_attention_is_causal(key):
    k1, k2, k3 = jr.split(key, 3)
    layer = Attention(16, 2, 8, logit_cap=50.0, key=k1)
    attn = eqx.filter_jit(lambda x: layer(x)[0])
    x = jr.normal(k2, (2, 6, 16))
    x2 = x.at[:, 4:].set(jr.normal(k3, (2, 2, 16)))
    np.testing.assert_allclose(attn(x)[:, :4], attn(x2)[:, :4], rtol=1e-6, atol=1e-6)
    assert not np.allclose(attn(x)[:, 4:], attn(x2)[:, 4:])


def _stack_blocks(blocks):
    """Unrolled blocks -> one block with leaves stacked on a leading layer axis."""
    params = [eqx.filter(b, eqx.is_array) for b in blocks]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *params)
    return eqx.combine(stacked, eqx.filter(blocks[0], eqx.is_array, inverse=True))


def test_scanned_and_unrolled_init_agree(key, trees_close):
    scanned = TransformerStack(TINY, key=key)
    unrolled = TransformerStack(dataclasses.replace(TINY, scan_layers=False), key=key)
    assert isinstance(scanned.layers, TransformerBlock)
    assert isinstance(unrolled.layers, tuple) and len(unrolled.layers) == TINY.num_layers
    assert scanned.layers.attention.qkv.shape == (2, 16, 3, 2, 8)
    trees_close(scanned.layers, _stack_blocks(unrolled.layers), rtol=1e-6, atol=1e-7)
    # Different layers get different parameters.
    first, second = unrolled.layers
    assert not np.allclose(first.attention.qkv, second.attention.qkv)


def _eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _eqns(sub)


def test_stacked_init_draws_one_layer_at_a_time_with_the_batched_inits_numbers(key):
    """A scanned stack is initialised by a map over its layers' keys (`stacked_init`): the numbers
    of the batched init (`eqx.filter_vmap`), bit for bit, eager and compiled, while every random
    draw in the program is one layer's (a batched draw over all layers compiled ~3x slower for
    XLA:TPU and held a layer-stack of temporaries: benchmarks/README.md, "Start-up")."""

    def make(k):
        return TransformerBlock(TINY, key=k)

    keys = jr.split(key, 3)
    want = jax.tree.leaves(eqx.filter(eqx.filter_vmap(make)(keys), eqx.is_array))
    for build in (stacked_init, eqx.filter_jit(stacked_init)):
        got = jax.tree.leaves(eqx.filter(build(make, keys), eqx.is_array))
        assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))
    jaxpr = jax.make_jaxpr(lambda k: eqx.filter(TransformerStack(TINY, key=k), eqx.is_array))(key)
    draws = [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "random_bits"]
    assert draws and all(e.invars[0].aval.shape == () for e in draws), [e.invars[0].aval for e in draws]


def _loss_and_out(stack, x):
    y = stack(x)  # one forward: its output is both the loss's input and the aux
    return jnp.sum(jnp.square(y)), y


_grad_and_out = eqx.filter_jit(eqx.filter_grad(_loss_and_out, has_aux=True))


@pytest.mark.slow
def test_scan_equals_unrolled_with_remat(key, trees_close):
    k_model, k_x = jr.split(key)
    cfg = dataclasses.replace(TINY, gated=True, activation="silu", atten_logit_cap=20.0, use_bias=True)
    unrolled = TransformerStack(dataclasses.replace(cfg, scan_layers=False), key=k_model)
    assert isinstance(unrolled.layers, tuple)
    # Perturb the zero/one-initialised biases and scales so the check covers them too.
    leaves, treedef = jax.tree.flatten(unrolled)
    leaves = [x + 0.1 * jr.normal(jr.fold_in(k_x, i), x.shape) for i, x in enumerate(leaves)]
    unrolled = jax.tree.unflatten(treedef, leaves)
    stacked = _stack_blocks(unrolled.layers)
    x = jr.normal(k_x, (2, 5, 16))
    g_ref, y_ref = _grad_and_out(unrolled, x)

    cases = [
        (True, r) for r in ("none", "full", "dots_saveable", "dots_with_context", "save_attention_out", "save_context")
    ]
    cases += [(False, "full")]
    for scan, remat in cases:
        c = dataclasses.replace(cfg, remat=remat, scan_layers=scan)
        layers = stacked if scan else unrolled.layers
        # The stack of this config around the same layers: built abstractly (its own random layers,
        # replaced at once, are never computed: 1-1.4 s of eager init each).
        stack = eqx.tree_at(lambda s: s.layers, eqx.filter_eval_shape(TransformerStack, c, key=k_model), layers)
        # The policy is really applied: a remat region appears in the traced program.
        jaxpr = str(jax.make_jaxpr(lambda s, x: s(x))(stack, x))
        assert ("checkpoint" in jaxpr or "remat" in jaxpr) == (remat != "none"), (scan, remat)
        g, y = _grad_and_out(stack, x)
        np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
        g_layers = g.layers if scan else _stack_blocks(g.layers)
        trees_close(g_layers, _stack_blocks(g_ref.layers), rtol=1e-4, atol=1e-4)


def _saved(remat, x):
    """What the backward pass keeps from the forward under `remat` (`jax.ad_checkpoint.saved_residuals`),
    traced on the parameters' shapes (what it prints is the same as for computed ones)."""
    stack = eqx.filter_eval_shape(
        TransformerStack, dataclasses.replace(TINY, scan_layers=False, remat=remat), key=jr.key(0)
    )
    params, static = eqx.partition(stack, lambda leaf: isinstance(leaf, jax.ShapeDtypeStruct))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(lambda p: eqx.combine(p, static)(x)[0].sum(), params)
    return out.getvalue().splitlines()


def test_remat_policies_save_what_they_name():
    x = jr.normal(jr.key(1), (2, 5, 16))
    named = [n for n in _saved("save_attention_out", x) if "named" in n]
    # Per layer: the attention context and the residual stream entering the MLP, nothing else named.
    assert sum("attention_out" in n for n in named) == sum("mlp_in" in n for n in named) == TINY.num_layers
    # save_context: the context alone, once per layer.
    named = [n for n in _saved("save_context", x) if "named" in n]
    assert sum("attention_out" in n for n in named) == len(named) == TINY.num_layers
    # dots_with_context: dots_saveable's residuals and the context, once per layer.
    dots = _saved("dots_saveable", x)
    with_context = _saved("dots_with_context", x)
    assert not any("attention_out" in n for n in dots)
    assert sum("attention_out" in n for n in with_context) == TINY.num_layers
    assert len(with_context) == len(dots) + TINY.num_layers
    counts = {r: len(_saved(r, x)) for r in ("none", "dots_saveable", "save_attention_out", "save_context", "full")}
    assert list(counts.values()) == sorted(set(counts.values()), reverse=True), counts  # fewer down the list
    with pytest.raises(ValueError, match="'auto' is chosen by compiling"):
        _saved("auto", x)


def test_transformer_config_validation():
    with pytest.raises(ValueError, match="num_layers"):
        TransformerConfig(num_layers=0)
    with pytest.raises(ValueError, match="head_dim"):
        TransformerConfig(head_dim=-1)
    with pytest.raises(ValueError, match="atten_logit_cap"):
        TransformerConfig(atten_logit_cap=0.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        TransformerConfig().num_layers = 2  # type: ignore[misc]


def test_flops_per_token():
    cfg = TransformerConfig(num_layers=2, model_dims=8, num_heads=2, head_dim=4, hidden_dims=16, gated=False)
    f = flops.transformer_lm_flops_per_token(cfg, vocab_size=10, seq_len=6)
    assert f["qkv_projection"] == 2 * (2 * 8 * 3 * 2 * 4)
    assert f["output_projection"] == 2 * (2 * 2 * 4 * 8)
    assert f["mlp"] == 2 * (2 * 8 * 16 * 2)
    assert f["attention"] == 2 * (2 * 6 * 2 * 4)  # 4 * seq * h * hd, halved by causality
    assert f["unembedding"] == 2 * 8 * 10
    assert f["training"] == 3 * f["forward"]
    assert f["remat"] == 0 and f["training_with_remat"] == f["training"]

    gated = flops.transformer_lm_flops_per_token(dataclasses.replace(cfg, gated=True), vocab_size=10, seq_len=6)
    assert gated["mlp"] == 1.5 * f["mlp"]

    full = flops.transformer_lm_flops_per_token(dataclasses.replace(cfg, remat="full"), vocab_size=10, seq_len=6)
    assert full["training"] == f["training"]  # remat is not model FLOPs
    assert full["remat"] == f["forward"] - f["unembedding"]
    dots = flops.transformer_lm_flops_per_token(
        dataclasses.replace(cfg, remat="dots_saveable"), vocab_size=10, seq_len=6
    )
    assert 0 < dots["remat"] < full["remat"]
    # The policy saving the attention context and the MLP input recomputes the QKV projection,
    # the scores (half the attention einsums) and the MLP's input matrix (1 of its 2).
    saved = flops.transformer_lm_flops_per_token(
        dataclasses.replace(cfg, remat="save_attention_out"), vocab_size=10, seq_len=6
    )
    assert saved["remat"] == f["qkv_projection"] + f["attention"] / 2 + f["mlp"] / 2
    assert dots["remat"] < saved["remat"] < full["remat"]
    # The context alone: the output projection too (the MLP's input is recomputed from it).
    context = flops.transformer_lm_flops_per_token(
        dataclasses.replace(cfg, remat="save_context"), vocab_size=10, seq_len=6
    )
    assert context["remat"] == saved["remat"] + f["output_projection"] < full["remat"]
    # Splash keeps its log-sum-exp with the context and computes the scores in its backward
    # kernel: nothing of the attention is recomputed under the policies that keep the context.
    # The projections and the context: only the scores (half the attention einsums) run again.
    with_context = flops.transformer_lm_flops_per_token(
        dataclasses.replace(cfg, remat="dots_with_context"), vocab_size=10, seq_len=6
    )
    assert with_context["remat"] == f["attention"] / 2 < dots["remat"]
    for remat, base in (("save_attention_out", saved), ("save_context", context), ("dots_with_context", with_context)):
        splash = dataclasses.replace(cfg, remat=remat, attention_impl="splash")
        got = flops.transformer_lm_flops_per_token(splash, vocab_size=10, seq_len=6)["remat"]
        assert got == base["remat"] - f["attention"] / 2

    # Without attention and unembedding, forward FLOPs are 2 x (matmul params).
    counts = flops.lm_param_counts(cfg, 10)
    matmul_params = cfg.num_layers * (8 * 3 * 2 * 4 + 2 * 4 * 8 + 2 * 8 * 16)
    assert f["forward"] - f["attention"] - f["unembedding"] == 2 * matmul_params
    assert counts["per_layer"] * cfg.num_layers > matmul_params


@pytest.mark.parametrize("overrides", [{}, {"gated": True, "use_bias": True}, {"norm": "rmsnorm", "use_bias": True}])
def test_param_counts_match_built_stack(key, overrides):
    cfg = dataclasses.replace(TINY, **overrides)
    counts = flops.lm_param_counts(cfg, vocab_size=37)
    # Abstract construction (no compile, no allocation) is enough to count.
    stack = eqx.filter_eval_shape(TransformerStack, cfg, key=key)
    assert flops.count_params(stack) == cfg.num_layers * counts["per_layer"]
    emb = eqx.filter_eval_shape(Embedding, 37, cfg.model_dims, key=key)
    assert flops.count_params(emb) == counts["embedding"]
    assert counts["total"] == (counts["embedding"] + cfg.num_layers * counts["per_layer"] + counts["final_norm"])
    # Static fields and integer arrays are not parameters.
    assert flops.count_params({"a": jnp.ones((3,), jnp.int32), "b": jnp.ones((2, 2))}) == 4


def test_the_remat_knobs_type_names_the_policies_in_their_order():
    """`TransformerConfig.remat`'s Literal repeats REMAT_POLICIES (a type needs the literal names):
    the two stay one list, "auto" after it."""
    import typing

    from equipax.core.configs import REMAT_POLICIES

    assert typing.get_args(typing.get_type_hints(TransformerConfig)["remat"]) == (*REMAT_POLICIES, "auto")
