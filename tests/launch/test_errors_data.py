"""docs/errors.md, the data and benchmark entries: `launch data prepare`, shard files and
`launch bench attention` through the CLI: the message, the exit code, and nothing damaged."""

import json
from pathlib import Path

import pytest

from equipax.data import DataError, TextShards, find_shards, write_shards
from helpers.cli import assert_one_paragraph, snapshot
from helpers.toy import TOY, set_args

FAST = [*TOY, "data.tokenizer=byte", "train.sample.tokens=0", "train.num_steps=2", "train.checkpoint_every=2"]


def invoke(*args):
    from typer.testing import CliRunner

    from equipax.launch.cli import app

    result = CliRunner().invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


def run_on_shards(job: Path, data: Path, *extra: str):
    return invoke(
        "run",
        "--exp",
        "shakespeare_tiny",
        "--job-log-dir",
        job,
        *set_args([*FAST, "data.source='c4'", f"data.path='{data}'", *extra]),
    )


def docs(split: str, n: int) -> list[str]:
    return [f"{split} document {i}: " + "words and more words " * (i % 5 + 1) for i in range(n)]


@pytest.fixture
def c4_like(tmp_path) -> Path:
    """A directory laid out like the C4 release: two train shards and one validation shard."""
    root = tmp_path / "c4"
    write_shards(docs("train", 12), root, prefix="c4-train", num_shards=2, format="jsonl.gz")
    write_shards(docs("validation", 5), root, prefix="c4-validation", num_shards=1, format="jsonl.gz")
    return root


# --- `data prepare` keeps C4 splits apart and never reads what it overwrites ----------------


@pytest.mark.parametrize("fmt", ["arrayrecord", "jsonl"])
def test_prepare_c4_directory_converts_one_split_at_a_time(c4_like, tmp_path, fmt):
    out = tmp_path / "converted"
    code, output = invoke("data", "prepare", "-i", c4_like, "-o", out, "--shards", 2, "--format", fmt)
    assert code == 0, output
    assert list(TextShards(find_shards(out, "c4-train.*"))) == docs("train", 12)
    assert "c4-validation" in output and "--split validation" in output  # says what it left out
    code, output = invoke("data", "prepare", "-i", c4_like, "-o", out, "--split", "validation", "--format", fmt)
    assert code == 0, output
    assert list(TextShards(find_shards(out, "c4-validation.*"))) == docs("validation", 5)
    assert list(TextShards(find_shards(out, "c4-train.*"))) == docs("train", 12)


def test_prepare_split_with_no_shards_in_a_c4_directory(c4_like, tmp_path):
    code, output = invoke("data", "prepare", "-i", c4_like, "-o", tmp_path / "out", "--split", "test")
    assert code == 2, output
    assert_one_paragraph(output, "--split test", "train", "validation")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "extra",
    [["--overwrite"], ["--overwrite", "--format", "arrayrecord"], ["--overwrite", "--split", "validation"]],
    ids=["same-format", "other-format", "validation"],
)
def test_prepare_refuses_to_overwrite_its_own_input(c4_like, extra):
    before = snapshot(c4_like)
    code, output = invoke("data", "prepare", "-i", c4_like, "-o", c4_like, *extra)
    assert code == 2, output
    assert_one_paragraph(output, "would replace", "--output")
    assert snapshot(c4_like) == before


def test_prepare_into_a_subdirectory_of_its_input_is_refused_on_the_rerun(tmp_path):
    src = tmp_path / "corpus"
    src.mkdir()
    for i, text in enumerate(docs("text", 4)):
        (src / f"{i}.txt").write_text(text)
    code, output = invoke("data", "prepare", "-i", src, "-o", src / "shards")
    assert code == 0, output
    before = snapshot(src)
    code, output = invoke("data", "prepare", "-i", src, "-o", src / "shards", "--overwrite")
    assert code == 2, output
    assert_one_paragraph(output, "would replace", "c4-train.00000-of-00001.jsonl")
    assert snapshot(src) == before


# --- a broken symlink is named, not skipped ----------------------------------------------------


def test_broken_symlink_shard_is_named_at_start_up(c4_like, tmp_path):
    dangling = c4_like / "c4-train.00002-of-00002.json.gz"
    dangling.symlink_to(tmp_path / "unmounted" / "c4-train.00002-of-00002.json.gz")
    job = tmp_path / "job"
    code, output = run_on_shards(job, c4_like)
    assert code == 2, output
    assert_one_paragraph(output, "c4-train.00002-of-00002.json.gz", "broken symbolic link", "unmounted")
    assert not (job / "checkpoints").exists()


def test_broken_symlink_in_prepare_input_is_named(tmp_path):
    src = tmp_path / "corpus"
    src.mkdir()
    (src / "a.txt").write_text("one document")
    (src / "b.txt").symlink_to(tmp_path / "gone.txt")
    code, output = invoke("data", "prepare", "-i", src, "-o", tmp_path / "out")
    assert code == 2, output
    assert_one_paragraph(output, "b.txt", "broken symbolic link")
    assert not (tmp_path / "out").exists()


# --- a corrupt ArrayRecord shard is a DataError naming the file -------------------------------


def _arrayrecord_shards(root: Path) -> list[Path]:
    paths = write_shards(docs("train", 40), root, prefix="c4-train", num_shards=2, format="arrayrecord")
    write_shards(docs("validation", 4), root, prefix="c4-validation", num_shards=1, format="arrayrecord")
    return paths


@pytest.mark.parametrize("damage", ["truncated", "not-arrayrecord"])
def test_corrupt_arrayrecord_shard_is_named_at_start_up(damage, tmp_path):
    data = tmp_path / "ar"
    bad = _arrayrecord_shards(data)[1]
    raw = bad.read_bytes()
    bad.write_bytes(raw[: len(raw) // 2] if damage == "truncated" else b"not an array record\n" * 100)
    job = tmp_path / "job"
    code, output = run_on_shards(job, data)
    assert code == 2, output
    assert_one_paragraph(output, str(bad), "ArrayRecord")
    assert not (job / "checkpoints").exists()
    code, output = invoke("data", "prepare", "-i", data, "-o", tmp_path / "out")
    assert code == 2, output
    assert_one_paragraph(output, str(bad))


def test_corrupt_arrayrecord_record_is_named_when_read(tmp_path):
    data = tmp_path / "ar"
    bad = _arrayrecord_shards(data)[0]
    raw = bytearray(bad.read_bytes())
    for i in range(60, 400, 3):  # inside the first chunks: the file opens, its records do not read
        raw[i] ^= 0xFF
    bad.write_bytes(bytes(raw))
    shards = TextShards([bad])
    with pytest.raises(DataError, match=str(bad)):
        shards[0]
    # In a run the record is read while the input starts (packing counts every document's tokens,
    # so the damaged records are read whatever the order); the error still reaches the user.
    job = tmp_path / "job"
    code, output = run_on_shards(job, data, "data.packing=true")
    assert code == 2, output
    assert_one_paragraph(output, str(bad), "does not read")
    assert not list((job / "checkpoints").glob("*"))


# --- `launch bench attention` checks its arguments before the work ----------------------


def test_bench_attention_out_is_a_file(tmp_path, monkeypatch):
    from equipax.launch.bench import attention_timing as bench

    def measure(*args, **kwargs):
        raise AssertionError("benchmarked before checking --out")

    monkeypatch.setattr(bench, "_measure", measure)
    target = tmp_path / "results.json"
    target.write_text("keep me")
    code, output = invoke("bench", "attention", "--seq", "8", "--repeats", "1", "--out", target)
    assert code == 2, output
    assert_one_paragraph(output, "--out", str(target), "directory")
    assert target.read_text() == "keep me"


@pytest.mark.parametrize("seq", ["abc", "128,2.5", "128,,x"])
def test_bench_attention_seq_not_integers(seq):
    code, output = invoke("bench", "attention", "--seq", seq)
    assert code == 2, output
    assert "Traceback" not in output and "int()" not in output
    assert "--seq" in output and "128,512" in output, output


# --- `data prepare`'s advice names its own options ---------------------------------------------


def test_prepare_malformed_records_advice_names_its_option(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    good = [json.dumps({"text": t}) for t in docs("train", 6)]
    (src / "c4-train.00000-of-00001.jsonl").write_text("\n".join(good + ["{not json"] * 4) + "\n")
    code, output = invoke("data", "prepare", "-i", src, "-o", tmp_path / "out")
    assert code == 2, output
    assert_one_paragraph(output, "are malformed", "--max-malformed-fraction")
    assert "data.max_malformed_fraction" not in output and "the knob" not in output
    assert not (tmp_path / "out").exists()
    code, output = invoke("data", "prepare", "-i", src, "-o", tmp_path / "out", "--max-malformed-fraction", 0.5)
    assert code == 0, output
    assert list(TextShards(find_shards(tmp_path / "out", "c4-train.*"))) == docs("train", 6)
