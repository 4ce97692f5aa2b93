"""`model.quantization` on the language model (docs/quantization.md): a quantized model learns as the
float one does, its gradients do not depend on the layer layout or the remat policy, LoRA trains
through it, a served model reads int8 weights, and what it cannot run is refused by name."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

from equipax.core.knobs import ConfigError, apply_overrides
from equipax.core.nn import TransformerConfig
from equipax.core.nn.quantization import QuantizedWeight, quantize_weights
from equipax.models import LMConfig, TransformerLM, generate, lm_loss
from equipax.models.decode import decode
from equipax.models.lora import LoRALM

VOCAB, SEQ = 32, 16
CFG = LMConfig(
    vocab_size=VOCAB,
    max_seq_len=SEQ,
    position="rope",
    output_logit_cap=None,
    transformer=TransformerConfig(
        num_layers=2, model_dims=32, num_heads=2, head_dim=16, hidden_dims=64, norm="rmsnorm", gated=True
    ),
)


def _markov_batch(key, batch=16):
    """Each token is 3 x the previous one plus a uniform draw from {0, 1, 2, 3} (mod VOCAB): the best
    possible loss is log 4 = 1.386."""
    k0, k1 = jr.split(key)
    start = jr.randint(k0, (batch, 1), 0, VOCAB)
    noise = jr.randint(k1, (batch, SEQ), 0, 4)

    def step(t, n):
        t = (3 * t + n) % VOCAB
        return t, t

    _, rest = jax.lax.scan(step, start[:, 0], noise.T)
    tokens = jnp.concatenate([start, rest.T], axis=1).astype(jnp.int32)
    return {"ids": tokens[:, :-1], "labels": tokens[:, 1:], "weights": jnp.ones((batch, SEQ), jnp.float32)}


def _train(cfg, steps=150):
    model = TransformerLM(cfg, key=jr.key(0))
    opt = optax.adam(1e-2)
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, state, key):
        loss, grads = eqx.filter_value_and_grad(lambda m: lm_loss(m, _markov_batch(key))[0])(model)
        updates, state = opt.update(grads, state, model)
        return eqx.apply_updates(model, updates), state, loss

    for i in range(steps):
        model, state, _ = step(model, state, jr.key(i + 1))
    eval_loss = float(eqx.filter_jit(lambda m: lm_loss(m, _markov_batch(jr.key(10_000), 64))[0])(model))
    return model, eval_loss


@pytest.fixture(scope="module")
def trained():
    """Eval loss (and model) after the same 150 steps, same seed and batches, per mode (f32 model)."""
    return {q: _train(dataclasses.replace(CFG, quantization=q)) for q in ("none", "int8", "int8w")}


def test_a_quantized_model_learns_as_the_float_one(trained):
    """The same steps from the same seed: the float model's eval loss falls from log 32 = 3.47 to near
    the floor log 4 = 1.386, and int8 (forward and backward) and int8w end within 2% of it."""
    base = trained["none"][1]
    assert base < 1.5, trained
    for q in ("int8", "int8w"):
        assert abs(trained[q][1] - base) < 0.02 * base, {k: v[1] for k, v in trained.items()}


def test_served_int8w_model_decodes_from_int8_weights_as_it_generates(trained):
    """The int8 copy made once (`quantize_weights`): the projections' weights are int8 in the served
    model, its logits are the trained model's to float rounding, and KV-cache decoding gives the
    tokens `generate` gives."""
    model = trained["int8w"][0]
    served = quantize_weights(model)
    int8 = [x for x in jax.tree.leaves(served) if x.dtype == jnp.int8]
    assert len(int8) == 2 + 3  # the stacked qkv and output projections, gate, up and down
    assert served.embedding.weight.dtype == jnp.float32  # embedding (tied output) stays float
    ids = _markov_batch(jr.key(7), 2)["ids"]
    np.testing.assert_allclose(served(ids), model(ids), atol=2e-4)
    prompt = ids[0, :5]
    tokens, _ = decode(served, prompt[None], jnp.array([5]), max_new_tokens=8)
    np.testing.assert_array_equal(tokens[0], generate(served, prompt, 8)[5:])


def test_decode_makes_the_int8_copy_itself(trained):
    """`decode` of the float model with quantization="int8w" computes from the int8 copy: the tokens
    of the served model."""
    model = trained["int8w"][0]
    prompt = _markov_batch(jr.key(8), 3)["ids"][:, :6]
    lengths = jnp.array([6, 4, 2])
    got, _ = decode(model, prompt, lengths, max_new_tokens=6)
    want, _ = decode(quantize_weights(model), prompt, lengths, max_new_tokens=6)
    np.testing.assert_array_equal(got, want)


def _grads(cfg):
    model = TransformerLM(cfg, key=jr.key(3))
    batch = _markov_batch(jr.key(4), 4)
    return eqx.filter_jit(eqx.filter_grad(lambda m: lm_loss(m, batch)[0]))(model)


def _layers(grads):
    """The per-layer gradients stacked on a leading axis (an unrolled stack's blocks stacked)."""
    layers = grads.stack.layers
    if isinstance(layers, tuple):
        layers = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    return layers


@pytest.mark.slow
def test_int8_gradients_do_not_depend_on_the_layer_layout_or_remat():
    """Scanned or unrolled layers and every remat policy that runs on a CPU give the same int8
    gradients (the quantization is recomputed, not approximated, when a policy drops its operands)."""
    q = dataclasses.replace(CFG, quantization="int8")
    base = _layers(_grads(q))
    assert float(jnp.max(jnp.abs(base.attention.qkv))) > 0
    variants = [dataclasses.replace(q.transformer, scan_layers=False)]
    variants += [dataclasses.replace(q.transformer, remat=r) for r in ("full", "dots_saveable", "save_attention_out")]
    for t in variants:
        got = _layers(_grads(dataclasses.replace(q, transformer=t)))
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), got, base)


def _roundings(jaxpr, in_loop=False):
    """(operand shape, inside a scan) of every conversion to int8 in `jaxpr` and the jaxprs it calls."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "convert_element_type" and eqn.params["new_dtype"] == jnp.int8:
            out.append((tuple(eqn.invars[0].aval.shape), in_loop))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
                if isinstance(inner, jax.extend.core.Jaxpr):
                    out += _roundings(inner, in_loop or eqn.primitive.name == "scan")
    return out


def test_int8_training_rounds_each_weight_once_outside_the_layer_loop():
    """A train step of scanned int8 layers rounds every projection weight once, all layers at a
    time, before the scan: the layers' forward and backward passes (and their recomputation under
    remat) read the int8 copy, not the float32 weight (four times the bytes)."""
    batch = _markov_batch(jr.key(4), 3)  # 3 x 16 tokens: no activation has a weight's shape
    for remat in ("none", "full", "dots_saveable"):
        transformer = dataclasses.replace(CFG.transformer, remat=remat)
        model = TransformerLM(dataclasses.replace(CFG, quantization="int8", transformer=transformer), key=jr.key(3))
        # The stacked projection weights [layers, *in, *out] (the norms' scales are [layers, width]).
        weights = [a.shape for a in jax.tree.leaves(eqx.filter(model.stack.layers, eqx.is_array)) if a.ndim >= 3]
        assert len(weights) == 5  # qkv, out, up, gate, down
        jaxpr = jax.make_jaxpr(eqx.filter_grad(lambda m: lm_loss(m, batch)[0]))(model)
        rounded = _roundings(jaxpr.jaxpr)
        per_layer = {w[1:] for w in weights}
        assert not [s for s, in_loop in rounded if in_loop and s in per_layer], (remat, rounded)
        assert sorted(s for s, in_loop in rounded if not in_loop and s in set(weights)) == sorted(weights), rounded


def test_lora_trains_its_adapters_through_int8_projections():
    cfg = dataclasses.replace(CFG, quantization="int8")
    lora = LoRALM(TransformerLM(cfg, key=jr.key(0)), cfg.lora, key=jr.key(1))
    lora = eqx.tree_at(lambda m: [a.b for a in m.adapters.values()], lora, replace_fn=lambda b: b + 0.01)
    batch = _markov_batch(jr.key(2), 4)
    grads = eqx.filter_jit(eqx.filter_grad(lambda m: lm_loss(m, batch)[0]))(lora)
    for adapter in grads.adapters.values():
        assert float(jnp.max(jnp.abs(adapter.a))) > 0 and float(jnp.max(jnp.abs(adapter.b))) > 0


def test_the_embedding_head_and_attention_scores_stay_float():
    """Only the block's projections are int8: one forward of a quantized model has int8 dots for the
    attention's two projections and the MLP's three, and float dots for the scores, the context and
    the logits."""
    cfg = dataclasses.replace(CFG, quantization="int8")
    model = TransformerLM(
        dataclasses.replace(cfg, transformer=dataclasses.replace(cfg.transformer, num_layers=1)), key=jr.key(0)
    )
    text = jax.jit(lambda m, ids: m(ids)).lower(model, _markov_batch(jr.key(1), 2)["ids"]).as_text()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    int8 = [d for d in dots if "xi8>" in d]
    assert len(int8) == 5 and len(dots) == 5 + 3, dots


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["quantization=int4"], "must be one of 'none', 'int8', 'int8w', 'fp8'"),
        (["transformer.num_experts=4", "quantization=int8"], "mixture of experts.*quantization='none'"),
    ],
)
def test_what_cannot_be_quantized_is_refused_when_the_config_is_built(overrides, match):
    with pytest.raises(ConfigError, match=match):
        apply_overrides(CFG, overrides)


def test_fp8_is_refused_on_a_cpu_before_compiling():
    model = TransformerLM(dataclasses.replace(CFG, quantization="fp8"), key=jr.key(0))
    with pytest.raises(ValueError, match="needs a GPU with FP8"):
        jax.eval_shape(model, jnp.zeros((1, 4), jnp.int32))


def test_quantized_weight_is_a_module_of_the_served_tree(trained):
    served = quantize_weights(trained["int8"][0])
    assert isinstance(served.stack.layers.ffn.up.weight, QuantizedWeight)  # pyright: ignore[reportAttributeAccessIssue]
    assert served.stack.layers.ffn.up.weight.scale.shape == (2, 1, 64)  # pyright: ignore[reportAttributeAccessIssue]
