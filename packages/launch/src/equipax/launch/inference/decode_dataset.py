"""Pax's decode over a dataset (`launch decode --split eval`): continue every example of the job's
eval input with the KV cache and write one JSON line per example to the job directory.

The eval input is read as one finite pass (`data.reset_for_eval=True`), which pads every host's
part to the same number of batches (missing rows have weight 0), so every host runs the same
number of decode steps and stops together; padding rows are dropped from the output. Each
example's prompt is the first `prompt_tokens` tokens of its row, and its reference is the row's
next `max_new_tokens` tokens (what the eval loss scores). Outputs go to
`<job>/decoder_out/<step>/outputs.jsonl` (and `summary.json`), written by process 0. The eval
input's decode metrics (`BaseInput.decode_metrics`: exact match and token F1 of the decoded text
against the reference text unless the input defines its own) go into summary.json and, as a
`decoder_out` record, into `<job>/decoder_out/metrics.jsonl` and TensorBoard
`<job>/summaries/decoder_out`.
"""

import dataclasses
import json
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from equipax.core.knobs import ConfigError
from equipax.launch.inference.sampling import host_arrays
from equipax.launch.store.storage import AnyPath, job_path

__all__ = ["DECODER_OUT", "decode_metrics", "decode_split", "DecodeSettings", "prompt_rows"]

DECODER_OUT = "decoder_out"  # Pax's name for the decode outputs' directory


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
    """What `decode_split` decodes: at most `max_examples` examples (0 = the whole split), each
    prompted with `prompt_tokens` tokens (0 = half the example) and continued by at most
    `max_new_tokens`, sampled as `equipax.models.decode.decode` samples."""

    max_examples: int = 0
    prompt_tokens: int = 0
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0


def prompt_rows(
    batch: Mapping[str, np.ndarray | jax.Array], prompt_tokens: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Prompts `[batch prompt_tokens]`, each row's prompt length and whether the row is an example.

    A row's length is `prompt_tokens`, or fewer where the example itself is shorter (its labeled
    tokens end first); a padding row (no labeled token) gets length 1 and `real = False`.
    """
    labeled = (np.asarray(batch["weights"]) > 0).sum(axis=1)
    real = labeled > 0
    lengths = np.clip(np.minimum(labeled, prompt_tokens), 1, None).astype(np.int32)
    return np.asarray(batch["ids"])[:, :prompt_tokens].astype(np.int32), lengths, real


def _check(cfg: Any, s: DecodeSettings) -> tuple[int, int, str]:
    """(prompt tokens, new tokens, a note or ""); ConfigError naming the option to change."""
    seq_len, max_len = cfg.data.seq_len, cfg.model.max_seq_len
    prompt = s.prompt_tokens or max(seq_len // 2, 1)
    if not 1 <= prompt < min(seq_len, max_len):
        raise ConfigError(
            f"--prompt-tokens {prompt} must be in [1, {min(seq_len, max_len) - 1}]: each example is "
            f"data.seq_len={seq_len} tokens, the model reads max_seq_len={max_len}, and the prompt "
            "must leave room for a reference and a new token."
        )
    new = min(s.max_new_tokens, max_len - prompt)
    note = (
        ""
        if new == s.max_new_tokens
        else (
            f"note: the model reads at most max_seq_len={max_len} tokens: prompts of {prompt} tokens get at most "
            f"{new} new tokens (lower --prompt-tokens for more)."
        )
    )
    return prompt, new, note


def decode_split(
    cfg: Any, job_dir: AnyPath, step: int, settings: DecodeSettings, *, log: Callable[[str], object]
) -> AnyPath:
    """Decode the job's eval split at checkpoint `step`; returns the outputs' directory.

    Arguments:
        cfg: the job's experiment (a language model).
        job_dir: the training job's directory (its checkpoints and tokenizer are read; only
            `decoder_out/` is written).
        step: an existing checkpoint's step (`trained_job.pick_step`).
        settings: which examples and how to sample.
        log: progress messages.

    Raises:
        ConfigError: a bad option, or the checkpoint does not restore (exit 2 with what to do).
    """
    from equipax.launch.inference.trained_job import check_tokenizer, local_mesh, restore_model
    from equipax.launch.program.program import build_program
    from equipax.launch.tasks import family
    from equipax.models.decode import decode, for_decoding

    prompt_tokens, new_tokens, note = _check(cfg, settings)
    if note:
        log(note)
    check_tokenizer(cfg, job_dir)
    if cfg.data.packing:  # a packed row holds several documents: no one prompt, no one example id
        log("Decoding the eval split one example per row (the job packs its rows; decode reads them unpacked).")
    # One finite pass over the eval examples, each in its own row.
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, reset_for_eval=True, packing=False))
    cfg, mesh, note = local_mesh(cfg)
    if note:
        log(note)
    program = build_program(cfg, mesh)
    model, _ = restore_model(job_dir, step, program)
    model = for_decoding(model)  # a LoRA job's merge, model.quantization's int8 copy: made once
    inputs = family(cfg).build_inputs(cfg, job_dir, mesh=mesh, log=log)
    tokenizer, source = inputs.extra["tokenizer"], inputs.eval
    limit = math.ceil(settings.max_examples / cfg.global_batch_size) if settings.max_examples else 0
    key = jax.random.key(settings.seed)
    records: list[dict[str, Any]] = []
    source.reset()
    batches, start = 0, time.monotonic()
    while limit == 0 or batches < limit:  # the same count on every host: the pass is padded
        try:
            batch = source.get_next()
        except StopIteration:
            break
        prompts, lengths, real = prompt_rows(batch, prompt_tokens)
        place = lambda x: jax.make_array_from_process_local_data(program.batch_sharding, x)  # noqa: E731
        try:
            tokens, counts = decode(
                model,
                place(prompts),
                place(lengths),
                max_new_tokens=new_tokens,
                temperature=settings.temperature,
                top_k=settings.top_k,
                top_p=settings.top_p,
                eos_id=tokenizer.eos_id,
                pad_id=tokenizer.pad_id,
                key=jax.random.fold_in(key, batches),
            )
        except ValueError as e:  # a sampling knob the model refuses (e.g. --top-k above its vocabulary)
            raise ConfigError(str(e)) from None
        rows = {
            k: _gather(v)
            for k, v in dict(
                prompts=prompts,
                lengths=lengths,
                real=real,
                labels=batch["labels"],
                weights=batch["weights"],
                example_id=batch["example_id"],
            ).items()
        }
        out, num = host_arrays(tokens, counts)
        records += _records(rows, out, num, tokenizer, new_tokens)
        batches += 1
    seconds = time.monotonic() - start
    records = sorted(records, key=lambda r: r["example_id"])[: settings.max_examples or None]
    metrics = decode_metrics(source.decode_metrics(), records)
    return _write(
        job_path(job_dir),
        step,
        records,
        batches=batches,
        seconds=seconds,
        settings=dataclasses.replace(settings, prompt_tokens=prompt_tokens, max_new_tokens=new_tokens),
        metrics=metrics,
    )


def decode_metrics(metrics: Any, records: list[dict[str, Any]]) -> dict[str, float]:
    """The input's decode metrics on the outputs: each `metric(references, texts) -> {name: value}`.
    A metric that fails or returns something else is a ConfigError naming it."""
    targets, predictions = [r["reference"] for r in records], [r["text"] for r in records]
    out: dict[str, float] = {}
    for metric in metrics:
        name = getattr(metric, "__qualname__", repr(metric))
        try:
            values = metric(targets, predictions)
            out |= {str(k): float(v) for k, v in dict(values).items()}
        except Exception as e:  # a user's function: say which one, keep the outputs' directory clean
            raise ConfigError(
                f"The eval input's decode metric {name} failed on {len(records)} decoded examples "
                f"({type(e).__name__}: {e}); it must return {{name: number}} from (targets, predictions). "
                "Fix it, or leave it out of the input's decode_metrics()."
            ) from None
    return out


def _gather(x: np.ndarray | jax.Array) -> np.ndarray:
    """Every host's rows of a host-local array, in global batch order."""
    if jax.process_count() == 1:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(np.asarray(x), tiled=True))


def _text(tokenizer: Any, ids: list[int]) -> str:
    # model.vocab_size may exceed the tokenizer's: ids past it decode to no text.
    return tokenizer.decode([i for i in ids if i < tokenizer.vocab_size and i != tokenizer.eos_id])


def _records(
    rows: dict[str, np.ndarray], tokens: np.ndarray, counts: np.ndarray, tokenizer: Any, new_tokens: int
) -> list[dict[str, Any]]:
    out = []
    for b in np.flatnonzero(rows["real"]):
        n = int(rows["lengths"][b])
        prompt = rows["prompts"][b, :n].tolist()
        # labels[t] is the token after ids[t]: the reference continues from the prompt's last token.
        ref = rows["labels"][b, n - 1 : n - 1 + new_tokens]
        ref = ref[rows["weights"][b, n - 1 : n - 1 + new_tokens] > 0].tolist()
        generated = tokens[b, : int(counts[b])].tolist()
        compared = min(len(ref), len(generated))
        out.append(
            {
                "example_id": int(rows["example_id"][b]),
                "prompt": _text(tokenizer, prompt),
                "prompt_tokens": prompt,
                "text": _text(tokenizer, generated),
                "tokens": generated,
                "reference": _text(tokenizer, ref),
                "reference_tokens": ref,
                "matching_tokens": int(sum(g == r for g, r in zip(generated[:compared], ref[:compared]))),
                "compared_tokens": compared,
            }
        )
    return out


def _write(
    job_dir: AnyPath,
    step: int,
    records: list[dict[str, Any]],
    *,
    batches: int,
    seconds: float,
    settings: DecodeSettings,
    metrics: dict[str, float],
) -> AnyPath:
    folder = job_dir / DECODER_OUT / str(step)
    if jax.process_index() != 0:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "outputs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    compared = sum(r["compared_tokens"] for r in records)
    generated = sum(len(r["tokens"]) for r in records)
    summary = {
        "step": step,
        "split": "eval",
        "examples": len(records),
        "batches": batches,
        "generated_tokens": generated,
        "seconds": seconds,
        # Greedy decoding scored against the eval text: the share of generated tokens equal to the
        # reference token at the same position (0 when nothing was compared).
        "reference_token_match": sum(r["matching_tokens"] for r in records) / compared if compared else 0.0,
        **metrics,
        **dataclasses.asdict(settings),
    }
    (folder / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    from equipax.launch.jobdir.summaries import MetricsWriter

    writer = MetricsWriter(job_dir, path=job_dir / DECODER_OUT / "metrics.jsonl")
    try:
        record = {"examples": len(records), "reference_token_match": summary["reference_token_match"], **metrics}
        writer.write(step, DECODER_OUT, record, flush=True)
    finally:
        writer.close()
    return folder
