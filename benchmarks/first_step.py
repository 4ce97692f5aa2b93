"""Time to the first step of `launch run`, by phase, and what a run spends after it.

Runs `python -m equipax.launch.cli run` as a user would. By default on a toy-size
`shakespeare_tiny` (the suite's toy knobs): a fresh job, then the same command again with two more
steps (a resume), each with the job's own compilation cache
(`train.compiler.cache_dir=compile_cache`: a fresh job compiles, whatever the machine's cache
holds) and without it (`train.compiler.cache_dir=""`), rounds interleaved. Each run prints its phases after
the first step (`equipax.launch.training.startup`); the table is their medians, with the process's
wall time and `after first step`: the wall time from that line to the process's exit (the last
steps, the final eval and checkpoint, the digest and result.json).

`--exp` and `--set` time another experiment (its own knobs, no toy knobs), `--steps` its length,
`--fresh-only` skips the reruns, `--cache off` keeps only the runs without the cache, and
`--python NAME=PATH` (repeatable) runs each round once per interpreter, interleaved: e.g. the
virtual environment of another checkout against this one, for before/after ratios measured in
one run on a loaded host.

    uv run python benchmarks/first_step.py --rounds 3
    uv run python benchmarks/first_step.py --rounds 2 --fresh-only --cache off --exp c4_1b --steps 2 \\
        --set model.transformer.num_layers=6 --set data.per_device_batch=1 --set data.source=synthetic \\
        --set data.packing=False --set "mesh.ici_mesh_shape=(1,-1,1)" \\
        --python before=/tmp/base/.venv/bin/python --python after=.venv/bin/python

`--programs TOPOLOGY` instead compiles, for a TPU slice that is not attached (libtpu on this host,
as `launch compile --topology` does), each program a fresh run of `--exp` compiles before its
first eval and checkpoint: the initialisation, the train step, the eval step and the checkpoint
checksums' program, and reports each one's XLA compile time (wall and CPU seconds) and the
initialisation's temporaries:

    uv run python benchmarks/first_step.py --programs v5e-1 --exp c4_1b --set model.transformer.num_layers=6 \
        --set data.per_device_batch=8 --set data.source=synthetic --set data.packing=False \
        --set "mesh.ici_mesh_shape=(1,-1,1)"

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


def run_once(
    job: Path, steps: int, cache: bool, *, exp: str = "shakespeare_tiny", sets: Sequence[str] = (), python: str = ""
) -> dict[str, float]:
    """One `launch run`: its phases (seconds), the process's wall time and the time after the
    first step (from the phase line to the exit)."""
    knobs = [*(TOY if exp == "shakespeare_tiny" and not sets else sets), f"train.num_steps={steps}"]
    knobs += ["train.compiler.cache_dir=" + ("compile_cache" if cache else "")]
    args = ["run", "--exp", exp, "--job-log-dir", str(job), *[a for s in knobs for a in ("--set", s)]]
    t0 = time.perf_counter()
    lines, match, matched_at = [], None, 0.0
    with subprocess.Popen(
        [python or sys.executable, "-m", "equipax.launch.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if match is None and (match := _LINE.search(line)):
                matched_at = time.perf_counter()
    end = time.perf_counter()
    if proc.returncode != 0 or match is None:
        raise SystemExit(f"exit {proc.returncode}, or no phase line in the run's output:\n{''.join(lines)[-3000:]}")
    phases = {name: float(value) for name, value in (p.rsplit(" ", 1) for p in match.group(2).split(", "))}
    return {"total": float(match.group(1)), **phases, "process_wall": end - t0, "after_first_step": end - matched_at}


def compile_programs(exp: str, sets: Sequence[str], topology: str) -> dict[str, Any]:
    """XLA:TPU compile time of each program a fresh run of `exp` compiles first, for `topology`."""
    import dataclasses

    import equinox as eqx
    import jax

    from equipax.core.mesh import build_mesh
    from equipax.core.trees import flat_arrays
    from equipax.launch.commands.common import resolve
    from equipax.launch.commands.compile_command import _host_only_jax
    from equipax.launch.hardware.tpu import lookup_slice, topology_devices
    from equipax.launch.jobdir.checksums import lower_checksums
    from equipax.launch.program.training import INIT_COMPILER_OPTIONS, _initial_state, build_training

    _, cfg, _ = resolve(exp, list(sets))
    _host_only_jax()
    devices = topology_devices(lookup_slice(topology))
    cfg = dataclasses.replace(cfg, mesh=cfg.mesh.fit(len(devices)))
    training = build_training(cfg, build_mesh(cfg.mesh, devices), feeds_batches=False)
    arrays, static = eqx.partition(training.abstract_state.model, lambda x: isinstance(x, jax.ShapeDtypeStruct))

    def init(key: Any) -> Any:
        state = _initial_state(training.task, training.learner.optimizer, key)
        return eqx.filter(eqx.filter_shard(state, training.state_sharding), eqx.is_array)

    def evaluate(model_arrays: Any, batch: Any) -> Any:
        return training.task.eval_sums(eqx.combine(model_arrays, static), batch, model_state=None)

    lowerings = {
        "init": lambda: jax.jit(init).lower(jax.eval_shape(lambda: training.keys.init)),
        "train step": training.lower,
        "eval step": lambda: jax.jit(evaluate).lower(arrays, training.abstract_batch()),
        "checksums": lambda: lower_checksums(flat_arrays(training.abstract_state)),
    }
    out: dict[str, Any] = {"topology": topology}
    for name, lower in lowerings.items():
        lowered = lower()
        wall, cpu = time.perf_counter(), time.process_time()
        # The initialisation with the options a run compiles it with.
        compiled = lowered.compile(**({"compiler_options": INIT_COMPILER_OPTIONS} if name == "init" else {}))
        out[name] = {"compile_s": time.perf_counter() - wall, "compile_cpu_s": time.process_time() - cpu}
        if name == "init":
            out[name]["temp_bytes"] = compiled.memory_analysis().temp_size_in_bytes
        print(f"  {name:<12} {out[name]}", flush=True)
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--exp", default="shakespeare_tiny", help="the experiment (default: shakespeare_tiny at toy size)")
    p.add_argument("--set", dest="sets", action="append", default=[], help="KNOB=VALUE for every run (repeatable)")
    p.add_argument("--steps", type=int, default=2, help="train.num_steps of a fresh job (a rerun adds two)")
    p.add_argument("--fresh-only", action="store_true", help="no reruns of the jobs")
    p.add_argument("--cache", choices=("both", "on", "off"), default="both", help="the runs with/without the cache")
    p.add_argument("--python", action="append", default=[], help="NAME=PATH: run every round with this interpreter too")
    p.add_argument("--programs", metavar="TOPOLOGY", help="compile the run's programs for a TPU slice instead")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the rounds, print the medians, write the JSON results.

    Arguments:
        argv: command-line arguments (without the program name); None reads `sys.argv`.

    Returns:
        The results written to `--out`: per variant (interpreter, cache on/off x fresh/rerun), each
        round's phases and their medians.
    """
    args = _parser().parse_args(argv)
    if args.programs:
        results = {"benchmark": "first_step programs", "exp": args.exp, "sets": args.sets}
        results |= compile_programs(args.exp, args.sets, args.programs)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        return results
    pythons = dict(p.split("=", 1) for p in args.python) or {"": sys.executable}
    caches = {"both": (True, False), "on": (True,), "off": (False,)}[args.cache]
    runs: dict[str, list[dict[str, float]]] = {}
    root = Path(tempfile.mkdtemp(prefix="first_step_"))
    for r in range(args.rounds):
        for name, python in pythons.items():
            for cache in caches:
                tag = f"{name + ', ' if name else ''}cache {'on' if cache else 'off'}"
                job = root / f"{r}_{name}_{'cache' if cache else 'nocache'}"
                common: dict[str, Any] = dict(exp=args.exp, sets=args.sets, python=python)
                runs.setdefault(f"fresh, {tag}", []).append(run_once(job, args.steps, cache, **common))
                if not args.fresh_only:
                    runs.setdefault(f"rerun, {tag}", []).append(run_once(job, args.steps + 2, cache, **common))
    # A phase missing from a run (e.g. remat auto's) counts 0 in it.
    phases = list(dict.fromkeys(p for v in runs.values() for r in v for p in r))
    medians = {k: {p: statistics.median(r.get(p, 0.0) for r in v) for p in phases} for k, v in runs.items()}
    results = {
        "benchmark": "first_step",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),
        "bytecode_cache": not sys.flags.dont_write_bytecode and not os.environ.get("PYTHONDONTWRITEBYTECODE"),
        "exp": args.exp,
        "sets": args.sets,
        "steps": args.steps,
        "pythons": pythons,
        "runs": runs,
        "medians": medians,
    }
    width = max(len(k) for k in medians) + 2
    print(f"  {'run':<{width}} " + " ".join(f"{p:>12}" for p in phases))
    for k, m in medians.items():
        print(f"  {k:<{width}} " + " ".join(f"{m[p]:>12.2f}" for p in phases))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
