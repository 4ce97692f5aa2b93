"""The `cnn_*` experiments end to end (digits run, mid-epoch resume, config errors) and checkpoints
holding BatchNorm state."""

import json

import numpy as np
import pytest

from helpers.toy import CNN_SHORT, CNN_TOY, persistent_compile_cache, set_args


def invoke(*args):
    from typer.testing import CliRunner

    from equipax.launch.cli import app
    from helpers.toy import fast_compile_in_process

    with fast_compile_in_process():  # behaviour, not numbers recorded at XLA's default level
        return CliRunner().invoke(app, list(args))


def test_checkpoint_round_trip_includes_bn_state(one_step, tmp_path, trees_close):
    import jax

    from equipax.launch.jobdir.checkpoints import Checkpointer

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
    result = invoke(
        "run",
        "--exp",
        "cnn_digits",
        "--job-log-dir",
        str(job),
        *set_args([*CNN_TOY, "train.num_epochs=2", "data.batch_size=32"]),
    )
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
    # Two epochs of 8 steps (256 images, batch 32: the programs of the docs' short epoch).
    sets = set_args([*CNN_SHORT, "train.num_epochs=2", "data.num_train=256", "train.log_every=4"])
    # The three runs compile the same programs: once, then from JAX's persistent cache.
    with persistent_compile_cache(tmp_path / "jax-cache"):
        _resume_mid_epoch(tmp_path, monkeypatch, sets)


def _resume_mid_epoch(tmp_path, monkeypatch, sets):
    import equipax.launch.training.step_loop as classify
    from equipax.data import ImageClassificationInput
    from equipax.launch.exit_codes import EXIT_PREEMPTED
    from equipax.launch.training.preemption import StopRequest

    full = invoke("run", "--exp", "cnn_digits", "--job-log-dir", str(tmp_path / "full"), *sets)
    assert full.exit_code == 0, full.output

    fetched = {"n": 0}
    original = ImageClassificationInput.get_next

    def counting(self):
        fetched["n"] += self.repeat
        return original(self)

    class StopAfter11(StopRequest):  # as if SIGTERM arrived during step 11 (epoch 2, of 8 steps)
        def __bool__(self):
            self.signal_name = "SIGTERM" if fetched["n"] >= 11 else None
            return self.signal_name is not None

    with monkeypatch.context() as m:
        m.setattr(ImageClassificationInput, "get_next", counting)
        m.setattr(classify, "StopRequest", StopAfter11)
        first = invoke("run", "--exp", "cnn_digits", "--job-log-dir", str(tmp_path / "split"), *sets)
    assert first.exit_code == EXIT_PREEMPTED, first.output
    second = invoke("run", "--exp", "cnn_digits", "--job-log-dir", str(tmp_path / "split"), *sets)
    assert second.exit_code == 0, second.output
    assert "Resumed from step 11" in second.output
    a = json.loads((tmp_path / "full" / "result.json").read_text())
    b = json.loads((tmp_path / "split" / "result.json").read_text())
    assert a["state_digest"] == b["state_digest"]  # parameters, optimizer and BatchNorm state
    assert a["history"] == b["history"]  # epoch 2's train loss/accuracy survived the stop


def test_classifier_config_errors_exit_2():
    result = invoke("run", "--exp", "cnn_digits", "--set", "model.in_channels=3")
    assert result.exit_code == 2 and "set model.in_channels=1" in result.output, result.output
    result = invoke("show", "--exp", "cnn_tutorial", "--set", "model.num_heads=3")
    assert result.exit_code == 2 and "must divide" in result.output, result.output


def test_digits_keep_the_first_num_train_and_num_test_of_their_split():
    """`data.num_train` / `data.num_test` size the digits as they size the synthetic images (they
    were once ignored there: a 512-image run trained on all 1438); the split stays the seed's."""
    from equipax.data import split_digits
    from equipax.launch.configs.data import ImageDataConfig

    whole = ImageDataConfig(source="digits")
    assert (whole.train_size, whole.image_source.test_size(whole)) == (1438, 359)
    (all_x, all_y), (all_tx, _) = whole.image_source.load(whole)
    assert (len(all_x), len(all_tx)) == (1438, 359)
    np.testing.assert_array_equal(all_x, split_digits(0.2, seed=0)[0][0])

    some = ImageDataConfig(source="digits", num_train=100, num_test=20)
    (x, y), (tx, ty) = some.image_source.load(some)
    assert some.train_size == len(x) == len(y) == 100 and len(tx) == len(ty) == 20
    np.testing.assert_array_equal(x, all_x[:100])
    np.testing.assert_array_equal(y, all_y[:100])
    np.testing.assert_array_equal(tx, all_tx[:20])
    synthetic = ImageDataConfig()
    assert synthetic.train_size == 1000 and synthetic.image_source.test_size(synthetic) == 200
    with pytest.raises(ValueError, match=r"data.num_train=2000 but the digits' train split has 1438 images"):
        ImageDataConfig(source="digits", num_train=2000)
    with pytest.raises(ValueError, match=r"data.num_test=400 .* has 359 images .* set data.num_test<=359"):
        ImageDataConfig(source="digits", num_test=400)


def test_digits_num_train_sets_the_epoch_and_too_many_is_a_config_error():
    shown = invoke("show", "--exp", "cnn_digits", "--set", "data.num_train=256")
    assert shown.exit_code == 0, shown.output
    assert "steps_per_epoch = 8" in shown.output and "total_steps = 80" in shown.output, shown.output
    result = invoke("run", "--exp", "cnn_digits", "--set", "data.num_train=5000")
    assert result.exit_code == 2 and "set data.num_train<=1438" in result.output, result.output
