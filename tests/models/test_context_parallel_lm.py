"""Context parallelism through the whole model: an LM's loss and every gradient over a `context`
axis of 4 (x data 2) equal one device's, for each family (Pax's GPT, Llama, Qwen3, Mistral with its
sliding window, a mixture of experts), on packed documents crossing the shards, ring attention
with the zigzag layout (and all-gather, and the contiguous layout, for Llama). One 8-device child
process, one-layer models. A mutation (the batch reordered but the masks left in slot order) moves
the loss. And the knob errors, at config time, naming the knob (the CLI's exit 2:
tests/launch/test_context_experiments.py).
"""

import json

import pytest

from helpers.multidevice import run_with_devices

CHILD = r"""
import dataclasses, json
import equinox as eqx, jax, jax.numpy as jnp, numpy as np
from equipax.core.mesh import CONTEXT_AXES, MeshConfig, build_mesh
from equipax.core.nn import TransformerConfig
from equipax.core.partition import named, param_specs
from equipax.models import LMConfig, TransformerLM, lm_loss

S, V = 32, 64
def decoder_lm(tie_embeddings=False, **block):
    # The Llama-style families' shared choices (the launch package's decoder presets).
    return LMConfig(vocab_size=V, max_seq_len=S, position="rope", rope_theta=1e4, output_logit_cap=None,
                    embedding_multiplier=None, tie_embeddings=tie_embeddings, transformer=TransformerConfig(
                        num_layers=1, model_dims=16, num_heads=4, num_kv_heads=2, head_dim=8, hidden_dims=32,
                        activation="silu", gated=True, norm="rmsnorm", norm_eps=1e-5, fused_qkv=False,
                        atten_logit_cap=None, **block))

FAMILIES = {
    "gpt": LMConfig(vocab_size=V, max_seq_len=S, transformer=TransformerConfig(
        num_layers=1, model_dims=16, num_heads=4, head_dim=8, hidden_dims=32)),
    "llama": decoder_lm(),
    "qwen3": decoder_lm(qk_norm=True, tie_embeddings=True),
    "mistral": decoder_lm(sliding_window=6),
}
FAMILIES["moe"] = dataclasses.replace(FAMILIES["llama"], transformer=dataclasses.replace(
    FAMILIES["llama"].transformer, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16))

rng = np.random.default_rng(0)
def docs(lengths):
    seg = np.repeat(np.arange(1, len(lengths) + 1), lengths)
    pos = np.concatenate([np.arange(n) for n in lengths])
    return seg, pos
segs, poss = zip(docs([5, 13, 3, 11]), docs([1, 18, 13]))
ids = rng.integers(0, V, (2, S + 1)).astype(np.int32)
batch = {"ids": ids[:, :-1], "labels": ids[:, 1:], "weights": (rng.random((2, S)) > 0.2).astype(np.float32),
         "segment_ids": np.stack(segs).astype(np.int32), "positions": np.stack(poss).astype(np.int32)}

def run(cfg, mesh):
    model = TransformerLM(cfg, key=jax.random.key(0))
    if mesh is not None:
        model = eqx.filter_shard(model, named(param_specs(model, mesh), mesh))
    fn = eqx.filter_jit(eqx.filter_value_and_grad(lambda m: lm_loss(m, batch, mesh=mesh)[0]))
    loss, grads = fn(model)
    leaves = jax.tree_util.tree_leaves_with_path(eqx.filter(grads, eqx.is_array))
    return float(loss), {jax.tree_util.keystr(p): np.asarray(g) for p, g in leaves}

mesh = build_mesh(MeshConfig(ici_mesh_shape=(2, 1, 4, 1), dcn_mesh_shape=(1, 1, 1, 1), axis_names=CONTEXT_AXES))
CASES = [(f, "ring", True) for f in FAMILIES] + [("llama", "all_gather", True), ("llama", "ring", False)]
out = {}
refs = {}
for family, strategy, balance in CASES:
    base = FAMILIES[family]
    if family not in refs:
        refs[family] = run(base, None)
    cfg = dataclasses.replace(base, transformer=dataclasses.replace(
        base.transformer, context_parallel_strategy=strategy, context_parallel_load_balance=balance))
    loss, grads = run(cfg, mesh)
    ref_loss, ref_grads = refs[family]
    out[f"{family}-{strategy}-{'zigzag' if balance else 'contiguous'}"] = {
        "loss": [loss, ref_loss],
        "grad_err": max(float(np.max(np.abs(g - ref_grads[k]))) for k, g in grads.items()),
        "grad_scale": max(float(np.max(np.abs(g))) for g in ref_grads.values())}
# Mutation: the batch reordered but the masks left in slot order (no sequence_index).
from equipax.models import lm as lm_module
original = lm_module.zigzag_batch
def slot_order(batch, n):
    reordered, index = original(batch, n)
    return reordered, jnp.broadcast_to(jnp.arange(index.shape[1], dtype=jnp.int32), index.shape)
lm_module.zigzag_batch = slot_order
cfg = dataclasses.replace(FAMILIES["llama"], transformer=dataclasses.replace(
    FAMILIES["llama"].transformer, context_parallel_strategy="ring"))
out["mutant-slot-order-masks"] = {"loss": [run(cfg, mesh)[0], refs["llama"][0]]}
lm_module.zigzag_batch = original
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def results():
    out = run_with_devices(CHILD, timeout=600, xla_flags="--xla_backend_optimization_level=0")
    return json.loads(out.splitlines()[-1])


@pytest.mark.slow
def test_context_parallel_lm_equals_one_device(results):
    mutant = results.pop("mutant-slot-order-masks")
    assert sorted(results) == sorted(
        [f"{f}-ring-zigzag" for f in ("gpt", "llama", "qwen3", "mistral", "moe")]
        + ["llama-all_gather-zigzag", "llama-ring-contiguous"]
    )
    for name, r in results.items():
        got, want = r["loss"]
        assert got == pytest.approx(want, rel=1e-5), name
        assert r["grad_err"] <= 1e-5 * max(r["grad_scale"], 1.0), name
    got, want = mutant["loss"]
    assert abs(got - want) > 1e-3  # the parity check can fail


def _lm(**transformer):
    from equipax.core.nn import TransformerConfig
    from equipax.models import LMConfig

    dims = dict(num_layers=1, model_dims=16, num_heads=4, head_dim=8, hidden_dims=32)
    block = TransformerConfig(**(dims | transformer))
    return LMConfig(vocab_size=64, max_seq_len=64, transformer=block)


def _context_mesh(cp):
    from equipax.core.mesh import CONTEXT_AXES, MeshConfig

    return MeshConfig(ici_mesh_shape=(1, 1, cp, 1), dcn_mesh_shape=(1, 1, 1, 1), axis_names=CONTEXT_AXES)


@pytest.mark.parametrize(
    "transformer, seq_len, match",
    [
        ({}, 36, r"data.seq_len=36 cannot be split .* zigzag layout .* multiple of 8"),
        ({"context_parallel_load_balance": False}, 34, r"data.seq_len=34 .* multiple of 4"),
        ({"attention": "linear", "atten_logit_cap": None}, 32, r"attention='linear'.* no context-parallel kernel"),
        (
            {"attention_impl": "splash", "context_parallel_strategy": "ring", "context_parallel_load_balance": False},
            256,
            r"attention_impl='splash'.*chunks of 64 positions.*multiple of 512",
        ),
        ({"attention_impl": "splash"}, 512, r"attention_impl='splash'.*chunks of 64 positions.*multiple of 1024"),
        ({"attention_impl": "cudnn", "atten_logit_cap": None}, 32, r"attention_impl='cudnn'.*cannot take another"),
    ],
)
def test_context_knob_errors(transformer, seq_len, match):
    from equipax.core.knobs import ConfigError

    lm = _lm(**transformer)
    lm.check_mesh(_context_mesh(1), 2, seq_len)  # no context axis: nothing to refuse
    with pytest.raises(ConfigError, match=match):
        lm.check_mesh(_context_mesh(4), 2, seq_len)


def test_context_strategy_must_be_known():
    from equipax.core.knobs import ConfigError, apply_overrides

    with pytest.raises(ConfigError, match=r"must be one of 'all_gather', 'ring'"):
        apply_overrides(_lm(), ["transformer.context_parallel_strategy=ulysses"])


def test_zigzag_batch_keeps_each_token_with_its_label():
    import jax.numpy as jnp
    import numpy as np

    from equipax.core.nn.context_parallel import zigzag_batch

    ids = jnp.arange(16, dtype=jnp.int32).reshape(1, 16)
    batch, index = zigzag_batch({"ids": ids, "labels": ids + 1, "weights": jnp.ones((1, 16))}, 4)
    np.testing.assert_array_equal(np.asarray(batch["labels"]), np.asarray(batch["ids"]) + 1)
    np.testing.assert_array_equal(np.asarray(index), np.asarray(batch["ids"]))  # ids were 0..15
    np.testing.assert_array_equal(np.asarray(batch["positions"]), np.asarray(index))
