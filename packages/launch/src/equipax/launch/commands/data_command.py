"""`launch data ...`: build C4-format shards and vocabularies, and look at an experiment's batches."""

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import numpy as np
import typer

from equipax.core.knobs import ConfigError
from equipax.launch.commands.common import check_output, err, out, path_option
from equipax.launch.commands.common import fail as _fail

if TYPE_CHECKING:
    from equipax.data import BaseInput

__all__ = ["batch_report", "data_app", "InputOption", "inspect", "MalformedOption", "prepare", "SplitByOption", "vocab"]

data_app: typer.Typer = typer.Typer(
    help="Prepare C4-format shards and SentencePiece vocabularies; inspect an experiment's batches.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

InputOption = Annotated[
    list[Path], typer.Option("--input", "-i", help="Text files, shard files or directories (repeatable).")
]
SplitByOption = Annotated[
    str,
    typer.Option("--split-by", help="'file' (a file is one document) or 'blank-line' (blocks between blank lines)."),
]
MalformedOption = Annotated[
    float,
    typer.Option(
        "--max-malformed-fraction",
        help="Shard inputs: malformed records (not JSON with a string 'text') are skipped up to "
        "this fraction of a file's records, then an error.",
    ),
]


def _documents(inputs: list[Path], split_by: str, max_malformed_fraction: float) -> list[str]:
    from equipax.data import iter_text_documents

    if split_by not in ("file", "blank-line"):
        _fail(f"--split-by must be 'file' or 'blank-line'; got {split_by!r}.")
    if not 0.0 <= max_malformed_fraction <= 1.0:
        _fail(f"--max-malformed-fraction must be in [0, 1]; got {max_malformed_fraction}.")
    try:
        docs = list(
            iter_text_documents(
                inputs,
                split="file" if split_by == "file" else "blank-line",
                max_malformed_fraction=max_malformed_fraction,
                fraction_setting="--max-malformed-fraction",
            )
        )
    except ValueError as e:
        _fail(str(e))
    if not docs:
        _fail(f"No non-empty documents in {[str(p) for p in inputs]}.")
    return docs


def _split_files(inputs: list[Path], split: str) -> list[Path]:
    """The input files of split `split`: C4-named shards of other splits in directories are left out."""
    from equipax.data import input_files, shard_split

    try:
        files = input_files(inputs, c4_split=split)
        left_out = sorted(set(input_files(inputs)) - set(files))
    except ValueError as e:
        _fail(str(e))
    if left_out:
        splits = sorted({str(shard_split(f)) for f in left_out})
        found = (
            f"{len(left_out)} C4 shard(s) of split(s) {', '.join(splits)} in the input directories "
            f"(e.g. {left_out[0].name})"
        )
        if not files:
            _fail(
                f"No input for --split {split}: there are only {found}. Pass --split {splits[0]} "
                f"(one split per run), or name the files with --input."
            )
        err.print(
            f"note: left out {found}, which are not --split {split}; convert them with --split {splits[0]}.",
            highlight=False,
        )
    return files


def _check_not_replacing_inputs(files: list[Path], output: Path, split: str) -> None:
    """Refuse when an input is one of the shards that writing `c4-<split>.*` into `output` replaces."""
    from equipax.data import shard_split

    out_dirs = {Path(os.path.abspath(output.expanduser())), output.expanduser().resolve()}
    for f in files:
        for path in (Path(os.path.abspath(f)), f.resolve()):
            if path.parent in out_dirs and shard_split(path) == split:
                _fail(
                    f"--input reads {str(f)!r}, which --output {str(output)!r} would replace (this command "
                    f"writes the c4-{split}.* shards there). Write to another directory, e.g. "
                    f"--output {str(output).rstrip('/')}-new, and move the shards over when it is done."
                )


@data_app.command()
def prepare(
    input: InputOption,
    output: Annotated[Path, typer.Option("--output", "-o", help="Directory for the shards.")],
    format: Annotated[str, typer.Option("--format", help="jsonl, jsonl.gz or arrayrecord.")] = "jsonl",
    shards: Annotated[int, typer.Option("--shards", help="Number of shard files.")] = 1,
    split: Annotated[
        str, typer.Option("--split", help="Split name in the file names: c4-<split>.00000-of-0000N.")
    ] = "train",
    split_by: SplitByOption = "file",
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace existing shards of this split.")] = False,
    max_malformed_fraction: MalformedOption = 0.01,
) -> None:
    """Write C4-format shards (JSON lines with a "text" field, or ArrayRecord) from text files.

    C4-named shards found in input directories are read only when they are of --split
    (`c4-train.*` for train), so a C4 directory converts one split per run.
    """
    from equipax.data import check_shard_output, write_shards

    if format not in ("jsonl", "jsonl.gz", "arrayrecord"):
        _fail(f"--format must be 'jsonl', 'jsonl.gz' or 'arrayrecord'; got {format!r}.")
    try:
        check_shard_output(output, f"c4-{split}")
    except ValueError as e:
        _fail(str(e))
    files = _split_files(input, split)
    _check_not_replacing_inputs(files, output, split)
    docs = _documents(files, split_by, max_malformed_fraction)
    fmt: Literal["jsonl", "jsonl.gz", "arrayrecord"] = format  # type: ignore[assignment]
    try:
        paths = write_shards(docs, output, prefix=f"c4-{split}", num_shards=shards, format=fmt, overwrite=overwrite)
    except ValueError as e:
        _fail(str(e))
    size = sum(p.stat().st_size for p in paths)
    out.print(
        f"Wrote {len(docs):,} documents to {len(paths)} shard(s) in {output} ({size / 1e6:.2f} MB): "
        f"{paths[0].name} ... {paths[-1].name}",
        highlight=False,
    )


@data_app.command()
def vocab(
    input: InputOption,
    vocab_size: Annotated[int, typer.Option("--vocab-size", help="Pieces, including 4 specials and 256 bytes.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="The .model file to write.")],
    model_type: Annotated[str, typer.Option("--model-type", help="bpe or unigram.")] = "bpe",
    max_sentences: Annotated[int, typer.Option("--max-sentences", help="Cap on training lines.")] = 1_000_000,
    split_by: SplitByOption = "file",
    max_malformed_fraction: MalformedOption = 0.01,
) -> None:
    """Train a SentencePiece vocabulary; experiments use it with --set data.vocab_path=FILE.model."""
    from equipax.data import SentencePieceTokenizer

    if model_type not in ("bpe", "unigram"):
        _fail(f"--model-type must be 'bpe' or 'unigram'; got {model_type!r}.")
    if output.suffix != ".model":
        _fail(f"--output should end in .model (SentencePiece's file name convention); got {str(output)!r}.")
    check_output(output, "--output", kind="file")
    docs = _documents(input, split_by, max_malformed_fraction)
    try:
        tok = SentencePieceTokenizer.train(
            docs,
            vocab_size=vocab_size,
            model_path=output,
            model_type="bpe" if model_type == "bpe" else "unigram",
            max_sentences=max_sentences,
        )
    except ValueError as e:
        _fail(str(e))
    sample = docs[0][:2000]
    ratio = len(sample.encode("utf-8")) / max(len(tok.encode(sample)), 1)
    out.print(
        f"Wrote {output}: {tok.vocab_size} pieces ({model_type}) from {len(docs):,} documents; "
        f"{ratio:.2f} bytes per token on the first document.",
        highlight=False,
    )


def batch_report(inp: "BaseInput", batch: Mapping[str, Any], index: int, rows: int) -> dict[str, Any]:
    """Shapes, dtypes, padding/weight statistics and decoded rows of one batch."""
    weights = batch.get("weights")
    report: dict[str, Any] = {
        "batch": index,
        "arrays": {k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in batch.items()},
    }
    if weights is not None:
        per_row = weights.reshape(weights.shape[0], -1).sum(axis=1)
        report["weight_sum"] = float(weights.sum())
        report["weight_fraction"] = float(weights.mean())
        report["padding_rows"] = int((per_row == 0).sum())
    if "segment_ids" in batch:
        report["segments_per_row"] = float(np.mean([len(set(r[r > 0].tolist())) for r in batch["segment_ids"]]))
    if "ids" in batch:
        ids = batch["ids"][:rows]
        lengths = None if weights is None else [int(w.sum()) for w in weights[:rows]]
        report["text"] = inp.ids_to_strings(ids, lengths)
    return report


@data_app.command()
def inspect(
    exp: Annotated[
        str, typer.Option("--exp", "-e", help="Experiment: short name or dotted path.")
    ] = "shakespeare_tiny",
    set_: Annotated[list[str] | None, typer.Option("--set", "-s", help="Override a knob: KNOB=VALUE.")] = None,
    split: Annotated[str, typer.Option("--split", help="train or eval.")] = "train",
    host: Annotated[int, typer.Option("--host", help="Infeed host index to simulate.")] = 0,
    hosts: Annotated[int, typer.Option("--hosts", help="Number of infeed hosts to simulate.")] = 1,
    batches: Annotated[int, typer.Option("--batches", help="Batches to print.")] = 2,
    rows: Annotated[int, typer.Option("--rows", help="Decoded rows per batch.")] = 2,
    job_log_dir: Annotated[
        Path | None,
        typer.Option(
            "--job-log-dir", parser=path_option, help="Reuse this job's tokenizer.model (default runs/<exp>)."
        ),
    ] = None,
    format: Annotated[str, typer.Option("--format", help="text or json.")] = "text",
) -> None:
    """Print the first batches host HOST of HOSTS would read: shapes, padding, weights, decoded text."""
    from equipax.core.knobs import apply_overrides
    from equipax.launch.configs.experiment import is_lm
    from equipax.launch.experiments import registry
    from equipax.launch.tasks.lm_data import TOKENIZER_FILE, build_lm_inputs, build_tokenizer

    if split not in ("train", "eval"):
        _fail(f"--split must be 'train' or 'eval'; got {split!r}.")
    if format not in ("text", "json"):
        _fail(f"--format must be 'text' or 'json'; got {format!r}.")
    if hosts < 1:
        _fail(f"--hosts must be >= 1 (the number of infeed hosts to simulate); got {hosts}.")
    if not 0 <= host < hosts:
        _fail(f"--host must be in [0, --hosts={hosts}); got {host}.")
    if batches < 1 or rows < 0:
        _fail(f"--batches must be >= 1 and --rows >= 0; got {batches} and {rows}.")
    try:
        cfg, _ = apply_overrides(registry.get_experiment(exp), set_ or [])
        if registry.lookup(exp).kind != "train" or not is_lm(cfg):
            raise ConfigError(
                f"`launch data inspect` shows the token batches of language-model experiments; {exp!r} is not one."
            )
        job_dir = job_log_dir or Path("runs") / cfg.name
        with tempfile.TemporaryDirectory() as tmp:
            # Reuse a job's vocabulary when there is one; never write into a job directory.
            tok_dir = job_dir if (job_dir / TOKENIZER_FILE).exists() else Path(tmp)
            log = (lambda m: err.print(m, highlight=False)) if format == "text" else (lambda m: None)
            tokenizer = build_tokenizer(cfg, tok_dir, log=log)
            inputs = build_lm_inputs(cfg, tokenizer, num_infeed_hosts=hosts, infeed_host_index=host)
    except ConfigError as e:
        _fail(str(e))
    inp = inputs.train if split == "train" else inputs.eval
    inp.reset() if split == "eval" else None
    reports = []
    for i in range(batches):
        try:
            batch = inp.get_next()
        except StopIteration:
            break
        reports.append(batch_report(inp, batch, i, rows))
    summary = {
        "experiment": cfg.name,
        "split": split,
        "host": host,
        "hosts": hosts,
        "per_host_batch": inp.batch_size,
        "global_batch": inp.global_batch_size,
        "eval_batches_per_pass": getattr(inp, "num_batches", None) if split == "eval" else None,
        "batches": reports,
    }
    if format == "json":
        print(json.dumps(summary, indent=2, ensure_ascii=False))
        return
    out.print(
        f"[bold]{cfg.name}[/] {split} data, host {host} of {hosts}: per-host batch {inp.batch_size}, "
        f"global batch {inp.global_batch_size}",
        highlight=False,
    )
    if summary["eval_batches_per_pass"] is not None:
        out.print(f"eval run: {summary['eval_batches_per_pass']} batches on every host", highlight=False)
    for r in reports:
        arrays = ", ".join(f"{k} {tuple(v['shape'])} {v['dtype']}" for k, v in r["arrays"].items())
        out.print(f"[bold]batch {r['batch']}[/]: {arrays}", highlight=False)
        if "weight_sum" in r:
            line = (
                f"  weights: sum {r['weight_sum']:,.0f} ({r['weight_fraction']:.1%} of positions), "
                f"padding rows {r['padding_rows']}"
            )
            if "segments_per_row" in r:
                line += f", documents per row {r['segments_per_row']:.2f}"
            out.print(line, highlight=False)
        for j, text in enumerate(r.get("text", [])):
            out.print(f"  row {j}: {text[:300]!r}", highlight=False, markup=False)
