"""Context parallelism: per-device memory of an LM's gradient step vs sequence length at a `context`
axis of 1/2/4/8, for the all-gather and ring strategies (XLA's memory analysis; nothing is run).

Each configuration compiles `value_and_grad(lm_loss)` of a Llama-style LM (rotary positions,
grouped-query heads, SwiGLU) for one sequence of `--seqs` tokens on a mesh `(1, 1, cp, 1)` of
simulated CPU devices (`CONTEXT_AXES`), the parameters replicated so that what changes is the
activations. `memory_analysis()` gives each device's temporaries (activations, logits, gathered
keys and values, the backward's buffers) and arguments. What this shows: how the per-device
working set scales with S and N on XLA's buffer assignment (the all-gather kernel holds every
device's keys and values and its queries' `[S/N, S]` logits; the ring two blocks and
`[S/2N, S/2N]` half-block logits). What it cannot show: XLA:TPU's or XLA:GPU's own buffer
assignment and fusion (different absolute numbers), or time. Figures: benchmarks/README.md.

    uv run python benchmarks/context_memory.py                      # ~11 minutes on 2 shared cores

`--time-steps K` times instead: the real train step (`build_training`: loss, zigzag reorder,
gradients, AdamW update) of `shakespeare_llama_tiny` widened to the model above, one sequence of
each `--seqs` length on the `(1, 1, N, 1)` mesh for each N of `--cps` and each strategy, on random
tokens. Every configuration is compiled and warmed up first, then `--rounds` rounds time K steps
of each in turn (interleaved, so a change in the machine's load hits them all); the table gives the
median step and its interquartile range. What simulated devices can show: the arithmetic each
strategy does on this host (the ring's N small block products, its skipped half-blocks and its
online-softmax merge against all-gather's one `[S/N, S]` product per device) and the host cost of
its collectives (N `ppermute`s per layer and direction vs one all-gather). What they cannot show:
the N devices share the host's cores (no concurrency between devices, nothing for a transfer to
overlap), and a `ppermute` or all-gather is a memory copy and a thread rendezvous, not an
ICI transfer; read the ratio, not the times, and not as a TPU prediction.

    uv run python benchmarks/context_memory.py --time-steps 4 --seqs 2048,4096 --cps 8   # minutes

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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file, `python benchmarks/context_memory.py`: the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from equipax.core.mesh import CONTEXT_AXES
from equipax.core.nn import TransformerConfig
from equipax.core.partition import batch_sharding
from equipax.models import LMConfig, TransformerLM, lm_loss

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "context_memory.json"
TIME_OUT = Path(__file__).resolve().parent / "results" / "context_step_time.json"


def model_config(args: argparse.Namespace, seq: int, strategy: str) -> LMConfig:
    """A Llama-style LM of `--layers` x `--model-dims` that takes `seq` tokens."""
    block = TransformerConfig(
        num_layers=args.layers,
        model_dims=args.model_dims,
        num_heads=args.heads,
        num_kv_heads=max(args.heads // 2, 1),
        head_dim=args.model_dims // args.heads,
        hidden_dims=4 * args.model_dims,
        activation="silu",
        gated=True,
        norm="rmsnorm",
        fused_qkv=False,
        atten_logit_cap=None,
        remat=args.remat,
        context_parallel_strategy=strategy,
    )
    return LMConfig(vocab_size=args.vocab, max_seq_len=seq, position="rope", tie_embeddings=False, transformer=block)


def measure(args: argparse.Namespace, seq: int, cp: int, strategy: str) -> dict[str, Any]:
    """Per-device bytes of the compiled gradient step at this sequence length and context axis."""
    devices = np.array(jax.devices()[:cp]).reshape(1, 1, cp, 1)
    mesh = Mesh(devices, CONTEXT_AXES, axis_types=(AxisType.Auto,) * 4)
    cfg = model_config(args, seq, strategy)
    model = eqx.filter_eval_shape(lambda: TransformerLM(cfg, key=jax.random.key(0)))
    replicated = NamedSharding(mesh, P())
    params, static = eqx.partition(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), params)
    tokens = jax.ShapeDtypeStruct((1, seq), jnp.int32, sharding=batch_sharding(mesh))
    batch = {
        "ids": tokens,
        "labels": tokens,
        "weights": jax.ShapeDtypeStruct((1, seq), jnp.float32, sharding=tokens.sharding),
    }

    def step(params: Any, batch: dict[str, Any]) -> Any:
        return jax.value_and_grad(lambda p: lm_loss(eqx.combine(p, static), batch, mesh=mesh)[0])(params)

    mem = jax.jit(step).lower(params, batch).compile().memory_analysis()
    if mem is None:
        raise RuntimeError("this backend gives no memory analysis")
    return {
        "seq": seq,
        "context": cp,
        "strategy": strategy,
        "temp_bytes": int(mem.temp_size_in_bytes),
        "argument_bytes": int(mem.argument_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes),
    }


def step_timer_for(args: argparse.Namespace, seq: int, cp: int, strategy: str) -> Any:
    """`run(n)` timing n train steps of `shakespeare_llama_tiny` at `model_config`'s size (one
    sequence of `seq` tokens on the mesh (1, 1, cp, 1))."""
    from benchmarks.step_timing import step_timer
    from equipax.core.knobs import set_knobs
    from equipax.launch.experiments.registry import get_experiment

    block = model_config(args, seq, strategy).transformer
    knobs = {
        f"model.transformer.{k}": getattr(block, k)
        for k in ("num_layers", "model_dims", "num_heads", "num_kv_heads", "head_dim", "hidden_dims", "remat")
    }
    cfg = set_knobs(
        get_experiment("shakespeare_llama_tiny"),
        knobs
        | {
            "model.transformer.context_parallel_strategy": strategy,
            "model.vocab_size": args.vocab,
            "model.max_seq_len": seq,
            "data.seq_len": seq,
            "data.batch_size": 1,
            "mesh.axis_names": CONTEXT_AXES,
            "mesh.ici_mesh_shape": (1, 1, cp, 1),
            "mesh.dcn_mesh_shape": (1, 1, 1, 1),
        },
    )
    return step_timer(cfg)


def time_steps(args: argparse.Namespace, configs: list[tuple[int, int, str]]) -> list[dict[str, Any]]:
    """Median (and quartiles) of `--time-steps` x `--rounds` train steps per configuration, all
    compiled and warmed up first, then timed in interleaved rounds."""
    from benchmarks.step_timing import quartiles

    runs = []
    for seq, cp, strategy in configs:
        start = time.perf_counter()
        run = step_timer_for(args, seq, cp, strategy)
        run(1)
        first = time.perf_counter() - start
        run(args.warmup)
        runs.append(({"seq": seq, "context": cp, "strategy": strategy, "first_step_s": first, "steps_s": []}, run))
    for _ in range(args.rounds):
        for row, run in runs:
            row["steps_s"] += run(args.time_steps)
    rows = []
    for row, _ in runs:
        row["step_q1_s"], row["step_s"], row["step_q3_s"] = quartiles(row["steps_s"])
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def time_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: median step ms (IQR) per configuration, and ring / all-gather at each (seq, N)."""
    lines = ["| seq | N | strategy | step ms, median (IQR) | ring / all-gather |", "|---|---|---|---|---|"]
    by = {(r["seq"], r["context"], r["strategy"]): r["step_s"] for r in rows}
    for r in rows:
        ag = by.get((r["seq"], r["context"], "all_gather"))
        ratio = f"{r['step_s'] / ag:.2f}" if r["strategy"] == "ring" and ag else "-"
        lines.append(
            f"| {r['seq']} | {r['context']} | {r['strategy']} | {1e3 * r['step_s']:.0f} "
            f"({1e3 * r['step_q1_s']:.0f}-{1e3 * r['step_q3_s']:.0f}) | {ratio} |"
        )
    return "\n".join(lines)


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: temporaries per device (MiB) by sequence length, one column per (strategy, cp)."""
    cols = sorted({(r["strategy"], r["context"]) for r in rows})
    seqs = sorted({r["seq"] for r in rows})
    by = {(r["seq"], r["strategy"], r["context"]): r["temp_bytes"] / 2**20 for r in rows}
    head = "| seq | " + " | ".join(f"{s} cp={c}" for s, c in cols) + " |"
    lines = [head, "|" + "---|" * (len(cols) + 1)]
    for seq in seqs:
        cells = [f"{by[(seq, s, c)]:.1f}" if (seq, s, c) in by else "-" for s, c in cols]
        lines.append(f"| {seq} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", default="1024,2048,4096,8192", help="sequence lengths (comma-separated)")
    parser.add_argument("--cps", default="1,2,4,8", help="context axis sizes (comma-separated)")
    parser.add_argument("--strategies", default="all_gather,ring")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--model-dims", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--remat", default="full", help="model.transformer.remat (full: only layer inputs saved)")
    parser.add_argument(
        "--time-steps", type=int, default=0, help="time K train steps per round instead (0: memory only)"
    )
    parser.add_argument("--rounds", type=int, default=4, help="with --time-steps: interleaved rounds")
    parser.add_argument("--warmup", type=int, default=2, help="with --time-steps: untimed steps after the first")
    parser.add_argument("--out", type=Path, default=None, help=f"default {DEFAULT_OUT} ({TIME_OUT} with --time-steps)")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = TIME_OUT if args.time_steps else DEFAULT_OUT
    configs = []
    for seq in (int(s) for s in args.seqs.split(",")):
        for cp in (int(c) for c in args.cps.split(",")):
            for strategy in args.strategies.split(","):
                if cp == 1 and strategy != args.strategies.split(",")[0]:
                    continue  # one device: both strategies are local attention
                configs.append((seq, cp, strategy))
    if args.time_steps:
        if any(cp != jax.device_count() for _, cp, _ in configs):
            parser.error(
                f"--time-steps runs the train step on all {jax.device_count()} devices: give --cps "
                f"{jax.device_count()} (or JAX_NUM_CPU_DEVICES=N with --cps N)"
            )
        rows = time_steps(args, configs)
    else:
        rows = []
        for seq, cp, strategy in configs:
            rows.append(measure(args, seq, cp, strategy))
            print(json.dumps(rows[-1]), flush=True)
    results = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax_version": jax.__version__,
        "device_kind": jax.devices()[0].device_kind,
        "devices": f"{jax.device_count()} simulated {jax.devices()[0].platform} devices on {os.cpu_count()} cores",
        "load_average_at_end": os.getloadavg(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(time_table(rows) if args.time_steps else table(rows))
    return results


if __name__ == "__main__":
    main()
