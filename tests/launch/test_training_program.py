"""One training program: `build_training` serves run and compile; one loop trains every family;
the job directory belongs to one live run; a family in a user module runs from the CLI."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from helpers import REPO
from helpers.toy import (
    CNN_SHORT,
    CNN_TOY,
    FAST_COMPILE,
    SMOKE_SHORT,
    compile_cache_env,
    set_args,
    suite_compile_cache_env,
    with_xla_flags,
)


def invoke(*args):
    from typer.testing import CliRunner

    from equipax.launch.cli import app
    from helpers.toy import fast_compile_in_process

    with fast_compile_in_process():  # behaviour, not numbers recorded at XLA's default level
        return CliRunner().invoke(app, [str(a) for a in args])


def launch(*args, timeout=600, xla_flags=""):
    """`launch ...` as its own process, on the suite's compile cache (never killed); `xla_flags`
    appended to XLA_FLAGS (FAST_COMPILE for runs compared only with each other)."""
    env = with_xla_flags({**os.environ, **suite_compile_cache_env()}, xla_flags)
    return subprocess.run(
        [sys.executable, "-m", "equipax.launch.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_run_executes_the_program_compile_reports():
    """The step `launch run` dispatches (concrete sharded state + a real batch) lowers to the same
    StableHLO as the one `launch compile` reports (abstract arguments), on an 8-device mesh."""
    script = textwrap.dedent("""
        import hashlib, json, pathlib, tempfile
        import jax
        from equipax.launch.aot.report import compile_report
        from equipax.launch.hardware.accelerators import ACCELERATORS
        from equipax.launch.experiments.registry import get_experiment
        from equipax.launch.tasks import family
        from equipax.launch.program.training import build_training
        from equipax.launch.training.loop import build_run_mesh

        cfg = get_experiment("lm_cloud_2b_smoke")
        mesh = build_run_mesh(cfg)
        training = build_training(cfg, mesh)
        state = training.init_state()
        inputs = family(cfg).build_inputs(cfg, pathlib.Path(tempfile.mkdtemp()), mesh=mesh, log=print)
        host = inputs.train.get_next()
        batch = training.place(host)  # what the loop does with each batch
        dispatched = training.train_step.lower(state, batch, training.keys.step).as_text()
        report = compile_report(cfg, target=ACCELERATORS["tpu-v4"], mesh=mesh, log=lambda m: None)
        print(json.dumps({"run": hashlib.sha256(dispatched.encode()).hexdigest(),
                          "compile": report["stablehlo_sha256"]}))
    """)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fingerprints = json.loads(proc.stdout.strip().splitlines()[-1])
    assert fingerprints["run"] == fingerprints["compile"]


def test_every_family_builds_through_build_training():
    import jax

    from equipax.core.mesh import build_mesh
    from equipax.core.step import TrainState
    from equipax.launch.experiments.registry import entries
    from equipax.launch.program.training import build_training

    kinds = set()
    for entry in entries():
        cfg = entry.fn()
        if entry.kind != "train" or cfg.mesh.num_devices != 1:
            continue
        training = build_training(cfg.for_devices(1), build_mesh(cfg.for_devices(1).mesh))
        assert isinstance(training.abstract_state, TrainState)
        batch = training.abstract_batch()
        assert all(isinstance(v, jax.ShapeDtypeStruct) for v in batch.values())
        kinds.add(cfg.kind)
    assert kinds == {"lm", "image_classification"}


# The toy CNN with one stage (the stem, a residual block with BatchNorm, attention, the head): its
# train step compiles in about 2/3 of the two-stage model's time. For runs that check what the
# program does (data parallel == one device, the nonfinite policy, a compile report), not its size.
ONE_STAGE = "model.stage_channels=(16,)"


@pytest.mark.slow
def test_cnn_digits_data_parallel_on_4_devices_matches_1_device(tmp_path):
    # One epoch of 4 steps of 128 (512 images; 128 test images).
    sets = set_args(
        [
            *CNN_TOY,
            ONE_STAGE,
            "train.num_epochs=1",
            "data.num_train=512",
            "data.num_test=128",
            "data.batch_size=128",
            "train.log_every=1",
        ]
    )
    fast = FAST_COMPILE  # the three runs compare with each other only
    # One device: in this process (its one CPU device), without a child's start-up.
    one = invoke("run", "--exp", "cnn_digits", "--job-log-dir", tmp_path / "one", *sets)
    assert one.exit_code == 0, one.output
    four = launch(
        "run", "--exp", "cnn_digits", "--cpu-devices", 4, "--job-log-dir", tmp_path / "four", *sets, xla_flags=fast
    )
    assert four.returncode == 0, four.stdout + four.stderr
    assert json.loads((tmp_path / "four" / "config.json").read_text())["mesh"]["ici_mesh_shape"] == [4, 1, 1]
    # The same 4 devices as two hosts (real jax.distributed processes): each feeds its half of every
    # global batch, and the training is the same computation again.
    hosts = launch(
        "local-cluster",
        "--processes",
        2,
        "--cpu-devices",
        2,
        "--",
        "run",
        "--exp",
        "cnn_digits",
        "--job-log-dir",
        tmp_path / "hosts",
        *sets,
        xla_flags=fast,
    )
    assert hosts.returncode == 0, hosts.stdout[-4000:] + hosts.stderr[-2000:]
    a = [json.loads(x) for x in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (tmp_path / "four" / "metrics.jsonl").read_text().splitlines()]
    c = [json.loads(x) for x in (tmp_path / "hosts" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["split"]) for r in a] == [(r["step"], r["split"]) for r in b]
    assert [(r["step"], r["split"]) for r in c] == [(r["step"], r["split"]) for r in b]
    for rb, rc in zip(b, c):
        if rb["split"] == "train":
            assert rc["loss"] == pytest.approx(rb["loss"], rel=1e-5), (rb, rc)
    # Training is the same computation: losses and gradient norms agree to float rounding. (Eval
    # is not compared: the conv biases in front of BatchNorm get ~0 true gradient, which Adam
    # scales up to full steps whose sign follows rounding noise; they move the BatchNorm running
    # means, so eval-mode outputs of two equally correct runs drift apart.)
    for ra, rb in zip(a, b):
        if ra["split"] == "train":
            assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5), (ra, rb)
            assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-4), (ra, rb)
        if ra["split"] == "epoch":
            assert rb["train_loss"] == pytest.approx(ra["train_loss"], rel=1e-5), (ra, rb)


@pytest.mark.slow
def test_cnn_nonfinite_policy_and_compile(tmp_path):
    """A NaN loss at step 3 aborts the image classifier's run (exit 4, naming the step); `launch
    compile` writes its report for that family (parameters counted, no FLOP count on XLA:CPU). Both
    at toy size and compiled with less optimisation: the exit code, the message and the report's
    fields are checked, no numbers (the full-size compile: 15.1 s against 8.5 s)."""
    # In this process: children would cost two JAX start-ups (2.5 s of CPU each) for one device.
    sets = set_args([*CNN_SHORT, ONE_STAGE, "train.debug_nan_steps=(3,)", "train.on_nonfinite=abort"])
    aborted = invoke("run", "--exp", "cnn_digits", "--job-log-dir", tmp_path / "job", *sets)
    assert aborted.exit_code == 4, aborted.output
    assert "Step 3: the loss is nan" in aborted.stderr
    toy = set_args([*CNN_TOY, ONE_STAGE])
    compiled = invoke("compile", "--exp", "cnn_digits", "--job-log-dir", tmp_path / "c", *toy)
    assert compiled.exit_code == 0, compiled.output
    report = json.loads((tmp_path / "c" / "compile.json").read_text())
    assert report["params"]["total"] > 0 and report["flops"] is None


def test_a_live_run_owns_its_job_directory(tmp_path):
    """A second run on a job directory whose run is alive exits 2 naming it; a dead one's lock is taken over."""
    job = tmp_path / "job"
    job.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
            import pathlib, sys, time
            from equipax.launch.jobdir.ownership import JobLock
            with JobLock(pathlib.Path({str(job)!r})):
                print("locked", flush=True)
                time.sleep(60)
        """),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        result = invoke("run", "--job-log-dir", job, *set_args(SMOKE_SHORT))
        assert result.exit_code == 2, result.output
        assert f"pid {holder.pid} on host" in result.output and "in use by another run" in result.output
    finally:
        holder.kill()
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()
    from equipax.launch.jobdir.ownership import JobLock

    messages = []
    with JobLock(job, log=messages.append):
        pass
    assert messages and f"left by pid {holder.pid}" in messages[0] and "no longer running" in messages[0]


def test_a_family_in_one_user_module_runs_from_the_cli(tmp_path):
    """docs/extending.md's regression family, saved as a user module (its definitions, as the page
    shows them) with an experiment function: `launch run --exp mod.fn` imports it, registers the
    family, trains with --set knobs, and a rerun with more steps resumes from its config.json."""
    import re

    page = (REPO / "docs" / "extending.md").read_text()
    code = re.search(r"```python\n(import dataclasses\n.*?)```", page, re.S).group(1)
    part1_run, part2 = code.index("x, y = regression_data(64"), code.index("# --- Part 2")
    part2_end = re.search(r'cfg = ExperimentConfig\(\s*name="mlp_regression"', code).start()
    definitions = code[:part1_run] + code[part2:part2_end]
    (tmp_path / "userfam.py").write_text(
        definitions
        + textwrap.dedent("""
        def mlp_regression() -> ExperimentConfig:
            return ExperimentConfig(name="mlp_regression", model=MLPConfig(), data=RegressionDataConfig(),
                                    train=TrainConfig(num_steps=20, log_every=10, eval_every=20, checkpoint_every=10))
    """)
    )
    env = {**compile_cache_env(tmp_path / "jax-cache"), "PYTHONPATH": str(tmp_path)}  # the rerun compiles nothing
    job = tmp_path / "job"

    def run(*extra):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "equipax.launch.cli",
                "run",
                "--exp",
                "userfam.mlp_regression",
                "--job-log-dir",
                str(job),
                "--set",
                "model.width=8",
                *extra,
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )

    first = run()
    assert first.returncode == 0, first.stdout + first.stderr
    assert "step 20/20" in first.stdout and json.loads((job / "config.json").read_text())["model"]["width"] == 8
    again = run("--set", "train.num_steps=30")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "step 30/30" in again.stdout and "step 10/30" not in again.stdout  # resumed at 20
    assert json.loads((job / "result.json").read_text())["final_step"] == 30
    missing = subprocess.run(
        [sys.executable, "-m", "equipax.launch.cli", "run", "--exp", "userfam.nope"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert missing.returncode == 2 and "module userfam has no experiment function 'nope'" in missing.stderr


def test_variational_noise_knobs_reach_the_train_step_and_a_regex_matching_nothing_is_refused():
    """`train.vn.*` goes into the step `build_training` builds (its program changes; the noise
    itself is checked in tests/core/test_variational_noise.py); a `vn_regex` that matches no
    trained parameter is a ConfigError naming the knob and listing the paths it searched."""
    from equipax.core.knobs import ConfigError, apply_overrides
    from equipax.core.mesh import build_mesh
    from equipax.launch.experiments.registry import get_experiment
    from equipax.launch.program.training import build_training
    from helpers.toy import TOY

    def program(*sets):
        cfg, _ = apply_overrides(get_experiment("shakespeare_tiny"), [*TOY, *sets])
        training = build_training(cfg, build_mesh(cfg.mesh))
        return training.train_step.lower(
            training.abstract_state, training.abstract_batch(), training.keys.step
        ).as_text()

    off = program()
    assert program("train.vn.vn_scale=0.0", "train.vn.vn_regex=nothing") == off  # off: the same program
    assert program("train.vn.vn_scale=0.01", "train.vn.vn_regex=attention") != off
    with pytest.raises(
        ConfigError, match=r"train\.vn\.vn_regex='nothing' matches no trained parameter.*embedding/weight"
    ):
        program("train.vn.vn_scale=0.01", "train.vn.vn_regex=nothing")


@pytest.mark.parametrize(
    ("platform", "sets", "kernel"),
    [
        ("cpu", [], "xla"),
        ("tpu", [], "splash"),
        ("tpu", ["data.seq_len=96"], "xla"),  # splash needs 128 x k positions
        ("gpu", ["model.dtype='bfloat16'", "model.transformer.atten_logit_cap=None"], "cudnn"),
        ("gpu", ["model.dtype='bfloat16'"], "xla"),  # cuDNN has no logit cap
    ],
)
def test_the_program_runs_the_attention_kernel_its_run_records(platform, sets, kernel, monkeypatch):
    """attention_impl='auto' is resolved once, when the task is built on its mesh: every attention
    layer of the program's model runs the kernel that knobs.txt and compile.json record for it."""
    import jax

    import equipax.launch.program.attention as record
    from equipax.core.knobs import apply_overrides
    from equipax.core.mesh import build_mesh
    from equipax.core.nn import fused_attention
    from equipax.core.nn.self_attention import Attention
    from equipax.launch.experiments.registry import get_experiment
    from equipax.launch.program.program import build_program

    for module in (fused_attention, record):  # the mesh's platform, as an AOT compile for it sees it
        monkeypatch.setattr(module, "mesh_platform", lambda mesh: platform)
    cfg, _ = apply_overrides(get_experiment("shakespeare_tiny"), sets)
    mesh = build_mesh(cfg.mesh, jax.devices()[:1])
    program = build_program(cfg, mesh, feeds_batches=False)
    layers = jax.tree.leaves(program.abstract_model, is_leaf=lambda x: isinstance(x, Attention))
    assert {m.impl for m in layers if isinstance(m, Attention)} == {kernel}
    assert record.attention_record(cfg, mesh) == {
        "knob": "model.transformer.attention_impl", "value": "auto", "kernel": kernel, "platform": platform,
        "seq_len": cfg.data.seq_len, "dtype": cfg.model.dtype,
    }  # fmt: skip
