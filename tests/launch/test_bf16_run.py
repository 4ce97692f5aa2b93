"""The default experiment in bfloat16 (docs/knobs.md, "Mixed precision") learns like float32 at toy size."""

import json

import pytest

from helpers.toy import TOY, set_args


@pytest.mark.slow
def test_bf16_run_of_the_default_experiment_learns_like_f32(tmp_path):
    # The margin the docs state: final eval loss within 5% of the f32 run at the same steps.
    _, eval32 = _final(tmp_path, "f32")
    train16, eval16 = _final(tmp_path, "bf16", "model.dtype=bfloat16")
    assert train16[-1] < train16[0] - 0.5, train16
    assert abs(eval16 - eval32) <= 0.05 * eval32, (eval16, eval32)


def _final(tmp_path, name, *overrides):
    from typer.testing import CliRunner

    from equipax.launch.cli import app

    job = tmp_path / name
    steps = (
        "train.num_steps=60",
        "train.log_every=10",
        "train.eval_every=60",
        "train.checkpoint_every=60",
        "train.sample.tokens=0",
    )
    result = CliRunner().invoke(app, ["run", "--job-log-dir", str(job), *set_args([*TOY, *steps, *overrides])])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    train = [r["loss"] for r in records if r["split"] == "train"]
    return train, json.loads((job / "result.json").read_text())["final_eval_loss"]
