"""`launch run` of experiments as a user runs them, timed (benchmarks/tpu/run.sh's `runs` part; the
figures: benchmarks/README.md, "On a real TPU").

Each named run is one `launch run` process on a job directory of its own (the experiment at its
defaults, cut to one chip by the run's `--set`s), one after the other: one program at a time holds
the chip. Per run: its exit code and wall time, the "Time to first step" line by phase, and from
its `metrics.jsonl` the last logged train step (step time, tokens/s, TFLOP/s per device and MFU, as
`launch run` logs them: against the chip's datasheet peak) and the final eval loss. With
`--profile`, steps 11-13 are traced (`launch run --profile 11:3`) and summarised per op by
`benchmarks/op_profile.py` (`<name>.ops.json`). Each job directory is deleted after its figures are
read, unless `--keep-jobs` (a c4_1b job at 6 layers writes a 7.6 GB checkpoint).

    python benchmarks/tpu/user_runs.py --out runs/tpu/runs [--runs c4_1b_6l,qwen3_0_6b] [--steps 20]
    python benchmarks/tpu/user_runs.py --runs c4_1b_6l,c4_1b_6l   # the second: a new job, the same machine
    python benchmarks/tpu/user_runs.py --runs c4_1b_6l --set model.transformer.remat=full   # on every run

`--out` must be new or empty, or a folder this script wrote before (`runs.json` in it); exit 2,
touching nothing, otherwise.
"""

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file, `python benchmarks/tpu/user_runs.py`: the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import op_profile

LAUNCH = [sys.executable, "-m", "equipax.launch.cli"]

# One chip, synthetic tokens, as the c4_1b_6l figures of benchmarks/README.md were taken.
ONE_CHIP = ("data.source=synthetic", "data.packing=False", "mesh.ici_mesh_shape=(1,-1,1)")
C4_6L = ("model.transformer.num_layers=6", "data.per_device_batch=8", *ONE_CHIP)
# Pax's learner and caps off, dots saved: the best settings the chip measured for c4_1b's shape.
BEST = ("learner.kind=adamw", "learner.clip_update_rms=None", "model.output_logit_cap=None")
SHAKESPEARE_100M = (
    "model.transformer.num_layers=12",
    "model.transformer.model_dims=768",
    "model.transformer.num_heads=12",
    "model.transformer.head_dim=64",
    "model.transformer.hidden_dims=3072",
    "model.transformer.scan_layers=True",
    "model.max_seq_len=512",
    "model.dtype=bfloat16",
    "data.seq_len=512",
    "data.batch_size=32",
    "learner.schedule.peak_learning_rate=6e-4",
    "learner.schedule.warmup_steps=30",
    "learner.schedule.decay_steps=300",
    "train.eval_every=100",
)
LLAMA_6L = ("model.transformer.num_layers=6", "data.per_device_batch=1", *ONE_CHIP)
RUNS: dict[str, tuple[str, tuple[str, ...]]] = {
    "c4_1b_6l": ("c4_1b", C4_6L),
    "c4_1b_6l_adamw_dots": ("c4_1b", (*C4_6L, *BEST, "model.transformer.remat=dots_saveable")),
    # The same keeping the attention context too: splash's forward kernel runs once, not twice.
    "c4_1b_6l_adamw_dots_context": ("c4_1b", (*C4_6L, *BEST, "model.transformer.remat=dots_with_context")),
    # The same with int8 matmuls forward and backward (docs/quantization.md): against the run above.
    "c4_1b_6l_adamw_dots_int8": (
        "c4_1b",
        (*C4_6L, *BEST, "model.transformer.remat=dots_saveable", "model.quantization=int8"),
    ),
    # At their defaults (qwen3_0_6b: seq 4096; llama3_2_1b: seq 8192), cut to fit one chip: the
    # per-device batch (and llama's layers: 6 of 16, its float32 weights and Adam moments fit).
    "qwen3_0_6b": ("qwen3_0_6b", ("data.per_device_batch=2", *ONE_CHIP)),
    "llama3_2_1b_6l": ("llama3_2_1b", LLAMA_6L),
    # The same with the attention's context kept (splash's output and log-sum-exp): its forward
    # kernel runs once per layer (benchmarks/README.md, "Splash's residuals under remat").
    "llama3_2_1b_6l_save_context": ("llama3_2_1b", (*LLAMA_6L, "model.transformer.remat=save_context")),
    # The shapes the figures were taken at: seq 1024, batch 4.
    "qwen3_0_6b_1k": ("qwen3_0_6b", ("data.seq_len=1024", "data.per_device_batch=4", *ONE_CHIP)),
    "llama3_2_1b_6l_1k": (
        "llama3_2_1b",
        ("model.transformer.num_layers=6", "data.seq_len=1024", "data.per_device_batch=4", *ONE_CHIP),
    ),
    # int8's quality on real text (docs/quantization.md): the default experiment's Shakespeare at ~86M
    # parameters (GPT-2 small's shape, seq 512, batch 32, bf16 compute), its eval loss after the same
    # steps (`--steps 300`) in bf16 and with int8 matmuls forward and backward, the same seed.
    "shakespeare_100m": ("shakespeare_tiny", SHAKESPEARE_100M),
    "shakespeare_100m_int8": ("shakespeare_tiny", (*SHAKESPEARE_100M, "model.quantization=int8")),
    # The default experiment at toy size (for a dry run on a CPU).
    "toy": ("shakespeare_tiny", ()),
}
DEFAULT_RUNS = ("c4_1b_6l", "c4_1b_6l_adamw_dots", "qwen3_0_6b", "llama3_2_1b_6l")
_PHASES = re.compile(r"Time to first step ([\d.]+) s: (.*) \(s\)\.")


def _records(job: Path) -> list[dict[str, Any]]:
    path = job / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def figures(text: str, job: Path) -> dict[str, Any]:
    """What one run's output and job directory say: time to first step by phase, the last logged
    train step and the last eval."""
    out: dict[str, Any] = {}
    if m := _PHASES.search(text):
        out["time_to_first_step_s"] = float(m.group(1))
        out["phases_s"] = {k.strip(): float(v) for k, v in (p.rsplit(" ", 1) for p in m.group(2).split(", "))}
    records = _records(job)
    train = next((r for r in reversed(records) if r.get("split") == "train"), None)
    evals = [r for r in records if r.get("split") == "eval"]
    if train:
        keys = ("step", "loss", "step_time_s", "tokens_per_s", "tflops_per_s_per_device")
        out["last_train"] = {k: train[k] for k in keys if k in train}
        if "mfu" in train:
            out["mfu"] = train["mfu"]
    if evals:
        out["final_eval_loss"] = evals[-1].get("loss")
    return out


def run_one(name: str, exp: str, sets: list[str], *, out: Path, jobs: Path, profile: bool) -> dict[str, Any]:
    """`launch run --exp EXP --set ...` on a fresh job directory; its figures (and op profile)."""
    job = jobs / name
    args = ["run", "--exp", exp, "--job-log-dir", str(job), *[a for s in sets for a in ("--set", s)]]
    if profile:
        args += ["--profile", "11:3"]
    print(f"-- {name}: launch {' '.join(args)}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run([*LAUNCH, *args], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    text = proc.stdout + proc.stderr
    (out / f"{name}.log").write_text(text)
    row = {"name": name, "command": "launch " + " ".join(args), "exit": proc.returncode, "wall_s": round(wall, 2)}
    row |= figures(text, job)
    if profile and proc.returncode == 0:
        try:
            summary = op_profile.summarize_trace(op_profile.find_trace(job / "profile"), steps=3)
            (out / f"{name}.ops.json").write_text(json.dumps(summary, indent=2) + "\n")
            row["profile_ops_file"] = f"{name}.ops.json"
        except (FileNotFoundError, ValueError) as e:
            row["profile_error"] = str(e)
    shown = {k: row.get(k) for k in ("exit", "wall_s", "time_to_first_step_s", "mfu")}
    print(f"   {shown} {row.get('last_train', {})}", flush=True)
    for line in text.strip().splitlines()[-3:]:
        print(f"   | {line}", flush=True)
    return row


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / "runs.json").exists())):
        sys.exit(
            f"user_runs.py: --out {out} holds files this script did not write; give a new or empty "
            "folder (nothing was touched)."
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--runs", default=",".join(DEFAULT_RUNS), help=f"comma-separated, of: {', '.join(RUNS)}")
    p.add_argument("--steps", type=int, default=20, help="train.num_steps of every run")
    p.add_argument("--set", dest="sets", action="append", default=[], help="a knob for every run (repeatable)")
    p.add_argument("--profile", action="store_true", help="trace steps 11-13 and summarise them per op")
    p.add_argument("--keep-jobs", action="store_true", help="keep each run's job directory")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        sys.exit(f"user_runs.py: unknown run(s) {unknown}; known: {', '.join(RUNS)}")
    _check_out(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    jobs = args.out / "jobs"
    results: dict[str, Any] = {"jax": version("jax"), "steps": args.steps, "runs": []}
    seen: dict[str, int] = {}
    for name in names:
        exp, sets = RUNS[name]
        every = [*sets, f"train.num_steps={args.steps}", "train.log_every=5", *args.sets]
        # A run named twice runs again in a job of its own (what a second job of the same
        # experiment pays: the machine's caches, the compilation cache of a new job).
        seen[name] = seen.get(name, 0) + 1
        label = name if seen[name] == 1 else f"{name}_{seen[name]}"
        row = run_one(label, exp, every, out=args.out, jobs=jobs, profile=args.profile)
        results["runs"].append(row)
        (args.out / "runs.json").write_text(json.dumps(results, indent=2) + "\n")
        if not args.keep_jobs:
            shutil.rmtree(jobs / label, ignore_errors=True)
    print("\n  run                        exit  wall s  first step s  tokens/s   MFU")
    for r in results["runs"]:
        t = r.get("last_train", {})
        mfu = f"{r['mfu']:.1%}" if "mfu" in r else "-"
        print(
            f"  {r['name']:<26} {r['exit']:>4} {r['wall_s']:>7.1f} {r.get('time_to_first_step_s', 0):>13.1f} "
            f"{t.get('tokens_per_s', 0):>9,.0f} {mfu:>6}"
        )
    return results


if __name__ == "__main__":
    main()
