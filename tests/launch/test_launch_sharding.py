"""Experiments on a mesh: a batch the data-parallel size does not divide fails at config time;
`launch run` on 8 simulated devices."""

import pytest


def test_batch_not_divisible_by_data_parallel_size_fails_at_config_time():
    from equipax.core.knobs import ConfigError, apply_overrides
    from equipax.launch.experiments.registry import get_experiment

    with pytest.raises(ConfigError, match="not divisible by the data-parallel size 8"):
        apply_overrides(get_experiment("shakespeare_tiny"), ["mesh.ici_mesh_shape=(2,4,1)", "data.batch_size=12"])


@pytest.mark.slow
def test_launch_run_on_a_simulated_mesh(tmp_path):
    import subprocess
    import sys

    from helpers.toy import TOY_SHORT, set_args

    args = [
        sys.executable,
        "-m",
        "equipax.launch.cli",
        "run",
        "--cpu-devices",
        "8",
        "--job-log-dir",
        str(tmp_path / "job"),
        *set_args(TOY_SHORT),
        "--set",
        "mesh.ici_mesh_shape=(1,4,1)",
        "--set",
        "mesh.dcn_mesh_shape=(2,1,1)",
        "--set",
        "data.batch_size=8",
    ]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Final eval loss" in proc.stdout
    # Without the devices: a clear error in seconds, pointing at compile and the smoke variant.
    # In this process (one CPU device, as a plain `launch run` has; the mesh is checked before
    # anything compiles): a child would cost a JAX start-up, 2.5 s of CPU, for the check.
    from typer.testing import CliRunner

    from equipax.launch.cli import app

    refused = CliRunner().invoke(app, args[3:4] + args[6:])
    assert refused.exit_code == 2, refused.output
    assert "needs 8 devices" in refused.stderr and "launch compile" in refused.stderr
