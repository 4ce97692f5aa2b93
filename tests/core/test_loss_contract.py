"""The steps' one loss contract (a Task) and the adapter for a plain loss function
(`LossFnTask`): what a loss may return and take, the errors that name what is wrong; the caller's
model survives the donating step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest


def _setup(key):
    import equinox as eqx

    from equipax.core.optim import LearnerConfig, make_learner

    model = eqx.nn.Linear(3, 1, key=key)
    return model, make_learner(LearnerConfig()).optimizer, {"x": np.ones((4, 3), np.float32)}


def _mse(model, batch):
    return jnp.mean(jax.vmap(model)(jnp.asarray(batch["x"])) ** 2)


def test_callers_model_survives_training(key):
    from equipax.core.optim import ScheduleConfig, make_schedule
    from equipax.core.step import LossFnTask, init_train_state, make_train_step

    model, opt, batch = _setup(key)
    state = init_train_state(model, opt)
    step = make_train_step(LossFnTask(lambda m, b, *, key: (_mse(m, b), {})), opt, make_schedule(ScheduleConfig()))
    state, _ = step(state, batch, key)
    state, _ = step(state, batch, key)
    # The caller's model was not donated: it still evaluates, and it is the untrained one.
    assert not model.weight.is_deleted()
    assert float(_mse(model, batch)) > float(_mse(state.model, batch))


def _step_error(key, loss_fn, *, call_key="same"):
    from equipax.core.optim import ScheduleConfig, make_schedule
    from equipax.core.step import LossContractError, LossFnTask, init_train_state, make_train_step

    model, opt, batch = _setup(key)
    with pytest.raises(LossContractError) as info:
        step = make_train_step(LossFnTask(loss_fn), opt, make_schedule(ScheduleConfig()))
        if call_key is None:
            # In the test suite the runtime type checker refuses key=None at the call already;
            # without it (as users run) the call reaches the traced step, which `lower` runs too.
            step.lower(init_train_state(model, opt), batch, None)
        else:
            step(init_train_state(model, opt), batch, key)
    message = str(info.value)
    assert "The loss contract" in message and "loss_fn(model, batch, *, key)" in message
    return message


def test_loss_without_key_keyword(key):
    assert "takes no `key` keyword" in _step_error(key, lambda m, b: (_mse(m, b), {}))


def test_loss_returning_a_bare_scalar(key):
    assert "returned an array of shape (); expected a tuple of 2" in _step_error(key, lambda m, b, *, key: _mse(m, b))


def test_loss_returning_three_values_without_state(key):
    assert "returned a tuple of 3" in _step_error(key, lambda m, b, *, key: (_mse(m, b), {}, None))


def test_non_scalar_loss(key):
    msg = _step_error(key, lambda m, b, *, key: (jax.vmap(m)(jnp.asarray(b["x"]))[:, 0], {}))
    assert "shape (4,); expected a scalar" in msg


def test_aux_not_a_dict(key):
    assert "aux is a list" in _step_error(key, lambda m, b, *, key: (_mse(m, b), [1.0]))


def test_reserved_aux_names(key):
    msg = _step_error(key, lambda m, b, *, key: (_mse(m, b), {"grad_norm": _mse(m, b)}))
    assert "['grad_norm']" in msg


def test_key_none_to_train_step(key):
    msg = _step_error(key, lambda m, b, *, key: (_mse(m, b), {}), call_key=None)
    assert "key=None" in msg and "make_eval_step" in msg


def test_the_adapter_checks_the_signature_before_any_step(key):
    from equipax.core.step import LossContractError, LossFnTask

    with pytest.raises(LossContractError, match="takes no `key` keyword"):
        LossFnTask(lambda m, b: (_mse(m, b), {}))


@pytest.mark.parametrize("build", ["make_train_step", "make_eval_step"])
def test_the_steps_take_a_task_and_say_how_to_wrap_a_function(key, build):
    from jaxtyping import TypeCheckError

    from equipax.core import step as step_module
    from equipax.core.optim import ScheduleConfig, make_schedule
    from equipax.core.step import LossContractError

    def fn(m, b, *, key):
        return _mse(m, b), {}

    with pytest.raises(LossContractError, match=r"take a Task; got the function .*LossFnTask\(loss_fn\)"):
        step_module.as_task(fn)  # what a user without the suite's runtime type checker sees
    _, opt, _ = _setup(key)
    args = (opt, make_schedule(ScheduleConfig())) if build == "make_train_step" else ()
    with pytest.raises((LossContractError, TypeCheckError)):
        getattr(step_module, build)(fn, *args)


def test_a_plain_loss_function_refuses_a_model_state(key):
    import equinox as eqx

    from equipax.core.optim import ScheduleConfig, make_schedule
    from equipax.core.step import LossContractError, LossFnTask, init_train_state, make_train_step

    model, opt, batch = _setup(key)
    _, bn_state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(3, "batch", mode="batch")
    state = init_train_state(model, opt, model_state=bn_state)
    step = make_train_step(LossFnTask(lambda m, b, *, key: (_mse(m, b), {})), opt, make_schedule(ScheduleConfig()))
    with pytest.raises(LossContractError, match="holds a model_state.*Write a Task"):
        step(state, batch, key)
