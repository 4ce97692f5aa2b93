"""Pipeline bubble: step time of the pipelined smoke at 2/4/8 microbatches vs the analytic bubble.

Runs the real train step (`build_training` of `c4_gpt3_xl_pipeline_smoke`, widened by
`--model-dims`/`--seq`) on 8 simulated CPU devices, for 2 stages (mesh (2, 1, 2, 2)) and 4 stages
(mesh (4, 1, 1, 2)), GPipe and circular (R = `--circular-repeats` layer groups per stage; it needs
M >= S), at each microbatch count M. The pipelined stack runs R x M + S - 1 iterations of 1/R of
a stage's layers for R x M microbatch-stages of useful work, so its time goes as
(R x M + S - 1) / (R x M) = 1 / (1 - bubble), bubble = (S - 1) / (R x M + S - 1). The table
compares each step time, relative to the one with the most microbatches (same S and schedule),
with that prediction. All configurations are compiled and warmed up first; then `--rounds`
rounds time `--steps` steps of each in turn (so a change in the machine's load hits them all),
and the table gives the median and interquartile range over all rounds.

What simulated devices can show: in equipax's SPMD pipeline every stage computes in every
iteration (a stage in the bubble computes on zeros and the result is dropped), so the total work
the host's cores do is proportional to (R x M + S - 1) / (R x M), as the idle time on real chips
is; and the cost of more, smaller microbatches (per-iteration overhead, smaller matmuls) shows
too. What they cannot show: the 8 "devices" share the host's 2 cores, so there is no real
concurrency between stages, ppermute and all-gathers are memory copies rather than ICI/DCN
transfers (no latency or overlap of communication with compute), and the non-pipelined part
(embedding, logits, optimizer) is a larger share than on a big model. Read ratios, not absolute
times. Measured figures and what they mean: benchmarks/README.md.

    uv run python benchmarks/pipeline_bubble.py --steps 8 --rounds 4 --warmup 2   # ~3 minutes

Importable: `main(argv) -> dict` returns what it writes to `--out`.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import argparse
import datetime
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file, `python benchmarks/pipeline_bubble.py`: the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax

from benchmarks.step_timing import quartiles, step_timer
from equipax.core.knobs import set_knobs
from equipax.core.nn import bubble_fraction
from equipax.launch.experiments.registry import get_experiment

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "pipeline_bubble.json"
MESHES = {2: (2, 1, 2, 2), 4: (4, 1, 1, 2)}


def build_step(
    stages: int, schedule: str, microbatches: int, args: argparse.Namespace
) -> tuple[Callable[[int], list[float]], int]:
    """The smoke's train step at this pipeline shape: `run(n)`, which times n more steps, and the
    global batch."""
    repeats = args.circular_repeats if schedule == "circular" else 1
    cfg = set_knobs(
        get_experiment("c4_gpt3_xl_pipeline_smoke"),
        {
            "mesh.ici_mesh_shape": MESHES[stages],
            "model.transformer.pipeline_stages": stages,
            "model.transformer.pipeline_schedule": schedule,
            "model.transformer.pipeline_repeats": repeats,
            "model.transformer.num_layers": stages * args.layers_per_stage,
            "model.transformer.pipeline_microbatches": microbatches,
            "model.transformer.pipeline_microbatch_size": None,
            "model.transformer.model_dims": args.model_dims,
            "model.transformer.hidden_dims": 4 * args.model_dims,
            "model.transformer.head_dim": args.model_dims // 4,
            "model.max_seq_len": args.seq,
            "data.seq_len": args.seq,
            "data.per_device_batch": args.per_device_batch,
        },
    )
    run = step_timer(cfg)

    return run, cfg.global_batch_size


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--stages", default="2,4", help="comma-separated stage counts (2, 4)")
    parser.add_argument("--schedules", default="gpipe,circular")
    parser.add_argument("--circular-repeats", type=int, default=2, help="R of the circular schedule")
    parser.add_argument("--microbatches", default="2,4,8")
    parser.add_argument("--model-dims", type=int, default=128)
    parser.add_argument("--layers-per-stage", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--per-device-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration per round")
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds over all configurations (interleaved, so load drift hits all alike)",
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after the compiling one")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    assert jax.device_count() == 8, "run in a fresh process: JAX must start with 8 CPU devices"

    configs = []
    for stages in (int(s) for s in args.stages.split(",")):
        for schedule in args.schedules.split(","):
            repeats = args.circular_repeats if schedule == "circular" else 1
            for m in (int(m) for m in args.microbatches.split(",")):
                if schedule == "circular" and m < stages:
                    continue  # the circular schedule needs M >= S (a config error)
                start = time.perf_counter()
                run, global_batch = build_step(stages, schedule, m, args)
                run(1)
                first = time.perf_counter() - start
                run(args.warmup)
                configs.append(
                    {
                        "stages": stages,
                        "schedule": schedule,
                        "repeats": repeats,
                        "microbatches": m,
                        "global_batch": global_batch,
                        "iterations": repeats * m + stages - 1,
                        "first_step_s": first,
                        "bubble_fraction": bubble_fraction(stages, m, repeats),
                        "steps_s": [],
                        "run": run,
                    }
                )
    for _ in range(args.rounds):
        for c in configs:
            c["steps_s"] += c["run"](args.steps)
    rows = []
    for c in configs:
        del c["run"]
        c["step_q1_s"], c["step_s"], c["step_q3_s"] = quartiles(c["steps_s"])
        rows.append(c)
    for c in rows:
        base = max(
            (r for r in rows if (r["stages"], r["schedule"]) == (c["stages"], c["schedule"])),
            key=lambda r: r["microbatches"],
        )
        # Work of the pipelined stack ~ iterations / microbatch-stages = 1 / (1 - bubble).
        c["measured_vs_most_microbatches"] = c["step_s"] / base["step_s"]
        c["predicted_vs_most_microbatches"] = (1 - base["bubble_fraction"]) / (1 - c["bubble_fraction"])
        c["ms_per_iteration"] = 1e3 * c["step_s"] / c["iterations"]
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "jax_version": jax.__version__,
        "devices": f"{jax.device_count()} simulated {jax.devices()[0].platform} devices on {os.cpu_count()} cores",
        "load_average": os.getloadavg(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": rows,
    }
    print(
        f"{'stages':>6} {'schedule':>10} {'micro':>5} {'iters':>5} {'bubble':>7} {'step ms':>8} {'IQR ms':>11} "
        f"{'ms/iter':>7} {'measured':>8} {'predicted':>9}  (time / time at most microbatches)"
    )
    for r in rows:
        sched = r["schedule"] + (f" R={r['repeats']}" if r["repeats"] > 1 else "")
        iqr = f"{1e3 * r['step_q1_s']:.0f}-{1e3 * r['step_q3_s']:.0f}"
        print(
            f"{r['stages']:>6} {sched:>10} {r['microbatches']:>5} {r['iterations']:>5} {r['bubble_fraction']:>7.3f} "
            f"{1e3 * r['step_s']:>8.1f} {iqr:>11} {r['ms_per_iteration']:>7.1f} "
            f"{r['measured_vs_most_microbatches']:>8.2f} {r['predicted_vs_most_microbatches']:>9.2f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
