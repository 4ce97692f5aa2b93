"""The tutorial's image classifier: BatchNorm state, dropout keys, the stateful train step,
image inputs, checkpoints with BatchNorm state, and the `cnn_*` experiments end to end."""

import functools
import json

import numpy as np
import pytest

from toy import CNN_TOY, persistent_compile_cache, set_args


def tiny_cnn(key, **overrides):
    import equinox as eqx

    from equipax.models import AdvancedCNN, CNNConfig

    cfg = CNNConfig(**{"in_channels": 1, "stem_channels": 4, "stage_channels": (8, 16), "blocks_per_stage": 1,
                       "num_heads": 2, "hidden_dims": 16, **overrides})
    return eqx.nn.make_with_state(AdvancedCNN)(cfg, key=key)


def images(n=4, size=8, channels=1, seed=0):
    import jax.numpy as jnp

    return jnp.asarray(np.random.default_rng(seed).normal(size=(n, size, size, channels)), jnp.float32)


@functools.cache
def _jitted_call():
    import equinox as eqx

    return eqx.filter_jit(lambda m, x, s, k, i: m(x, s, key=k, inference=i))


def apply(model, x, state, *, key=None, inference=False):
    """The model under jit (fast, and each call unflattens its own copy of the state)."""
    return _jitted_call()(model, x, state, key, inference)


def invoke(*args):
    from typer.testing import CliRunner

    from equipax.launch.cli import app

    return CliRunner().invoke(app, list(args))


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
    import jax.numpy as jnp

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


@pytest.fixture(scope="module")
def one_step():
    """(initial state, state after one train step, metrics, batch, optimizer) of a tiny CNN."""
    import jax

    from equipax.core.optim import LearnerConfig, make_learner, make_schedule
    from equipax.core.step import init_train_state, make_train_step
    from equipax.models import classification_loss

    model, model_state = tiny_cnn(jax.random.key(0))
    learner = LearnerConfig()
    optimizer = make_learner(learner).optimizer
    fresh_model, fresh_state = tiny_cnn(jax.random.key(0))
    initial = init_train_state(fresh_model, optimizer, model_state=fresh_state)
    state = init_train_state(model, optimizer, model_state=model_state)
    batch = {"images": images(n=8), "labels": np.arange(8, dtype=np.int32) % 10,
             "weights": np.ones((8,), np.float32)}
    step = make_train_step(classification_loss, optimizer, make_schedule(learner.schedule))
    state, metrics = step(state, batch, jax.random.key(1))
    return initial, state, metrics, batch, optimizer


def test_train_step_threads_bn_state_and_eval_is_deterministic(one_step, trees_close):
    import jax

    from equipax.core.step import make_eval_step
    from equipax.models import classification_loss

    initial, state, metrics, batch, _ = one_step
    assert {"loss", "accuracy", "loss_sum", "correct_sum", "weight_sum", "grad_norm"} <= set(metrics)
    assert all(not np.allclose(a, b)
               for a, b in zip(jax.tree.leaves(initial.model_state), jax.tree.leaves(state.model_state)))
    eval_step = make_eval_step(classification_loss)
    first = eval_step(state.model, batch, state.model_state)
    second = eval_step(state.model, batch, state.model_state)
    trees_close(first, second, rtol=0, atol=0)
    assert float(first["weight_sum"]) == 8.0
    # Padding rows (weight 0) do not count.
    padded = dict(batch, weights=np.r_[np.ones(4), np.zeros(4)].astype(np.float32))
    assert float(eval_step(state.model, padded, state.model_state)["weight_sum"]) == 4.0


def test_image_input_epochs_padding_and_resume():
    from equipax.data import ImageClassificationInput, split_digits, synthetic_images

    x, y = synthetic_images(10, image_size=4, channels=1, seed=0)
    train = ImageClassificationInput(x, y, batch_size=4, seed=1)
    assert train.steps_per_epoch == 2  # 10 // 4: the remainder is dropped
    seen = [train.get_next()["labels"] for _ in range(4)]
    state = train.get_state()
    nxt = train.get_next()
    again = ImageClassificationInput(x, y, batch_size=4, seed=1)
    again.set_state(state)
    np.testing.assert_array_equal(again.get_next()["images"], nxt["images"])
    assert len(seen) == 4
    test = ImageClassificationInput(x, y, batch_size=4, repeat=False, shuffle=False)
    batches = list(test)
    assert len(batches) == 3 and batches[-1]["weights"].tolist() == [1, 1, 0, 0]
    (tr_x, tr_y), (te_x, te_y) = split_digits(0.2, seed=0)
    assert tr_x.shape == (1438, 8, 8, 1) and te_x.shape == (359, 8, 8, 1)
    assert 0.0 <= tr_x.min() and tr_x.max() <= 1.0 and set(np.unique(tr_y)) == set(range(10))
    (_, tr_y2), _ = split_digits(0.2, seed=0)
    np.testing.assert_array_equal(tr_y, tr_y2)  # a fixed split


def test_checkpoint_round_trip_includes_bn_state(one_step, tmp_path, trees_close):
    import jax

    from equipax.launch.training.checkpoints import Checkpointer

    template, state, _, _, _ = one_step
    ckpt = Checkpointer(tmp_path / "checkpoints", keep=2)
    ckpt.save(1, state, {"input": {"step": 1}})
    ckpt.wait()
    restored, data = ckpt.restore(1, template)
    ckpt.close()
    assert data == {"input": {"step": 1}}
    trees_close(restored.model_state, state.model_state, rtol=0, atol=0)
    assert not np.allclose(jax.tree.leaves(restored.model_state)[0], jax.tree.leaves(template.model_state)[0])
    trees_close(jax.tree.leaves(restored.model), jax.tree.leaves(state.model), rtol=0, atol=0)
    trees_close(jax.tree.leaves(restored.opt_state), jax.tree.leaves(state.opt_state), rtol=0, atol=0)


@pytest.mark.slow
def test_short_cnn_digits_run_learns_and_writes_job_dir(tmp_path):
    job = tmp_path / "job"
    result = invoke("run", "--exp", "cnn_digits", "--job-log-dir", str(job),
                    *set_args([*CNN_TOY, "train.num_epochs=2", "data.batch_size=32"]))
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    assert "Epoch 2/2: Loss:" in result.output and "Test Acc:" in result.output
    for name in ("config.json", "knobs.txt", "metrics.jsonl", "result.json", "plots/history.png"):
        assert (job / name).exists(), name
    for split in ("train", "eval", "epoch"):
        assert list((job / "summaries" / split).iterdir()), split
    records = [json.loads(ln) for ln in (job / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in records if r["split"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [1, 2] and [r["step"] for r in epochs] == [44, 88]
    res = json.loads((job / "result.json").read_text())
    assert res["final_test_accuracy"] > 0.8, res["history"]  # chance is 0.1
    assert res["history"]["test_accuracy"] == [r["test_accuracy"] for r in epochs]


@pytest.mark.slow
def test_resume_mid_epoch_equals_uninterrupted(tmp_path, monkeypatch):
    sets = set_args([*CNN_TOY, "train.num_epochs=2", "data.batch_size=128", "train.log_every=4"])
    # The three runs compile the same programs: once, then from JAX's persistent cache.
    with persistent_compile_cache(tmp_path / "jax-cache"):
        _resume_mid_epoch(tmp_path, monkeypatch, sets)


def _resume_mid_epoch(tmp_path, monkeypatch, sets):
    import equipax.launch.training.loop as classify
    from equipax.data import ImageClassificationInput
    from equipax.launch.errors import EXIT_PREEMPTED
    from equipax.launch.training.preemption import StopRequest

    full = invoke("run", "--exp", "cnn_digits", "--job-log-dir", str(tmp_path / "full"), *sets)
    assert full.exit_code == 0, full.output

    fetched = {"n": 0}
    original = ImageClassificationInput.get_next

    def counting(self):
        fetched["n"] += self.repeat
        return original(self)

    class StopAfter15(StopRequest):  # as if SIGTERM arrived during step 15 (epoch 2, of 11 steps)
        def __bool__(self):
            self.signal_name = "SIGTERM" if fetched["n"] >= 15 else None
            return self.signal_name is not None

    with monkeypatch.context() as m:
        m.setattr(ImageClassificationInput, "get_next", counting)
        m.setattr(classify, "StopRequest", StopAfter15)
        first = invoke("run", "--exp", "cnn_digits", "--job-log-dir", str(tmp_path / "split"), *sets)
    assert first.exit_code == EXIT_PREEMPTED, first.output
    second = invoke("run", "--exp", "cnn_digits", "--job-log-dir", str(tmp_path / "split"), *sets)
    assert second.exit_code == 0, second.output
    assert "Resumed from step 15" in second.output
    a = json.loads((tmp_path / "full" / "result.json").read_text())
    b = json.loads((tmp_path / "split" / "result.json").read_text())
    assert a["state_digest"] == b["state_digest"]  # parameters, optimizer and BatchNorm state
    assert a["history"] == b["history"]  # epoch 2's train loss/accuracy survived the stop


def test_classifier_config_errors_exit_2():
    result = invoke("run", "--exp", "cnn_digits", "--set", "model.in_channels=3")
    assert result.exit_code == 2 and "set model.in_channels=1" in result.output, result.output
    result = invoke("show", "--exp", "cnn_tutorial", "--set", "model.num_heads=3")
    assert result.exit_code == 2 and "must divide" in result.output, result.output


@pytest.mark.parametrize("overrides", [{}, dict(in_channels=1, stem_channels=8, stage_channels=(8, 16, 32),
                                                blocks_per_stage=1, num_heads=2, hidden_dims=20, num_classes=3)])
def test_analytic_param_count_equals_the_traced_model(overrides):
    """`launch show` counts the CNN's parameters from the config (no JAX); it must match the model."""
    import equinox as eqx
    import jax

    from equipax.core.flops import count_params
    from equipax.models import AdvancedCNN, CNNConfig, cnn_param_count

    cfg = CNNConfig(**overrides)
    model, _ = eqx.filter_eval_shape(lambda k: eqx.nn.make_with_state(AdvancedCNN)(cfg, key=k), jax.random.key(0))
    assert cnn_param_count(cfg) == count_params(model)
