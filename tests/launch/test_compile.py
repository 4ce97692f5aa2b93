"""`launch compile`: AOT compile of the exact train step on a simulated mesh (fresh processes: the
mesh's CPU devices are set before JAX starts)."""

import json
import subprocess
import sys

import pytest

from helpers.launch_parts import launch_with_devices


def launch(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "equipax.launch.cli", *args], capture_output=True, text=True, timeout=timeout
    )


BUDGET = ("--exp", "c4_22b_2x_smoke", "--hbm-gib", "0.0001")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The 8-device smoke compiles of this module, in one child process (one start-up, not four) on
    the suite's compile cache: {name: (job directory, the command's exit code, stdout, stderr)}.
    The two budget compiles are one program: the second loads the first's executable (the figures
    are the same)."""
    jobs = {name: tmp_path_factory.mktemp(name) for name in ("budget", "lm_cloud", "llama")}
    commands = {
        "budget": ["compile", *BUDGET, "--job-log-dir", jobs["budget"]],
        "strict": ["compile", *BUDGET, "--job-log-dir", jobs["budget"], "--strict"],
        "lm_cloud": ["compile", "--exp", "lm_cloud_2b_smoke", "--job-log-dir", jobs["lm_cloud"], "--target", "h100"],
        "llama": ["compile", "--exp", "llama3_8b_smoke", "--job-log-dir", jobs["llama"]],
    }
    procs = launch_with_devices(commands, devices=8)
    return {name: (jobs.get(name, jobs["budget"]), procs[name]) for name in commands}


@pytest.mark.slow
def test_c4_22b_2x_compiles_on_128_simulated_devices(tmp_path):
    proc = launch("compile", "--exp", "c4_22b_2x", "--job-log-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "compile.json").read_text())
    assert report["devices"] == 128 and report["mesh"] == {"data": 2, "fsdp": 64, "tensor": 1}
    assert report["params"]["total"] == pytest.approx(21.9e9, rel=0.01)
    f = report["flops"]
    assert f["model_flops_per_token"] == pytest.approx(f["six_n_per_token"] + f["attention_flops_per_token"], rel=0.02)
    # FSDP over 64: each device holds 1/64 of the f32 params and twice that of Adam moments.
    assert report["params"]["per_device_param_bytes"] == pytest.approx(21.9e9 * 4 / 64, rel=0.02)
    assert report["params"]["per_device_optimizer_bytes"] == pytest.approx(2 * 21.9e9 * 4 / 64, rel=0.02)
    assert report["collectives"]["all-gather"] > 0  # FSDP gathers weights
    assert report["compile"]["host_peak_rss_gib"] < 4
    assert "params        21.945e9 total" in proc.stdout


@pytest.mark.slow
def test_budget_is_flagged_and_strict_exits_non_zero(smoke):
    """Over budget: reported (exit 0), and exit 3 under --strict."""
    _, proc = smoke["budget"]
    assert proc.returncode == 0, proc.stderr
    assert "DOES NOT FIT" in proc.stdout and "over the 0.0001 GiB budget" in proc.stderr
    _, strict = smoke["strict"]
    assert strict.returncode == 3, strict.stdout + strict.stderr


@pytest.mark.slow
def test_smoke_compile_reports_the_real_models_parameter_count(smoke):
    job, proc = smoke["lm_cloud"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((job / "compile.json").read_text())
    assert report["memory_per_device"]["fits"]

    import equinox as eqx
    import jax

    from equipax.core.flops import count_params
    from equipax.launch.experiments.registry import get_experiment
    from equipax.models import TransformerLM

    cfg = get_experiment("lm_cloud_2b_smoke")
    # The model's arrays by shape only (the same leaves, not initialised: 5.6 s against 0.8 s alone).
    model = eqx.filter_eval_shape(TransformerLM, cfg.model, key=jax.random.key(0))
    assert report["params"]["total"] == count_params(model)


def test_unknown_target_is_a_user_error():
    from typer.testing import CliRunner

    from equipax.launch.cli import app

    result = CliRunner().invoke(app, ["compile", "--exp", "c4_1b", "--target", "tpu-v9"])
    assert result.exit_code == 2 and "Unknown --target 'tpu-v9'" in result.output


@pytest.mark.parametrize(
    "option, value, expected",
    [
        ("--hbm-gib", "0", "--hbm-gib must be a number of GiB > 0"),
        ("--hbm-gib", "-1", "--hbm-gib must be a number of GiB > 0"),
        ("--hbm-gib", "nan", "--hbm-gib must be a number of GiB > 0"),
        ("--hbm-gib", "inf", "--hbm-gib must be a number of GiB > 0"),
        ("--assumed-mfu", "0", "--assumed-mfu must be in (0, 1]"),
        ("--assumed-mfu", "-0.5", "--assumed-mfu must be in (0, 1]"),
        ("--assumed-mfu", "1.5", "--assumed-mfu must be in (0, 1]"),
        ("--assumed-mfu", "nan", "--assumed-mfu must be in (0, 1]"),
        ("--slices", "0", "--slices must be >= 1"),
    ],
)
def test_bad_numbers_are_usage_errors_before_compiling(option, value, expected):
    from typer.testing import CliRunner

    from equipax.launch.cli import app

    result = CliRunner().invoke(app, ["compile", "--exp", "c4_22b_2x", "--topology", "v4-128", option, value])
    assert result.exit_code == 2, result.output
    assert expected in " ".join(result.output.split())


def test_budget_and_mfu_at_their_limits_are_accepted():
    from typer.testing import CliRunner

    from equipax.launch.cli import app

    # Valid numbers pass the option checks and reach the experiment lookup (a misspelled name here).
    result = CliRunner().invoke(app, ["compile", "--exp", "no_such_exp", "--hbm-gib", "0.5", "--assumed-mfu", "1"])
    assert result.exit_code == 2 and "must be" not in result.output and "no_such_exp" in result.output


def test_collective_counting():
    from equipax.launch.aot.report import count_collectives

    hlo = (
        "%a = all-gather(x)\n%b = all-reduce-start(y)\n%c = all-reduce-done(%b)\n%d = all-to-all(z)\n"
        "%e = send(w), channel_id=1\n%f = send-done(%e)\n%g = recv(t)\n%h = recv-done(%g)"
    )
    assert count_collectives(hlo) == {
        "all-gather": 1,
        "reduce-scatter": 0,
        "all-reduce": 1,
        "collective-permute": 0,
        "all-to-all": 1,
        "send": 1,
        "recv": 1,
    }


def test_compiler_out_of_memory_is_a_does_not_fit_figure():
    from equipax.launch.aot.memory import out_of_memory_figures

    msg = (
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
        "(34.65G) exceeds available HBM (30.75G). HLO module: jit_fn."
    )
    m = out_of_memory_figures(msg, state_bytes=6 * 2**30, batch_bytes=2**20)
    assert m is not None and m["compiler_refused"] == msg
    assert m["temp_bytes"] == int(34.65 * 2**30) and m["available_bytes"] == int(30.75 * 2**30)
    assert m["total_bytes"] == 6 * 2**30 + 2**20 + int(34.65 * 2**30)
    assert out_of_memory_figures("INVALID_ARGUMENT: bad sharding", 1, 1) is None


@pytest.mark.slow
def test_llama_smoke_compiles_with_model_flops(smoke):
    job, proc = smoke["llama"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((job / "compile.json").read_text())
    assert report["flops"]["model_flops_per_token"] > 0 and report["projection"]["ideal_step_s"] > 0
