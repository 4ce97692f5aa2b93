import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from equipax.core.optim import LearnerConfig, ScheduleConfig, clip_by_update_rms, make_learner, make_schedule


def _values(schedule, steps):
    return np.array([float(schedule(jnp.asarray(s, jnp.int32))) for s in steps])


def test_constant_schedule():
    schedule = make_schedule(ScheduleConfig(peak_learning_rate=3e-4))
    np.testing.assert_allclose(_values(schedule, [0, 10, 10_000]), [3e-4] * 3, rtol=1e-6)


def test_warmup_cosine_schedule():
    cfg = ScheduleConfig(
        kind="warmup_cosine", peak_learning_rate=1e-3, warmup_steps=10, decay_steps=100, final_fraction=0.1
    )
    got = _values(make_schedule(cfg), [0, 5, 10, 60, 110, 1000])
    # Mid-cosine (50 of 100 steps): peak * (alpha + (1 - alpha) * 0.5 * (1 + cos(pi / 2))).
    want = [0.0, 5e-4, 1e-3, 1e-3 * (0.1 + 0.9 * 0.5), 1e-4, 1e-4]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-9)


def test_exponential_decay_schedule_22b():
    # Pax's 22B: warmup 4000, decay from the end of warmup to 0.1x at step 300000.
    cfg = ScheduleConfig(
        kind="linear_rampup_exponential_decay",
        peak_learning_rate=1e-3,
        warmup_steps=4000,
        decay_steps=300_000,
        final_fraction=0.1,
    )
    mid = (4000 + 300_000) // 2
    got = _values(make_schedule(cfg), [0, 2000, 4000, mid, 300_000, 400_000])
    want = [0.0, 5e-4, 1e-3, 1e-3 * math.sqrt(0.1), 1e-4, 1e-4]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-9)


def test_exponential_decay_holds_peak_until_decay_start():
    cfg = ScheduleConfig(
        kind="linear_rampup_exponential_decay",
        peak_learning_rate=2.0,
        warmup_steps=10,
        decay_start=20,
        decay_steps=30,
        final_fraction=0.25,
    )
    got = _values(make_schedule(cfg), [5, 10, 15, 20, 25, 30, 99])
    np.testing.assert_allclose(got, [1.0, 2.0, 2.0, 2.0, 1.0, 0.5, 0.5], rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(peak_learning_rate=0.0), "schedule.peak_learning_rate"),
        (dict(warmup_steps=-1), "schedule.warmup_steps"),
        (dict(kind="warmup_cosine", decay_steps=0), "schedule.decay_steps"),
        (dict(kind="warmup_cosine", decay_steps=5, final_fraction=1.5), "schedule.final_fraction"),
        (dict(kind="linear_rampup_exponential_decay", warmup_steps=10, decay_steps=5), "schedule.decay_steps"),
        (
            dict(kind="linear_rampup_exponential_decay", warmup_steps=10, decay_start=5, decay_steps=50),
            "schedule.decay_start",
        ),
        (dict(kind="linear_rampup_exponential_decay", decay_steps=50, final_fraction=0.0), "schedule.final_fraction"),
    ],
)
def test_bad_schedule_config_raises(kwargs, field):
    with pytest.raises(ValueError, match=field) as info:
        ScheduleConfig(**kwargs)
    assert "expected" in str(info.value) and "found" in str(info.value)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(b1=1.0), "learner.b1"),
        (dict(b2=-0.1), "learner.b2"),
        (dict(eps=-1.0), "learner.eps"),
        (dict(weight_decay=-1e-3), "learner.weight_decay"),
        (dict(clip_gradient_norm=0.0), "learner.clip_gradient_norm"),
        (dict(kind="pax_adam", clip_update_rms=-1.0), "learner.clip_update_rms"),
        (dict(kind="adamw", clip_update_rms=1.0), "learner.clip_update_rms"),
    ],
)
def test_bad_learner_config_raises(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LearnerConfig(**kwargs)


def test_unknown_kind_raises():
    # Under the test suite's runtime type checking the Literal annotation rejects the value
    # first (a TypeError); without it, __post_init__ raises a ValueError naming the field.
    with pytest.raises((ValueError, TypeError), match="kind"):
        ScheduleConfig(kind="cosine")  # pyright: ignore[reportArgumentType]
    with pytest.raises((ValueError, TypeError), match="kind"):
        LearnerConfig(kind="sgd")  # pyright: ignore[reportArgumentType]


def _params(key):
    k1, k2 = jax.random.split(key)
    return {"w": jax.random.normal(k1, (8, 16)), "b": jax.random.normal(k2, (16,)), "big": jnp.ones((4, 4))}


def test_clip_by_update_rms_bounds_each_tensor(key):
    updates = {"big": 10.0 * jnp.ones((4, 4)), "small": jnp.full((3,), 0.01), "none": None}
    clipped, _ = clip_by_update_rms(0.5).update(updates, optax.EmptyState())

    def rms(x):
        return float(jnp.sqrt(jnp.mean(jnp.square(x))))

    assert rms(clipped["big"]) == pytest.approx(0.5, rel=1e-6)
    np.testing.assert_array_equal(clipped["small"], updates["small"])
    assert clipped["none"] is None


def test_pax_adam_update_rms_clip_is_active(key):
    lr = 1.0
    cfg = LearnerConfig(
        kind="pax_adam", clip_gradient_norm=None, clip_update_rms=0.1, schedule=ScheduleConfig(peak_learning_rate=lr)
    )
    opt = make_learner(cfg).optimizer
    params = _params(key)
    state = opt.init(params)
    grads = jax.tree.map(lambda p: 3.0 * p, params)
    updates, _ = opt.update(grads, state, params)
    for name, u in updates.items():
        rms = float(jnp.sqrt(jnp.mean(jnp.square(u)))) / lr
        # Adam's first update has RMS ~1, so the 0.1 clip must be binding on every tensor.
        assert rms == pytest.approx(0.1, rel=1e-4), name


def test_pax_adam_matches_manual_adam_with_decay(key):
    lr, b1, b2, eps, wd = 0.01, 0.9, 0.99, 1e-6, 0.1
    cfg = LearnerConfig(
        kind="pax_adam",
        b1=b1,
        b2=b2,
        eps=eps,
        weight_decay=wd,
        clip_gradient_norm=None,
        schedule=ScheduleConfig(peak_learning_rate=lr),
    )
    opt = make_learner(cfg).optimizer
    params = _params(key)
    state = opt.init(params)
    ref = {k: np.asarray(v, np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in ref.items()}
    v = {k: np.zeros_like(x) for k, x in ref.items()}
    for t in range(1, 5):
        grads = {
            k: jax.random.normal(jax.random.fold_in(key, 10 * t + i), p.shape)
            for i, (k, p) in enumerate(sorted(params.items()))
        }
        updates, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        for k in ref:
            g = np.asarray(grads[k], np.float64)
            m[k] = b1 * m[k] + (1 - b1) * g
            v[k] = b2 * v[k] + (1 - b2) * g**2
            step = (m[k] / (1 - b1**t)) / (np.sqrt(v[k] / (1 - b2**t)) + eps)
            decay = wd * ref[k] if ref[k].ndim >= 2 else 0.0
            ref[k] = ref[k] - lr * (step + decay)
    for k in ref:
        np.testing.assert_allclose(np.asarray(params[k]), ref[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["adamw", "pax_adam"])
def test_weight_decay_only_on_matrices(kind, key):
    lr, wd = 0.1, 0.5
    cfg = LearnerConfig(kind=kind, weight_decay=wd, schedule=ScheduleConfig(peak_learning_rate=lr))
    opt = make_learner(cfg).optimizer
    params = _params(key)
    zero_grads = jax.tree.map(jnp.zeros_like, params)
    updates, _ = opt.update(zero_grads, opt.init(params), params)
    new = optax.apply_updates(params, updates)
    np.testing.assert_allclose(new["w"], params["w"] * (1 - lr * wd), rtol=1e-6)
    np.testing.assert_array_equal(new["b"], params["b"])


@pytest.mark.parametrize("kind", ["adamw", "pax_adam"])
def test_global_norm_clip_reaches_adam_moments(kind, key):
    b2 = 0.999
    cfg = LearnerConfig(kind=kind, b2=b2, clip_gradient_norm=2.0)
    opt = make_learner(cfg).optimizer
    params = _params(key)
    grads = jax.tree.map(lambda p: 100.0 * p, params)
    _, state = opt.update(grads, opt.init(params), params)
    nu = optax.tree_utils.tree_get(state, "nu")
    scale = 2.0 / float(optax.tree.norm(grads))
    want = jax.tree.map(lambda g: (1 - b2) * (scale * g) ** 2, grads)
    for k in params:
        np.testing.assert_allclose(nu[k], want[k], rtol=1e-4)


@pytest.mark.parametrize("kind", ["adamw", "pax_adam"])
def test_mu_dtype_stores_the_first_moment_in_bfloat16(kind, key):
    """learner.mu_dtype='bfloat16': Adam's first moment is kept in bfloat16 (half its memory), the
    second moment and the parameters stay float32, and ten steps land where float32 moments do
    to bfloat16's precision."""
    params = _params(key)
    grads_at = [jax.tree.map(lambda p, i=i: jnp.sin(p * (i + 1)), params) for i in range(10)]
    finals = {}
    for mu_dtype in (None, "bfloat16"):
        opt = make_learner(LearnerConfig(kind=kind, mu_dtype=mu_dtype, weight_decay=1e-2)).optimizer
        state, p = opt.init(params), params
        for grads in grads_at:
            updates, state = opt.update(grads, state, p)
            p = optax.apply_updates(p, updates)
        mu, nu = optax.tree_utils.tree_get(state, "mu"), optax.tree_utils.tree_get(state, "nu")
        want = jnp.bfloat16 if mu_dtype else jnp.float32
        assert all(x.dtype == want for x in jax.tree.leaves(mu))
        assert all(x.dtype == jnp.float32 for x in jax.tree.leaves((nu, p)))
        finals[mu_dtype] = p
    moved = jax.tree.map(lambda a, b: jnp.max(jnp.abs(a - b)), finals[None], params)
    for k in params:
        err = float(jnp.max(jnp.abs(finals["bfloat16"][k] - finals[None][k])))
        assert err < 0.02 * float(moved[k]) + 1e-7, (k, err, float(moved[k]))


def test_bad_mu_dtype_names_the_knob():
    with pytest.raises((ValueError, TypeError), match="mu_dtype"):
        LearnerConfig(mu_dtype="float16")  # pyright: ignore[reportArgumentType]


def _pax_adam_reference(cfg):
    """Pax's Adam as the plain optax chain: global-norm clip, Adam, per-tensor update-RMS clip,
    decoupled weight decay on matrices, learning rate (what `make_learner` builds, with optax's own
    Adam, which computes its update from the moments before the train step's guard)."""
    from equipax.core.optim import decay_mask

    return optax.chain(
        optax.clip_by_global_norm(cfg.clip_gradient_norm),
        optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, mu_dtype=cfg.mu_dtype),
        clip_by_update_rms(cfg.clip_update_rms),
        optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask),
        optax.scale_by_learning_rate(make_schedule(cfg.schedule)),
    )


@pytest.mark.parametrize("mu_dtype", [None, "bfloat16"])
def test_pax_adam_trains_as_the_plain_optax_chain_bit_for_bit(mu_dtype, key):
    """pax_adam's update, computed from the moments the guarded train step keeps (so XLA:TPU
    applies it in the passes AdamW's update takes, tests/launch/test_compile_tpu.py), is the plain
    optax chain's, bit for bit: parameters, optimizer state and metrics, over steps where the
    update-RMS clip binds on some tensors, the global-norm clip on some steps, and one step whose
    gradients are NaN is skipped."""
    from equipax.core.step import LossFnTask, init_train_state, make_train_step

    cfg = LearnerConfig(
        kind="pax_adam",
        clip_gradient_norm=3.0,
        clip_update_rms=0.5,
        weight_decay=0.1,
        mu_dtype=mu_dtype,
        schedule=ScheduleConfig(kind="warmup_cosine", peak_learning_rate=0.05, warmup_steps=2, decay_steps=20),
    )
    learner = make_learner(cfg)

    def loss_fn(model, batch, key):
        h = jnp.tanh(batch["x"] @ model["w"] + model["b"][None, :])
        return jnp.mean(jnp.square(h @ model["v"] - batch["y"])), {}

    k1, k2, k3 = jax.random.split(key, 3)
    model = {"w": jax.random.normal(k1, (8, 16)), "b": jnp.zeros((16,)), "v": jax.random.normal(k2, (16, 4))}
    batches = [
        {"x": s * jax.random.normal(jax.random.fold_in(k3, i), (32, 8)), "y": jnp.ones((32, 4))}
        for i, s in enumerate([1.0, 10.0, 1.0, jnp.nan, 0.5, 20.0, 1.0])
    ]
    runs = {}
    for name, opt in (("learner", learner.optimizer), ("reference", _pax_adam_reference(cfg))):
        step = make_train_step(LossFnTask(loss_fn), opt, learner.schedule, skip_nonfinite=True)
        state, metrics = init_train_state(model, opt), []
        for batch in batches:
            state, m = step(state, batch, key)
            metrics.append(m)
        runs[name] = (state.model, state.opt_state, metrics)
    got, want = jax.tree.leaves(runs["learner"]), jax.tree.leaves(runs["reference"])
    assert jax.tree.structure(runs["learner"]) == jax.tree.structure(runs["reference"])
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    metrics = runs["learner"][2]
    assert [float(m["nonfinite"]) for m in metrics] == [0, 0, 0, 1, 0, 0, 0]
    assert any(float(m["grad_norm"]) > 3.0 for m in metrics)  # the global-norm clip bound
    assert all(np.isfinite(float(m["update_norm"])) for i, m in enumerate(metrics) if i != 3)
    assert float(metrics[3]["update_norm"]) == np.inf  # skipped: no update (not one from the kept moments)


def test_pax_adam_told_the_step_is_skipped_still_returns_its_new_state(key):
    """Given `grads_finite=False` (the step will keep the old state), pax_adam's optimizer
    returns optax's new state all the same (the step selects), and with `grads_finite=True` both
    its update and state are optax's."""
    cfg = LearnerConfig(kind="pax_adam", clip_update_rms=0.5, weight_decay=0.1)
    opt, reference = make_learner(cfg).optimizer, _pax_adam_reference(cfg)
    params = _params(key)
    state = opt.init(params)
    grads = jax.tree.map(lambda p: 3.0 * p, params)
    want_updates, want_state = reference.update(grads, state, params)
    for finite in (True, False):
        updates, new_state = opt.update(grads, state, params, grads_finite=jnp.asarray(finite))
        for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(want_state)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        if finite:
            for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(want_updates)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
