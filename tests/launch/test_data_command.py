"""C4-format shards through the CLI: `launch data prepare/vocab/inspect`, the config checks of C4
experiments, a run on prepared shards."""

import json

import pytest
from typer.testing import CliRunner

from equipax.data import TextShards, find_shards, load_plays

PLAYS = ["macbeth", "the-tempest", "hamlet"]


@pytest.fixture(scope="module")
def plays(tmp_path_factory):
    root = tmp_path_factory.mktemp("plays")
    texts = load_plays()
    for name in PLAYS:
        (root / f"{name}.txt").write_text(texts[name])
    return root, [texts[n] for n in sorted(PLAYS)]


def invoke(*args):
    from equipax.launch.cli import app

    return CliRunner().invoke(app, list(map(str, args)))


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "arrayrecord"])
def test_prepare_round_trips_shakespeare(plays, tmp_path, fmt):
    root, texts = plays
    result = invoke("data", "prepare", "--input", root, "--output", tmp_path, "--format", fmt, "--shards", 2)
    assert result.exit_code == 0, result.output
    files = find_shards(tmp_path, "c4-train.*")
    assert [f.name.split(".")[1] for f in files] == ["00000-of-00002", "00001-of-00002"]
    assert list(TextShards(files)) == texts  # same documents, same order, byte for byte
    # Blank-line blocks: each block is a document.
    out = tmp_path / "blocks"
    result = invoke(
        "data",
        "prepare",
        "-i",
        root / "hamlet.txt",
        "-o",
        out,
        "--split-by",
        "blank-line",
        "--split",
        "validation",
        "--format",
        fmt,
    )
    assert result.exit_code == 0, result.output
    blocks = list(TextShards(find_shards(out, "c4-validation.*")))
    assert len(blocks) > 100 and "\n\n".join(blocks) == texts[0].strip("\n")


def test_prepare_refuses_to_overwrite_and_bad_arguments(plays, tmp_path):
    root, _ = plays
    assert invoke("data", "prepare", "-i", root, "-o", tmp_path).exit_code == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    result = invoke("data", "prepare", "-i", root, "-o", tmp_path)
    assert result.exit_code == 2 and "--overwrite" in result.output
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    result = invoke("data", "prepare", "-i", root, "-o", tmp_path / "x", "--shards", 9)
    assert result.exit_code == 2 and "num_shards=9" in result.output
    result = invoke("data", "prepare", "-i", tmp_path / "nope", "-o", tmp_path / "y")
    assert result.exit_code == 2 and "does not exist" in result.output
    result = invoke("data", "prepare", "-i", root, "-o", tmp_path / "z", "--format", "csv")
    assert result.exit_code == 2 and "--format" in result.output


def sets(*overrides):
    return [a for o in overrides for a in ("--set", o)]


@pytest.fixture(scope="module")
def c4_dir(plays, tmp_path_factory):
    root, _ = plays
    out = tmp_path_factory.mktemp("c4")
    assert (
        invoke(
            "data",
            "prepare",
            "-i",
            root / "macbeth.txt",
            "-i",
            root / "the-tempest.txt",
            "-o",
            out,
            "--split-by",
            "blank-line",
            "--shards",
            3,
        ).exit_code
        == 0
    )
    assert (
        invoke(
            "data",
            "prepare",
            "-i",
            root / "hamlet.txt",
            "-o",
            out,
            "--split-by",
            "blank-line",
            "--split",
            "validation",
            "--format",
            "jsonl.gz",
        ).exit_code
        == 0
    )
    return out


def test_inspect_prints_batches_of_a_host(c4_dir):
    args = ["data", "inspect", *sets(*TOY_C4, f"data.path={c4_dir}", "data.packing=true")]
    result = invoke(*args, "--hosts", 2, "--host", 1, "--batches", 2, "--format", "json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert (report["host"], report["hosts"], report["per_host_batch"]) == (1, 2, 2)
    first = report["batches"][0]
    assert first["arrays"]["segment_ids"] == {"shape": [2, 32], "dtype": "int32"}
    assert len(first["text"]) == 2 and all(first["text"])
    other = json.loads(invoke(*args, "--hosts", 2, "--host", 0, "--format", "json").output)
    assert other["batches"][0]["text"] != first["text"]
    result = invoke(*args, "--split", "eval", "--batches", 1)
    assert result.exit_code == 0 and "eval run:" in result.output and "row 0:" in result.output
    result = invoke("data", "inspect", *sets(*TOY_C4, f"data.path={c4_dir / 'nope'}"))
    assert result.exit_code == 2 and "does not exist" in result.output and "Traceback" not in result.output
    result = invoke(*args, "--host", 3, "--hosts", 2)
    assert result.exit_code == 2 and "--host" in result.output


def test_config_checks_for_c4_and_eval_knobs():
    result = invoke("show", *sets(*TOY_C4))
    assert result.exit_code == 2 and "data.path" in result.output
    result = invoke("show", *sets("data.reset_for_eval=false", "train.eval_batches=0"))
    assert result.exit_code == 2 and "train.eval_batches" in result.output
    result = invoke("show", *sets("data.packing=true"))
    assert result.exit_code == 2 and "data.packing" in result.output


def test_vocab_then_run_on_c4_shards(c4_dir, tmp_path):
    model = tmp_path / "c4.model"
    result = invoke("data", "vocab", "-i", c4_dir, "--vocab-size", 384, "-o", model)
    assert result.exit_code == 0, result.output
    from equipax.data import SentencePieceTokenizer

    assert SentencePieceTokenizer.load(model).vocab_size == 384
    toy = [o for o in TOY_C4 if o != "data.tokenizer=byte"]
    result = invoke(
        "run",
        "--job-log-dir",
        tmp_path / "job",
        *sets(
            *toy,
            f"data.path={c4_dir}",
            f"data.vocab_path={model}",
            "data.packing=true",
            "data.reset_for_eval=false",
            "train.eval_batches=2",
            "train.num_steps=2",
            "train.eval_every=1",
            "train.checkpoint_every=2",
            "train.log_every=1",
            "train.sample.tokens=4",
        ),
    )
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "job" / "tokenizer.model").exists()
    evals = [json.loads(line) for line in (tmp_path / "job" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in evals if r["split"] == "eval"]
    assert len(evals) == 2 and evals[0]["batches"] == 2 and evals[0]["loss"] != evals[1]["loss"]


TOY_C4 = [
    "model.vocab_size=384",
    "model.max_seq_len=32",
    "model.transformer.num_layers=1",
    "model.transformer.model_dims=32",
    "model.transformer.num_heads=2",
    "model.transformer.head_dim=16",
    "model.transformer.hidden_dims=64",
    "data.seq_len=32",
    "data.batch_size=4",
    "data.source=c4",
    "data.tokenizer=byte",
]
