"""The pipelined experiment through the CLI: its knob errors, `launch show`'s and `launch
compile`'s pipeline figures (its bit-for-bit resume, from a bucket: tests/launch/test_object_storage.py)."""

import json
import os
import subprocess
import sys

import pytest


def test_pipeline_errors_reach_the_cli():
    """A mismatched stage axis is a config error (exit 2) at `launch show`, naming the knobs."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "equipax.launch.cli",
            "show",
            "--exp",
            "c4_gpt3_xl_pipeline_smoke",
            "--set",
            "model.transformer.pipeline_stages=4",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "pipeline_stages=4 but the mesh's `stage` axis has size 2" in proc.stdout + proc.stderr


def test_show_reports_stages_microbatches_and_bubble():
    from equipax.launch.experiments.registry import get_experiment
    from equipax.launch.tasks import derived_numbers

    n = derived_numbers(get_experiment("c4_gpt3_xl_pipeline"))
    assert n["devices_required"] == 64 and n["mesh_shape"] == [4, 1, 4, 4]
    assert (n["pipeline_stages"], n["pipeline_microbatches"], n["pipeline_microbatch_size"]) == (4, 32, 16)
    assert n["pipeline_bubble_fraction"] == pytest.approx(3 / 35, abs=1e-4)
    assert n["global_batch"] == 512
    assert n["params_per_stage"] == 6 * n["params_per_layer"]


@pytest.mark.slow
def test_compile_reports_one_stages_share_and_the_pipeline(tmp_path):
    """`launch compile` of the pipelined smoke (8 simulated devices): the report's pipeline section
    holds `launch show`'s numbers, and its per-device bytes are one stage's share of the state."""
    from equipax.launch.experiments.registry import get_experiment
    from equipax.launch.tasks import derived_numbers
    from helpers.toy import suite_compile_cache_env

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "equipax.launch.cli",
            "compile",
            "--exp",
            "c4_gpt3_xl_pipeline_smoke",
            "--job-log-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        # On the suite's compile cache: its train step is the one the Pax README's pipelined command
        # trains (tests/launch/test_object_storage.py), so whichever runs second loads it.
        env={**os.environ, **suite_compile_cache_env()},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "compile.json").read_text())
    p, params = report["pipeline"], report["params"]
    n = derived_numbers(get_experiment("c4_gpt3_xl_pipeline_smoke"))
    assert (p["stages"], p["repeats"], p["schedule"], p["microbatches"], p["microbatch_size"]) == (2, 1, "gpipe", 4, 4)
    assert p["bubble_fraction"] == n["pipeline_bubble_fraction"] == pytest.approx(1 / 5)
    assert p["params_per_stage"] == n["params_per_stage"] and p["stage_state_bytes_per_device"] > 0
    # The stages hold the layers; with the embedding (and final norm) that is the whole model.
    assert p["params_per_stage"] * p["stages"] + params["embedding"] == pytest.approx(params["total"], rel=1e-3)
    # A device holds one stage's layers + the embedding, split over fsdp x tensor = 4: f32 params
    # and Adam's two moments (the layer norms are replicated, hence the tolerance).
    stage_share = 4 * (p["params_per_stage"] + params["embedding"]) / 4
    assert params["per_device_param_bytes"] == pytest.approx(stage_share, rel=0.05)
    assert params["per_device_param_bytes"] < 0.7 * 4 * params["total"] / 4  # not the whole model's share
    assert params["per_device_param_bytes"] + params["per_device_optimizer_bytes"] == pytest.approx(
        p["stage_state_bytes_per_device"], rel=0.05
    )
    assert "per device    params 0.00 GiB, optimizer state 0.00 GiB, one stage's share" in proc.stdout
    assert (
        "pipeline      2 stages x 1 repeat (gpipe), 4 microbatches of 4 examples, bubble 20.0% = "
        "(S - 1) / (R x M + S - 1)"
    ) in proc.stdout
    assert f"{n['params_per_stage']:,} params per stage; one stage's state per device" in proc.stdout


def test_unpipelined_report_has_no_pipeline_section():
    from equipax.launch.aot.pipeline_report import pipeline_section
    from equipax.launch.experiments.registry import get_experiment
    from equipax.launch.tasks import derived_numbers

    assert pipeline_section(derived_numbers(get_experiment("c4_1b"))) is None
    section = pipeline_section(derived_numbers(get_experiment("c4_gpt3_xl_pipeline")))
    assert section is not None and (section["stages"], section["microbatches"]) == (4, 32)
