"""Several learners (`LearnerConfig.groups`): each group's parameters follow its own learner
exactly as if that learner trained them alone (checked against separate optimizers on the
sub-trees), a frozen group never moves, each group's learning rate is logged, resume is exact,
and a group matching nothing or two groups matching one parameter are ConfigErrors."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array, Float

from equipax.core.knobs import ConfigError, apply_overrides
from equipax.core.learner_config import LearnerConfig, ParamGroupConfig, ScheduleConfig
from equipax.core.optim import group_labels, group_schedules, make_learner
from equipax.core.step import LossFnTask, init_train_state, make_train_step


class Net(eqx.Module):
    embed: Float[Array, "in hidden"]
    bias: Float[Array, " hidden"]
    head: Float[Array, "hidden out"]

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.embed = jax.random.normal(k1, (8, 32)) / np.sqrt(8)
        self.bias = jnp.full((32,), 0.1)
        self.head = jax.random.normal(k2, (32, 1)) / np.sqrt(32)

    def __call__(self, x):
        return jnp.tanh(x @ self.embed + self.bias[None, :]) @ self.head


def loss_fn(model, batch, *, key):
    err = jnp.square(model(batch["x"])[:, 0] - batch["y"])
    return jnp.mean(err), {"loss_sum": jnp.sum(err), "num_examples": jnp.asarray(err.size, jnp.float32)}


BATCH = {"x": jax.random.normal(jax.random.key(1), (32, 8)), "y": jax.random.normal(jax.random.key(2), (32,))}
DEFAULT = LearnerConfig(kind="adamw", schedule=ScheduleConfig(kind="constant", peak_learning_rate=1e-2))
HEAD = LearnerConfig(
    kind="pax_adam",
    weight_decay=0.1,
    clip_gradient_norm=0.5,
    schedule=ScheduleConfig(kind="constant", peak_learning_rate=3e-2),
)
GROUPED = LearnerConfig(
    kind="adamw",
    schedule=ScheduleConfig(kind="constant", peak_learning_rate=1e-2),
    groups=(ParamGroupConfig(name="head", regex="^head$", learner=HEAD), ParamGroupConfig(name="frozen", regex="bias")),
)


def train(cfg, steps, state=None):
    learner = make_learner(cfg)
    step = make_train_step(LossFnTask(loss_fn), *learner, group_schedules=group_schedules(cfg))
    state = state if state is not None else init_train_state(Net(jax.random.key(0)), learner.optimizer)
    metrics = None
    for _ in range(steps):
        state, metrics = step(state, BATCH, jax.random.key(3))
    return state, metrics


def test_each_group_trains_as_its_own_learner_alone():
    state, metrics = train(GROUPED, 3)
    net = Net(jax.random.key(0))
    # The reference: each learner's optimizer on its own sub-tree, from the full model's gradients.
    alone = {"embed": make_learner(DEFAULT).optimizer, "head": make_learner(HEAD).optimizer}
    params = {"embed": net.embed, "head": net.head}
    opt = {k: alone[k].init(params[k]) for k in alone}
    for _ in range(3):
        model = eqx.tree_at(lambda m: (m.embed, m.head), net, (params["embed"], params["head"]))
        grads = eqx.filter_grad(lambda m: loss_fn(m, BATCH, key=None)[0])(model)
        for k in alone:
            update, opt[k] = alone[k].update(getattr(grads, k), opt[k], params[k])
            params[k] = params[k] + update
    np.testing.assert_allclose(state.model.embed, params["embed"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(state.model.head, params["head"], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(state.model.bias, net.bias)  # frozen
    assert float(metrics["learning_rate"]) == pytest.approx(1e-2) and float(
        metrics["learning_rate/head"]
    ) == pytest.approx(3e-2)
    assert "learning_rate/frozen" not in metrics
    # The check can fail: one learner for everything moves the head (and the bias) differently.
    single, _ = train(DEFAULT, 3)
    assert not np.allclose(single.model.head, state.model.head, rtol=1e-4)
    assert not np.allclose(single.model.bias, net.bias)


def test_grouped_resume_is_bit_exact():
    straight, _ = train(GROUPED, 4)
    half, _ = train(GROUPED, 2)
    restored = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)) if eqx.is_array(x) else x, half)
    resumed, _ = train(GROUPED, 2, restored)
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(a, b)


def test_groups_that_match_nothing_or_overlap_are_config_errors():
    net = Net(jax.random.key(0))
    assert jax.tree.leaves(group_labels(net, GROUPED.groups)) == ["default", "frozen", "head"]
    with pytest.raises(ConfigError, match=r"\['typo'\] match no trained parameter.*embed, bias, head"):
        group_labels(net, (ParamGroupConfig(name="typo", regex="^emb$"),))
    with pytest.raises(ConfigError, match=r"'head' matches the regexes of groups \['a', 'b'\]"):
        group_labels(net, (ParamGroupConfig(name="a", regex="head"), ParamGroupConfig(name="b", regex="^h")))
    with pytest.raises(ConfigError, match="distinct names other than 'default'"):
        LearnerConfig(groups=(ParamGroupConfig(name="default", regex="head"),))
    with pytest.raises(ConfigError, match=r"groups\['x'\]\.regex: expected a valid regular expression"):
        ParamGroupConfig(name="x", regex="(head")


def test_groups_are_a_knob():
    """`--set learner.groups=(...)` takes the groups as a literal (dicts), a frozen group with no learner."""
    cfg, sources = apply_overrides(
        GROUPED, ["groups=({'name': 'embed', 'regex': '^embed$', 'learner': None},)", "schedule.peak_learning_rate=0.5"]
    )
    assert cfg.groups == (ParamGroupConfig(name="embed", regex="^embed$"),) and sources["groups"] == "--set"


def test_grouped_optimizer_state_is_sharded_like_its_parameters():
    """With groups, `train_state_shardings` finds each moment's parameter by path and shape (optax's
    tree_map_params cannot see through multi_transform): every Adam moment gets its parameter's
    spec, in whichever group's state it sits; counts are replicated."""
    from jax.sharding import PartitionSpec as P

    from equipax.core.partition import _specs_by_path

    net = Net(jax.random.key(0))
    params = eqx.filter(net, eqx.is_inexact_array)
    specs = Net.__new__(Net)
    for name, spec in (("embed", P("fsdp", "tensor")), ("bias", P("tensor")), ("head", P("tensor", None))):
        object.__setattr__(specs, name, spec)
    opt_state = make_learner(GROUPED).optimizer.init(params)
    out = _specs_by_path(opt_state, params, specs)
    leaves = jax.tree_util.tree_flatten_with_path(out, is_leaf=lambda x: isinstance(x, P))[0]
    by_param = {}
    for path, spec in leaves:
        text = jax.tree_util.keystr(tuple(path))
        for name in ("embed", "bias", "head"):
            if text.endswith(f".{name}"):
                by_param.setdefault(name, set()).add(spec)
    assert by_param == {"embed": {P("fsdp", "tensor")}, "head": {P("tensor", None)}}  # the frozen bias has no moments
    assert P() in {spec for _, spec in leaves}  # the counts
