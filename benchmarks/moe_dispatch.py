"""Mixture of experts: train-step time of dropless vs capacity dispatch at expert parallelism 1/2/4.

Runs the real train step (`build_training` of `mixtral_8x7b_smoke`: 8 experts, top-2, widened by
`--model-dims`/`--seq`) on 8 simulated CPU devices over (data, fsdp, expert, tensor) meshes
(8, 1, 1, 1) (EP 1: the experts replicated, pure data parallelism), (4, 1, 2, 1) (EP 2) and
(2, 1, 4, 1) (EP 4), each dropless and with `--capacity-factor`. All configurations are compiled
and warmed up first; then `--rounds` rounds time `--steps` steps of each in turn (so a change in
the machine's load hits them all), and the table gives the median step and its interquartile
range, and each step time relative to dropless at EP 1.

What simulated devices can show: the extra work of each dispatch (sorting, gathers and scatters,
the capacity buffers' padding) and of its collectives done as memory copies. What they cannot:
the 8 "devices" share the host's cores, so an all-to-all or all-gather costs a copy rather than
ICI time, and splitting the experts saves no per-device work that the host would see. Read ratios,
not absolute times. Measured figures: benchmarks/README.md.

    uv run python benchmarks/moe_dispatch.py --steps 8 --rounds 3 --warmup 2

Importable: `main(argv) -> dict` returns what it writes to `--out`.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import argparse
import datetime
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
from step_timing import quartiles, step_timer

from equipax.core.knobs import set_knobs
from equipax.launch.experiments.registry import get_experiment

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "moe_dispatch.json"
MESHES = {1: (8, 1, 1, 1), 2: (4, 1, 2, 1), 4: (2, 1, 4, 1)}


def build_step(ep: int, capacity_factor: float | None, args: argparse.Namespace) -> Callable[[int], list[float]]:
    """The smoke's train step at this expert parallelism and dispatch: `run(n)` times n more steps."""
    d = args.model_dims
    cfg = set_knobs(
        get_experiment("mixtral_8x7b_smoke"),
        {
            "mesh.ici_mesh_shape": MESHES[ep],
            "model.transformer.capacity_factor": capacity_factor,
            "model.transformer.model_dims": d,
            "model.transformer.hidden_dims": 2 * d,
            "model.transformer.head_dim": d // 4,
            "model.max_seq_len": args.seq,
            "data.seq_len": args.seq,
            "data.per_device_batch": args.per_device_batch,
        },
    )
    run = step_timer(cfg)

    return run


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--ep", default="1,2,4", help="comma-separated expert-parallel sizes (1, 2, 4)")
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--model-dims", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--per-device-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over all configurations (interleaved)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after the compiling one")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    assert jax.device_count() == 8, "run in a fresh process: JAX must start with 8 CPU devices"

    configs = []
    for ep in (int(e) for e in args.ep.split(",")):
        for cf in (None, args.capacity_factor):
            start = time.perf_counter()
            run = build_step(ep, cf, args)
            run(1)
            first = time.perf_counter() - start
            run(args.warmup)
            dispatch = "dropless" if cf is None else f"capacity {cf:g}"
            configs.append({"ep": ep, "dispatch": dispatch, "first_step_s": first, "steps_s": [], "run": run})
    for _ in range(args.rounds):
        for c in configs:
            c["steps_s"] += c["run"](args.steps)
    for c in configs:
        del c["run"]
        c["step_q1_s"], c["step_s"], c["step_q3_s"] = quartiles(c["steps_s"])
    base = next(c for c in configs if c["ep"] == min(r["ep"] for r in configs) and c["dispatch"] == "dropless")
    for c in configs:
        c["vs_dropless_lowest_ep"] = c["step_s"] / base["step_s"]
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "jax_version": jax.__version__,
        "devices": f"{jax.device_count()} simulated {jax.devices()[0].platform} devices on {os.cpu_count()} cores",
        "load_average": os.getloadavg(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": configs,
    }
    print(f"{'EP':>3} {'dispatch':>13} {'step ms':>8} {'IQR ms':>11} {'relative':>8}  (to dropless at the lowest EP)")
    for r in configs:
        iqr = f"{1e3 * r['step_q1_s']:.0f}-{1e3 * r['step_q3_s']:.0f}"
        print(
            f"{r['ep']:>3} {r['dispatch']:>13} {1e3 * r['step_s']:>8.1f} {iqr:>11} {r['vs_dropless_lowest_ep']:>8.2f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
