"""Chat SFT benchmark: packing vs one conversation per row, and LoRA vs full fine-tuning.

The model is `llama3_2_chat_cpu`'s (the tiny Llama 3.2 fixture's shape, random init here: the
timings do not depend on the weights), its data the plays' dialogue rendered with the Llama 3
template (`data.source=play_chat`), built as `launch run` builds them. For each case the real train
step (`build_training`) runs on batches taken from the input beforehand, so the figures are the
step's alone:

- `packed` / `unpacked` (full fine-tuning): step time, conversation tokens per second (positions
  holding a conversation's tokens, not padding) and the packing efficiency (their share of the
  rows' positions);
- `lora_packed` (rank 8 on q/k/v/o/gate/up/down): the same, with the optimizer state's bytes and
  the trained parameters next to full fine-tuning's.

    uv run python benchmarks/chat_sft.py --steps 20

Importable: `main(argv) -> dict` returns what it writes to `--out`.
"""

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np

from equipax.core.knobs import apply_overrides
from equipax.core.mesh import build_mesh
from equipax.core.task import trainable
from equipax.launch.experiments.registry import get_experiment
from equipax.launch.program.training import build_training
from equipax.launch.tasks.lm_data import build_lm_inputs, build_tokenizer

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "chat_sft.json"
CASES = {
    "unpacked": ["data.packing=false"],
    "packed": ["data.packing=true"],
    "lora_packed": [
        "data.packing=true",
        "model.lora.enabled=true",
        "model.lora.rank=8",
        "model.lora.targets=('q', 'k', 'v', 'o', 'gate', 'up', 'down')",
    ],
}


def _bytes(tree: Any) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype")))


def run_case(name: str, overrides: Sequence[str], *, steps: int, warmup: int, batch_size: int) -> dict[str, Any]:
    """Time `steps` train steps of one case (after `warmup` untimed ones)."""
    cfg, _ = apply_overrides(
        get_experiment("llama3_2_chat_cpu"), ["model.init_from=None", f"data.batch_size={batch_size}", *overrides]
    )
    cfg = cfg.for_devices(1)
    training = build_training(cfg, build_mesh(cfg.mesh, jax.devices()[:1]))
    inputs = build_lm_inputs(cfg, build_tokenizer(cfg, HERE))
    batches = [inputs.train.get_next() for _ in range(steps + warmup)]
    placed = [training.place(b) for b in batches]
    state = training.init_state()
    key = training.keys.step
    times = []
    for i, batch in enumerate(placed):
        start = time.perf_counter()
        state, metrics = training.train_step(state, batch, key)
        jax.block_until_ready(metrics["loss"])
        if i >= warmup:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    conv_tokens = statistics.mean(_conversation_tokens(b) for b in batches[warmup:])
    trained = eqx.filter(state.model, trainable(state.model))
    return {
        "case": name,
        "step_s_median": step_s,
        "conversation_tokens_per_step": conv_tokens,
        "conversation_tokens_per_s": conv_tokens / step_s,
        "packing_efficiency": conv_tokens / batches[0]["ids"].size,
        "trained_params": int(sum(x.size for x in jax.tree.leaves(trained))),
        "optimizer_state_bytes": _bytes(state.opt_state),
        "final_loss": float(metrics["loss"]),
    }


def _conversation_tokens(batch: dict[str, np.ndarray]) -> int:
    """Positions holding a conversation's tokens: segment ids > 0 in packed rows; in unpacked rows,
    those up to each row's last weighted position (a conversation ends with its last reply)."""
    if "segment_ids" in batch:
        return int((np.asarray(batch["segment_ids"]) > 0).sum())
    total = 0
    for row in np.asarray(batch["weights"]):
        nonzero = np.nonzero(row)[0]
        total += int(nonzero[-1]) + 1 if len(nonzero) else 0
    return total


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    results = [
        run_case(c, CASES[c], steps=args.steps, warmup=args.warmup, batch_size=args.batch_size)
        for c in args.cases.split(",")
    ]
    out = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": {"machine": platform.machine(), "python": sys.version.split()[0], "jax": jax.__version__},
        "steps": args.steps,
        "batch_size": args.batch_size,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"{'case':<12} {'step ms':>8} {'conv tok/s':>11} {'packing':>8} {'trained':>9} {'opt state':>10}")
    for r in results:
        print(
            f"{r['case']:<12} {1e3 * r['step_s_median']:>8.1f} {r['conversation_tokens_per_s']:>11.0f} "
            f"{r['packing_efficiency']:>8.3f} {r['trained_params']:>9,} {r['optimizer_state_bytes']:>10,}"
        )
    return out


if __name__ == "__main__":
    main()
