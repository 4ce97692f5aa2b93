import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array, Float

from equipax.core.optim import LearnerConfig, ScheduleConfig, make_learner, make_schedule
from equipax.core.step import LossFnTask, TrainState, init_train_state, make_eval_step, make_train_step

IN, HIDDEN, OUT, BATCH = 4, 32, 1, 64


class MLP(eqx.Module):
    w1: Float[Array, "in hidden"]
    b1: Float[Array, " hidden"]
    w2: Float[Array, "hidden out"]
    b2: Float[Array, " out"]
    dropout: float = eqx.field(static=True)

    def __init__(self, *, dropout: float = 0.0, key):
        k1, k2 = jax.random.split(key)
        self.w1 = jax.random.normal(k1, (IN, HIDDEN)) / np.sqrt(IN)
        self.b1 = jnp.zeros((HIDDEN,))
        self.w2 = jax.random.normal(k2, (HIDDEN, OUT)) / np.sqrt(HIDDEN)
        self.b2 = jnp.zeros((OUT,))
        self.dropout = dropout

    def __call__(self, x: Float[Array, "batch in"], *, key=None) -> Float[Array, "batch out"]:
        h = jax.nn.gelu(x @ self.w1 + self.b1[None, :])
        if key is not None and self.dropout > 0:
            keep = jax.random.bernoulli(key, 1.0 - self.dropout, h.shape)
            h = jnp.where(keep, h / (1.0 - self.dropout), 0.0)
        return h @ self.w2 + self.b2[None, :]


def loss_fn(model, batch, *, key):
    pred = model(batch["x"], key=key)
    err = jnp.square(pred[:, 0] - batch["y"])
    loss = jnp.mean(err)
    return loss, {"loss_sum": jnp.sum(err), "num_examples": jnp.asarray(err.size, jnp.float32)}


def make_batch(key):
    kx, kn = jax.random.split(key)
    x = jax.random.normal(kx, (BATCH, IN))
    y = jnp.sin(x[:, 0]) + 0.5 * x[:, 1] * x[:, 2] + 0.01 * jax.random.normal(kn, (BATCH,))
    return {"x": x, "y": y}


LEARNER = LearnerConfig(
    kind="pax_adam",
    b2=0.99,
    weight_decay=1e-3,
    clip_gradient_norm=5.0,
    clip_update_rms=1.0,
    schedule=ScheduleConfig(
        kind="linear_rampup_exponential_decay",
        peak_learning_rate=1e-2,
        warmup_steps=5,
        decay_steps=100,
        final_fraction=0.1,
    ),
)


_OPTIMIZER = make_learner(LEARNER).optimizer
_SCHEDULE = make_schedule(LEARNER.schedule)
# One step function for the module, so it compiles once.
_STEP = make_train_step(LossFnTask(loss_fn), _OPTIMIZER, _SCHEDULE)


def setup(key):
    state = init_train_state(MLP(dropout=0.1, key=key), _OPTIMIZER)
    return state, _STEP, _SCHEDULE


def run(step_fn, state, batches, key, n):
    history = []
    for i in range(n):
        state, metrics = step_fn(state, batches[i % len(batches)], key)
        history.append(metrics)
    return state, history


def to_numpy(state):
    """Split a state into host numpy leaves (what a checkpoint would store) and the rest."""
    arrays, static = eqx.partition(state, eqx.is_array)
    leaves, treedef = jax.tree.flatten(arrays)
    return [np.asarray(x).copy() for x in leaves], treedef, static


def from_numpy(leaves, treedef, static):
    return eqx.combine(jax.tree.unflatten(treedef, [jnp.asarray(x) for x in leaves]), static)


@pytest.fixture(scope="module")
def batches():
    return [make_batch(jax.random.key(100 + i)) for i in range(4)]


def test_loss_decreases_and_metrics(key, batches):
    state, step_fn, schedule = setup(key)
    base_key = jax.random.key(1)
    state, history = run(step_fn, state, batches, base_key, 30)
    assert int(state.step) == 30
    expected = {"loss", "loss_sum", "num_examples", "grad_norm", "param_norm", "learning_rate"}
    for i, metrics in enumerate(history):
        assert set(metrics) == expected
        for name, value in metrics.items():
            assert value.shape == () and bool(jnp.isfinite(value)), (i, name)
        # Equal up to float32 rounding (XLA may fuse the jitted schedule differently).
        want_lr = float(schedule(jnp.asarray(i, jnp.int32)))
        assert float(metrics["learning_rate"]) == pytest.approx(want_lr, rel=1e-6, abs=1e-12)
    assert float(history[0]["learning_rate"]) == 0.0  # warmup starts at 0
    first = np.mean([float(m["loss"]) for m in history[:4]])
    last = np.mean([float(m["loss"]) for m in history[-4:]])
    assert last < 0.5 * first, (first, last)
    # Eval on the trained model agrees with a direct deterministic evaluation.
    aux = make_eval_step(LossFnTask(loss_fn))(state.model, batches[0])
    _, want = loss_fn(state.model, batches[0], key=None)
    assert set(aux) == {"loss_sum", "num_examples"}
    np.testing.assert_allclose(aux["loss_sum"], want["loss_sum"], rtol=1e-5)


def test_step_is_deterministic(key, batches):
    base_key = jax.random.key(7)
    a, step_fn, _ = setup(key)
    b, _, _ = setup(key)
    a, ma = run(step_fn, a, batches, base_key, 3)
    b, mb = run(step_fn, b, batches, base_key, 3)
    for x, y in zip(
        jax.tree.leaves(eqx.filter((a, ma), eqx.is_array)), jax.tree.leaves(eqx.filter((b, mb), eqx.is_array))
    ):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_step_key_changes_with_step(key, batches):
    # Dropout masks come from fold_in(key, step): a different base key gives different losses.
    a, step_fn, _ = setup(key)
    b, _, _ = setup(key)
    _, ma = step_fn(a, batches[0], jax.random.key(1))
    _, mb = step_fn(b, batches[0], jax.random.key(2))
    assert float(ma["loss"]) != float(mb["loss"])


def test_resume_from_numpy_equals_uninterrupted(key, batches):
    n = 4
    base_key = jax.random.key(3)
    straight, step_fn, _ = setup(key)
    straight, _ = run(step_fn, straight, batches, base_key, 2 * n)

    resumed, _, _ = setup(key)
    resumed, _ = run(step_fn, resumed, batches, base_key, n)
    leaves, treedef, static = to_numpy(resumed)
    del resumed
    resumed = from_numpy(leaves, treedef, static)
    assert int(resumed.step) == n
    resumed, _ = run(step_fn, resumed, batches[n % len(batches) :] + batches[: n % len(batches)], base_key, n)

    got, _, _ = to_numpy(resumed)
    want, _, _ = to_numpy(straight)
    assert len(got) == len(want)
    for x, y in zip(got, want):
        np.testing.assert_array_equal(x, y)


def test_state_is_donated_batch_is_not(key, batches):
    state, step_fn, _ = setup(key)
    base_key = jax.random.key(0)
    old_w1 = state.model.w1
    state, _ = step_fn(state, batches[0], base_key)
    assert old_w1.is_deleted()
    assert not batches[0]["x"].is_deleted() and not base_key.is_deleted()
    # The same batch and key can be used again.
    state, metrics = step_fn(state, batches[0], base_key)
    assert int(state.step) == 2 and bool(jnp.isfinite(metrics["loss"]))


def test_reserved_aux_name_raises(key, batches):
    def bad_loss(model, batch, *, key):
        loss, _ = loss_fn(model, batch, key=key)
        return loss, {"grad_norm": loss}

    optimizer = make_learner(LearnerConfig()).optimizer
    state = init_train_state(MLP(key=key), optimizer)
    step_fn = make_train_step(LossFnTask(bad_loss), optimizer, make_schedule(ScheduleConfig()))
    with pytest.raises(ValueError, match="grad_norm"):
        step_fn(state, batches[0], key)


def test_train_state_fields(key):
    state = init_train_state(MLP(key=key), make_learner(LearnerConfig()).optimizer)
    assert isinstance(state, TrainState)
    assert state.step.dtype == jnp.int32 and int(state.step) == 0
    assert state.model_state is None


def test_train_step_skips_nonfinite_updates_in_graph(key):
    import equinox as eqx

    from equipax.core.optim import LearnerConfig, make_learner
    from equipax.core.step import LossFnTask, init_train_state, make_train_step

    model = eqx.nn.Linear(3, 2, key=key)

    def loss_fn(m, batch, *, key):
        pred = jax.vmap(m)(batch["x"])
        return jnp.mean((pred - batch["y"]) ** 2), {}

    cfg = LearnerConfig()
    opt, sched = make_learner(cfg)
    step = make_train_step(LossFnTask(loss_fn), opt, sched, skip_nonfinite=True)
    good = {"x": jnp.ones((4, 3)), "y": jnp.zeros((4, 2))}
    bad = {"x": jnp.full((4, 3), jnp.nan), "y": jnp.zeros((4, 2))}
    state = init_train_state(model, opt)
    state, m1 = step(state, good, key)
    before = jax.tree.map(np.asarray, eqx.filter((state.model, state.opt_state), eqx.is_array))
    state, m2 = step(state, bad, key)
    after = jax.tree.map(np.asarray, eqx.filter((state.model, state.opt_state), eqx.is_array))
    assert float(m1["nonfinite"]) == 0.0 and float(m2["nonfinite"]) == 1.0
    assert int(state.step) == 2  # the counter advances: step numbers stay aligned with batches
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(a, b)  # parameters and optimizer state untouched
    state, m3 = step(state, good, key)
    assert np.isfinite(float(m3["loss"])) and float(m3["nonfinite"]) == 0.0


def test_an_overflowing_update_never_makes_a_parameter_non_finite(key):
    """Finite loss and gradients, an update that overflows (a learning rate of 1e38): the step is
    reported non-finite, the moments advance, and each parameter is either updated (where that
    stays finite) or kept; none becomes inf or NaN."""
    import equinox as eqx
    import optax

    from equipax.core.step import LossFnTask, init_train_state, make_train_step

    model = eqx.nn.Linear(3, 2, key=key)

    def loss_fn(m, batch, *, key):
        pred = jax.vmap(m)(batch["x"])
        return jnp.mean((pred - batch["y"]) ** 2), {}

    opt = optax.sgd(1e38)
    step = make_train_step(LossFnTask(loss_fn), opt, optax.constant_schedule(1e38), skip_nonfinite=True)
    # The first input's gradients are ~50 (their updates overflow), the second's ~0.05 (finite).
    batch = {"x": jnp.asarray([[10.0, 0.01, 0.0]]), "y": jnp.full((1, 2), 5.0)}
    state = init_train_state(model, opt)
    before = np.asarray(state.model.weight)
    state, metrics = step(state, batch, key)
    after = np.asarray(state.model.weight)
    assert float(metrics["nonfinite"]) == 1.0 and not np.isfinite(float(metrics["update_norm"]))
    assert np.isfinite(float(metrics["grad_norm"])) and np.all(np.isfinite(after))
    grad = np.asarray(jax.grad(lambda m: loss_fn(m, batch, key=None)[0])(model).weight)
    with np.errstate(over="ignore"):
        expected = (before - np.float32(1e38) * grad).astype(np.float32)
    applied = np.isfinite(expected)
    assert applied.any() and not applied.all()  # both cases occur in this batch
    np.testing.assert_array_equal(after[~applied], before[~applied])  # kept where it would overflow
    np.testing.assert_array_equal(after[applied], expected[applied])


@pytest.mark.parametrize("learning_rate", [1e38, 1e30])
def test_without_the_update_norm_check_an_overflow_is_still_reported_at_its_step(key, learning_rate):
    """`check_update_norm=False` (train.check_update_norm): no `update_norm` metric, but an update
    that overflows a parameter (1e38) or leaves it finite and past any forward pass (1e30: weights
    of ~1e31, whose squares overflow float32) is reported non-finite at its own step, as with the
    norm; it is still applied only where it stays finite, and a non-finite loss still skips."""
    import optax

    def loss_fn(m, batch, *, key):
        return jnp.mean((jax.vmap(m)(batch["x"]) - batch["y"]) ** 2), {}

    opt = optax.sgd(learning_rate)
    schedule = optax.constant_schedule(learning_rate)
    step = make_train_step(LossFnTask(loss_fn), opt, schedule, skip_nonfinite=True, check_update_norm=False)
    state = init_train_state(eqx.nn.Linear(3, 2, key=key), opt)
    before = np.asarray(state.model.weight)
    state, metrics = step(state, {"x": jnp.asarray([[10.0, 0.01, 0.0]]), "y": jnp.full((1, 2), 5.0)}, key)
    assert "update_norm" not in metrics and float(metrics["nonfinite"]) == 1.0
    after = np.asarray(state.model.weight)
    assert np.all(np.isfinite(after)) and not np.array_equal(after, before)
    nan = {"x": jnp.full((1, 3), jnp.nan), "y": jnp.zeros((1, 2))}
    state, metrics = step(state, nan, key)
    assert float(metrics["nonfinite"]) == 1.0
    np.testing.assert_array_equal(np.asarray(state.model.weight), after)


def test_without_the_update_norm_check_a_sane_update_is_not_flagged(key):
    """The flag that stands in for the norm stays 0 for an ordinary step (it is no blanket refusal)."""
    import optax

    def loss_fn(m, batch, *, key):
        return jnp.mean((jax.vmap(m)(batch["x"]) - batch["y"]) ** 2), {}

    opt = optax.adam(1e-3)
    step = make_train_step(
        LossFnTask(loss_fn), opt, optax.constant_schedule(1e-3), skip_nonfinite=True, check_update_norm=False
    )
    state = init_train_state(eqx.nn.Linear(3, 2, key=key), opt)
    state, metrics = step(state, {"x": jnp.asarray([[10.0, 0.01, 0.0]]), "y": jnp.full((1, 2), 5.0)}, key)
    assert float(metrics["nonfinite"]) == 0.0


def test_shardings_on_one_device_add_no_constraints_and_compile_once(key, batches):
    """On a one-device mesh the step leaves its boundary constraints out (no-ops there) and still
    compiles once over repeated calls; on several devices they stay (tests/models/test_sharding.py)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from equipax.core import step as step_module

    mesh = jax.make_mesh((1,), ("data",))
    state = init_train_state(MLP(key=key), _OPTIMIZER)
    state_sharding = jax.tree.map(lambda _: NamedSharding(mesh, P()), eqx.filter(state, eqx.is_array))
    assert not step_module._placed_on_several_devices(state_sharding)
    step = make_train_step(
        LossFnTask(loss_fn),
        _OPTIMIZER,
        _SCHEDULE,
        state_sharding=state_sharding,
        batch_sharding=NamedSharding(mesh, P()),
    )
    assert "sharding_constraint" not in step.lower(state, batches[0], key).as_text()
    compiles = []

    def on_event(name, secs, **kw):
        if name == "/jax/core/compile/backend_compile_duration" and kw.get("fun_name") == "jit(train_step)":
            compiles.append(name)

    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        run(step, state, batches, key, 3)
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
    assert len(compiles) == 1
