"""Context parallelism through `launch`: the knob errors reach the CLI as exit 2
(tests/models/test_context_parallel_lm.py checks each error; this, that `launch show` reports it
before anything is built), and a run on a context axis resumes bit for bit."""

import subprocess
import sys

import pytest


def test_context_errors_reach_the_cli():
    """A sequence the zigzag layout cannot cut is exit 2 at `launch show`, naming the knobs."""
    sets = [
        "mesh.axis_names=('data', 'fsdp', 'context', 'tensor')",
        "mesh.ici_mesh_shape=(1, 1, 4, 1)",
        "mesh.dcn_mesh_shape=(1, 1, 1, 1)",
        "data.seq_len=36",
    ]
    cmd = [sys.executable, "-m", "equipax.launch.cli", "show", "--exp", "shakespeare_llama_tiny"]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "data.seq_len=36 cannot be split" in proc.stdout + proc.stderr
    assert "multiple of 8" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_context_parallel_run_resumes_to_the_uninterrupted_runs_bits(tmp_path):
    """`launch run` on data 2 x context 2 (ring attention, zigzag) for 4 steps, and the same
    stopped at step 2 and resumed: the same parameters and optimizer state, bit for bit. One
    4-device child runs the three commands, so they share its compiled programs."""
    import json

    from helpers.multidevice import FAST_COMPILE, run_with_devices
    from helpers.toy import TOY, set_args

    knobs = [
        *TOY,
        "mesh.axis_names=('data', 'fsdp', 'context', 'tensor')",
        "mesh.ici_mesh_shape=(2, 1, 2, 1)",
        "mesh.dcn_mesh_shape=(1, 1, 1, 1)",
        "model.transformer.context_parallel_strategy=ring",
        "train.log_every=1",
        "train.eval_every=2",
        "train.checkpoint_every=2",
        "train.eval_batches=1",
        "train.sample.tokens=0",
    ]
    out = run_with_devices(
        f"""
        import json
        from typer.testing import CliRunner
        from equipax.launch.cli import app
        def run(job, steps):
            args = ["run", "--exp", "shakespeare_llama_tiny", "--job-log-dir", {str(tmp_path)!r} + "/" + job,
                    *{set_args(knobs)!r}, "--set", f"train.num_steps={{steps}}"]
            result = CliRunner().invoke(app, args)
            assert result.exit_code == 0, result.output
            return result.output
        run("full", 4)
        run("split", 2)
        print(json.dumps({{"resumed": "Resumed from step 2" in run("split", 4)}}))
        """,
        devices=4,
        timeout=600,
        xla_flags=FAST_COMPILE,
    )
    assert json.loads(out.strip().splitlines()[-1]) == {"resumed": True}
    a, b = (json.loads((tmp_path / job / "result.json").read_text()) for job in ("full", "split"))
    assert a["state_digest"] == b["state_digest"]  # parameters and optimizer state, bit for bit
    assert a["final_train_loss"] == b["final_train_loss"]
    config = json.loads((tmp_path / "full" / "config.json").read_text())
    assert config["mesh"]["ici_mesh_shape"] == [2, 1, 2, 1]
