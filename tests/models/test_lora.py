"""LoRA on the one stack: merged == base + scale * A @ B (numpy), a frozen base stays bit-identical
with no optimizer state, the merged model computes the adapter model's loss, bad targets."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from equipax.core.nn import TransformerConfig
from equipax.core.step import init_train_state, make_train_step
from equipax.core.task import trainable
from equipax.models import LMConfig, LMTask, LoRAConfig, LoRALM, TransformerLM, lm_loss

GQA = LMConfig(
    vocab_size=64,
    max_seq_len=16,
    position="rope",
    tie_embeddings=False,
    embedding_multiplier=None,
    output_logit_cap=None,
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
        fused_qkv=False,
        scan_layers=True,
    ),
)
ALL = LoRAConfig(enabled=True, rank=3, alpha=6.0, targets=("q", "k", "v", "o", "gate", "up", "down"))


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 64, (2, 17)).astype(np.int32)
    return {"ids": tokens[:, :-1], "labels": tokens[:, 1:], "weights": np.ones((2, 16), np.float32)}


def _trained_adapters(model: LoRALM, key) -> LoRALM:
    """Random B (zeros at init would make every delta vanish)."""
    names = sorted(model.adapters)
    keys = jax.random.split(key, len(names))
    return eqx.tree_at(
        lambda m: [m.adapters[n].b for n in names],
        model,
        [jax.random.normal(k, model.adapters[n].b.shape) for n, k in zip(names, keys)],
    )


@pytest.mark.parametrize("fused", [False, True], ids=["q_kv", "qkv"])
def test_merged_weights_are_base_plus_scaled_a_b(fused):
    cfg = (
        GQA
        if not fused
        else dataclasses.replace(
            GQA, transformer=dataclasses.replace(GQA.transformer, num_kv_heads=None, fused_qkv=True)
        )
    )
    base = TransformerLM(cfg, key=jax.random.key(0))
    lora = _trained_adapters(LoRALM(base, ALL, key=jax.random.key(1)), jax.random.key(2))
    merged = lora.merged()
    att, ffn = base.stack.layers.attention, base.stack.layers.ffn
    m_att, m_ffn = merged.stack.layers.attention, merged.stack.layers.ffn
    ad = lora.adapters
    scale = ALL.alpha / ALL.rank

    def delta(name):  # numpy, layer by layer
        a, b = np.asarray(ad[f"stack.layers.{name}"].a), np.asarray(ad[f"stack.layers.{name}"].b)
        out = []
        for layer in range(a.shape[0]):
            ins, outs = a.shape[1:-1], b.shape[2:]
            out.append(
                scale * (a[layer].reshape(-1, a.shape[-1]) @ b[layer].reshape(b.shape[1], -1)).reshape(*ins, *outs)
            )
        return np.stack(out)

    if fused:
        want = np.asarray(att.qkv).copy()
        for i, t in enumerate("qkv"):
            want[:, :, i] += delta(f"attention.{t}")
        np.testing.assert_allclose(np.asarray(m_att.qkv), want, rtol=1e-6, atol=1e-6)
    else:
        np.testing.assert_allclose(np.asarray(m_att.q), np.asarray(att.q) + delta("attention.q"), rtol=1e-6, atol=1e-6)
        kv = np.asarray(att.kv).copy()
        kv[:, :, 0] += delta("attention.k")
        kv[:, :, 1] += delta("attention.v")
        np.testing.assert_allclose(np.asarray(m_att.kv), kv, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(m_att.out), np.asarray(att.out) + delta("attention.o"), rtol=1e-6, atol=1e-6)
    for t in ("gate", "up", "down"):
        got, base_w = getattr(m_ffn, t).weight, getattr(ffn, t).weight
        np.testing.assert_allclose(np.asarray(got), np.asarray(base_w) + delta(f"ffn.{t}"), rtol=1e-6, atol=1e-6)
    # The embedding and norms are the base's; the adapter model computes the merged model's logits.
    assert merged.embedding.weight is base.embedding.weight
    ids = jnp.asarray(_batch()["ids"])
    np.testing.assert_array_equal(np.asarray(lora(ids)), np.asarray(merged(ids)))


def test_fresh_adapters_compute_the_base_model():
    base = TransformerLM(GQA, key=jax.random.key(0))
    lora = LoRALM(base, ALL, key=jax.random.key(1))
    ids = jnp.asarray(_batch()["ids"])
    np.testing.assert_array_equal(np.asarray(lora(ids)), np.asarray(base(ids)))


def test_training_moves_only_the_adapters():
    cfg = dataclasses.replace(GQA, lora=LoRAConfig(enabled=True, rank=2, targets=("q", "v")))
    task = LMTask(cfg, 16)
    model, _ = task.init(jax.random.key(0))
    assert isinstance(model, LoRALM) and set(model.adapters) == {"stack.layers.attention.q", "stack.layers.attention.v"}
    base_before = jax.tree.map(np.asarray, model.base)
    optimizer = optax.adamw(1e-2)
    state = init_train_state(model, optimizer)
    # Optimizer state only for the adapters: Adam's two moments of A and B, nothing of the base.
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    adapter_sizes = sorted(x.size for x in jax.tree.leaves(model.adapters))
    assert sorted(x.size for x in moments) == sorted(adapter_sizes * 2)
    step = make_train_step(task, optimizer, optax.constant_schedule(1e-2))
    losses = []
    for i in range(5):
        state, metrics = step(state, _batch(i % 2), jax.random.key(3))
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]
    for before, after in zip(jax.tree.leaves(base_before), jax.tree.leaves(state.model.base)):
        np.testing.assert_array_equal(before, np.asarray(after))  # bit-identical
    assert float(jnp.abs(state.model.adapters["stack.layers.attention.q"].b).max()) > 0
    # The merged model's loss is the adapter model's.
    batch = {k: jnp.asarray(v) for k, v in _batch().items()}
    np.testing.assert_allclose(
        float(lm_loss(state.model.merged(), batch)[0]), float(lm_loss(state.model, batch)[0]), rtol=1e-6
    )
    # Without LoRA every inexact array trains (the default of `trainable`).
    plain = TransformerLM(GQA, key=jax.random.key(0))
    assert all(jax.tree.leaves(trainable(plain)))


def test_bad_lora_configs():
    with pytest.raises(ValueError, match="model.lora.rank must be a positive int; got 0"):
        LoRAConfig(enabled=True, rank=0)
    with pytest.raises(ValueError, match="names no projection.*choose among q, k, v, o, gate, up, down"):
        LoRAConfig(enabled=True, targets=("q_proj",))
    gelu = dataclasses.replace(GQA, transformer=dataclasses.replace(GQA.transformer, gated=False, activation="gelu"))
    with pytest.raises(
        ValueError, match="names 'gate', which this model does not have; its projections are q, k, v, o, up, down"
    ):
        LoRALM(
            TransformerLM(gelu, key=jax.random.key(0)),
            LoRAConfig(enabled=True, targets=("gate",)),
            key=jax.random.key(1),
        )
    with pytest.raises(ValueError, match="names 'gate'.*model.transformer.gated=False"):
        dataclasses.replace(gelu, lora=LoRAConfig(enabled=True, targets=("gate",)))
