"""The launcher end to end at toy size: registry, CLI errors, training, resume."""

import json
import shutil
import subprocess
import sys

import pytest

from helpers.toy import TOY, persistent_compile_cache, set_args


def sets(*overrides):
    return set_args([*TOY, *overrides])


def invoke(*args):
    from typer.testing import CliRunner

    from equipax.launch.cli import app
    from helpers.toy import fast_compile_in_process

    with fast_compile_in_process():  # behaviour, not numbers recorded at XLA's default level
        return CliRunner().invoke(app, list(args))


def test_registry_short_name_and_dotted_suffix():
    from equipax.launch.experiments.registry import get_experiment, lookup

    assert lookup("shakespeare_tiny").name == "shakespeare_tiny"
    assert lookup("shakespeare_lms.shakespeare_tiny").name == "shakespeare_tiny"
    assert get_experiment("experiments.shakespeare_lms.shakespeare_tiny").name == "shakespeare_tiny"


def test_unknown_experiment_lists_close_names():
    from equipax.core.knobs import ConfigError
    from equipax.launch.experiments.registry import lookup

    with pytest.raises(ConfigError, match="Did you mean 'shakespeare_tiny'"):
        lookup("shakespear_tiny")


def test_experiment_config_is_pure_and_round_trips():
    from equipax.core.knobs import from_json, to_json
    from equipax.launch.configs.experiment import ExperimentConfig
    from equipax.launch.experiments.registry import get_experiment

    cfg = get_experiment("shakespeare_tiny")
    assert from_json(ExperimentConfig, to_json(cfg)) == cfg


@pytest.mark.parametrize(
    "args, message",
    [
        (["--exp", "nope"], "Unknown experiment 'nope'"),
        (["--set", "model.transformer.num_layer=2"], "Did you mean 'model.transformer.num_layers'"),
        (["--set", "train.num_steps=many"], "expects int"),
        (["--set", "data.seq_len=4096"], "exceeds model.max_seq_len"),
        (["--set", "data.validation_plays=['hamlett']"], "Did you mean"),
    ],
)
def test_cli_user_errors_exit_2_with_message(args, message, tmp_path):
    result = invoke("run", "--job-log-dir", str(tmp_path / "job"), *args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output


def test_show_json_touches_no_devices():
    result = invoke("show", "--format", "json", "--set", "model.transformer.num_layers=3")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["config"]["model"]["transformer"]["num_layers"] == 3
    assert data["sources"]["model.transformer.num_layers"] == "--set"
    assert data["derived"]["params_total"] > 0


def test_list_shows_default_experiment():
    result = invoke("list")
    assert result.exit_code == 0 and "shakespeare_tiny" in result.output


@pytest.mark.slow
def test_toy_run_learns_and_writes_job_dir(tmp_path):
    job = tmp_path / "job"
    result = invoke(
        "run",
        "--job-log-dir",
        str(job),
        *sets("train.num_steps=60", "train.log_every=10", "train.eval_every=30", "train.checkpoint_every=30"),
    )
    assert result.exit_code == 0, result.output
    for name in ("config.json", "knobs.txt", "metrics.jsonl", "tokenizer.model", "result.json", "plots/loss.png"):
        assert (job / name).exists(), name
    assert list((job / "summaries" / "train").iterdir()) and list((job / "summaries" / "eval").iterdir())
    assert sorted(p.name for p in (job / "checkpoints").iterdir()) == ["30", "60"]
    assert "model.vocab_size" in (job / "knobs.txt").read_text() and "# --set" in (job / "knobs.txt").read_text()
    records = [json.loads(ln) for ln in (job / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    evals = [r for r in records if r["split"] == "eval"]
    for key in ("step", "loss", "learning_rate", "grad_norm", "step_time_s", "tokens_per_s"):
        assert key in train[0]
    assert train[-1]["loss"] < train[0]["loss"] - 0.5, [r["loss"] for r in train]
    assert evals[-1]["loss"] < evals[0]["loss"]
    res = json.loads((job / "result.json").read_text())
    assert res["final_eval_loss"] < res["unigram_entropy"] + 1.0
    assert "Sample:" in result.output


@pytest.mark.slow
def test_resume_equals_uninterrupted(tmp_path, monkeypatch):
    with persistent_compile_cache(tmp_path / "jax-cache"):  # the three runs compile the same programs once
        _resume_equals_uninterrupted(tmp_path, monkeypatch)


def _resume_equals_uninterrupted(tmp_path, monkeypatch):
    from equipax.launch.program.training import Training

    common = ("train.log_every=5", "train.eval_every=10", "train.checkpoint_every=10")
    full = invoke("run", "--job-log-dir", str(tmp_path / "full"), *sets("train.num_steps=20", *common))
    assert full.exit_code == 0, full.output
    # Stopped after step 10: the uninterrupted job as a run killed right after its checkpoint of
    # step 10 left it (its checkpoint of step 20 and result.json gone; the records of steps 15-20
    # stay, and the resumed run drops them). The checkpoint a `train.num_steps=10` run writes
    # (nothing saved depends on num_steps), without that run.
    shutil.copytree(tmp_path / "full", tmp_path / "split")
    shutil.rmtree(tmp_path / "split" / "checkpoints" / "20")
    (tmp_path / "split" / "result.json").unlink()
    with monkeypatch.context() as m:  # a resumed run restores into the abstract state: no random init
        m.setattr(Training, "init_state", lambda self: pytest.fail("a resumed run initialised the state"))
        second = invoke("run", "--job-log-dir", str(tmp_path / "split"), *sets("train.num_steps=20", *common))
    assert second.exit_code == 0, second.output
    assert "Resumed from step 10" in second.output
    a = json.loads((tmp_path / "full" / "result.json").read_text())
    b = json.loads((tmp_path / "split" / "result.json").read_text())
    assert a["state_digest"] == b["state_digest"]  # parameters and optimizer state, bit for bit
    assert a["final_train_loss"] == b["final_train_loss"]
    assert a["final_eval_loss"] == b["final_eval_loss"]
    # metrics.jsonl holds each step once, as if the run had never stopped.
    recs = [json.loads(ln) for ln in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if r["split"] == "train"] == [5, 10, 15, 20]


@pytest.mark.slow
def test_resume_refuses_a_different_model_shape(tmp_path):
    job = str(tmp_path / "job")
    ok = invoke("run", "--job-log-dir", job, *sets("train.num_steps=2", "train.sample.tokens=0"))
    assert ok.exit_code == 0, ok.output
    bad = invoke("run", "--job-log-dir", job, *sets("train.num_steps=4", "model.transformer.hidden_dims=96"))
    assert bad.exit_code == 2
    assert "different shapes" in bad.output, bad.output
    assert "model.transformer.hidden_dims: 64 -> 96" in bad.output, bad.output
    # The job's record of its config is not overwritten by the refused run.
    assert json.loads((tmp_path / "job" / "config.json").read_text())["model"]["transformer"]["hidden_dims"] == 64


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["list"],
        ["show", "--exp", "shakespeare_tiny"],
        ["show", "--exp", "c4_gpt3_xl_pipeline"],
        ["show", "--exp", "cnn_digits"],
        ["show", "--exp", "shakespeare_tiny", "--set", "model.transformer.num_layer=3"],
    ],
)
def test_commands_that_do_not_train_do_not_import_jax(argv):
    """benchmarks/README.md, CLI latency: `--help`, `list`, `show` and knob errors answer without
    JAX, grain or orbax (seconds each): the config classes live in JAX-free `configs` modules."""
    code = (
        "import sys; from equipax.launch.cli import main; sys.argv = ['launch', *sys.argv[1:]]\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'jax', 'grain', 'orbax', 'optax', 'equinox'})\n"
        "assert not heavy, heavy"
    )
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_progress_bar_on_a_terminal_and_plain_lines_otherwise():
    import io

    from rich.console import Console

    from equipax.launch.training.progress import ProgressReporter

    metrics = {"loss": 2.5, "learning_rate": 1e-3, "tokens_per_s": 1234.0}
    tty = io.StringIO()
    bar = ProgressReporter(Console(file=tty, force_terminal=True, width=100), total=10, start=0)
    bar.update(5, metrics)
    bar.close()
    assert "5/10" in tty.getvalue() and "\x1b[" in tty.getvalue()  # drawn with terminal escapes

    log = io.StringIO()
    plain = ProgressReporter(Console(file=log, force_terminal=False, width=100), total=10, start=0)
    plain.update(5, metrics)
    plain.close()
    assert log.getvalue().startswith("step 5/10  loss 2.5000") and "\x1b[" not in log.getvalue()


def test_launch_run_with_cudnn_on_cpu_exits_2_naming_the_knob(tmp_path):
    from typer.testing import CliRunner

    from equipax.launch.cli import app
    from helpers.toy import TOY, set_args

    knobs = [
        *TOY,
        "train.num_steps=2",
        "model.transformer.attention_impl=cudnn",
        "model.transformer.atten_logit_cap=None",
    ]
    result = CliRunner().invoke(app, ["run", "--job-log-dir", str(tmp_path / "job"), *set_args(knobs)])
    assert result.exit_code == 2, result.output
    assert "attention_impl='cudnn' needs a CUDA GPU" in " ".join(result.output.split())


def test_moved_train_knobs_are_refused_by_their_new_name_and_old_config_json_reads():
    """The loop's sub-configs (train.sample/decode/profile/pgle/compiler): an old flat knob given
    with --set is exit 2 naming its new path; a config.json written before the move reads."""
    import json

    from typer.testing import CliRunner

    from equipax.core.knobs import from_json, to_dict
    from equipax.launch.cli import app
    from equipax.launch.configs.experiment import ExperimentConfig
    from equipax.launch.experiments.registry import get_experiment

    for old, new in [
        ("train.sample_tokens=0", "train.sample.tokens"),
        ("train.pgle=auto", "train.pgle.mode"),
        ("train.xla_flags=''", "train.compiler.xla_flags"),
    ]:
        result = CliRunner().invoke(app, ["show", "--set", old])
        assert result.exit_code == 2 and f"Did you mean {new!r}?" in result.output, result.output
    saved = to_dict(get_experiment("shakespeare_tiny"))
    train = saved["train"]
    for group in ("sample", "decode", "profile", "pgle", "compiler"):
        del train[group]
    train |= {"sample_tokens": 7, "decode_every": 5, "profile_steps": 2, "pgle": "auto", "libtpu_init_args": "--x=1"}
    cfg = from_json(ExperimentConfig, json.dumps(saved))
    assert (cfg.train.sample.tokens, cfg.train.decode.every, cfg.train.profile.steps) == (7, 5, 2)
    assert cfg.train.pgle.mode == "auto" and cfg.train.compiler.libtpu_init_args == "--x=1"


def test_without_matplotlib_a_plot_is_skipped_and_said(tmp_path, monkeypatch):
    """A host set up with only what a run needs (benchmarks/tpu/wheels.sh leaves matplotlib out)
    draws no plot and says why, instead of failing the run at its end."""
    import sys

    from equipax.launch.jobdir import plots

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    records = [{"step": 1, "split": "train", "loss": 2.0}, {"step": 1, "split": "eval", "loss": 2.5}]
    assert plots.plot_loss(records, tmp_path / "loss.png") is None
    assert not (tmp_path / "loss.png").exists()
    assert "pip install matplotlib" in plots.NO_MATPLOTLIB
    monkeypatch.undo()  # matplotlib as it was
    assert plots.plot_loss(records, tmp_path / "loss.png") == tmp_path / "loss.png"
    assert (tmp_path / "loss.png").read_bytes().startswith(b"\x89PNG")
