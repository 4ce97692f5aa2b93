"""Several named, weighted losses (Pax's loss aggregator, `equipax.core.losses`): the step trains
their weighted sum and logs each, eval reports each over the pass, against numpy references; a
mutant aggregator is caught; malformed named losses name what is wrong."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest


def _setup(key):
    import equinox as eqx

    from equipax.core.optim import LearnerConfig, make_learner

    model = eqx.nn.Linear(3, 2, key=key)
    x = np.asarray(jax.random.normal(jax.random.key(7), (5, 3)), np.float32)
    w = np.asarray([1.0, 2.0, 0.0, 1.0, 3.0], np.float32)
    return model, make_learner(LearnerConfig()).optimizer, {"x": x, "w": w}


WEIGHTS = {"fit": 1.0, "size": 0.25, "spread": 3.0}


def _terms(model, batch):
    """Three losses of different scale: a weighted mean over examples, and two per-batch values."""
    y = jax.vmap(model)(jnp.asarray(batch["x"]))
    w = jnp.asarray(batch["w"])
    fit = jnp.sum(jnp.sum((y - 1.0) ** 2, axis=-1) * w) / jnp.sum(w)
    size = jnp.sum(model.weight**2)
    spread = jnp.var(y)
    return {"fit": fit, "size": size, "spread": spread}, {"weight_sum": jnp.sum(w)}


def named_loss_fn(model, batch, *, key=None):
    terms, aux = _terms(model, batch)
    sums = {"loss_sum": terms["fit"] * aux["weight_sum"], "correct_sum": jnp.zeros(()), **aux}
    return {n: (v, WEIGHTS[n]) for n, v in terms.items()}, sums


def _reference_terms(model, batch):
    """The three terms in float64 numpy, from the model's weights alone."""
    wt, b = np.asarray(model.weight, np.float64), np.asarray(model.bias, np.float64)
    y = np.asarray(batch["x"], np.float64) @ wt.T + b
    w = np.asarray(batch["w"], np.float64)
    return {"fit": np.sum(np.sum((y - 1.0) ** 2, -1) * w) / w.sum(), "size": np.sum(wt**2), "spread": np.var(y)}


def _check_step_against_reference(key):
    """One step: `loss` is the weighted sum of the numpy terms, each `loss/<name>` is its term, and
    the update is the gradient of that weighted sum (the same step trained on the summed scalar)."""
    from equipax.core.optim import ScheduleConfig, make_schedule
    from equipax.core.step import LossFnTask, init_train_state, make_train_step

    model, opt, batch = _setup(key)
    schedule = make_schedule(ScheduleConfig())
    want = _reference_terms(model, batch)
    new, metrics = make_train_step(LossFnTask(named_loss_fn), opt, schedule)(init_train_state(model, opt), batch, key)
    total = sum(WEIGHTS[n] * v for n, v in want.items())
    np.testing.assert_allclose(float(metrics["loss"]), total, rtol=1e-5)
    for name, value in want.items():
        np.testing.assert_allclose(float(metrics[f"loss/{name}"]), value, rtol=1e-5)

    def summed(m, b, *, key=None):
        terms, _ = _terms(m, b)
        return sum(WEIGHTS[n] * v for n, v in terms.items()), {}

    model2, _, _ = _setup(key)
    plain, _ = make_train_step(LossFnTask(summed), opt, schedule)(init_train_state(model2, opt), batch, key)
    np.testing.assert_allclose(np.asarray(new.model.weight), np.asarray(plain.model.weight), rtol=1e-6, atol=1e-7)


def test_the_step_trains_the_weighted_sum_and_logs_each_loss(key):
    _check_step_against_reference(key)


def test_mutation_an_aggregator_that_ignores_the_weights_fails_the_check(key, monkeypatch):
    import equipax.core._loss_contract as contract
    from equipax.core.losses import LOSS_PREFIX

    def unweighted(losses):
        total = sum(jnp.asarray(v, jnp.float32) for v, _ in losses.values())
        return total, {LOSS_PREFIX + n: jnp.asarray(v, jnp.float32) for n, (v, _) in losses.items()}

    monkeypatch.setattr(contract, "aggregate_losses", unweighted)
    with pytest.raises(AssertionError):
        _check_step_against_reference(key)


def test_eval_reports_each_named_loss_weighted_by_each_batchs_weight(key):
    from equipax.core.step import LossFnTask, make_eval_step, mean_eval_metrics

    model, _, batch = _setup(key)
    step = make_eval_step(LossFnTask(named_loss_fn))
    batches = [batch, {"x": batch["x"][::-1] * 2.0, "w": np.asarray([0.5, 0.0, 1.0, 1.0, 1.0], np.float32)}]
    got = mean_eval_metrics(jax.device_get(step(model, b)) for b in batches)
    refs = [(_reference_terms(model, b), float(np.sum(b["w"]))) for b in batches]
    weight = sum(w for _, w in refs)
    for name in WEIGHTS:
        np.testing.assert_allclose(got[f"loss/{name}"], sum(t[name] * w for t, w in refs) / weight, rtol=1e-5)
    np.testing.assert_allclose(got["loss"], got["loss/fit"], rtol=1e-6)


@pytest.mark.parametrize(
    ("losses", "found"),
    [
        ({}, "The named losses are empty"),
        ({"2nd": (jnp.ones(()), 1.0)}, "'2nd' is not a name"),
        ({"a": jnp.ones(())}, "expected a `(value, weight)` pair"),
        ({"a": (jnp.ones((2,)), 1.0)}, "has shape (2,); expected a scalar"),
        ({"a": (jnp.ones(()), jnp.ones((3,)))}, "The weight of the named loss 'a' has shape (3,)"),
    ],
)
def test_malformed_named_losses_say_what_is_wrong(key, losses, found):
    from equipax.core.optim import ScheduleConfig, make_schedule
    from equipax.core.step import LossContractError, LossFnTask, init_train_state, make_train_step

    model, opt, batch = _setup(key)
    step = make_train_step(LossFnTask(lambda m, b, *, key: (losses, {})), opt, make_schedule(ScheduleConfig()))
    with pytest.raises(LossContractError) as info:
        step(init_train_state(model, opt), batch, key)
    assert found in str(info.value) and "The loss contract" in str(info.value)


def test_an_aux_entry_that_a_named_loss_writes_is_refused(key):
    from equipax.core.optim import ScheduleConfig, make_schedule
    from equipax.core.step import LossContractError, LossFnTask, init_train_state, make_train_step

    model, opt, batch = _setup(key)
    fn = lambda m, b, *, key: ({"fit": (jnp.ones(()), 1.0)}, {"loss/fit": jnp.zeros(())})  # noqa: E731
    step = make_train_step(LossFnTask(fn), opt, make_schedule(ScheduleConfig()))
    with pytest.raises(LossContractError, match="which its named losses write"):
        step(init_train_state(model, opt), batch, key)
