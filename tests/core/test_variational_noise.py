"""Variational noise (`equipax.core.variational_noise`, `make_train_step(variational_noise=...)`):
the matched parameters get N(0, vn_scale^2) from vn_start_step on; the step's loss and gradient are
those at the noisy weights, applied to the clean ones (checked against jax.grad by hand); the
noise comes from the step key or vn_seed, so a resumed run continues bit for bit; eval sees none."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jaxtyping import Array, Float

from equipax.core.knobs import ConfigError
from equipax.core.step import LossFnTask, init_train_state, make_eval_step, make_train_step
from equipax.core.variational_noise import (
    VariationalNoiseConfig,
    add_variational_noise,
    noise_key,
    param_paths,
    variational_noise,
)


class Net(eqx.Module):
    w1: Float[Array, "in hidden"]
    b1: Float[Array, " hidden"]
    w2: Float[Array, "hidden out"]

    def __init__(self, key, hidden=64):
        k1, k2 = jax.random.split(key)
        self.w1 = jax.random.normal(k1, (8, hidden)) / np.sqrt(8)
        self.b1 = jnp.zeros((hidden,))
        self.w2 = jax.random.normal(k2, (hidden, 1)) / np.sqrt(hidden)

    def __call__(self, x):
        return jnp.tanh(x @ self.w1 + self.b1[None, :]) @ self.w2


def loss_fn(model, batch, *, key):
    err = jnp.square(model(batch["x"])[:, 0] - batch["y"])
    return jnp.mean(err), {"loss_sum": jnp.sum(err), "num_examples": jnp.asarray(err.size, jnp.float32)}


BATCH = {"x": jax.random.normal(jax.random.key(1), (32, 8)), "y": jax.random.normal(jax.random.key(2), (32,))}
VN = VariationalNoiseConfig(vn_scale=0.05, vn_regex="w1|b1", vn_start_step=0)


def step_fn(vn, lr=1.0):
    return make_train_step(LossFnTask(loss_fn), optax.sgd(lr), optax.constant_schedule(lr), variational_noise=vn)


def test_noise_follows_regex_scale_and_start_step():
    net = Net(jax.random.key(0), hidden=4096)
    assert param_paths(net) == ["w1", "b1", "w2"]
    cfg = VariationalNoiseConfig(vn_scale=0.1, vn_regex="^w1$", vn_start_step=3)
    key = jax.random.key(5)
    noise = variational_noise(net, cfg, key=key, step=jnp.asarray(3))
    w1 = np.asarray(noise.w1)
    assert abs(w1.std() / 0.1 - 1) < 0.02 and abs(w1.mean()) < 0.003  # 32768 draws of N(0, 0.01)
    assert not np.any(np.asarray(noise.b1)) and not np.any(np.asarray(noise.w2))
    before = variational_noise(net, cfg, key=key, step=jnp.asarray(2))
    assert not any(np.any(np.asarray(x)) for x in jax.tree.leaves(before))
    noisy = add_variational_noise(net, cfg, key=key, step=jnp.asarray(3))
    np.testing.assert_array_equal(noisy.w1, net.w1 + noise.w1)
    assert noisy.b1 is net.b1 and noisy.w2 is net.w2  # unmatched leaves untouched


def test_the_step_trains_at_the_noisy_weights_and_updates_the_clean_ones():
    net = Net(jax.random.key(0))
    base = jax.random.key(9)
    _, metrics = step_fn(None)(init_train_state(net, optax.sgd(1.0)), BATCH, base)
    clean_loss = metrics["loss"]
    state, metrics = step_fn(VN)(init_train_state(net, optax.sgd(1.0)), BATCH, base)
    # By hand: the noise of step 0, the loss and gradient there, SGD with lr 1 on the clean weights.
    noisy = add_variational_noise(net, VN, key=noise_key(VN, jax.random.fold_in(base, 0), jnp.asarray(0)), step=0)
    (loss, _), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(noisy, BATCH, key=None)
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-6)
    assert abs(float(loss) - float(clean_loss)) > 1e-4  # the noise changed the loss
    for name in ("w1", "b1", "w2"):
        want = getattr(net, name) - getattr(grads, name)
        np.testing.assert_allclose(getattr(state.model, name), want, rtol=1e-5, atol=1e-6)
    # The check can fail: the gradient at the clean weights is a different update.
    (_, _), clean_grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(net, BATCH, key=None)
    assert not np.allclose(net.w1 - clean_grads.w1, state.model.w1, rtol=1e-5, atol=1e-6)
    # Eval sees the trained parameters, without noise.
    sums = make_eval_step(LossFnTask(loss_fn))(state.model, BATCH)
    np.testing.assert_allclose(sums["loss_sum"] / 32, loss_fn(state.model, BATCH, key=None)[0], rtol=1e-6)


def test_vn_seed_noise_ignores_the_run_key_and_resume_is_bit_exact():
    net = Net(jax.random.key(0))
    seeded = VariationalNoiseConfig(vn_scale=0.05, vn_seed=7)
    losses = {}
    for cfg, name in ((seeded, "seeded"), (VN, "step_key")):
        for base in (1, 2):
            _, m = step_fn(cfg)(init_train_state(net, optax.sgd(1.0)), BATCH, jax.random.key(base))
            losses[name, base] = float(m["loss"])
    assert losses["seeded", 1] == losses["seeded", 2]
    assert losses["step_key", 1] != losses["step_key", 2]

    step, key = step_fn(VN, lr=0.1), jax.random.key(3)
    straight = init_train_state(net, optax.sgd(0.1))
    for _ in range(4):
        straight, _ = step(straight, BATCH, key)
    resumed = init_train_state(net, optax.sgd(0.1))
    for _ in range(2):
        resumed, _ = step(resumed, BATCH, key)
    resumed = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)) if eqx.is_array(x) else x, resumed)  # a restore
    for _ in range(2):
        resumed, _ = step(resumed, BATCH, key)
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "kwargs, knob",
    [
        ({"vn_scale": -0.1}, "train.vn.vn_scale"),
        ({"vn_scale": float("nan")}, "train.vn.vn_scale"),
        ({"vn_regex": "blocks/(attention"}, "train.vn.vn_regex"),
        ({"vn_start_step": -1}, "train.vn.vn_start_step"),
    ],
)
def test_bad_knobs_name_themselves(kwargs, knob):
    with pytest.raises(ConfigError, match=knob.replace(".", r"\.")):
        VariationalNoiseConfig(**kwargs)
