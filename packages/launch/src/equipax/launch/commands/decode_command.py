"""`launch decode`: sample from a training job's checkpoint with the KV cache (Pax's decode mode):
given prompts (`--prompt`, `--prompts`), or every example of the job's eval split (`--split eval`,
Pax's decode dataset: outputs in `<job>/decoder_out/<step>/`)."""

import json
import math
import os
from pathlib import Path, PurePath
from typing import Annotated

import typer

from equipax.launch.commands.common import (
    CpuDevicesOption,
    JobSetOption,
    check_output,
    err,
    fail,
    job_dir_option,
    out,
    path_option,
    resolve_job,
)
from equipax.launch.store.storage import AnyPath, job_path

__all__ = ["decode_cmd", "JobDirOption"]

JobDirOption = Annotated[  # PurePath: the base of the local and the bucket paths job_dir_option gives
    PurePath,
    typer.Option("--job-log-dir", parser=job_dir_option, help="The training job's directory: a path or gs://B/JOB."),
]


def decode_cmd(
    job_log_dir: JobDirOption,
    prompt: Annotated[str | None, typer.Option("--prompt", help="Text to continue.")] = None,
    prompts: Annotated[
        Path | None,
        typer.Option("--prompts", parser=path_option, help="A file of prompts, one per line (blank lines skipped)."),
    ] = None,
    step: Annotated[int | None, typer.Option("--step", help="The checkpoint's step (default: the newest).")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Tokens to generate per prompt, >= 1.")] = 64,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy; > 0 samples.")] = 0.0,
    top_k: Annotated[int | None, typer.Option("--top-k", help="Sample among the K most likely tokens.")] = None,
    top_p: Annotated[
        float | None,
        typer.Option(
            "--top-p", help="Nucleus sampling: the smallest set of tokens whose probability reaches P, in (0, 1]."
        ),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Sampling seed (the same seed gives the same samples).")] = 0,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Prompts decoded together, >= 1.")] = 16,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            parser=path_option,
            help="Write JSON lines (prompt, text, tokens, seconds_per_token) to this file; '-' for stdout.",
        ),
    ] = None,
    split: Annotated[
        str | None,
        typer.Option(
            "--split",
            help="Decode the job's eval split instead of prompts ('eval'): each "
            "example's first --prompt-tokens tokens continued, one JSON line "
            "per example in <job>/decoder_out/<step>/outputs.jsonl.",
        ),
    ] = None,
    max_examples: Annotated[
        int, typer.Option("--max-examples", help="--split: decode at most this many examples (0 = all).")
    ] = 0,
    prompt_tokens: Annotated[
        int, typer.Option("--prompt-tokens", help="--split: prompt length in tokens (0 = half an example).")
    ] = 0,
    chat: Annotated[
        bool,
        typer.Option(
            "--chat",
            help="Each prompt is a user message: render it with the job's chat template (data.chat_template, "
            "else the tokenizer's) and stop at the end-of-turn token.",
        ),
    ] = False,
    cpu_devices: CpuDevicesOption = None,
    set_: JobSetOption = None,
) -> None:
    """Continue prompts with a trained language model's checkpoint (KV cache; model only, no optimizer state)."""
    job_log_dir = job_path(job_log_dir)
    if split is not None:
        if prompt is not None or prompts is not None or output is not None:
            fail(
                "--split decodes the job's own eval examples and writes them to the job directory; leave out "
                "--prompt, --prompts and --output (or drop --split to decode your own prompts)."
            )
        if split != "eval":
            fail(f"--split {split!r} is not a split `launch decode` reads; use --split eval (the job's eval input).")
        if max_examples < 0 or prompt_tokens < 0:
            fail(
                f"--max-examples and --prompt-tokens must be >= 0 (0 = all / half an example); got {max_examples} "
                f"and {prompt_tokens}."
            )
        texts: list[str] = []
    else:
        texts = _read_prompts(prompt, prompts)
        if output is not None and str(output) != "-":
            check_output(output, "--output", kind="file", job_dir=job_log_dir)
    if max_new_tokens < 1 or batch_size < 1:
        fail(f"--max-new-tokens and --batch-size must be >= 1; got {max_new_tokens} and {batch_size}.")
    if not (math.isfinite(temperature) and temperature >= 0):
        fail(f"--temperature must be >= 0 (0 = greedy); got {temperature}.")
    if top_p is not None and not 0 < top_p <= 1:
        fail(f"--top-p must be in (0, 1]; got {top_p}.")
    if top_k is not None and top_k < 1:
        fail(f"--top-k must be >= 1; got {top_k}.")
    _check_seed(seed)

    from equipax.launch.cluster.devices import use_cpu_devices
    from equipax.launch.configs.experiment import is_lm

    cfg = resolve_job(job_log_dir, set_)[1]  # ConfigError -> exit 2 with what to do
    if not is_lm(cfg):
        fail(
            f"{job_log_dir} holds a {cfg.kind} job ({cfg.name}): there is no text to decode. `launch decode` "
            "samples from language-model jobs; evaluate this one with `launch eval --job-log-dir "
            f"{job_log_dir}`."
        )
    use_cpu_devices(cpu_devices)
    if split is not None:
        _decode_split(
            cfg,
            job_log_dir,
            step=step,
            max_examples=max_examples,
            prompt_tokens=prompt_tokens,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
        )
        return
    samples = _decode(
        cfg,
        job_log_dir,
        texts,
        step=step,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        batch_size=batch_size,
        chat=chat,
    )
    if output is None:
        for s in samples:
            out.print(f"[bold]{s.prompt}[/]", end="", highlight=False)
            out.print(s.text, highlight=False, markup=False)
            out.print("")
        return
    lines = "".join(json.dumps(s.record()) + "\n" for s in samples)
    if str(output) == "-":
        print(lines, end="")
    else:
        tmp = output.with_name(f".{output.name}.{os.getpid()}.tmp")
        tmp.write_text(lines)
        tmp.replace(output)  # whole or not at all: a signal or a full disk leaves no half file
        err.print(f"Wrote {len(samples)} samples to {output}.", highlight=False)


def _decode_split(cfg, job_dir: AnyPath, *, step: int | None, **settings) -> None:
    from equipax.launch.inference.decode_dataset import DecodeSettings, decode_split
    from equipax.launch.inference.trained_job import pick_step

    step = pick_step(job_dir, step)
    folder = decode_split(cfg, job_dir, step, DecodeSettings(**settings), log=lambda m: err.print(m, highlight=False))
    if (folder / "summary.json").exists():  # process 0 writes it
        s = json.loads((folder / "summary.json").read_text())
        out.print(
            f"{cfg.name}: step {step}: decoded {s['examples']} eval examples in {s['batches']} batches "
            f"({s['seconds']:.1f} s); {s['reference_token_match']:.1%} of the generated tokens match the "
            f"reference -> {folder / 'outputs.jsonl'}",
            highlight=False,
        )


def _read_prompts(prompt: str | None, prompts: Path | None) -> list[str]:
    if (prompt is None) == (prompts is None):
        fail("Give the text to continue: either --prompt TEXT or --prompts FILE (one prompt per line).")
    if prompt is not None:
        if not prompt.strip():
            fail("--prompt is empty: give some text to continue (e.g. --prompt 'ROMEO:').")
        _check_text(prompt, "--prompt")
        return [prompt]
    assert prompts is not None
    if not prompts.is_file():
        fail(f"--prompts {prompts} is not a file; give a text file with one prompt per line.")
    try:
        # utf-8-sig: a byte-order mark (what some editors write first) is not part of the first prompt.
        texts = [line for line in prompts.read_text(encoding="utf-8-sig").splitlines() if line.strip()]
    except UnicodeDecodeError as e:
        fail(
            f"--prompts {prompts} is not UTF-8 text (byte {e.object[e.start : e.start + 1]!r} at offset {e.start}); "
            "give a text file in UTF-8 with one prompt per line."
        )
    except OSError as e:
        fail(f"--prompts {prompts} does not read ({e.strerror or e}); give a readable text file.")
    if not texts:
        fail(f"--prompts {prompts} holds no prompt (every line is blank); put one prompt per line.")
    return texts


def _check_text(value: str, option: str) -> None:
    from equipax.core.knobs import ConfigError, check_text

    try:
        check_text(value, option)
    except ConfigError as e:
        fail(str(e))


def _check_seed(seed: int) -> None:
    from equipax.core.knobs import ConfigError
    from equipax.core.seeds import check_seed

    try:
        check_seed(seed, "--seed")
    except ConfigError as e:
        fail(str(e))


def _chat_prompts(lm, tokenizer, texts: list[str]) -> tuple[list[str], int]:
    """Each text as a one-message conversation rendered for the assistant's reply, and the id of
    the end-of-turn token that ends it (ConfigError, exit 2: no Hugging Face tokenizer or template)."""
    from equipax.core.knobs import ConfigError
    from equipax.data import ChatError, ChatTemplate, HFTokenizer

    if not isinstance(tokenizer, HFTokenizer):
        raise ConfigError(
            f"--chat renders prompts with a Hugging Face chat template, but this job's tokenizer is "
            f"data.tokenizer={lm.data.tokenizer!r}; decode without --chat."
        )
    try:
        template = ChatTemplate.for_tokenizer(tokenizer, lm.data.chat_template, end_of_turn=lm.data.end_of_turn or None)
        rendered = [template.render([{"role": "user", "content": t}], add_generation_prompt=True) for t in texts]
    except ChatError as e:
        raise ConfigError(f"--chat: {e}") from None
    eot = tokenizer.token_id(template.end_of_turn)
    assert eot is not None  # for_tokenizer checked it is one token
    return rendered, eot


def _decode(
    cfg,
    job_dir: AnyPath,
    texts: list[str],
    *,
    step: int | None,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    seed: int,
    batch_size: int,
    chat: bool = False,
) -> list:
    import jax

    from equipax.launch.configs.experiment import as_lm
    from equipax.launch.inference.sampling import decode_texts, encode_prompts
    from equipax.launch.inference.trained_job import check_tokenizer, local_mesh, pick_step, restore_model
    from equipax.launch.program.program import build_program
    from equipax.launch.tasks.lm_data import build_tokenizer
    from equipax.models.decode import for_decoding

    step = pick_step(job_dir, step)
    check_tokenizer(cfg, job_dir)
    lm = as_lm(cfg)
    tokenizer = build_tokenizer(lm, job_dir, log=lambda m: None)
    eos_id = None
    if chat:
        texts, eos_id = _chat_prompts(lm, tokenizer, texts)
    _, lengths = encode_prompts(tokenizer, texts, lm.model.max_seq_len)  # empty or too long: exit 2 before restoring
    cut = [(i, int(n)) for i, n in enumerate(lengths) if n + max_new_tokens > lm.model.max_seq_len]
    if cut:
        which = ", ".join(f"prompt {i + 1} ({n} tokens) gets {lm.model.max_seq_len - n}" for i, n in cut[:3])
        more = f" and {len(cut) - 3} more" if len(cut) > 3 else ""
        err.print(
            f"note: the model reads at most max_seq_len={lm.model.max_seq_len} tokens (prompt + generated), so "
            f"fewer than --max-new-tokens {max_new_tokens} fit after a long prompt: {which}{more}.",
            highlight=False,
        )
    cfg, mesh, note = local_mesh(cfg)
    if note:
        err.print(note, highlight=False)
    model, _ = restore_model(job_dir, step, build_program(cfg, mesh))
    model = for_decoding(model)  # a LoRA job's merge, model.quantization's int8 copy: made once
    err.print(f"{cfg.name}: step {step} of {job_dir} on {mesh.size} device(s).", highlight=False)
    key = jax.random.key(seed)
    samples = []
    for i in range(0, len(texts), batch_size):
        try:
            samples += decode_texts(
                model,
                tokenizer,
                texts[i : i + batch_size],
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                key=jax.random.fold_in(key, i),
                eos_id=eos_id,
            )
        except ValueError as e:  # a sampling knob the model refuses (e.g. --top-k above its vocabulary)
            fail(str(e))
    return samples
