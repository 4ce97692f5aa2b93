"""docs/errors.md, entry by entry: each user-facing error through the CLI, its message, its exit
code, and that nothing already in the job directory was damaged."""

import errno
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from helpers.cli import FAST, assert_one_paragraph, invoke, launch_process, run, snapshot
from helpers.toy import TOY, set_args


@pytest.fixture(scope="module")
def finished_job(tmp_path_factory):
    """A finished 4-step toy job with checkpoints 2 and 4 (copied by each test that uses it)."""
    job = tmp_path_factory.mktemp("finished") / "job"
    code, out = run(job, "train.num_steps=4")
    assert code == 0, out
    return job


@pytest.fixture
def job_copy(finished_job, tmp_path):
    job = tmp_path / "job"
    shutil.copytree(finished_job, job)
    return job


@pytest.mark.parametrize(
    "args, needles",
    [
        # unknown experiment
        (["--exp", "shakespear_tiny"], ["Unknown experiment 'shakespear_tiny'", "Did you mean 'shakespeare_tiny'"]),
        # unknown knob
        (["--set", "model.transformer.num_layer=2"], ["Unknown knob", "Did you mean 'model.transformer.num_layers'"]),
        # wrong knob type
        (["--set", "train.log_every=[1, 2]"], ["Knob 'train.log_every' expects int"]),
        (["--set", "train.on_nonfinite=ignore"], ["must be one of 'skip', 'abort'"]),
        # unparsable value
        (["--set", "data.validation_plays=('hamlet',"], ["Knob 'data.validation_plays' expects tuple"]),
        (["--set", "train.num_steps"], ["is not of the form KNOB=VALUE"]),
        # batch not divisible by the data-parallel size
        (["--set", "mesh.ici_mesh_shape=(3, 1, 1)"], ["not divisible by the data-parallel size 3"]),
        # conflicting eval settings
        (
            ["--set", "data.reset_for_eval=False", "--set", "train.eval_batches=0"],
            ["rolling eval", "train.eval_batches=0"],
        ),
        # a knob of another model: the CNN experiment has no transformer
        (
            ["--exp", "cnn_digits", "--set", "model.transformer.num_layers=2"],
            ["Unknown knob 'model.transformer.num_layers'"],
        ),
    ],
)
def test_config_errors_exit_2_and_write_nothing(args, needles, job_copy):
    before = snapshot(job_copy)
    code, out = invoke("run", "--job-log-dir", job_copy, *args)
    assert code == 2, out
    assert_one_paragraph(out, *needles)
    assert snapshot(job_copy) == before


def test_mesh_device_mismatch(job_copy):
    before = snapshot(job_copy)
    code, out = run(job_copy, "mesh.ici_mesh_shape=(2, 1, 1)")
    assert code == 2, out
    assert_one_paragraph(out, "The mesh needs 2 devices", "1 are available", "launch compile")
    assert snapshot(job_copy) == before


def _shards(tmp_path: Path, train_lines: list[str]) -> Path:
    data = tmp_path / "c4"
    data.mkdir()
    (data / "c4-train.00000-of-00001.jsonl").write_text("".join(ln + "\n" for ln in train_lines))
    (data / "c4-validation.00000-of-00001.jsonl").write_text(json.dumps({"text": "some words"}) + "\n")
    return data


@pytest.mark.parametrize(
    "lines, needles",
    [
        (None, ["data.path", "does not exist", "launch data prepare"]),  # missing data path
        ([], ["it is empty"]),  # empty shard
        ([json.dumps({"text": "fine"})] * 5 + ["{not json"] * 5, ["are malformed", "data.max_malformed_fraction"]),
    ],
    ids=["missing-path", "empty-shard", "malformed-lines"],
)
def test_data_errors(lines, needles, tmp_path):
    data = tmp_path / "nowhere" if lines is None else _shards(tmp_path, lines)
    job = tmp_path / "job"
    code, out = run(job, "data.source='c4'", f"data.path='{data}'")
    assert code == 2, out
    assert_one_paragraph(out, *needles)
    assert not (job / "checkpoints").exists()


def test_job_dir_not_writable(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("keep me")
    code, out = run(blocker / "job")
    assert code == 2, out
    assert_one_paragraph(out, "is not a writable directory", "--job-log-dir")
    assert blocker.read_text() == "keep me"


def test_job_dir_read_only(tmp_path):
    import os

    if os.geteuid() == 0:
        pytest.skip("root writes into read-only directories; covered by test_job_dir_not_writable")
    job = tmp_path / "job"
    job.mkdir()
    job.chmod(0o500)
    try:
        code, out = run(job)
    finally:
        job.chmod(0o700)
    assert code == 2, out
    assert_one_paragraph(out, "is not a writable directory")


def test_disk_full_while_saving(job_copy, monkeypatch):
    import orbax.checkpoint as ocp

    def full(self, step, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.directory / f"{step}"))

    before = snapshot(job_copy / "checkpoints")
    monkeypatch.setattr(ocp.CheckpointManager, "save", full)
    code, out = run(job_copy, "train.num_steps=8")
    assert code == 2, out
    assert_one_paragraph(
        out,
        "Could not write the checkpoint of step 6",
        "No space left on device",
        "step 4, is intact",
        "run the same command again",
    )
    assert snapshot(job_copy / "checkpoints") == before
    monkeypatch.undo()
    code, out = run(job_copy, "train.num_steps=8")  # space freed: resumes from the intact step
    assert code == 0 and "Resumed from step 4" in out, out


def test_corrupt_checkpoint_falls_back_to_the_previous_one(job_copy):
    damaged = [p for p in (job_copy / "checkpoints" / "4" / "state").rglob("*") if p.is_file()]
    for p in damaged:
        p.write_bytes(b"\0garbage")
    code, out = run(job_copy, "train.num_steps=6")
    assert code == 0, out
    assert "warning: the checkpoint of step 4 does not restore" in out and "Resumed from step 2" in out, out
    assert "Traceback" not in out
    moved = list((job_copy / "corrupt_checkpoints").iterdir())
    assert len(moved) == 1 and moved[0].name.startswith("4-")  # kept for inspection, never deleted
    assert sorted(p.name for p in (job_copy / "checkpoints").iterdir()) == ["2", "4", "6"]


def truncate_array_files(job: Path, step: int) -> None:
    """What a copy cut short or a full disk leaves: the step's array data files (the large files of
    `ocdbt.process_*/d/`), 100 bytes each; its metadata files stay whole."""
    for p in (job / "checkpoints" / str(step) / "state").glob("ocdbt.process_*/d/*"):
        if p.stat().st_size > 1000:
            os.truncate(p, 100)


@pytest.mark.slow
def test_a_truncated_checkpoint_is_one_paragraph_in_decode_and_eval(job_copy):
    truncate_array_files(job_copy, 4)
    before = snapshot(job_copy)
    done = launch_process("decode", "--job-log-dir", job_copy, "--prompt", "ROMEO:", "--max-new-tokens", 2)
    assert done.returncode == 2, done.stdout + done.stderr
    # orbax's read coroutines and futures print nothing after the one paragraph (they did: 1-24
    # tracebacks); the cause is tensorstore's own words or the metadata's, not orbax's wrapper.
    assert_one_paragraph(
        done.stderr,
        "The checkpoint of step 4",
        "does not restore",
        "pick another with --step (this job also has step(s) 2)",
    )
    assert "Exception ignored" not in done.stderr and "bound method" not in done.stderr
    done = launch_process("eval", "--job-log-dir", job_copy)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "step 2: eval loss" in done.stdout, done.stderr  # the readable one is evaluated, then the failure is said
    assert_one_paragraph(done.stderr, "warning: The checkpoint of step 4", "skipped it", "step(s) 4 in")
    assert "Exception ignored" not in done.stderr and "never retrieved" not in done.stderr
    assert [json.loads(ln)["step"] for ln in (job_copy / "eval_job" / "metrics.jsonl").read_text().splitlines()] == [2]
    after = snapshot(job_copy)
    assert {k: after[k] for k in before} == before  # nothing of the job changed (eval adds eval_job/)


def test_eval_on_a_full_disk_is_one_paragraph_and_keeps_whole_records(job_copy):
    done = launch_process("eval", "--job-log-dir", job_copy, file_size_limit=250)  # a record (~150 B) fits, not two
    assert done.returncode == 2, done.stdout + done.stderr
    # no tracebacks from TensorBoard's writer thread or its exit hook after the one paragraph
    assert_one_paragraph(done.stderr, "Could not record the evaluation of step", "Nothing of it was kept")
    assert "Exception" not in done.stderr, done.stderr
    failed = int(re.search(r"evaluation of step (\d+)", done.stderr)[1])
    lines = (job_copy / "eval_job" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(ln)["step"] for ln in lines] == [s for s in (2, 4) if s < failed]  # no line cut short
    code, out = invoke("eval", "--job-log-dir", job_copy)  # space freed: the rest is evaluated once
    assert code == 0, out
    lines = (job_copy / "eval_job" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(ln)["step"] for ln in lines] == [2, 4]


def test_eval_and_decode_take_the_jobs_knobs_changed_for_themselves(job_copy):
    """The advice of data errors ("--set data.path=...") holds for eval and decode too: their
    --set changes the job's knobs for that command only; a model knob that no longer fits the
    checkpoint is named; the job's files stay as they were."""
    before = snapshot(job_copy)
    code, out = invoke("eval", "--job-log-dir", job_copy, "--set", "train.eval_batches=1")
    assert code == 0 and "step 4: eval loss" in out, out
    assert all(
        json.loads(ln)["batches"] == 1 for ln in (job_copy / "eval_job" / "metrics.jsonl").read_text().splitlines()
    )
    code, out = invoke(
        "decode",
        "--job-log-dir",
        job_copy,
        "--prompt",
        "A",
        "--max-new-tokens",
        1,
        "--set",
        "model.transformer.hidden_dims=96",
    )
    assert code == 2 and "does not hold this job's model" in out, out
    code, out = invoke("decode", "--job-log-dir", job_copy, "--prompt", "A", "--set", "data.pathh=/x")
    assert code == 2 and "Unknown knob 'data.pathh'" in out, out
    after = snapshot(job_copy)
    assert {k: after[k] for k in before} == before


def test_a_checkpoint_without_checksums_restores_with_a_warning(job_copy):
    shutil.rmtree(job_copy / "checkpoints" / "4" / "digests")
    code, out = run(job_copy, "train.num_steps=6")
    assert code == 0 and "Resumed from step 4" in out, out
    assert "warning: the checkpoint of step 4" in out and "has no checksums" in out, out


def test_checkpoint_of_another_shape(job_copy):
    before = snapshot(job_copy)
    code, out = run(job_copy, "train.num_steps=6", "model.transformer.hidden_dims=96")
    assert code == 2, out
    assert_one_paragraph(out, "different shapes", "model.transformer.hidden_dims: 64 -> 96", "--job-log-dir")
    assert snapshot(job_copy) == before


def test_job_dir_of_another_experiment(job_copy):
    config = json.loads((job_copy / "config.json").read_text())
    (job_copy / "config.json").write_text(json.dumps({**config, "name": "other_experiment"}))
    before = snapshot(job_copy)
    code, out = run(job_copy, "train.num_steps=6")
    assert code == 2, out
    assert_one_paragraph(out, "holds checkpoints of experiment 'other_experiment'", "--exp other_experiment")
    assert snapshot(job_copy) == before


@pytest.mark.parametrize("content", [None, b"not a sentencepiece model"], ids=["missing", "corrupt"])
def test_sentencepiece_vocab_path(content, tmp_path):
    path = tmp_path / "vocab.model"
    if content is not None:
        path.write_bytes(content)
    code, out = invoke("run", "--job-log-dir", tmp_path / "job", *set_args([*TOY, f"data.vocab_path='{path}'"]))
    assert code == 2, out
    assert_one_paragraph(out, "data.vocab_path", "not found" if content is None else "could not parse")


def test_job_tokenizer_corrupt(tmp_path):
    job = tmp_path / "job"
    code, out = invoke("run", "--job-log-dir", job, *set_args([*TOY, "train.num_steps=2", "train.sample.tokens=0"]))
    assert code == 0, out
    (job / "tokenizer.model").write_bytes(b"half a file")
    before = snapshot(job)
    code, out = invoke("run", "--job-log-dir", job, *set_args([*TOY, "train.num_steps=4"]))
    assert code == 2, out
    assert_one_paragraph(out, "tokenizer.model", "does not load", "new --job-log-dir")
    assert snapshot(job) == before


def test_reading_a_job_without_its_vocabulary_never_trains_a_new_one(tmp_path):
    """`launch decode` and `launch eval` of a job whose tokenizer.model is gone: exit 2 saying to
    copy it back, and no vocabulary is trained into the job directory."""
    job = tmp_path / "job"
    code, out = invoke("run", "--job-log-dir", job, *set_args([*TOY, "train.num_steps=2", "train.sample.tokens=0"]))
    assert code == 0, out
    (job / "tokenizer.model").unlink()
    before = snapshot(job)
    for args in (("decode", "--prompt", "ROMEO:", "--max-new-tokens", 2), ("eval",)):
        code, out = invoke(args[0], "--job-log-dir", job, *args[1:])
        assert code == 2, out
        assert_one_paragraph(out, "has no tokenizer.model", "copy it back")
    assert snapshot(job) == before


def test_nan_loss_skip(tmp_path):
    job = tmp_path / "job"
    code, out = run(job, "train.num_steps=6", "train.debug_nan_steps=(3,)")
    assert code == 0, out
    assert "step 3: the loss is nan; the update was skipped (1 in a row, 1 in all" in out, out
    records = [json.loads(ln) for ln in (job / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in records if r["split"] == "train"}
    assert train[3]["loss"] == "nan" and train[2]["nonfinite_steps"] == 0 and train[6]["nonfinite_steps"] == 1
    assert all(isinstance(train[s]["loss"], float) for s in (4, 5, 6))
    assert json.loads((job / "result.json").read_text())["final_eval_loss"] < 100


def test_nan_loss_abort_names_step_and_last_good_checkpoint(tmp_path):
    job = tmp_path / "job"
    code, out = run(job, "train.num_steps=6", "train.debug_nan_steps=(3,)", "train.on_nonfinite='abort'")
    assert code == 4, out
    assert_one_paragraph(
        out, "Step 3: the loss is nan", "train.on_nonfinite='abort'", "The last good checkpoint is step 2"
    )
    assert sorted(p.name for p in (job / "checkpoints").iterdir()) == ["2"]  # nothing saved past it


def test_too_many_consecutive_nonfinite_steps(tmp_path):
    job = tmp_path / "job"
    code, out = run(job, "train.num_steps=8", "train.debug_nan_steps=(3, 4, 5)", "train.max_consecutive_nonfinite=2")
    assert code == 4, out
    assert "step 3: the loss is nan; the update was skipped" in out and "step 4:" in out
    # Checkpoint 4 was saved inside the streak (3, 4, 5): the last good one is from before it.
    assert_one_paragraph(
        out,
        "Step 5: the loss is nan",
        "3 consecutive steps",
        "max_consecutive_nonfinite=2",
        "The run became unstable at step 3",
        "likely a bad batch",
        "The last good checkpoint is step 2",
    )
    assert sorted(p.name for p in (job / "checkpoints").iterdir()) == ["2"]
    assert [p.name.split("-")[0] for p in (job / "unstable_checkpoints").iterdir()] == ["4"]


def test_unexpected_error_one_paragraph_and_debug_traceback(tmp_path, monkeypatch):
    import equipax.launch.training.loop as run_module

    def boom(*args, **kwargs):
        raise RuntimeError("something deep inside broke\nsecond line")

    monkeypatch.setattr(run_module, "run_experiment", boom)
    code, out = run(tmp_path / "job")
    assert code == 1, out
    assert_one_paragraph(out, "Unexpected RuntimeError: something deep inside broke", "launch --debug")
    assert "second line" not in out

    from typer.testing import CliRunner

    from equipax.launch.cli import app

    result = CliRunner().invoke(app, ["--debug", "run", "--job-log-dir", str(tmp_path / "job"), *set_args(FAST)])
    assert isinstance(result.exception, RuntimeError)  # --debug lets the traceback through


def test_each_run_ending_failure_carries_the_exit_code_the_cli_ends_with():
    """`equipax.launch.failures`: every exception there names its own exit code (docs/errors.md's
    table), and `errors.describe` ends the command with it."""
    from equipax.launch import failures
    from equipax.launch.errors import describe

    documented = {
        failures.Preempted(3): 75,
        failures.Interrupted("SIGTERM"): 75,
        failures.NonFiniteError("step 3: the loss is nan", step=3, last_checkpoint=2): 4,
        failures.CheckpointSaveError("Could not write the checkpoint of step 3"): 2,
    }
    assert {type(e) for e in documented} == {getattr(failures, name) for name in failures.__all__}
    for exc, code in documented.items():
        assert exc.exit_code == code and describe(exc)[1] == code, type(exc).__name__
