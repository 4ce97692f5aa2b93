"""Pipeline bubble: step time of the pipelined smoke at 2/4/8 microbatches vs the analytic bubble.

Runs the real train step (`build_training` of `c4_gpt3_xl_pipeline_smoke`, widened by
`--model-dims`/`--seq`) on 8 simulated CPU devices, for 2 stages (mesh (2, 1, 2, 2)) and 4 stages
(mesh (4, 1, 1, 2)), one layer group per stage, at each microbatch count M. The pipelined stack
runs M x R + S - 1 iterations for M x R microbatch-stages of useful work, so its time goes as
(M + S - 1) / M (bubble = (S - 1) / (M + S - 1)). The table compares each step time, relative
to the one with the most microbatches, with that prediction.

What simulated devices can show: in equipax's SPMD pipeline every stage computes in every
iteration (a stage in the bubble computes on zeros and the result is dropped), so the total work
the host's cores do is proportional to (M + S - 1) / M, as the idle time on real chips is; and
the cost of smaller microbatches (per-iteration overhead, smaller matmuls) shows too. What they
cannot show: the 8 "devices" share the host's 2 cores, so there is no real concurrency between
stages, ppermute and all-gathers are memory copies rather than ICI/DCN transfers (no latency or
overlap of communication with compute), and the non-pipelined part (embedding, logits, optimizer)
is a larger share than on a big model. Read ratios, not absolute times.

    uv run python benchmarks/pipeline_bubble.py --steps 5 --warmup 2

Importable: `main(argv) -> dict` returns what it writes to `--out`.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from equipax.core.config import set_knobs  # noqa: E402
from equipax.core.mesh import build_mesh  # noqa: E402
from equipax.core.nn import bubble_fraction  # noqa: E402
from equipax.launch.experiments.registry import get_experiment  # noqa: E402
from equipax.launch.training.build import build_training  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "pipeline_bubble.json"
MESHES = {2: (2, 1, 2, 2), 4: (4, 1, 1, 2)}


def time_step(stages: int, microbatches: int, args: argparse.Namespace) -> dict[str, Any]:
    """Median step time of the smoke with `stages` stages and `microbatches` microbatches."""
    cfg = set_knobs(get_experiment("c4_gpt3_xl_pipeline_smoke"), {
        "mesh.ici_mesh_shape": MESHES[stages],
        "model.transformer.pipeline_stages": stages,
        "model.transformer.num_layers": stages * args.layers_per_stage,
        "model.transformer.pipeline_microbatches": microbatches,
        "model.transformer.pipeline_microbatch_size": None,
        "model.transformer.model_dims": args.model_dims,
        "model.transformer.hidden_dims": 4 * args.model_dims,
        "model.transformer.head_dim": args.model_dims // 4,
        "model.max_seq_len": args.seq,
        "data.seq_len": args.seq,
        "data.per_device_batch": args.per_device_batch,
    })
    training = build_training(cfg, build_mesh(cfg.mesh))
    state = training.init_state()
    rng = np.random.default_rng(0)
    batch = {}
    for name, spec in training.abstract_batch().items():
        host = (rng.integers(0, cfg.model.vocab_size, spec.shape).astype(spec.dtype)  # pyright: ignore
                if name in ("ids", "labels") else np.ones(spec.shape, spec.dtype))
        batch[name] = jax.device_put(host, training.batch_sharding)
    key = training.keys.step
    start = time.perf_counter()
    state, metrics = training.train_step(state, batch, key)
    jax.block_until_ready((state, metrics))
    first = time.perf_counter() - start
    for _ in range(args.warmup):
        state, metrics = training.train_step(state, batch, key)
        jax.block_until_ready((state, metrics))
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        state, metrics = training.train_step(state, batch, key)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
    return {"stages": stages, "microbatches": microbatches, "global_batch": cfg.global_batch_size,
            "first_step_s": first, "step_s": statistics.median(times), "steps_s": times,
            "bubble_fraction": bubble_fraction(stages, microbatches)}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--stages", default="2,4", help="comma-separated stage counts (2, 4)")
    parser.add_argument("--microbatches", default="2,4,8")
    parser.add_argument("--model-dims", type=int, default=128)
    parser.add_argument("--layers-per-stage", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--per-device-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    assert jax.device_count() == 8, "run in a fresh process: JAX must start with 8 CPU devices"

    rows = []
    for stages in (int(s) for s in args.stages.split(",")):
        runs = [time_step(stages, int(m), args) for m in args.microbatches.split(",")]
        base = max(runs, key=lambda r: r["microbatches"])
        for r in runs:
            m, s = r["microbatches"], stages
            r["measured_vs_most_microbatches"] = r["step_s"] / base["step_s"]
            mb, sb = base["microbatches"], stages
            r["predicted_vs_most_microbatches"] = ((m + s - 1) / m) / ((mb + sb - 1) / mb)
            rows.append(r)
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "jax_version": jax.__version__,
        "devices": f"{jax.device_count()} simulated {jax.devices()[0].platform} devices on {os.cpu_count()} cores",
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": rows,
    }
    print(f"{'stages':>6} {'micro':>5} {'bubble':>7} {'step ms':>9} {'measured':>9} {'predicted':>9}  (time / time at most microbatches)")
    for r in rows:
        print(f"{r['stages']:>6} {r['microbatches']:>5} {r['bubble_fraction']:>7.3f} {1e3 * r['step_s']:>9.1f} "
              f"{r['measured_vs_most_microbatches']:>9.2f} {r['predicted_vs_most_microbatches']:>9.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
