"""`launch decode` throughput: tokens/s of the CLI's KV-cache decoding on a trained job.

For each experiment, trains a job for two steps (the weights do not matter for speed; the shapes
do) unless `--job-root/<exp>` already holds one, then runs `launch decode` on `--batches` batches
of `--batch` prompts and reads each batch's `seconds_per_token` (the decode loop's own time per
step, compilation excluded) from its JSON output. Tokens/s of a batch = rows / seconds per step;
the first batch is a warm-up and is not counted.

    uv run python benchmarks/launch_decode.py                         # tiny GPT and tiny Llama
    uv run python benchmarks/launch_decode.py --exps shakespeare_tiny --batch 1

Importable: `main(argv) -> dict` returns what it writes to `--out`.
"""

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "launch_decode.json"
DEFAULT_EXPS = ("shakespeare_tiny", "shakespeare_llama_tiny")
_TRAIN = [
    "train.num_steps=2",
    "train.eval_every=2",
    "train.checkpoint_every=2",
    "train.eval_batches=1",
    "train.sample.tokens=0",
]
_PROMPTS = ("ROMEO:", "JULIET:", "First Citizen:", "KING HENRY:", "HAMLET:", "To be", "Now is the", "O, ")


def _launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "equipax.launch.cli", *args], check=True, capture_output=True, text=True
    )


def benchmark_exp(
    exp: str, *, job_root: Path, batch: int, batches: int, new_tokens: int, extra_sets: Sequence[str]
) -> dict[str, Any]:
    """Train (if needed) and decode one experiment; per-batch and median tokens/s."""
    job = job_root / exp
    if not (job / "checkpoints").exists():
        _launch(
            "run", "--exp", exp, "--job-log-dir", str(job), *[a for s in [*_TRAIN, *extra_sets] for a in ("--set", s)]
        )
    prompts = [_PROMPTS[i % len(_PROMPTS)] for i in range(batch * batches)]
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(prompts) + "\n")
    t0 = time.perf_counter()
    done = _launch(
        "decode",
        "--job-log-dir",
        str(job),
        "--prompts",
        f.name,
        "--batch-size",
        str(batch),
        "--max-new-tokens",
        str(new_tokens),
        "--output",
        "-",
    )
    wall = time.perf_counter() - t0
    os.unlink(f.name)
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    per_batch = [records[i]["seconds_per_token"] for i in range(0, len(records), batch)]
    rates = [batch / s for s in per_batch]
    counted = rates[1:] or rates
    return {
        "exp": exp,
        "batch": batch,
        "batches": batches,
        "new_tokens": new_tokens,
        "seconds_per_step": per_batch,
        "tokens_per_s": rates,
        "median_tokens_per_s": statistics.median(counted),
        "command_wall_s": wall,
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--exps", default=",".join(DEFAULT_EXPS), help="comma-separated experiment names")
    p.add_argument("--batch", type=int, default=8, help="prompts per decode batch")
    p.add_argument("--batches", type=int, default=4, help="batches (the first is a warm-up)")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--job-root", type=Path, default=None, help="where the trained jobs live (default: a temp dir)")
    p.add_argument("--set", dest="sets", action="append", default=[], help="extra --set for the training run")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print a table, write the JSON results.

    Arguments:
        argv: command-line arguments (without the program name); None reads `sys.argv`.

    Returns:
        The results written to `--out`: per experiment, tokens/s of each batch and their median.
    """
    args = _parser().parse_args(argv)
    exps = [e.strip() for e in args.exps.split(",") if e.strip()]
    job_root = args.job_root or Path(tempfile.mkdtemp(prefix="launch_decode_"))
    results = {
        "benchmark": "launch_decode",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "experiments": {
            e: benchmark_exp(
                e,
                job_root=job_root,
                batch=args.batch,
                batches=args.batches,
                new_tokens=args.new_tokens,
                extra_sets=args.sets,
            )
            for e in exps
        },
    }
    print(f"launch decode: batch {args.batch}, {args.new_tokens} new tokens, median of {args.batches - 1} batches")
    for e, r in results["experiments"].items():
        print(
            f"  {e:28s} {r['median_tokens_per_s']:8.0f} tokens/s  (per batch: "
            + ", ".join(f"{x:.0f}" for x in r["tokens_per_s"])
            + ")"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
