"""`launch decode` and `launch eval` on a short training run's job directory, their bad inputs
(exit 2 with what to do), and decode during training (`train.decode.every`)."""

import json
import shutil
import threading

import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

from helpers.toy import TOY_SHORT, set_args

# Two checkpoints (steps 2 and 4), decode during training at both, greedy.
DECODE_RUN = [
    *TOY_SHORT,
    "data.tokenizer=byte",
    "train.checkpoint_every=2",
    "train.decode.every=2",
    "train.decode.tokens=4",
    "train.decode.prompts=('ROMEO:', 'To be')",
    "train.sample.tokens=0",
]


def invoke(*args):
    from typer.testing import CliRunner

    from equipax.launch.cli import app
    from helpers.toy import fast_compile_in_process

    with fast_compile_in_process():  # behaviour, not numbers recorded at XLA's default level
        return CliRunner().invoke(app, [str(a) for a in args])


def records(path, split):
    return [json.loads(line) for line in path.read_text().splitlines() if json.loads(line)["split"] == split]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    job_dir = tmp_path_factory.mktemp("decode") / "job"
    result = invoke("run", "--exp", "shakespeare_tiny", "--job-log-dir", job_dir, *set_args(DECODE_RUN))
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    return job_dir


def test_decode_during_training_records_samples(job):
    decoded = records(job / "metrics.jsonl", "decode")
    assert [(r["step"], r["prompt"]) for r in decoded] == [(2, "ROMEO:"), (2, "To be"), (4, "ROMEO:"), (4, "To be")]
    for r in decoded:
        assert 1 <= len(r["tokens"]) <= 4 and isinstance(r["text"], str) and r["seconds_per_token"] >= 0
    assert list((job / "summaries" / "decode").glob("events.out.tfevents.*"))  # TensorBoard text


def test_decode_restores_the_checkpoint_and_writes_json_lines(job, tmp_path):
    """Greedy `launch decode --step 4` continues the prompts exactly as the run did at step 4 (same
    model restored, same KV-cache decoding); a prompts file decodes its lines as one batch (a UTF-8
    byte-order mark, as some editors write, is not part of the first prompt)."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes("\ufeffROMEO:\n\nTo be\n".encode())
    result = invoke(
        "decode", "--job-log-dir", job, "--prompts", prompts, "--step", 4, "--max-new-tokens", 4, "--output", "-"
    )
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    samples = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    during = [r for r in records(job / "metrics.jsonl", "decode") if r["step"] == 4]
    assert [(s["prompt"], s["tokens"], s["text"]) for s in samples] == [
        (r["prompt"], r["tokens"], r["text"]) for r in during
    ]
    assert set(samples[0]) == {"prompt", "text", "tokens", "seconds_per_token"}


def test_decode_samples_reproducibly_by_seed(job):
    args = (
        "decode",
        "--job-log-dir",
        job,
        "--prompt",
        "ROMEO:",
        "--max-new-tokens",
        6,
        "--temperature",
        1.0,
        "--top-k",
        50,
        "--top-p",
        0.9,
        "--output",
        "-",
    )
    first, again = invoke(*args, "--seed", 3), invoke(*args, "--seed", 3)
    assert first.exit_code == 0, f"{first.output}\n{first.exception!r}"
    tokens = [json.loads(r.stdout.splitlines()[-1])["tokens"] for r in (first, again)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 6


def test_decode_and_eval_build_the_model_and_never_a_learner_or_train_step(job, tmp_path, monkeypatch):
    """Reading a job builds its model on a mesh (`build_program`): no learner, optimizer state or
    train step is built for `launch decode` (prompts or a split) or `launch eval`."""
    import equipax.launch.program.training as training

    def refuse(*args, **kwargs):
        raise AssertionError("reading a job built the training program")

    for name in ("build_training", "make_learner", "make_train_step"):
        monkeypatch.setattr(training, name, refuse)
    copy = tmp_path / "job"
    shutil.copytree(job, copy)
    for args in (
        ("decode", "--job-log-dir", copy, "--prompt", "ROMEO:", "--max-new-tokens", 2, "--output", "-"),
        ("decode", "--job-log-dir", copy, "--split", "eval", "--max-examples", 2, "--max-new-tokens", 2),
        ("eval", "--job-log-dir", copy),
    ):
        result = invoke(*args)
        assert result.exit_code == 0, f"{args[0]}: {result.output}\n{result.exception!r}"


def test_each_prompt_gets_its_own_room_whatever_shares_its_batch(job, tmp_path):
    """A prompt's room is `min(--max-new-tokens, max_seq_len - its own length)`: short prompts
    batched with one near max_seq_len (32 here) are continued as when decoded alone (greedy), at
    every --batch-size; only the long prompt gets fewer tokens, and a note says so."""
    texts = ["First Citizen: Before we p", "ROMEO:", "To be", "O, speak again"]  # 26, 6, 5 and 14 bytes
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(texts) + "\n")
    tokens, outputs = {}, []
    for size in (1, 3):  # alone; then [long, short, short] and [medium]
        result = invoke(
            "decode", "--job-log-dir", job, "--prompts", prompts, "--max-new-tokens", 12, "--batch-size", size,
            "--output", "-",
        )  # fmt: skip
        assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
        tokens[size] = [json.loads(line)["tokens"] for line in result.stdout.splitlines() if line.startswith("{")]
        outputs.append(" ".join(result.output.split()))
    assert tokens[3] == tokens[1]
    assert [len(t) for t in tokens[1]] == [6, 12, 12, 12]  # this checkpoint never emits EOS this early
    assert all("prompt 1 (26 tokens) gets 6." in o and "prompt 2" not in o for o in outputs)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--step", 3], "no checkpoint of step 3; it has steps 2, 4"),
        (["--prompt", " "], "empty"),
        (["--prompt", "x" * 40], "at most max_seq_len=32"),
        ([], "either --prompt TEXT or --prompts FILE"),
        (["--max-new-tokens", 0], "--max-new-tokens"),
        (["--top-k", 100_000], "top_k must be in"),
    ],
)
def test_decode_bad_inputs_exit_2(job, args, message):
    if "--prompt" not in args and args:
        args = [*args, "--prompt", "ROMEO:"]
    result = invoke("decode", "--job-log-dir", job, *args)
    assert result.exit_code == 2, f"{result.output}\n{result.exception!r}"
    assert message in " ".join(result.output.split())
    assert "Traceback" not in result.output


def test_decode_split_eval_writes_each_example_to_the_job_directory(job):
    """Pax's decode dataset: `--split eval` continues the first examples of the job's eval input,
    each prompted with its first --prompt-tokens tokens; the reference is the example's next tokens."""

    from equipax.data import ByteTokenizer, build_lm_texts_tokens, split_plays

    result = invoke(
        "decode",
        "--job-log-dir",
        job,
        "--split",
        "eval",
        "--max-examples",
        6,
        "--prompt-tokens",
        8,
        "--max-new-tokens",
        4,
        "--step",
        2,
    )
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    folder = job / "decoder_out" / "2"
    assert "decoded 6 eval examples in 2 batches" in " ".join(result.output.split())
    rows = [json.loads(line) for line in (folder / "outputs.jsonl").read_text().splitlines()]
    assert [r["example_id"] for r in rows] == list(range(6))  # 6 of the 2 batches' 8, padding none
    # The eval input's windows (data.seq_len + 1 = 33 tokens each, in order, on one host).
    stream = build_lm_texts_tokens(split_plays(("hamlet", "the-tempest"))[1].values(), ByteTokenizer())
    for r in rows:
        window = stream[33 * r["example_id"] : 33 * (r["example_id"] + 1)].tolist()
        assert r["prompt_tokens"] + r["reference_tokens"] == window[:12]
        assert r["prompt"] == ByteTokenizer().decode(window[:8]) and len(r["reference_tokens"]) == 4
        assert 1 <= len(r["tokens"]) <= 4 and isinstance(r["text"], str)
        assert 0 <= r["matching_tokens"] <= r["compared_tokens"] == min(4, len(r["tokens"]))
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["examples"] == 6 and summary["prompt_tokens"] == 8 and summary["max_new_tokens"] == 4
    assert summary["reference_token_match"] == pytest.approx(
        sum(r["matching_tokens"] for r in rows) / sum(r["compared_tokens"] for r in rows)
    )
    # The eval input's decode metrics (BaseInput.decode_metrics) on the decoded texts.
    from equipax.data.metrics import exact_match, token_f1

    refs, texts = [r["reference"] for r in rows], [r["text"] for r in rows]
    assert summary["exact_match"] == exact_match(refs, texts)["exact_match"]
    assert summary["token_f1"] == pytest.approx(token_f1(refs, texts)["token_f1"])
    [record] = records(job / "decoder_out" / "metrics.jsonl", "decoder_out")
    assert record["step"] == 2 and record["token_f1"] == pytest.approx(summary["token_f1"])
    assert list((job / "summaries" / "decoder_out").glob("events.out.tfevents.*"))
    assert not (job / "decoder_out" / "4").exists()


def test_eval_scores_each_checkpoint_on_a_multiple_choice_set(job, tmp_path):
    """`launch eval --multiple-choice shakespeare_next_line`: each checkpoint's record carries the
    set's accuracies beside the loss; the choices longer than the toy model's rows are noted."""
    copy = tmp_path / "job"
    shutil.copytree(job, copy)
    result = invoke("eval", "--job-log-dir", copy, "--multiple-choice", "shakespeare_next_line")
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    text = " ".join(result.output.split())
    assert "are longer than the job's rows allow (data.seq_len=32)" in text
    evaluated = records(copy / "eval_job" / "metrics.jsonl", "eval_job")
    assert [r["step"] for r in evaluated] == [2, 4]
    for r in evaluated:
        for name in ("accuracy", "accuracy_norm"):
            value = r[f"shakespeare_next_line/{name}"] * 64  # 64 questions
            assert 0 <= value <= 64 and value == pytest.approx(round(value))
        assert f"shakespeare_next_line/accuracy {r['shakespeare_next_line/accuracy']:.3f}" in text
    bad = invoke("eval", "--job-log-dir", copy, "--multiple-choice", "hellaswag")
    assert bad.exit_code == 2 and "the sets are shakespeare_next_line" in " ".join(bad.output.split())


def test_decode_split_drops_padding_rows():
    """A padded eval batch (rows of weight 0, so every host runs the same number of batches):
    the padding rows decode along (same program) but write no output."""
    import numpy as np

    from equipax.data import ByteTokenizer
    from equipax.launch.inference.decode_dataset import _records, prompt_rows

    ids = np.arange(2 * 6, dtype=np.int32).reshape(2, 6) + 40
    batch = {
        "ids": ids,
        "labels": ids + 1,
        "weights": np.array([[1.0] * 6, [0.0] * 6], np.float32),
        "example_id": np.array([7, -1]),
    }
    prompts, lengths, real = prompt_rows(batch, 3)
    assert prompts.shape == (2, 3) and lengths.tolist() == [3, 1] and real.tolist() == [True, False]
    rows = dict(
        prompts=prompts,
        lengths=lengths,
        real=real,
        labels=batch["labels"],
        weights=batch["weights"],
        example_id=batch["example_id"],
    )
    records = _records(rows, np.array([[44, 1], [0, 0]]), np.array([2, 2]), ByteTokenizer(), 2)
    assert [r["example_id"] for r in records] == [7]
    assert records[0]["reference_tokens"] == [43, 44] and records[0]["matching_tokens"] == 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--split", "train"], "use --split eval"),
        (["--split", "eval", "--prompt", "A"], "leave out --prompt"),
        (["--split", "eval", "--prompt-tokens", 32], "--prompt-tokens 32 must be in [1, 31]"),
        (["--split", "eval", "--max-examples", -1], "--max-examples"),
    ],
)
def test_decode_split_bad_inputs_exit_2(job, args, message):
    result = invoke("decode", "--job-log-dir", job, *args)
    assert result.exit_code == 2, f"{result.output}\n{result.exception!r}"
    assert message in " ".join(result.output.split())
    assert "Traceback" not in result.output


def test_decode_and_eval_refuse_jobs_they_cannot_read(job, tmp_path):
    from equipax.core.knobs import to_json
    from equipax.launch.experiments.registry import get_experiment

    no_checkpoint = tmp_path / "fresh"
    no_checkpoint.mkdir()
    shutil.copy(job / "config.json", no_checkpoint / "config.json")
    classifier = tmp_path / "cnn"
    classifier.mkdir()
    (classifier / "config.json").write_text(to_json(get_experiment("cnn_digits")))
    cases = [
        (["decode", "--job-log-dir", no_checkpoint, "--prompt", "A"], "has no checkpoint yet"),
        (["eval", "--job-log-dir", no_checkpoint], "has no checkpoint yet"),
        (["decode", "--job-log-dir", classifier, "--prompt", "A"], "image_classification job"),
        (["decode", "--job-log-dir", tmp_path / "missing", "--prompt", "A"], "does not exist"),
        (["eval", "--job-log-dir", tmp_path], "no config.json"),
    ]
    for args, message in cases:
        result = invoke(*args)
        assert result.exit_code == 2, f"{args}: {result.output}\n{result.exception!r}"
        assert message in " ".join(result.output.split()), args


def test_eval_evaluates_every_checkpoint_without_touching_the_job(job):
    before = {p: p.read_bytes() for p in (job / "metrics.jsonl", job / "result.json")}
    checkpoints = sorted(p.name for p in (job / "checkpoints").iterdir())
    result = invoke("eval", "--job-log-dir", job)
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    evaluated = records(job / "eval_job" / "metrics.jsonl", "eval_job")
    assert [r["step"] for r in evaluated] == [2, 4]
    # The run's own eval of its final state (same input, same batches): the same numbers.
    final = next(r for r in records(job / "metrics.jsonl", "eval") if r["step"] == 4)
    assert evaluated[1]["loss"] == pytest.approx(final["loss"], rel=1e-6)
    assert evaluated[1]["tokens"] == final["tokens"]
    assert list((job / "summaries" / "eval_job").glob("events.out.tfevents.*"))
    assert {p: p.read_bytes() for p in before} == before
    assert sorted(p.name for p in (job / "checkpoints").iterdir()) == checkpoints
    again = invoke("eval", "--job-log-dir", job)
    assert again.exit_code == 0 and "already evaluated" in again.output


def test_eval_follow_evaluates_checkpoints_as_they_land(job, tmp_path):
    """A job with only its step-2 checkpoint: `--follow` evaluates it, then step 4 when it lands
    (renamed into place, as orbax does), and stops once result.json follows."""
    from equipax.launch.commands.eval_command import EvalJob
    from equipax.launch.inference.trained_job import load_config

    running = tmp_path / "running"
    shutil.copytree(job, running, ignore=shutil.ignore_patterns("eval_job", "result.json", "4"))
    evaluator = EvalJob(load_config(running), running)
    thread = threading.Thread(target=evaluator.run, kwargs=dict(follow=True, poll_seconds=0.2, idle_timeout=300.0))
    thread.start()
    try:
        while 2 not in evaluator.done and thread.is_alive():
            thread.join(0.2)
        shutil.copytree(job / "checkpoints" / "4", running / "checkpoints" / "4.orbax-checkpoint-tmp-1")
        (running / "checkpoints" / "4.orbax-checkpoint-tmp-1").rename(running / "checkpoints" / "4")
        while 4 not in evaluator.done and thread.is_alive():
            thread.join(0.2)
        shutil.copy(job / "result.json", running / "result.json")
    finally:
        thread.join(120)
    assert not thread.is_alive()
    assert [r["step"] for r in records(running / "eval_job" / "metrics.jsonl", "eval_job")] == [2, 4]


def test_eval_follow_stops_when_no_checkpoint_comes(job, tmp_path):
    stalled = tmp_path / "stalled"
    shutil.copytree(job, stalled, ignore=shutil.ignore_patterns("result.json"))
    result = invoke("eval", "--job-log-dir", stalled, "--follow", "--poll-seconds", 0.1, "--idle-timeout", 0.3)
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    assert "No new checkpoint for" in result.output


@pytest.mark.slow
def test_decode_on_a_sharded_llama_job_and_on_one_device(tmp_path):
    """A Llama job trained FSDP on 8 simulated devices decodes on its own mesh (8 devices) and,
    restored onto one device, gives the same greedy tokens."""
    from helpers.multidevice import run_with_devices
    from helpers.toy import SMOKE_SHORT

    job_dir = tmp_path / "llama"
    code = f"""
        import json
        from typer.testing import CliRunner
        from equipax.launch.cli import app
        run = CliRunner().invoke(app, ["run", "--exp", "llama3_8b_smoke", "--job-log-dir", {str(job_dir)!r},
                                       *{set_args(SMOKE_SHORT)!r}])
        assert run.exit_code == 0, run.output
        out = CliRunner().invoke(app, ["decode", "--job-log-dir", {str(job_dir)!r}, "--prompt", "ROMEO:",
                                       "--max-new-tokens", "5", "--output", "-"])
        assert out.exit_code == 0, out.output
        assert "note:" not in out.output  # the job's own mesh
        print(out.stdout.splitlines()[-1])
    """
    sharded = json.loads(run_with_devices(code, devices=8, timeout=600).splitlines()[-1])
    result = invoke("decode", "--job-log-dir", job_dir, "--prompt", "ROMEO:", "--max-new-tokens", 5, "--output", "-")
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    assert "restored onto one device" in " ".join(result.output.split())
    assert json.loads(result.stdout.splitlines()[-1])["tokens"] == sharded["tokens"]


def test_end_of_run_sample_is_the_cached_decode_of_generate():
    """`launch run`'s final sample (tasks.lm_family.continue_ids, KV cache): greedy, it is `generate`'s
    output while the sample fits the model's max_seq_len; longer samples continue in rounds to the
    requested length; sampling is reproducible by key."""
    from equipax.launch.experiments.decoder_presets import decoder_lm
    from equipax.launch.tasks.lm_family import continue_ids
    from equipax.models import TransformerLM, generate

    cfg = decoder_lm(
        vocab_size=64,
        max_seq_len=16,
        num_layers=2,
        model_dims=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        hidden_dims=48,
        rope_theta=1e4,
        remat="none",
        dtype="float32",
    )
    model = TransformerLM(cfg, key=jr.key(2))
    prompt = [5, 6, 7]
    fits = cfg.max_seq_len - len(prompt)
    out = continue_ids(model, prompt, fits, temperature=0.0, key=jr.key(0))
    np.testing.assert_array_equal(out, np.asarray(generate(model, jnp.array(prompt, jnp.int32), fits)))
    long = continue_ids(model, prompt, 3 * cfg.max_seq_len, temperature=0.0, key=None)
    assert len(long) == len(prompt) + 3 * cfg.max_seq_len and long[: len(out)] == out
    hot = [continue_ids(model, prompt, 20, temperature=1.0, key=jr.key(k)) for k in (3, 3, 4)]
    assert hot[0] == hot[1] != hot[2] and len(hot[0]) == len(prompt) + 20


def test_a_pipelined_job_on_another_device_count_names_the_flag_to_pass():
    """Its weights are stacked per stage: decode/eval/export say which --cpu-devices to pass
    (they cannot take mesh knobs), instead of a mesh.axis_names fix."""
    import jax

    from equipax.core.knobs import ConfigError
    from equipax.launch.experiments.registry import get_experiment
    from equipax.launch.inference.trained_job import local_mesh

    cfg = get_experiment("c4_gpt3_xl_pipeline_smoke")
    assert jax.device_count() != cfg.mesh.num_devices
    with pytest.raises(ConfigError, match=r"pipelined model .* pass --cpu-devices 8") as e:
        local_mesh(cfg)
    assert "mesh.axis_names" not in str(e.value)
