"""The CNN tutorial's image classifier (AdvancedCNN): BatchNorm state, dropout keys, the stateful
train step, the first batch checked against its Task, the analytic parameter count."""

import functools

import numpy as np
import pytest

from helpers.cnn import images, tiny_cnn, tiny_cnn_task


@functools.cache
def _jitted_call():
    import equinox as eqx

    return eqx.filter_jit(lambda m, x, s, k, i: m(x, s, key=k, inference=i))


def apply(model, x, state, *, key=None, inference=False):
    """The model under jit (fast, and each call unflattens its own copy of the state)."""
    return _jitted_call()(model, x, state, key, inference)


def test_batchnorm_stats_change_in_training_and_not_in_eval(key, trees_close):
    import jax

    model, state = tiny_cnn(key)
    x = images()
    _, trained = apply(model, x, state, key=jax.random.key(1))
    _, evaluated = apply(model, x, state, inference=True)
    before, after = jax.tree.leaves(state), jax.tree.leaves(trained)
    assert len(before) == 2 * 4  # (mean, var) of 2 blocks x 2 BatchNorms
    assert all(not np.allclose(a, b) for a, b in zip(before, after))
    trees_close(evaluated, state, rtol=0, atol=0)


def test_batchnorm_normalises_with_batch_stats_and_updates_running_averages(key):

    import equinox as eqx

    from equipax.core.nn.conv import BatchNorm

    bn, state = eqx.nn.make_with_state(BatchNorm)(3, momentum=0.9)
    x = images(n=8, channels=3) * 2.0 + 5.0
    y, new = eqx.filter_jit(lambda b, x, s: b(x, s, inference=False))(bn, x, state)
    np.testing.assert_allclose(np.mean(np.asarray(y), axis=(0, 1, 2)), 0.0, atol=1e-4)
    np.testing.assert_allclose(np.var(np.asarray(y), axis=(0, 1, 2)), 1.0, rtol=1e-3)
    mean, var = new.get(bn.running)
    np.testing.assert_allclose(mean, 0.1 * np.mean(np.asarray(x), axis=(0, 1, 2)), rtol=1e-5)
    np.testing.assert_allclose(var, 0.9 + 0.1 * np.var(np.asarray(x), axis=(0, 1, 2)), rtol=1e-4)
    # Inference with the initial statistics (mean 0, var 1) is the identity.
    y_eval, _ = eqx.filter_jit(lambda b, x, s: b(x, s, inference=True))(bn, x, state)
    np.testing.assert_allclose(np.asarray(y_eval), np.asarray(x) / np.sqrt(1 + 1e-5), rtol=1e-6)


def test_dropout_off_in_eval_and_keyed_in_training(key):
    import jax

    model, state = tiny_cnn(key, dropout_rate=0.5)
    x = images()
    a, _ = apply(model, x, state, key=jax.random.key(1))
    b, _ = apply(model, x, state, key=jax.random.key(1))
    c, _ = apply(model, x, state, key=jax.random.key(2))
    np.testing.assert_array_equal(a, b)  # same key, same mask
    assert not np.allclose(a, c)  # another key, another mask
    e1, _ = apply(model, x, state, key=jax.random.key(1), inference=True)
    e2, _ = apply(model, x, state, inference=True)
    np.testing.assert_array_equal(e1, e2)  # evaluation ignores the key: no dropout
    with pytest.raises(ValueError, match="needs a dropout `key`"):
        apply(model, x, state)


def test_train_step_threads_bn_state_and_eval_is_deterministic(one_step, trees_close):
    import jax

    from equipax.core.step import make_eval_step

    initial, state, metrics, batch, _ = one_step
    assert {"loss", "accuracy", "loss_sum", "correct_sum", "weight_sum", "grad_norm"} <= set(metrics)
    assert all(
        not np.allclose(a, b) for a, b in zip(jax.tree.leaves(initial.model_state), jax.tree.leaves(state.model_state))
    )
    eval_step = make_eval_step(tiny_cnn_task())
    first = eval_step(state.model, batch, state.model_state)
    second = eval_step(state.model, batch, state.model_state)
    trees_close(first, second, rtol=0, atol=0)
    assert float(first["weight_sum"]) == 8.0
    # Padding rows (weight 0) do not count.
    padded = dict(batch, weights=np.r_[np.ones(4), np.zeros(4)].astype(np.float32))
    assert float(eval_step(state.model, padded, state.model_state)["weight_sum"]) == 4.0


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        dict(
            in_channels=1,
            stem_channels=8,
            stage_channels=(8, 16, 32),
            blocks_per_stage=1,
            num_heads=2,
            hidden_dims=20,
            num_classes=3,
        ),
    ],
)
def test_analytic_param_count_equals_the_traced_model(overrides):
    """`launch show` counts the CNN's parameters from the config (no JAX); it must match the model."""
    import equinox as eqx
    import jax

    from equipax.core.flops import count_params
    from equipax.models import AdvancedCNN, CNNConfig, cnn_param_count

    cfg = CNNConfig(**overrides)
    model, _ = eqx.filter_eval_shape(lambda k: eqx.nn.make_with_state(AdvancedCNN)(cfg, key=k), jax.random.key(0))
    assert cnn_param_count(cfg) == count_params(model)


def test_first_batch_is_checked_against_the_task():
    import numpy as np

    from equipax.core.task import BatchError
    from equipax.models import CNNConfig, ImageClassificationTask

    task = ImageClassificationTask(CNNConfig(in_channels=1), (8, 8, 1))
    good = {
        "images": np.zeros((4, 8, 8, 1), np.float32),
        "labels": np.zeros(4, np.int32),
        "weights": np.ones(4, np.float32),
    }
    task.check_batch(good, 4)
    with pytest.raises(BatchError, match="'images': expected shape \\(4, 8, 8, 1\\)"):
        task.check_batch({**good, "images": np.zeros((4, 9, 9, 1), np.float32)}, 4)
    with pytest.raises(BatchError, match="lack the field"):
        task.check_batch({"images": good["images"]}, 4)
