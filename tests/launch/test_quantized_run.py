"""`model.quantization` end to end (docs/quantization.md): a run trains with int8, resumes with it
switched off (checkpoints hold float weights), decodes with int8 weights, and `launch compile`
reports the quantized share of the FLOPs and the int8 matmuls of the program."""

import json
import math

import pytest

from helpers.toy import TOY, set_args


def invoke(*args):
    from typer.testing import CliRunner

    from equipax.launch.cli import app
    from helpers.toy import fast_compile_in_process

    with fast_compile_in_process():
        return CliRunner().invoke(app, [str(a) for a in args])


STEPS = ("train.log_every=2", "train.eval_every=4", "train.checkpoint_every=4", "train.sample.tokens=0")


@pytest.mark.slow
def test_an_int8_run_resumes_in_float_and_decodes_with_int8_weights(tmp_path):
    job = tmp_path / "job"
    first = invoke(
        "run", "--job-log-dir", job, *set_args([*TOY, *STEPS, "train.num_steps=4", "model.quantization=int8"])
    )
    assert first.exit_code == 0, first.output
    saved = json.loads((job / "config.json").read_text())
    assert saved["model"]["quantization"] == "int8"
    # The same job, quantization off: the float checkpoint of step 4 restores into the float model.
    second = invoke(
        "run", "--job-log-dir", job, *set_args([*TOY, *STEPS, "train.num_steps=6", "model.quantization=none"])
    )
    assert second.exit_code == 0, second.output
    assert "Resumed from step 4" in second.output
    result = json.loads((job / "result.json").read_text())
    assert math.isfinite(result["final_eval_loss"]), result
    steps = [json.loads(line)["step"] for line in (job / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 6
    decoded = invoke(
        "decode",
        "--job-log-dir",
        job,
        "--prompt",
        "ROMEO:",
        "--max-new-tokens",
        "4",
        "--set",
        "model.quantization=int8w",
    )
    assert decoded.exit_code == 0, decoded.output
    assert "ROMEO:" in decoded.output


@pytest.mark.slow
def test_compile_reports_the_quantized_share_and_the_int8_matmuls(tmp_path):
    result = invoke("compile", "--job-log-dir", tmp_path, *set_args([*TOY, "model.quantization=int8"]))
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "compile.json").read_text())
    flops = report["flops"]
    # Every projection of the block (attention and MLP), not the attention scores nor the logits.
    assert flops["quantization"] == "int8" and 0.3 < flops["quantized_flops_share"] < 1.0
    # Forward and both backward matmuls of the 2 attention and 2 MLP projections, once per copy of
    # the block XLA keeps (it may unroll the scan over the 2 layers); the rest stay float.
    matmuls = report["matmuls"]
    assert matmuls["int8"] > 0 and matmuls["int8"] % (4 * 3) == 0 and matmuls["total"] > matmuls["int8"], matmuls
    assert "of the model FLOPs in int8" in result.output


@pytest.mark.slow
def test_int8_with_splash_attention_compiles_for_a_v5e(tmp_path):
    """XLA:TPU (libtpu, no TPU needed): the int8 projections beside the splash kernels, whose
    scores stay bf16; the program's int8 matmuls are int8 convolutions on the chip."""
    splash = ("model.transformer.attention_impl=splash", "data.seq_len=128", "model.max_seq_len=128")
    args = set_args([*TOY, *splash, "model.quantization=int8", "model.dtype=bfloat16"])
    result = invoke("compile", "--topology", "v5e-1", "--job-log-dir", tmp_path, *args)
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "compile.json").read_text())
    assert report["compile"]["backend"] == "tpu"
    # splash's forward and its fused backward (dq, dk and dv in one kernel)
    assert report["custom_calls"].get("tpu_custom_call", 0) >= 2, report["custom_calls"]
    assert report["matmuls"]["int8"] >= 4 * 3, report["matmuls"]
