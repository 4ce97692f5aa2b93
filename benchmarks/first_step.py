"""Time to the first step of `launch run`, by phase, with and without the persistent compilation cache.

Runs `python -m equipax.launch.cli run` on a toy-size `shakespeare_tiny` (the suite's toy knobs)
as a user would: a fresh job, then the same command again with two more steps (a resume), each
with the job's compilation cache (`train.compiler.cache_dir`, the default) and without it
(`train.compiler.cache_dir=""`), rounds interleaved. Each run prints its phases after the first
step (`equipax.launch.training.startup`); the table is their medians.

    uv run python benchmarks/first_step.py --rounds 3

Importable: `main(argv) -> dict` returns what it writes to `--out`.
"""

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "first_step.json"
TOY = [
    "model.vocab_size=384",
    "model.max_seq_len=32",
    "model.transformer.num_layers=2",
    "model.transformer.model_dims=32",
    "model.transformer.num_heads=2",
    "model.transformer.head_dim=16",
    "model.transformer.hidden_dims=64",
    "data.seq_len=32",
    "data.batch_size=4",
    "train.eval_batches=1",
    "train.sample.tokens=0",
    "train.eval_every=2",
    "train.checkpoint_every=2",
]
_LINE = re.compile(r"Time to first step ([\d.]+) s: (.*) \(s\)\.")


def run_once(job: Path, steps: int, cache: bool) -> dict[str, float]:
    """One `launch run`: its phases (seconds) and the process's wall time."""
    sets = [*TOY, f"train.num_steps={steps}"] + ([] if cache else ["train.compiler.cache_dir="])
    args = ["run", "--exp", "shakespeare_tiny", "--job-log-dir", str(job), *[a for s in sets for a in ("--set", s)]]
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "equipax.launch.cli", *args], capture_output=True, text=True, check=True
    )
    wall = time.perf_counter() - t0
    match = _LINE.search(done.stdout)
    if match is None:
        raise SystemExit(f"no phase line in the run's output:\n{done.stdout[-2000:]}")
    phases = {name: float(value) for name, value in (p.rsplit(" ", 1) for p in match.group(2).split(", "))}
    return {"total": float(match.group(1)), **phases, "process_wall": wall}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the rounds, print the medians, write the JSON results.

    Arguments:
        argv: command-line arguments (without the program name); None reads `sys.argv`.

    Returns:
        The results written to `--out`: per variant (cache on/off x fresh/rerun), each round's
        phases and their medians.
    """
    args = _parser().parse_args(argv)
    runs: dict[str, list[dict[str, float]]] = {}
    root = Path(tempfile.mkdtemp(prefix="first_step_"))
    for r in range(args.rounds):
        for cache in (True, False):
            job = root / f"{r}_{'cache' if cache else 'nocache'}"
            runs.setdefault(f"fresh, cache {'on' if cache else 'off'}", []).append(run_once(job, 2, cache))
            runs.setdefault(f"rerun, cache {'on' if cache else 'off'}", []).append(run_once(job, 4, cache))
    medians = {k: {p: statistics.median(r[p] for r in v) for p in v[0]} for k, v in runs.items()}
    results = {
        "benchmark": "first_step",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),
        "bytecode_cache": not sys.flags.dont_write_bytecode and not os.environ.get("PYTHONDONTWRITEBYTECODE"),
        "runs": runs,
        "medians": medians,
    }
    phases = list(next(iter(medians.values())))
    print(f"  {'run':<18} " + " ".join(f"{p:>12}" for p in phases))
    for k, m in medians.items():
        print(f"  {k:<18} " + " ".join(f"{m[p]:>12.2f}" for p in phases))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
