"""A mixture-of-experts LM as a configuration of the one `TransformerLM`: the router losses as
weighted terms of the training loss and in its metrics, scan == loop with the per-layer stats,
parameter and FLOP counts (total and active) against the traced model, config errors."""

import dataclasses

import equinox as eqx
import jax
import jax.random as jr
import numpy as np
import pytest

from equipax.core.flops import count_params, lm_param_counts, transformer_lm_flops_per_token
from equipax.core.nn import TransformerConfig
from equipax.models import LMConfig, TransformerLM, lm_loss

BLOCK = TransformerConfig(
    num_layers=2,
    model_dims=16,
    num_heads=2,
    head_dim=8,
    hidden_dims=24,
    activation="silu",
    gated=True,
    norm="rmsnorm",
    fused_qkv=False,
    atten_logit_cap=None,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=12,
    router_aux_loss_coef=0.02,
    router_z_loss_coef=0.001,
)
CFG = LMConfig(vocab_size=32, max_seq_len=8, transformer=BLOCK, position="rope", tie_embeddings=False)


def _batch(rows=2, seq=8):
    ids = np.random.default_rng(0).integers(0, CFG.vocab_size, (rows, seq + 1)).astype(np.int32)
    return {"ids": ids[:, :-1], "labels": ids[:, 1:], "weights": np.ones((rows, seq), np.float32)}


def _replace(**kw):
    return dataclasses.replace(CFG, transformer=dataclasses.replace(BLOCK, **kw))


def test_router_losses_are_weighted_terms_of_the_loss_and_reported():
    model, batch = TransformerLM(CFG, key=jr.key(0)), _batch()
    loss, aux = jax.jit(lm_loss)(model, batch)
    ce = aux["loss_sum"] / aux["weight_sum"]
    want = ce + 0.02 * aux["moe_aux_loss"] + 0.001 * aux["moe_z_loss"]
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    assert float(aux["moe_aux_loss"]) >= 2.0 - 1e-5  # top_k is its minimum
    counts = [float(aux[f"moe_expert_{e}_tokens"]) for e in range(4)]
    assert sum(counts) == 2 * 8 * 2 and float(aux["moe_dropped_fraction"]) == 0.0
    assert 1.0 <= float(aux["moe_load_max"]) <= 4.0  # the busiest expert over the even share


def test_capacity_reports_the_dropped_share():
    model = TransformerLM(_replace(capacity_factor=0.5), key=jr.key(0))
    _, aux = jax.jit(lm_loss)(model, _batch())
    # Capacity 2 per expert and sequence of 8 tokens x 2 choices: at least half is dropped.
    assert float(aux["moe_dropped_fraction"]) >= 0.5


def test_scan_equals_loop_with_per_layer_stats():
    scanned = TransformerLM(CFG, key=jr.key(0))
    looped = TransformerLM(_replace(scan_layers=False), key=jr.key(0))
    ids = _batch()["ids"]
    (la, sa), (lb, sb) = (eqx.filter_jit(lambda m: m.forward(ids))(m) for m in (scanned, looped))
    assert sa is not None and sb is not None and sa.tokens_per_expert.shape == (2, 4)
    np.testing.assert_allclose(la, lb, rtol=1e-5, atol=1e-5)
    for a, b in zip(sa, sb, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_parameter_and_flop_counts_total_and_active():
    cfg = _replace(shared_expert_intermediate_size=8)
    model = eqx.filter_eval_shape(lambda k: TransformerLM(cfg, key=k), jr.key(0))
    counts = lm_param_counts(cfg.transformer, cfg.vocab_size, tie_embeddings=False)
    assert count_params(model) == counts["total"]
    # Per layer, 2 of 4 experts of 3 x 16 x 12 parameters are not used by a token.
    assert counts["total"] - counts["active"] == 2 * 2 * 3 * 16 * 12
    dense_ffn = 16 * 4 + 3 * 16 * (2 * 12 + 8)  # router, two experts, shared expert
    f = transformer_lm_flops_per_token(cfg.transformer, vocab_size=cfg.vocab_size, seq_len=8)
    assert f["mlp"] == 2 * 2 * dense_ffn


@pytest.mark.parametrize(
    "kw, knob",
    [
        (dict(num_experts_per_tok=5), "num_experts_per_tok"),
        (dict(num_experts_per_tok=0), "num_experts_per_tok"),
        (dict(num_experts=-1), "num_experts"),
        (dict(capacity_factor=0.0), "capacity_factor"),
        (dict(capacity_factor=-1.0), "capacity_factor"),
        (dict(moe_intermediate_size=0), "moe_intermediate_size"),
        (dict(shared_expert_intermediate_size=-1), "shared_expert_intermediate_size"),
        (dict(router_aux_loss_coef=-0.1), "router_aux_loss_coef"),
        (dict(router_z_loss_coef=float("nan")), "router_z_loss_coef"),
        (dict(gated=False), "gated=True"),
        (dict(tensor_parallel="shard_map"), "tensor_parallel='gspmd'"),
        (dict(pipeline_stages=2), "pipeline_stages=1"),
    ],
)
def test_config_errors_name_the_knob(kw, knob):
    with pytest.raises(ValueError, match=knob):
        _replace(**kw)


def test_expert_axis_must_divide_the_experts():
    from equipax.core.knobs import ConfigError
    from equipax.core.mesh import EXPERT_AXES, MeshConfig

    def mesh(ep):
        return MeshConfig(ici_mesh_shape=(1, 1, ep, 1), dcn_mesh_shape=(1, 1, 1, 1), axis_names=EXPERT_AXES)

    CFG.check_mesh(mesh(2), 8)
    with pytest.raises(ConfigError, match=r"num_experts=4 cannot be split .* one of \[1, 2, 4\]"):
        CFG.check_mesh(mesh(3), 9)


def test_auxiliary_loss_free_balancing_sets_the_biases_from_each_steps_load():
    """With router_bias_update_rate the train step moves each layer's routing biases by the rate
    towards balance from that step's own load (the model before the update, on the batch), the
    biases get no gradient and no optimizer state, and over steps the load evens out."""
    import jax.numpy as jnp
    import optax

    from equipax.core.nn.moe import update_router_bias
    from equipax.core.step import init_train_state, make_train_step
    from equipax.models import LMTask
    from equipax.models.lm import lm_loss_and_stats

    rate = 0.002  # DeepSeek-V3's 0.001 order; sign steps of 0.05 would overshoot at this size
    cfg = _replace(router_bias_update_rate=rate, router_aux_loss_coef=0.0, router_z_loss_coef=0.0)
    task = LMTask(cfg, seq_len=8)
    model, load0 = task.init(jr.key(0))
    assert load0.shape == (2, 4) and model.stack.layers.ffn.router_bias.shape == (2, 4)
    optimizer = optax.adamw(0.0)  # no parameter moves: only the biases change the routing
    state = init_train_state(model, optimizer, model_state=load0)
    mu = state.opt_state[0].mu
    assert mu.stack.layers.ffn.router_bias is None and mu.stack.layers.ffn.router is not None
    step = jax.jit(make_train_step(task, optimizer, optax.constant_schedule(0.0)))
    batch = _batch(rows=4)
    _, _, stats = jax.jit(lm_loss_and_stats)(state.model, batch)
    want = update_router_bias(jnp.zeros((2, 4)), stats.tokens_per_expert, rate)
    state, _ = step(state, batch, jr.key(1))
    np.testing.assert_allclose(state.model.stack.layers.ffn.router_bias, want, rtol=1e-6)
    np.testing.assert_array_equal(state.model_state, stats.tokens_per_expert)
    first = np.ptp(np.asarray(stats.tokens_per_expert), axis=1)  # busiest minus idlest expert, per layer
    assert (first > 0).all()
    spans = []
    for _ in range(40):
        state, _ = step(state, batch, jr.key(1))
        spans.append(np.ptp(np.asarray(state.model_state), axis=1))
    assert (np.mean(spans[-10:], axis=0) < 0.5 * first).all(), (first, spans[-10:])


def test_rate_without_experts_is_refused():
    with pytest.raises(ValueError, match=r"router_bias_update_rate=0.01 balances the experts.*num_experts=0"):
        dataclasses.replace(BLOCK, num_experts=0, router_bias_update_rate=0.01)


def test_the_lm_task_returns_named_losses_the_step_sums_logs_and_evaluates_each():
    from equipax.core.optim import LearnerConfig, ScheduleConfig, make_learner, make_schedule
    from equipax.core.step import init_train_state, make_eval_step, make_train_step
    from equipax.models import LMTask

    cfg = dataclasses.replace(CFG, z_loss_coef=1e-3)
    task = LMTask(cfg, seq_len=8)
    model, state = task.init(jr.key(0))
    batch = _batch()
    losses, _, _ = task.loss(model, batch, key=jr.key(1), model_state=state)
    assert list(losses) == ["cross_entropy", "z_loss", "router_aux", "router_z"]
    # The z-loss against float64 numpy on the model's own logits.
    logits = np.asarray(jax.jit(lambda m, i: m.forward(i)[0])(model, batch["ids"]), np.float64)
    top = logits.max(-1, keepdims=True)
    lse = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    np.testing.assert_allclose(float(losses["z_loss"][0]), np.mean(lse**2), rtol=1e-5)
    learner = make_learner(LearnerConfig())
    _, metrics = make_train_step(task, learner.optimizer, make_schedule(ScheduleConfig()))(
        init_train_state(model, learner.optimizer), batch, jr.key(1)
    )
    parts = {n: float(metrics[f"loss/{n}"]) for n in losses}
    want = parts["cross_entropy"] + 1e-3 * parts["z_loss"] + 0.02 * parts["router_aux"] + 0.001 * parts["router_z"]
    np.testing.assert_allclose(float(metrics["loss"]), want, rtol=1e-6)
    assert parts["router_aux"] == float(metrics["moe_aux_loss"])
    sums = jax.device_get(make_eval_step(task)(model, batch))
    assert sorted(k for k in sums if k.startswith("loss_sum/")) == sorted(f"loss_sum/{n}" for n in losses)
    np.testing.assert_allclose(sums["loss_sum/cross_entropy"], sums["loss_sum"], rtol=1e-6)


def test_a_dense_lm_without_z_loss_keeps_one_scalar_loss():
    from equipax.models import LMTask

    task = LMTask(dataclasses.replace(CFG, transformer=dataclasses.replace(BLOCK, num_experts=0)), seq_len=8)
    model, _ = task.init(jr.key(0))
    loss, _, _ = task.loss(model, _batch(), key=None, model_state=None)
    assert np.shape(loss) == ()


@pytest.mark.parametrize("bad", [-1e-4, float("inf"), float("nan")])
def test_z_loss_coef_must_be_a_finite_non_negative_number(bad):
    with pytest.raises(ValueError, match=r"model.z_loss_coef must be a finite number >= 0"):
        dataclasses.replace(CFG, z_loss_coef=bad)
