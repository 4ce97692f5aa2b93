"""`launch decode` tokens/s against a plain-JAX greedy KV-cache loop of the same model.

For each experiment, trains a job for two steps (the weights do not matter for speed; the shapes
do) unless `--job-root/<exp>` holds one, runs `launch decode` (greedy) on `--batches` batches of
`--batch` prompts for each batch size, and runs the hand-written loop of
`benchmarks/baseline_lm.py` (`make_greedy_decode`: no Equinox, no equipax; the job's parameters
converted to its dict layout) on the same prompts. The reference's tokens must equal the CLI's
(up to each row's end-of-sequence), so both decode the same model. Per batch, `launch decode`
reports `seconds_per_token` (its decode loop's own time per step, compilation excluded); the
reference's is its jitted call's wall time over `--new-tokens`, after a warm-up call. Since a
loaded host makes separate runs incomparable, the same batches are also decoded in this process,
interleaved batch by batch, by `decode_texts` (the function `launch decode` calls, timed the
same way) and the reference: `paired_ratio` is the median over batches of equipax tokens/s /
reference tokens/s (> 1: equipax is faster). The first batch of each is a warm-up and is not
counted; tokens/s = rows / seconds per step.

    uv run python benchmarks/decode_reference.py                      # tiny GPT and tiny Llama, batch 1 and 8
    uv run python benchmarks/decode_reference.py --exps shakespeare_tiny --batch-sizes 1 --new-tokens 16

Importable: `main(argv) -> dict` returns what it writes to `--out`.
"""

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "decode_reference.json"
DEFAULT_EXPS = ("shakespeare_tiny", "shakespeare_llama_tiny")


def _module(name: str) -> Any:
    """A sibling benchmark module, loaded by path (the benchmarks folder is not a package)."""
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def launch_decode(job: Path, prompts: Sequence[str], *, batch: int, new_tokens: int) -> list[dict[str, Any]]:
    """`launch decode` (greedy) of `prompts` in batches of `batch`: its JSON records, in order."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(prompts) + "\n")
    try:
        done = _module("launch_decode")._launch(
            "decode", "--job-log-dir", str(job), "--prompts", f.name, "--batch-size", str(batch),
            "--max-new-tokens", str(new_tokens), "--temperature", "0", "--output", "-",
        )  # fmt: skip
    finally:
        os.unlink(f.name)
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def load_reference(job: Path) -> tuple[Any, Any, Any, Any]:
    """`(equipax model, baseline config, baseline params, tokenizer)` of the job's newest checkpoint."""
    from equipax.launch.configs.experiment import as_lm
    from equipax.launch.inference.trained_job import load_config, local_mesh, pick_step, restore_model
    from equipax.launch.tasks.lm_data import build_tokenizer
    from equipax.launch.training.build import build_training

    train_step = _module("train_step")
    cfg = load_config(job)
    lm = as_lm(cfg)
    cfg, mesh, _ = local_mesh(cfg)
    model, _ = restore_model(job, pick_step(job, None), build_training(cfg, mesh).abstract_state)
    preset = train_step.Preset(
        name=cfg.name, description="", model=lm.model, batch_size=1, seq_len=lm.data.seq_len, learner=cfg.learner
    )
    tokenizer = build_tokenizer(lm, job, log=lambda m: None)
    return model, train_step.baseline_for(preset), train_step.baseline_params(model), tokenizer


def benchmark_exp(exp: str, *, job_root: Path, batch_sizes: Sequence[int], batches: int, new_tokens: int) -> dict:
    """Train (if needed) and decode one experiment both ways at each batch size."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from equipax.launch.inference.sampling import decode_texts, encode_prompts

    ld = _module("launch_decode")
    job = job_root / exp
    if not (job / "checkpoints").exists():
        ld._launch("run", "--exp", exp, "--job-log-dir", str(job), *[a for s in ld._TRAIN for a in ("--set", s)])
    model, bcfg, params, tokenizer = load_reference(job)
    baseline = _module("baseline_lm")
    decode = baseline.make_greedy_decode(bcfg, new_tokens)
    rows: dict[str, Any] = {}
    for batch in batch_sizes:
        prompts = [ld._PROMPTS[i % len(ld._PROMPTS)] for i in range(batch * batches)]
        records = launch_decode(job, prompts, batch=batch, new_tokens=new_tokens)
        cli_rates = [batch / records[i]["seconds_per_token"] for i in range(0, len(records), batch)]
        # In this process, interleaved batch by batch: the function `launch decode` calls
        # (`decode_texts`, its own seconds per step) and the reference, on the same prompts.
        eqx_rates, ref_rates, same = [], [], True
        for i in range(0, len(prompts), batch):
            texts = prompts[i : i + batch]
            samples = decode_texts(model, tokenizer, texts, max_new_tokens=new_tokens)
            eqx_rates.append(batch / samples[0].seconds_per_token)
            ids, lengths = encode_prompts(tokenizer, texts, bcfg.seq_len)
            args = (params, jnp.asarray(ids), jnp.asarray(lengths))
            jax.block_until_ready(decode(*args))  # compiled on the first batch; warm afterwards
            t0 = time.perf_counter()
            tokens = np.asarray(decode(*args))
            ref_rates.append(batch / ((time.perf_counter() - t0) / new_tokens))
            for row, record, sample in zip(tokens.tolist(), records[i : i + batch], samples):
                same &= row[: len(record["tokens"])] == record["tokens"] == list(sample.tokens)
        counted = lambda rates: rates[1:] or rates  # noqa: E731 (the first batch warms up)
        paired = [e / r for e, r in zip(counted(eqx_rates), counted(ref_rates))]
        cli, ref = statistics.median(counted(cli_rates)), statistics.median(counted(ref_rates))
        rows[str(batch)] = {
            "launch_decode_tokens_per_s": cli,
            "in_process_tokens_per_s": statistics.median(counted(eqx_rates)),
            "reference_tokens_per_s": ref,
            "paired_ratio": statistics.median(paired),
            "paired_ratios": paired,
            "same_tokens": same,
            "launch_decode_per_batch": cli_rates,
            "in_process_per_batch": eqx_rates,
            "reference_per_batch": ref_rates,
        }
    return {
        "exp": exp,
        "params": dataclasses.asdict(bcfg),
        "new_tokens": new_tokens,
        "batches": batches,
        "by_batch": rows,
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--exps", default=",".join(DEFAULT_EXPS), help="comma-separated experiment names")
    p.add_argument("--batch-sizes", default="1,8", help="comma-separated prompts per batch")
    p.add_argument("--batches", type=int, default=4, help="batches per size (the first is a warm-up)")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--job-root", type=Path, default=None, help="where the trained jobs live (default: a temp dir)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print a table, write the JSON results.

    Arguments:
        argv: command-line arguments (without the program name); None reads `sys.argv`.

    Returns:
        The results written to `--out`: per experiment and batch size, both tokens/s, their ratio
        and whether the tokens agreed.
    """
    args = _parser().parse_args(argv)
    exps = [e.strip() for e in args.exps.split(",") if e.strip()]
    sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    job_root = args.job_root or Path(tempfile.mkdtemp(prefix="decode_reference_"))
    results = {
        "benchmark": "decode_reference",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),
        "experiments": {
            e: benchmark_exp(e, job_root=job_root, batch_sizes=sizes, batches=args.batches, new_tokens=args.new_tokens)
            for e in exps
        },
    }
    print(f"greedy, {args.new_tokens} new tokens, median of {max(args.batches - 1, 1)} batches per size")
    print(
        f"  {'experiment':<24} {'batch':>5} {'launch decode':>14} {'in-process':>11} {'plain JAX':>10} "
        f"{'paired ratio':>13}  same tokens   (tokens/s)"
    )
    for e, r in results["experiments"].items():
        for b, row in r["by_batch"].items():
            print(
                f"  {e:<24} {b:>5} {row['launch_decode_tokens_per_s']:>14,.0f} "
                f"{row['in_process_tokens_per_s']:>11,.0f} {row['reference_tokens_per_s']:>10,.0f} "
                f"{row['paired_ratio']:>13.2f}  {row['same_tokens']}"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
