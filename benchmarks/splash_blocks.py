"""The splash attention kernel's block sizes, timed forward + backward at the attention shapes of
the experiments (benchmarks/README.md, "Splash block sizes"; what `equipax.core.nn.fused_attention.
splash_block_sizes` chooses comes from these figures).

Per shape (batch, sequence, query heads, key/value heads, head dim) and per block setting
(block_q, block_kv, block_kv_compute, the backward's blocks the same; fused or separate dq
kernel): the median of `--repeats` calls of a jitted value-and-grad of the causal kernel's output
sum, in milliseconds, and its attention TFLOP/s (causal: half the square).

    python benchmarks/splash_blocks.py --out runs/splash_blocks.json            # on a TPU
    python benchmarks/splash_blocks.py --out /tmp/s.json --toy --interpret      # any host, tiny
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

# The shapes the chip's `launch run` figures were taken at (benchmarks/tpu/user_runs.py):
# name: (batch, seq, heads, kv_heads, head_dim).
SHAPES: dict[str, tuple[int, int, int, int, int]] = {
    "c4_1b_6l": (8, 1024, 20, 20, 128),
    "qwen3_0_6b": (2, 4096, 16, 8, 128),
    "llama3_2_1b_6l": (1, 8192, 32, 8, 64),
}
TOY = {"toy": (1, 256, 2, 1, 128)}
# (block_q, block_kv, block_kv_compute, fused backward)
SETTINGS = (
    (512, 512, 512, True),
    (512, 512, 512, False),
    (1024, 512, 512, True),
    (512, 1024, 512, True),
    (1024, 1024, 512, True),
    (1024, 1024, 1024, True),
    (2048, 1024, 512, True),
    (1024, 2048, 512, True),
    (2048, 2048, 512, True),
    (2048, 2048, 1024, True),
    (1024, 1024, 512, False),
    (2048, 2048, 512, False),
)
TOY_SETTINGS = ((128, 128, 128, True), (256, 128, 128, False))


def kernel(seq: int, heads: int, setting: tuple[int, int, int, bool], interpret: bool) -> Any:
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    bq, bkv, bkc, fused = setting
    sizes = sa.BlockSizes(
        block_q=bq, block_kv=bkv, block_kv_compute=bkc,
        block_q_dkv=bq, block_kv_dkv=bkv, block_kv_dkv_compute=bkc,
        **({} if fused else {"block_q_dq": bq, "block_kv_dq": bkv}),
        use_fused_bwd_kernel=fused,
    )  # fmt: skip
    mask = sa.MultiHeadMask([sa.CausalMask((seq, seq))] * heads)
    return sa.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)


def time_setting(shape: tuple[int, int, int, int, int], setting: tuple[int, int, int, bool], *, repeats: int,
                 interpret: bool) -> dict[str, Any]:  # fmt: skip
    b, s, h, kvh, d = shape
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (b, h, s, d), jnp.bfloat16) / d**0.5
    k = jax.random.normal(keys[1], (b, kvh, s, d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, kvh, s, d), jnp.bfloat16)
    run = jax.vmap(kernel(s, h, setting, interpret))

    def loss(q: Any, k: Any, v: Any) -> Any:
        return jnp.sum(run(q, k, v).astype(jnp.float32))

    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    t0 = time.perf_counter()
    jax.block_until_ready(f(q, k, v))
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(q, k, v))
        times.append(time.perf_counter() - t0)
    ms = statistics.median(times) * 1e3
    # forward 2 matmuls, backward 5 (fused) of 2*s*s*d each per head, causal: half.
    flops = 7 * 2 * b * h * s * s * d / 2
    return {"ms": round(ms, 3), "tflops": round(flops / (ms / 1e3) / 1e12, 2), "compile_s": round(compile_s, 2)}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="the JSON file written")
    p.add_argument("--shapes", default=None, help=f"comma-separated, of: {', '.join(SHAPES)} (default: all)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--toy", action="store_true", help="a tiny shape and two settings (a dry run)")
    p.add_argument("--interpret", action="store_true", help="Pallas interpret mode (a host without a TPU)")
    args = p.parse_args(argv)
    shapes = TOY if args.toy else {n: SHAPES[n] for n in (args.shapes.split(",") if args.shapes else SHAPES)}
    settings = TOY_SETTINGS if args.toy else SETTINGS
    rows: list[dict[str, Any]] = []
    print(f"{'shape':<16} {'bq':>5} {'bkv':>5} {'bkvc':>5} {'fused':>5} {'ms':>9} {'TFLOP/s':>8}", flush=True)
    for name, shape in shapes.items():
        for setting in settings:
            if max(setting[:3]) > shape[1]:
                continue
            row: dict[str, Any] = {"shape": name, "dims": shape, "block_q": setting[0], "block_kv": setting[1],
                                   "block_kv_compute": setting[2], "fused_bwd": setting[3]}  # fmt: skip
            try:
                row |= time_setting(shape, setting, repeats=args.repeats, interpret=args.interpret)
                shown = f"{row['ms']:>9.2f} {row['tflops']:>8.1f}"
            except Exception as e:  # a setting the kernel refuses (VMEM): recorded, the rest run
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                shown = "  refused: " + row["error"][:60]
            print(f"{name:<16} {setting[0]:>5} {setting[1]:>5} {setting[2]:>5} {setting[3]!s:>5} {shown}", flush=True)
            rows.append(row)
            args.out.write_text(json.dumps(rows, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
