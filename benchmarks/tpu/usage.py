"""What a user does with equipax on a TPU host, run as they would type it (benchmarks/tpu/run.sh's
`usage` part; the figures: benchmarks/README.md, "On a real TPU").

1. `launch run` of the default experiment trains (its final eval loss against the corpus' unigram
   entropy, tokens/s of its last logged step);
2. the same run in a second job directory, stopped by SIGTERM after its first step (it saves and
   exits 75), then resumed by the same command to the end: its `state_digest` equals the
   uninterrupted run's, bit for bit;
3. `launch decode` and `launch eval` of the first job;
4. `launch compile --topology v5e-8` of an experiment, compiled by XLA:TPU on this host.

Each command runs in its own process, one after the other (one program at a time holds the chip),
through `python -m equipax.launch.cli` with this interpreter; `--out` gets each command's output
(`<name>.log`) and `usage.json`. Exit 0 only where every check holds; exit 2, touching nothing,
where `--out` holds anything but what this script wrote there before (which it replaces).

    python benchmarks/tpu/usage.py --out runs/tpu/usage [--compile-exp c4_1b_smoke] [--steps N]
"""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

LAUNCH = [sys.executable, "-m", "equipax.launch.cli"]


def _run(name: str, args: list[str], out: Path, *, timeout: float = 600) -> dict[str, Any]:
    """Run `launch ARGS` to the end; its exit code, wall time and output (also in `<name>.log`)."""
    print(f"-- {name}: launch {' '.join(args)}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run([*LAUNCH, *args], capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    text = proc.stdout + proc.stderr
    (out / f"{name}.log").write_text(text)
    print(f"   exit {proc.returncode} in {wall:.1f} s; last lines:", flush=True)
    for line in text.strip().splitlines()[-3:]:
        print(f"   | {line}", flush=True)
    return {"command": "launch " + " ".join(args), "exit": proc.returncode, "wall_s": round(wall, 2), "output": text}


def _stopped_run(args: list[str], out: Path, *, timeout: float = 600) -> dict[str, Any]:
    """`launch ARGS`, frozen (SIGSTOP) once its first step has run (the "Compiled and ran the first
    step" line), sent SIGTERM and let go: the signal is pending when it continues, so it stops with
    steps to go however fast the steps are."""
    print(f"-- stopped: launch {' '.join(args)} (SIGTERM after its first step)", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen([*LAUNCH, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("Compiled and ran the first step") or re.match(r"step \d+/", line):
            proc.send_signal(signal.SIGSTOP)
            proc.send_signal(signal.SIGTERM)
            proc.send_signal(signal.SIGCONT)
            break
    rest, _ = proc.communicate(timeout=timeout)
    text = "".join(lines) + rest
    (out / "stopped.log").write_text(text)
    wall = time.perf_counter() - t0
    print(f"   exit {proc.returncode} in {wall:.1f} s", flush=True)
    return {"command": "launch " + " ".join(args), "exit": proc.returncode, "wall_s": round(wall, 2), "output": text}


def _last_train_record(job: Path) -> dict[str, Any]:
    records = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return next((r for r in reversed(records) if r.get("split") == "train"), {})


# What main() writes into --out; usage.json first (unfinished until the end), so a folder holding it
# and nothing else but these is one this script made and may empty.
LOGS = ("train", "stopped", "resumed", "decode", "eval", "compile")
OWN = {"usage.json", "default", "stopped", "compiled", *(f"{n}.log" for n in LOGS)}


def _clear_own_folder(out: Path) -> str:
    """Make `out` an empty folder, removing only what this script wrote there before; a message
    (and nothing touched) where it is a file or holds anything else."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        return f"--out '{out}' exists and is not a folder; it was left as it is. Give a new folder."
    if out.is_dir():
        entries = sorted(p.name for p in out.iterdir())
        others = [n for n in entries if n not in OWN]
        if others or (entries and "usage.json" not in entries):
            named = ", ".join(others[:5]) if others else "no usage.json"
            return (
                f"--out '{out}' holds what this script did not write ({named}); nothing was changed. "
                "Give a new or empty folder, or one this script wrote before (it replaces that)."
            )
        for name in entries:
            path = out / name
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    out.mkdir(parents=True, exist_ok=True)
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/tpu/usage"))
    parser.add_argument("--exp", default=None, help="the experiment trained (default: launch run's default)")
    parser.add_argument("--steps", type=int, default=None, help="train.num_steps (default: the experiment's)")
    parser.add_argument("--compile-exp", default="c4_1b_smoke", help="compiled with --topology (default: %(default)s)")
    parser.add_argument("--topology", default="v5e-8", help="the slice compiled for (default: %(default)s)")
    args = parser.parse_args(argv)
    out: Path = args.out
    refused = _clear_own_folder(out)
    if refused:
        print(f"usage.py: {refused}", file=sys.stderr)
        return 2
    (out / "usage.json").write_text('{"unfinished": true}\n')  # marks the folder as this script's
    knobs = (["--exp", args.exp] if args.exp else []) + (
        ["--set", f"train.num_steps={args.steps}"] if args.steps is not None else []
    )
    checks: dict[str, bool] = {}
    report: dict[str, Any] = {}

    job = out / "default"
    r = _run("train", ["run", "--job-log-dir", str(job), *knobs], out)
    checks["train: exit 0"] = r["exit"] == 0
    result = json.loads((job / "result.json").read_text()) if (job / "result.json").exists() else {}
    last = _last_train_record(job) if (job / "metrics.jsonl").exists() else {}
    report["train"] = {
        "command": r["command"],
        "wall_s": r["wall_s"],
        "final_step": result.get("final_step"),
        "final_eval_loss": result.get("final_eval_loss"),
        "unigram_entropy": result.get("unigram_entropy"),
        "last_logged_tokens_per_s": last.get("tokens_per_s"),
        "last_logged_step_time_s": last.get("step_time_s"),
        "state_digest": result.get("state_digest"),
    }
    if args.steps is None and result.get("final_eval_loss") is not None and result.get("unigram_entropy") is not None:
        # (The default experiment's whole run learns more than unigram statistics; a shortened one may not.)
        checks["train: eval loss below the unigram entropy"] = result["final_eval_loss"] < result["unigram_entropy"]

    stopped_job = out / "stopped"
    stop = _stopped_run(["run", "--job-log-dir", str(stopped_job), *knobs], out)
    checks["stopped: exit 75 (saved, preempted)"] = stop["exit"] == 75
    resumed = _run("resumed", ["run", "--job-log-dir", str(stopped_job), *knobs], out)
    resumed_from = re.search(r"Resumed from step (\d+)", resumed["output"])
    total = result.get("final_step")
    checks["resumed: exit 0, from a step before the last"] = (
        resumed["exit"] == 0 and resumed_from is not None and total is not None and int(resumed_from.group(1)) < total
    )
    resumed_result = (
        json.loads((stopped_job / "result.json").read_text()) if (stopped_job / "result.json").exists() else {}
    )
    checks["resumed: state digest == the uninterrupted run's"] = resumed_result.get(
        "state_digest"
    ) is not None and resumed_result.get("state_digest") == result.get("state_digest")
    report["resume"] = {
        "stopped_exit": stop["exit"],
        "resumed_exit": resumed["exit"],
        "resumed_from_step": int(resumed_from.group(1)) if resumed_from else None,
        "state_digest": resumed_result.get("state_digest"),
        "wall_s": [stop["wall_s"], resumed["wall_s"]],
    }

    r = _run("decode", ["decode", "--job-log-dir", str(job), "--prompt", "ROMEO:", "--max-new-tokens", "64"], out)
    checks["decode: exit 0, the prompt continued"] = r["exit"] == 0 and "ROMEO:" in r["output"]
    report["decode"] = {
        "command": r["command"],
        "exit": r["exit"],
        "wall_s": r["wall_s"],
        "output": r["output"][-2000:],
    }
    r = _run("eval", ["eval", "--job-log-dir", str(job)], out)
    checks["eval: exit 0"] = r["exit"] == 0
    report["eval"] = {"command": r["command"], "exit": r["exit"], "wall_s": r["wall_s"], "output": r["output"][-2000:]}

    r = _run(
        "compile",
        ["compile", "--exp", args.compile_exp, "--topology", args.topology, "--job-log-dir", str(out / "compiled")],
        out,
    )
    checks[f"compile --topology {args.topology}: exit 0"] = r["exit"] == 0
    compiled = out / "compiled" / "compile.json"
    report["compile"] = {
        "command": r["command"],
        "exit": r["exit"],
        "wall_s": r["wall_s"],
        "report": json.loads(compiled.read_text()) if compiled.exists() else None,
    }

    report["checks"] = checks
    report["jax_platforms"] = os.environ.get("JAX_PLATFORMS")
    (out / "usage.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print("== usage checks")
    for name, ok in checks.items():
        print(f"  {'ok  ' if ok else 'FAIL'} {name}")
    print(f"train: {report['train']}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
