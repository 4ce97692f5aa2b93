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

    uv run python benchmarks/context_memory.py                      # ~2 minutes on 2 cores

Importable: `main(argv) -> dict` returns what it writes to `--out`.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import argparse
import datetime
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    rows = []
    for seq in (int(s) for s in args.seqs.split(",")):
        for cp in (int(c) for c in args.cps.split(",")):
            for strategy in args.strategies.split(","):
                if cp == 1 and strategy != args.strategies.split(",")[0]:
                    continue  # one device: both strategies are local attention
                row = measure(args, seq, cp, strategy)
                rows.append(row)
                print(json.dumps(row), flush=True)
    results = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax_version": jax.__version__,
        "device_kind": jax.devices()[0].device_kind,
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(table(rows))
    return results


if __name__ == "__main__":
    main()
