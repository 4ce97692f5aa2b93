"""The LM head's loss (`equipax.models.cross_entropy`, through `lm_losses`) against the obvious loss:
log-softmax of the model's float32 logits, the label's log-probability, argmax accuracy,
`logsumexp**2` z-loss. Values and every gradient agree for the whole head at once and for the
vocabulary in chunks (`model.num_vocab_tiling`): tied and untied heads, a logit cap, the z-loss,
zero weights and packed documents, a mixture of experts' router losses, LoRA, and on a sharded
mesh (vocabulary over `tensor`, context-parallel zigzag). The form XLA:TPU fuses agrees with the
CPU's. Bad tiling is a config error naming the knob.
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from equipax.core.losses import aggregate_losses
from equipax.core.nn import TransformerConfig
from equipax.core.nn.moe_metrics import moe_loss_and_metrics
from equipax.models import LMConfig, LoRAConfig, LoRALM, TransformerLM
from equipax.models.cross_entropy import head_stats, pick_label, soft_cap
from equipax.models.lm import lm_losses

V, S = 64, 16
GPT = LMConfig(  # tied, capped (a small cap, so the tanh bends), z-loss
    vocab_size=V,
    max_seq_len=S,
    output_logit_cap=2.0,
    z_loss_coef=1e-2,
    transformer=TransformerConfig(num_layers=1, model_dims=16, num_heads=2, head_dim=8, hidden_dims=32),
)
LLAMA = LMConfig(  # untied, uncapped
    vocab_size=V,
    max_seq_len=S,
    position="rope",
    output_logit_cap=None,
    tie_embeddings=False,
    embedding_multiplier=None,
    transformer=TransformerConfig(
        num_layers=1,
        model_dims=16,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        hidden_dims=32,
        activation="silu",
        gated=True,
        norm="rmsnorm",
        fused_qkv=False,
    ),
)
QWEN = dataclasses.replace(  # tied, QK-norm, z-loss
    LLAMA, tie_embeddings=True, z_loss_coef=1e-3, transformer=dataclasses.replace(LLAMA.transformer, qk_norm=True)
)
MOE = dataclasses.replace(
    LLAMA,
    transformer=dataclasses.replace(LLAMA.transformer, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
)


def _batch(seed: int = 0) -> dict[str, np.ndarray]:
    """Two rows of packed documents, a fifth of the positions weighted 0."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, V, (2, S + 1)).astype(np.int32)
    lengths = ([5, 7, 4], [9, 7])
    seg = np.stack([np.repeat(np.arange(1, len(n) + 1), n) for n in lengths]).astype(np.int32)
    pos = np.stack([np.concatenate([np.arange(k) for k in n]) for n in lengths]).astype(np.int32)
    weights = (rng.random((2, S)) > 0.2).astype(np.float32)
    return {"ids": ids[:, :-1], "labels": ids[:, 1:], "weights": weights, "segment_ids": seg, "positions": pos}


def obvious_losses(model, batch) -> dict[str, jax.Array]:
    """The loss as written in a textbook, from the model's float32 logits."""
    logits, moe = model.forward(batch["ids"], segment_ids=batch["segment_ids"], positions=batch["positions"])
    labels, w = jnp.asarray(batch["labels"]), jnp.asarray(batch["weights"])
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], axis=-1)[..., 0]
    lse = jax.nn.logsumexp(logits, axis=-1)
    out = {
        "cross_entropy": jnp.sum(nll * w) / jnp.sum(w),
        "z_loss": jnp.sum(jnp.square(lse) * w) / jnp.sum(w),
        "accuracy": jnp.sum((jnp.argmax(logits, axis=-1) == labels) * w) / jnp.sum(w),
    }
    total = out["cross_entropy"] + model.cfg.z_loss_coef * out["z_loss"]
    if moe is not None:
        t = model.cfg.transformer
        total = (
            total + moe_loss_and_metrics(moe, aux_loss_coef=t.router_aux_loss_coef, z_loss_coef=t.router_z_loss_coef)[0]
        )
    return out | {"total": total}


def equipax_losses(model, batch, mesh=None) -> dict[str, jax.Array]:
    losses, aux, _ = lm_losses(model, batch, mesh=mesh)
    out = {"cross_entropy": losses["cross_entropy"][0], "accuracy": aux["accuracy"]}
    if "z_loss" in losses:
        out["z_loss"] = losses["z_loss"][0]
    return out | {"total": aggregate_losses(losses)[0]}


def _values_and_grads(fn, model, batch):
    def total(m):
        out = fn(m, batch)
        return out["total"], out

    (_, out), grads = eqx.filter_jit(eqx.filter_value_and_grad(total, has_aux=True))(model)
    return out, grads


def _with_tiling(model: TransformerLM, tiling: int) -> TransformerLM:
    """The same weights under a config with `num_vocab_tiling=tiling` (a static field)."""
    cfg = dataclasses.replace(model.cfg, num_vocab_tiling=tiling)
    skeleton = eqx.filter_eval_shape(TransformerLM, cfg, key=jax.random.key(0))
    return jax.tree.unflatten(jax.tree.structure(skeleton), jax.tree.leaves(model))


def _assert_agree(model, tiling: int, batch):
    tiled = _with_tiling(model, tiling)
    want, want_grads = _values_and_grads(obvious_losses, model, batch)
    got, got_grads = _values_and_grads(equipax_losses, tiled, batch)
    for name, value in got.items():
        np.testing.assert_allclose(value, want[name], rtol=2e-6, atol=2e-6, err_msg=name)
    flat_want = jax.tree_util.tree_leaves_with_path(eqx.filter(want_grads, eqx.is_array))
    flat_got = jax.tree_util.tree_leaves(eqx.filter(got_grads, eqx.is_array))
    for (path, w), g in zip(flat_want, flat_got, strict=True):
        scale = max(float(jnp.max(jnp.abs(w))), 1e-3)
        np.testing.assert_allclose(g, w, rtol=0, atol=2e-5 * scale, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize(
    "cfg, tiling",
    [(GPT, 1), (GPT, 4), (LLAMA, 8), (QWEN, 2), (MOE, 4)],
    ids=["tied-capped-zloss", "tied-capped-zloss-4", "untied-8", "tied-2", "moe-4"],
)
def test_loss_and_gradients_are_the_obvious_loss(cfg, tiling):
    model = TransformerLM(cfg, key=jax.random.key(0))
    # Larger output weights than the init's, so the softmax is far from uniform and the cap bends.
    if cfg.tie_embeddings:
        model = eqx.tree_at(lambda m: m.embedding.weight, model, model.embedding.weight * 8.0)
    else:
        model = eqx.tree_at(lambda m: m.unembed.weight, model, model.unembed.weight * 8.0)
    _assert_agree(model, tiling, _batch())


def test_lora_adapters_get_the_same_gradients_with_a_tiled_head():
    cfg = dataclasses.replace(QWEN, lora=LoRAConfig(enabled=True, rank=2, targets=("q", "v", "down")))
    base = TransformerLM(cfg, key=jax.random.key(0))
    lora = LoRALM(base, cfg.lora, key=jax.random.key(1))
    names = sorted(lora.adapters)
    lora = eqx.tree_at(
        lambda m: [m.adapters[n].b for n in names], lora, [jnp.ones_like(lora.adapters[n].b) for n in names]
    )
    tiled = eqx.tree_at(lambda m: m.base, lora, _with_tiling(base, 4))
    batch = _batch(1)
    (want, want_grads), (got, got_grads) = (_values_and_grads(equipax_losses, m, batch) for m in (lora, tiled))
    np.testing.assert_allclose(got["total"], want["total"], rtol=2e-6)
    for n in names:
        for part in ("a", "b"):
            w, g = getattr(want_grads.adapters[n], part), getattr(got_grads.adapters[n], part)
            np.testing.assert_allclose(g, w, rtol=0, atol=2e-5 * float(jnp.max(jnp.abs(w))), err_msg=f"{n}.{part}")


@pytest.mark.parametrize("cap", [None, 2.0])
def test_the_form_xla_tpu_fuses_is_the_same_loss(cap):
    """`head_stats(fused=True)` (the label gathered from the matmul's output, with a cap the sums
    shifted by the cap) gives the CPU form's statistics and gradients, to float32 rounding."""
    rng = np.random.default_rng(0)
    raw = jnp.asarray(rng.normal(0, 3, (3, 5, V)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, V, (3, 5)), jnp.int32)

    def loss(raw, fused):
        st = head_stats(raw, labels, cap, fused=fused)
        return jnp.sum(st.log_sum - st.label) + 0.1 * jnp.sum(jnp.square(st.log_sum + st.ref)), st

    (want, plain), want_grad = jax.value_and_grad(loss, has_aux=True)(raw, False)
    (got, fused), got_grad = jax.value_and_grad(loss, has_aux=True)(raw, True)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(got_grad, want_grad, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(fused.correct, plain.correct)
    logits = soft_cap(raw, cap)
    np.testing.assert_array_equal(fused.correct, jnp.argmax(logits, -1) == labels)
    np.testing.assert_allclose(fused.log_sum + fused.ref, jax.nn.logsumexp(logits, -1), rtol=1e-6)


def test_the_label_is_picked_without_a_scatter():
    """`pick_label` gives a gather's numbers and gradient bit for bit (bfloat16, as the head's
    matmul writes them), and its gradient program has no scatter into `[*batch, vocab]` (a
    gather's has: on the TPU it lays the logits out flat and back, two copies)."""
    rng = np.random.default_rng(1)
    raw = jnp.asarray(rng.normal(0, 3, (2, 7, V)), jnp.bfloat16)
    labels = jnp.asarray(rng.integers(0, V, (2, 7)), jnp.int32)
    weights = jnp.asarray(rng.normal(0, 1, (2, 7)), jnp.bfloat16)
    gather = lambda r: jnp.take_along_axis(r, labels[..., None], axis=-1)[..., 0]  # noqa: E731
    pick = lambda r: pick_label(r, labels)  # noqa: E731
    np.testing.assert_array_equal(pick(raw), gather(raw))
    grad = lambda f: jax.grad(lambda r: jnp.sum((f(r) * weights).astype(jnp.float32)))  # noqa: E731
    np.testing.assert_array_equal(grad(pick)(raw), grad(gather)(raw))
    hlo = lambda f: jax.jit(grad(f)).lower(raw).as_text()  # noqa: E731
    assert "scatter" in hlo(gather)  # the premise: a gather's gradient is a scatter
    assert "scatter" not in hlo(pick)


def test_sharded_and_context_parallel_heads_equal_one_devices():
    """On 8 simulated devices the tiled head's loss and every gradient equal one device's: the
    vocabulary over `tensor` (each chunk a slice of every device's part; tied and untied tables),
    and context-parallel zigzag rows."""
    from helpers.multidevice import run_with_devices

    lines = run_with_devices(CHILD, devices=8).strip().splitlines()
    assert [line.split()[0] for line in lines] == ["qwen-tensor", "qwen-context", "llama-tensor"]
    for line in lines:
        _, loss, ref, err, scale = line.split()
        assert abs(float(loss) - float(ref)) <= 2e-6 * abs(float(ref)), line
        assert float(err) <= 2e-5 * float(scale), line


CHILD = r"""
import dataclasses
import equinox as eqx, jax, numpy as np
from equipax.core.mesh import CONTEXT_AXES, MeshConfig, build_mesh
from equipax.core.partition import named, param_specs
from equipax.models import LMConfig, TransformerLM, lm_loss
from equipax.core.nn import TransformerConfig

V, S = 64, 32
block = TransformerConfig(num_layers=1, model_dims=16, num_heads=4, num_kv_heads=2, head_dim=8, hidden_dims=32,
                          activation="silu", gated=True, norm="rmsnorm", fused_qkv=False)
qwen = LMConfig(vocab_size=V, max_seq_len=S, position="rope", output_logit_cap=5.0, z_loss_coef=1e-2,
                embedding_multiplier=None, transformer=dataclasses.replace(block, qk_norm=True))
llama = dataclasses.replace(qwen, tie_embeddings=False, output_logit_cap=None)
rng = np.random.default_rng(0)
ids = rng.integers(0, V, (2, S + 1)).astype(np.int32)
batch = {"ids": ids[:, :-1], "labels": ids[:, 1:], "weights": (rng.random((2, S)) > 0.2).astype(np.float32)}

def run(cfg, mesh):
    model = TransformerLM(cfg, key=jax.random.key(0))
    model = eqx.tree_at(lambda m: m.embedding.weight, model, model.embedding.weight * 8.0)
    if mesh is not None:
        model = eqx.filter_shard(model, named(param_specs(model, mesh), mesh))
    loss, grads = eqx.filter_jit(eqx.filter_value_and_grad(lambda m: lm_loss(m, batch, mesh=mesh)[0]))(model)
    return float(loss), [np.asarray(g) for g in jax.tree.leaves(eqx.filter(grads, eqx.is_array))]

tp = build_mesh(MeshConfig(ici_mesh_shape=(2, 2, 2), dcn_mesh_shape=(1, 1, 1)))
cp = build_mesh(MeshConfig(ici_mesh_shape=(1, 1, 4, 2), dcn_mesh_shape=(1, 1, 1, 1), axis_names=CONTEXT_AXES))
# (The whole head at once on these meshes is every sharded LM test's path.)
for family, base, meshes in (("qwen", qwen, (("tensor", tp), ("context", cp))), ("llama", llama, (("tensor", tp),))):
    ref_loss, ref_grads = run(base, None)
    for mesh_name, mesh in meshes:
        cfg = dataclasses.replace(base, num_vocab_tiling=4)
        if mesh_name == "context":  # zigzag rows (all_gather attention: the cheaper program)
            cfg = dataclasses.replace(cfg, transformer=dataclasses.replace(
                cfg.transformer, context_parallel_strategy="all_gather", context_parallel_load_balance=True))
        loss, grads = run(cfg, mesh)
        err = max(float(np.max(np.abs(g - r))) for g, r in zip(grads, ref_grads))
        scale = max(float(np.max(np.abs(r))) for r in ref_grads)
        print(f"{family}-{mesh_name}", loss, ref_loss, err, scale)
"""


@pytest.mark.parametrize("tiling", [0, 5, True])
def test_tiling_that_does_not_divide_the_vocabulary_is_a_config_error(tiling):
    with pytest.raises(ValueError, match=r"model\.num_vocab_tiling .*divides model\.vocab_size=64") as err:
        dataclasses.replace(GPT, num_vocab_tiling=tiling)
    assert "32" in str(err.value)  # a divisor to use instead
