"""`train.compiler.xla_flags` and `train.compiler.libtpu_init_args`: set in the environment before JAX starts by
`launch run` and `launch compile`, printed, and recorded with the other knobs."""

import json
import subprocess
import sys

import pytest

from equipax.launch.hardware.compiler_flags import SEED_C4_22B_LIBTPU_INIT_ARGS, apply_compiler_flags, merge_flags
from helpers.toy import TOY, set_args


def test_a_knob_flag_replaces_one_of_the_same_name_and_keeps_the_others():
    env = {"XLA_FLAGS": "--xla_a=1 --xla_b=2"}
    changed = apply_compiler_flags("--xla_b=3 --xla_c", "", env)
    assert env["XLA_FLAGS"] == "--xla_a=1 --xla_b=3 --xla_c" and changed == {"XLA_FLAGS": env["XLA_FLAGS"]}
    assert apply_compiler_flags("", "", env) == {} and "LIBTPU_INIT_ARGS" not in env
    assert merge_flags("", "'--x=a b'") == "--x=a b"


def test_the_multislice_experiments_carry_the_seeds_libtpu_args():
    from equipax.launch.experiments.registry import get_experiment

    for name in ("c4_22b_1x", "c4_22b_2x", "c4_22b_2x_smoke"):
        assert get_experiment(name).train.compiler.libtpu_init_args == SEED_C4_22B_LIBTPU_INIT_ARGS
    assert "--xla_tpu_enable_latency_hiding_scheduler=true" in SEED_C4_22B_LIBTPU_INIT_ARGS
    with pytest.raises(ValueError, match="train.compiler.xla_flags"):
        from equipax.launch.configs.train import CompilerConfig

        CompilerConfig(xla_flags="--xla_dump_to='unterminated")


def _cli(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "equipax.launch.cli", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
def test_launch_run_applies_xla_flags_before_jax_starts(tmp_path):
    dump = tmp_path / "dump"
    job = tmp_path / "job"
    proc = _cli(
        "run",
        "--job-log-dir",
        str(job),
        *set_args(
            [
                *TOY,
                "train.num_steps=2",
                "train.log_every=1",
                "train.eval_every=2",
                "train.checkpoint_every=2",
                "train.sample.tokens=0",
                f"train.compiler.xla_flags=--xla_dump_to={dump}",
            ]
        ),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"XLA_FLAGS=--xla_dump_to={dump}" in proc.stderr
    assert any(dump.iterdir()), "XLA did not see the flag: it was set after the backend started"
    assert json.loads((job / "config.json").read_text())["train"]["compiler"]["xla_flags"] == f"--xla_dump_to={dump}"


def test_launch_compile_hands_the_seeds_libtpu_args_to_xla_tpu(tmp_path):
    proc = _cli("compile", "--exp", "c4_22b_2x_smoke", "--topology", "v4-8", "--job-log-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"LIBTPU_INIT_ARGS={SEED_C4_22B_LIBTPU_INIT_ARGS}" in proc.stderr
    flags = json.loads((tmp_path / "compile.json").read_text())["compiler_flags"]
    assert flags["train.compiler.libtpu_init_args"] == SEED_C4_22B_LIBTPU_INIT_ARGS
    assert flags["environment"]["LIBTPU_INIT_ARGS"].endswith(SEED_C4_22B_LIBTPU_INIT_ARGS)


# --- flags XLA or libtpu do not know: exit 2 naming the knob, before JAX starts --------------


@pytest.fixture
def probe_env(tmp_path, monkeypatch):
    """An empty probe cache (at its default place under XDG_CACHE_HOME) and no flags of the machine's own."""
    monkeypatch.delenv("EQUIPAX_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for var in ("XLA_FLAGS", "LIBTPU_INIT_ARGS"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


@pytest.mark.parametrize(
    "xla, libtpu, needles",
    [
        ("--xla_bogus_flag=1", "", ["train.compiler.xla_flags: XLA does not know the flag(s) --xla_bogus_flag=1"]),
        ("", "--garbage", ["train.compiler.libtpu_init_args: libtpu does not know the flag(s) --garbage"]),
    ],
    ids=["xla", "libtpu"],
)
def test_an_unknown_compiler_flag_is_refused_before_the_run(xla, libtpu, needles, probe_env):
    from typer.testing import CliRunner

    from equipax.launch.cli import app

    # In-process: the probe that finds the flag unknown is a child process of its own either way.
    job = probe_env / "job"
    proc = CliRunner().invoke(
        app,
        [
            "run",
            "--job-log-dir",
            str(job),
            *set_args([*TOY, f"train.compiler.xla_flags={xla}", f"train.compiler.libtpu_init_args={libtpu}"]),
        ],
    )
    assert proc.exit_code == 2, proc.output
    assert "Traceback" not in proc.stderr and all(n in proc.stderr for n in needles), proc.stderr
    assert not job.exists()  # refused before anything was written


def test_a_flag_from_the_environment_is_named_as_such_and_good_flags_are_probed_once(probe_env, monkeypatch):
    import equipax.launch.hardware.compiler_flags as flags

    monkeypatch.setenv("XLA_FLAGS", "--xla_nope=2")
    changed = apply_compiler_flags("--xla_dump_hlo_as_text", "")
    with pytest.raises(
        flags.ConfigError, match=r"XLA_FLAGS in the environment: XLA does not know the flag\(s\) --xla_nope=2"
    ):
        flags.check_compiler_flags(changed, xla_flags="--xla_dump_hlo_as_text", libtpu_init_args="")
    monkeypatch.setenv("XLA_FLAGS", "")
    changed = apply_compiler_flags("--xla_dump_hlo_as_text", "")
    flags.check_compiler_flags(changed, xla_flags="--xla_dump_hlo_as_text", libtpu_init_args="")  # probed: known
    assert (probe_env / "cache" / "equipax" / "compiler_flags.json").exists()

    def no_probe(*a, **k):
        raise AssertionError("a flag set that passed is not probed again")

    monkeypatch.setattr(flags.subprocess, "run", no_probe)
    flags.check_compiler_flags(changed, xla_flags="--xla_dump_hlo_as_text", libtpu_init_args="")
    flags.check_compiler_flags({}, xla_flags="", libtpu_init_args="")  # nothing set: nothing probed


def test_libtpu_is_quiet_on_a_host_without_tpus_and_untouched_on_a_tpu_vm(tmp_path, monkeypatch):
    """On a host with no TPU chip, libtpu (loaded whenever JAX_PLATFORMS leaves tpu in) gets the
    variables that answer its metadata question, instead of printing "Failed to find host bounds"
    and an INVALID_ARGUMENT trace on every run; a TPU VM, a set variable or JAX_PLATFORMS=cpu is
    left alone; a compile for a real slice replaces what was set this way."""
    from equipax.launch.hardware.tpu import QUIETED_TPU, prepare_libtpu, quiet_absent_tpu

    dev = tmp_path / "dev"
    (dev / "vfio").mkdir(parents=True)
    env: dict[str, str] = {}
    assert quiet_absent_tpu(env, dev=dev) and env["TPU_ACCELERATOR_TYPE"] and env[QUIETED_TPU] == "1"
    assert not quiet_absent_tpu({"JAX_PLATFORMS": "cpu"}, dev=dev)
    assert quiet_absent_tpu({"JAX_PLATFORMS": "tpu,cpu"}, dev=dev)
    assert not quiet_absent_tpu({"TPU_WORKER_HOSTNAMES": "10.0.0.2"}, dev=dev)
    (dev / "vfio" / "0").touch()  # a v5p / v6e VM's chip
    assert not quiet_absent_tpu(env := {}, dev=dev) and env == {}
    (dev / "vfio" / "0").unlink()
    (dev / "accel0").touch()  # a v4 / v5e VM's chip
    assert not quiet_absent_tpu({}, dev=dev)

    for var in ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "TPU_WORKER_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v4-8")
    monkeypatch.setenv(QUIETED_TPU, "1")
    prepare_libtpu("v5p-64")
    import os

    assert os.environ["TPU_ACCELERATOR_TYPE"] == "v5p-64" and QUIETED_TPU not in os.environ


def test_a_new_tpu_job_opens_the_chip_with_a_1_gib_host_buffer_and_a_resume_keeps_libtpus(tmp_path, monkeypatch):
    """libtpu pins `TPU_PREMAPPED_BUFFER_SIZE` bytes when it opens the chip (4 GiB by default, about
    1.1 s per GiB on the v5e's host). `launch run` of a job with no checkpoint and no weights to
    import sets 1 GiB before JAX starts, and says so; a resume, `model.init_from`, a buffer the
    user set, `JAX_PLATFORMS` without tpu, or a host without TPU chips keep libtpu's default."""
    from equipax.launch.cluster import devices
    from equipax.launch.hardware import tpu
    from helpers.cli import invoke

    dev = tmp_path / "dev"
    (dev / "vfio").mkdir(parents=True)
    new, old = tmp_path / "new", tmp_path / "old"
    (old / "checkpoints").mkdir(parents=True)
    assert tpu.host_buffer_for_new_job(new, loads_weights=False, environ=(env := {}), dev=dev) is None and env == {}
    (dev / "accel0").touch()  # a v5e VM's chip
    assert tpu.host_buffer_for_new_job(new, loads_weights=False, environ=(env := {}), dev=dev) == "1073741824"
    assert env == {"TPU_PREMAPPED_BUFFER_SIZE": str(2**30)}
    assert tpu.host_buffer_for_new_job(new, loads_weights=False, environ={"JAX_PLATFORMS": "tpu,cpu"}, dev=dev)
    for environ, job, loads in [
        ({}, old, False),  # a resume puts the whole state on the chip
        ({}, new, True),  # so does an import of weights
        ({"TPU_PREMAPPED_BUFFER_SIZE": str(4 * 2**30)}, new, False),
        ({"JAX_PLATFORMS": "cpu"}, new, False),
    ]:
        before = dict(environ)
        assert tpu.host_buffer_for_new_job(job, loads_weights=loads, environ=environ, dev=dev) is None
        assert environ == before

    # `launch run` asks before the devices open, with the job's directory and its model.init_from.
    class Opened(Exception):
        pass

    def stop() -> None:
        raise Opened

    seen: list[tuple[str, bool]] = []

    def spy(job_dir, *, loads_weights):
        seen.append((str(job_dir), loads_weights))
        return str(2**30) if not loads_weights else None

    monkeypatch.setattr(devices, "open_devices_early", stop)
    monkeypatch.setattr(tpu, "host_buffer_for_new_job", spy)
    code, out = invoke("run", "--exp", "shakespeare_tiny", "--job-log-dir", new)
    assert code == 1 and seen == [(str(new), False)] and "TPU_PREMAPPED_BUFFER_SIZE=1073741824" in out, out
    hf = tmp_path / "hf"
    hf.mkdir()
    code, out = invoke("run", "--exp", "shakespeare_tiny", "--job-log-dir", new, "--set", f"model.init_from=hf:{hf}")
    assert seen[-1] == (str(new), True) and "TPU_PREMAPPED_BUFFER_SIZE" not in out, out
