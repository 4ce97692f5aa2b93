"""The profiling window and the PGLE workflows: traces, XLA flags, `launch pgle collect`."""

import gzip
import json
import os
import struct

import pytest

from helpers.toy import TOY, set_args


def launch(*args):
    from typer.testing import CliRunner

    from equipax.launch.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


SHORT = [
    *TOY,
    "train.num_steps=4",
    "train.log_every=2",
    "train.eval_every=4",
    "train.checkpoint_every=4",
    "train.eval_batches=1",
    "train.sample.tokens=0",
]


def _step_annotations(trace_dir):
    """Step numbers of the `train` step annotations in a trace's Chrome-format events."""
    [path] = trace_dir.glob("*.trace.json.gz")
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    return sorted(
        {int(e["args"]["step_num"]) for e in events if e.get("name") == "train" and "step_num" in e.get("args", {})}
    )


def test_profile_window_writes_a_trace_with_step_annotations(tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "")
    job = tmp_path / "job"
    result = launch("run", "--exp", "shakespeare_tiny", *set_args(SHORT), "--job-log-dir", job, "--profile", "2:2")
    assert result.exit_code == 0, result.output
    [trace] = (job / "profile" / "plugins" / "profile").iterdir()  # where TensorBoard / xprof look
    assert list(trace.glob("*.xplane.pb")) and (trace / "perfetto_trace.json.gz").exists()
    assert _step_annotations(trace) == [2, 3]
    assert "Profiled steps 2-3" in result.output and f"xprof --logdir {job / 'profile'}" in result.output
    assert json.loads((job / "result.json").read_text())["profile_dir"] == str(trace)
    flags = json.loads((job / "xla_flags.json").read_text())
    assert flags["pgle"] == "off" and flags["pgle_xla_flags"] == [] and not flags["pgle_in_effect"]


def test_profile_window_skips_the_compiling_step_unless_asked():
    from equipax.launch.configs.train import ProfileConfig
    from equipax.launch.training.profiling import profile_window

    def window(start, total, **knobs):
        return profile_window(ProfileConfig(**knobs), start=start, total=total)

    assert window(0, 10) is None
    assert window(0, 10, steps=3) == (2, 4)  # the first step compiles: not in the default window
    assert window(5, 10, steps=3) == (7, 9)  # a resumed run: its own second step
    assert window(0, 10, steps=3, start_step=1) == (1, 3)  # asked for
    assert window(0, 10, steps=5, start_step=8) == (8, 10)  # cut at the last step
    assert window(6, 10, steps=2, start_step=3) is None  # before this run's steps


def test_profile_option_is_checked():
    result = launch("run", "--exp", "shakespeare_tiny", "--profile", "5")
    assert result.exit_code == 2 and "--profile takes START:COUNT" in result.output


def test_pgle_modes_set_exactly_the_readme_flags():
    from equipax.launch.configs.train import PGLEConfig
    from equipax.launch.training.pgle import pgle_settings, set_xla_flags

    assert pgle_settings(PGLEConfig()).xla_flags == () and pgle_settings(PGLEConfig()).jax_config == {}
    auto = pgle_settings(PGLEConfig(mode="auto", profiling_runs=5, aggregation_percentile=85))
    assert auto.xla_flags == ("--xla_gpu_enable_latency_hiding_scheduler=true",)
    assert auto.jax_config == {
        "jax_enable_pgle": True,
        "jax_pgle_profiling_runs": 5,
        "jax_pgle_aggregation_percentile": 85,
    }
    manual = pgle_settings(PGLEConfig(mode="manual", profile_path="/p/profile.pb"))
    assert manual.xla_flags == (
        "--xla_gpu_enable_latency_hiding_scheduler=true",
        "--xla_gpu_pgle_profile_file_or_directory_path=/p/profile.pb",
    )
    assert manual.jax_config == {}
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_gpu_enable_latency_hiding_scheduler=false"}
    set_xla_flags(PGLEConfig(mode="manual", profile_path="/p/profile.pb"), env)
    assert env["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=8", *manual.xla_flags]
    with pytest.raises(ValueError, match=r"train\.pgle\.profile_path"):
        PGLEConfig(mode="manual")


def test_manual_pgle_flags_are_recorded_and_said_to_do_nothing_on_cpu(tmp_path, monkeypatch):
    import os

    monkeypatch.setenv("XLA_FLAGS", "")
    job, profile = tmp_path / "job", tmp_path / "profile.pb"
    profile.write_bytes(b"")  # there (a missing one is refused); read by XLA on GPU only
    result = launch(
        "run",
        "--exp",
        "shakespeare_tiny",
        *set_args([*SHORT, "train.num_steps=1", "train.pgle.mode=manual", f"train.pgle.profile_path={profile}"]),
        "--job-log-dir",
        job,
    )
    assert result.exit_code == 0, result.output
    pgle_flags = [
        "--xla_gpu_enable_latency_hiding_scheduler=true",
        f"--xla_gpu_pgle_profile_file_or_directory_path={profile}",
    ]
    assert os.environ["XLA_FLAGS"].split() == pgle_flags  # set by `launch run` before JAX's backend starts
    record = json.loads((job / "xla_flags.json").read_text())
    assert record["pgle"] == "manual" and record["pgle_xla_flags"] == pgle_flags
    assert record["platform"] == "cpu" and not record["pgle_in_effect"]
    assert "train.pgle.mode='manual' has no effect on cpu" in result.output


# JAX's automatic PGLE, forced on here on a CPU: XLA:CPU records no instruction latencies, so JAX
# warns that each profiled run collected an empty trace; the recompile happens all the same.
@pytest.mark.filterwarnings("ignore:PGLE collected an empty trace:RuntimeWarning")
def test_auto_pgle_turns_on_jax_pgle_and_reports_the_recompile(tmp_path, monkeypatch):
    import jax

    from equipax.launch.training import pgle

    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setattr(pgle, "device_platform", lambda: "gpu")
    job = tmp_path / "job"
    result = launch(
        "run",
        "--exp",
        "shakespeare_tiny",
        *set_args([*SHORT, "train.pgle.mode=auto", "train.pgle.profiling_runs=2"]),
        "--job-log-dir",
        job,
    )
    assert result.exit_code == 0, result.output
    assert "step 3: the train step was recompiled with its PGLE profile" in result.output
    record = json.loads((job / "xla_flags.json").read_text())
    assert record["pgle_in_effect"] and record["jax_config"]["jax_pgle_profiling_runs"] == 2
    assert jax.config.values["jax_enable_pgle"] is False  # restored after the run


def test_compile_refuses_auto_pgle():
    result = launch("compile", "--exp", "c4_1b_smoke", "--set", "train.pgle.mode=auto")
    assert result.exit_code == 2
    assert "train.pgle.mode='auto' cannot be compiled ahead of time" in result.output


# The first profile.pb `launch pgle collect` wrote on an H200 (2026-11-30), before it turned XLA:GPU's
# command buffers off: five CUDA-graph launches and no instruction, so the run matched nothing.
H200_COMMAND_BUFFER_PROFILE = (
    b"\n\x1c\n\x11command_buffer_72\x11~\xb3\x0f\x9f\xa1yZ@\n\x1c\n\x11command_buffer_42\x11\x1a]\x1c8,V\x7f@"
    b"\n\x1b\n\x10command_buffer_1\x11o\xd6\x1b?@\xd7W@\n\x1c\n\x11command_buffer_12\x11\xd0\\H\x9ar\x8a[@"
    b"\n\x1d\n\x12command_buffer_162\x11A\x03\xe2\x1b\xd4_.@"
)


def test_profiled_instructions_decodes_xla_profiles():
    from equipax.launch.training.pgle import profiled_instructions

    costs = profiled_instructions(H200_COMMAND_BUFFER_PROFILE)
    assert sorted(costs) == [
        "command_buffer_1",
        "command_buffer_12",
        "command_buffer_162",
        "command_buffer_42",
        "command_buffer_72",
    ]
    assert all(1.0 < c < 1000.0 for c in costs.values())  # microseconds

    # A hand-built profile: two instruction costs and a latency entry (field 2), which is skipped.
    def entry(name: bytes, us: float) -> bytes:
        body = b"\n" + bytes([len(name)]) + name + b"\x11" + struct.pack("<d", us)
        return b"\n" + bytes([len(body)]) + body

    proto = entry(b"fusion.3", 12.5) + b"\x12\x04\n\x02ab" + entry(b"all-gather-start", 70.25)
    assert profiled_instructions(proto) == {"fusion.3": 12.5, "all-gather-start": 70.25}
    assert profiled_instructions(b"") == {}
    with pytest.raises(ValueError, match="not a profile.pb"):
        profiled_instructions(b"\x0f")


def test_pgle_collect_on_cpu_turns_command_buffers_off(tmp_path, monkeypatch):
    """One `launch pgle collect` (each costs a profiled run): its trace, its (empty, on CPU) profile
    and advice, and the XLA flags it sets. No end-of-run sample (TOY's 8 tokens: a decode program
    compiled for nothing checked here)."""
    # XLA reads XLA_FLAGS when the backend starts: collect adds its flags (after the run's own
    # train.compiler.xla_flags) before that, and XLA:CPU accepts them.
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=FUSION")
    job = tmp_path / "collect"
    result = launch(
        "pgle",
        "collect",
        "--exp",
        "shakespeare_tiny",
        *set_args([*TOY, "train.sample.tokens=0"]),
        "--steps",
        "2",
        "--warmup",
        "1",
        "--set",
        "train.compiler.xla_flags=--xla_cpu_enable_fast_math=false",
        "--job-log-dir",
        job,
    )
    assert result.exit_code == 0, result.output
    flags = os.environ["XLA_FLAGS"].split()
    assert flags == [
        "--xla_cpu_enable_fast_math=false",
        "--xla_gpu_enable_latency_hiding_scheduler=true",
        "--xla_gpu_enable_command_buffer=",
    ]
    [trace] = (job / "profile" / "plugins" / "profile").iterdir()
    assert _step_annotations(trace) == [2, 3]  # after the warm-up step, which compiled
    profile = job / "profile.pb"
    # XLA:CPU records no per-instruction latencies: the profile is empty here, and says so.
    assert profile.exists() and profile.stat().st_size == 0
    assert "only on NVIDIA GPUs" in result.output
    assert f"--set train.pgle.mode=manual --set train.pgle.profile_path={profile.resolve()}" in result.output
    again = launch("pgle", "collect", "--exp", "shakespeare_tiny", "--job-log-dir", job)
    assert again.exit_code == 2 and "is not empty" in again.output
