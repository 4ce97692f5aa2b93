"""Ring attention on one accelerator chip (benchmarks/tpu/run.sh's `ring` part): what a `context`
axis of 1 runs, and what the ring kernels cost on one device.

One chip gives a `context` mesh axis of 1 only, where ring attention has nothing to rotate. What
N > 1 adds, the N - 1 rotations of the keys and values (and of their gradients) over the chips'
interconnect, their overlap with each block's compute and the zigzag layout's balance, needs N
chips and is not measured here. What is:

1. The train step (`build_training` of `--exp`, llama3_2_1b at `--layers` layers with a
   `--vocab` vocabulary, `--batch` sequences of `--seq` tokens, synthetic tokens) lowered three
   ways: on a mesh without a `context` axis, and on a (data, fsdp, context, tensor) = (1, 1, 1, 1)
   mesh with `context_parallel_strategy` all_gather and ring. At a context axis of 1 equipax calls
   no context-parallel kernel (`SelfAttention` does only on an axis > 1, and the loss reorders no
   batch), so the strategy changes nothing: the JSON holds each program's sha256 and the lines in
   which they differ. The ring configuration's step is compiled and timed (`--steps`; the others
   too with `--time-layouts`, each a compile of its own): tokens/s and MFU of the step a ring
   run is at N = 1.
2. The attention kernels on one device, forward and backward of one call at the model's heads
   and each of `--kernel-seqs` (`--kernels`): `xla` (equipax's XLA softmax attention), `splash`
   (the Pallas TPU kernel), `ring` (`ring_attention` at N = 1: its half blocks, the one above the
   diagonal skipped, the float32 online softmax, its custom backward; no rotation) and
   `splash_ring` (`splash_ring_attention` at N = 1: the splash kernel on the chunk pair, merged by
   its log-sum-exp, the backward through splash's own backward kernels). A kernel XLA refuses
   (more memory than the chip has) is reported as such. TFLOP/s count causal attention's model
   FLOPs (forward 2 B S^2 H D, backward twice that).

Every program (the train step and the kernels) is lowered first, then all are compiled at once in
threads (XLA:TPU takes about a minute of one core for the step), then each runs in turn.

    python benchmarks/ring_one_chip.py --out runs/tpu/ring.json              # one TPU chip
    uv run python benchmarks/ring_one_chip.py --layers 1 --model-dims 64 --heads 4 --kv-heads 2 \\
        --vocab 256 --seq 256 --kernel-seqs 256 --interpret --steps 2      # a CPU dry run

Importable: `main(argv) -> dict` returns what it writes to `--out`.
"""

import argparse
import datetime
import difflib
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file, `python benchmarks/ring_one_chip.py`: the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp

from benchmarks.step_timing import PreparedStep, compile_all, quartiles
from equipax.core.flops import transformer_lm_flops_per_token
from equipax.core.knobs import set_knobs
from equipax.core.mesh import CONTEXT_AXES
from equipax.launch.experiments.registry import get_experiment

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "ring_one_chip.json"
KERNELS = ("xla", "splash", "ring", "splash_ring")


def experiment(args: argparse.Namespace, layout: str) -> Any:
    """`--exp` on one device: `layout` "none" (no `context` axis), or "all_gather" / "ring" (a
    `context` axis of 1 with that strategy)."""
    knobs: dict[str, Any] = {
        "model.transformer.num_layers": args.layers,
        "model.transformer.remat": args.remat,
        "model.transformer.attention_impl": args.attention,
        "model.vocab_size": args.vocab,
        "model.max_seq_len": args.seq,
        "data.seq_len": args.seq,
        "data.per_device_batch": args.batch,
        "data.source": "synthetic",
        "data.packing": False,
        "data.tokenizer": "byte",
    }
    optional = {
        "model.transformer.model_dims": args.model_dims,
        "model.transformer.num_heads": args.heads,
        "model.transformer.num_kv_heads": args.kv_heads,
        "model.transformer.head_dim": args.head_dim,
        "model.transformer.hidden_dims": args.hidden_dims,
        "model.dtype": args.dtype,
    }
    knobs |= {k: v for k, v in optional.items() if v is not None}
    if layout == "none":
        knobs |= {"mesh.ici_mesh_shape": (1, 1, 1), "mesh.dcn_mesh_shape": (1, 1, 1)}
    else:
        knobs |= {
            "mesh.axis_names": CONTEXT_AXES,
            "mesh.ici_mesh_shape": (1, 1, 1, 1),
            "mesh.dcn_mesh_shape": (1, 1, 1, 1),
            "model.transformer.context_parallel_strategy": layout,
        }
    return set_knobs(get_experiment(args.exp), knobs)


def program_identity(steps: dict[str, PreparedStep]) -> dict[str, Any]:
    """Each lowered step's sha256, and the lines in which the ring program differs from the others."""
    texts = {name: s.lowered.as_text() for name, s in steps.items()}
    out: dict[str, Any] = {"sha256": {n: hashlib.sha256(t.encode()).hexdigest() for n, t in texts.items()}}
    for other in ("all_gather", "none"):
        diff = [
            line[:300]
            for line in difflib.unified_diff(texts[other].splitlines(), texts["ring"].splitlines(), lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))
        ]
        out[f"ring_vs_{other}_differing_lines"] = diff[:8]
        out[f"ring_vs_{other}_differing_line_count"] = len(diff)
    return out


def _kernel(name: str, seq: int, interpret: bool) -> Callable[..., Any]:
    from equipax.core.nn.attention import dot_product_attention
    from equipax.core.nn.context_parallel import ring_attention, splash_ring_attention
    from equipax.core.nn.fused_attention import splash_attention

    if name == "xla":
        return lambda q, k, v: dot_product_attention(q, k, v, causal=True)
    if name == "splash":
        return lambda q, k, v: splash_attention(q, k, v, causal=True, interpret=interpret)
    if name == "ring":
        at = lambda q: jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), q.shape[:2])  # noqa: E731
        return lambda q, k, v: ring_attention(q, k, v, positions=at(q), causal=True)
    if name == "splash_ring":
        return lambda q, k, v: splash_ring_attention(q, k, v, zigzag=False, causal=True, interpret=interpret)
    raise SystemExit(f"--kernels: {name!r} is not one of {KERNELS}")


class KernelProgram:
    """Forward + backward of one attention kernel at one sequence length, lowered on abstract
    inputs `[batch seq heads head_dim]` (keys and values `kv_heads`)."""

    def __init__(self, name: str, seq: int, shape: tuple[int, int, int, int], dtype: Any, interpret: bool) -> None:
        self.name, self.seq, self.shape, self.dtype = name, seq, shape, dtype
        batch, heads, kv_heads, head_dim = shape
        attention = _kernel(name, seq, interpret)

        def fwd_bwd(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array) -> Any:
            out, vjp = jax.vjp(attention, q, k, v)
            return out, vjp(g)

        spec = lambda h: jax.ShapeDtypeStruct((batch, seq, h, head_dim), dtype)  # noqa: E731
        self.error: str | None = None
        self.compiled: Any = None
        self.compile_s: float | None = None
        try:
            self.lowered: Any = jax.jit(fwd_bwd).lower(spec(heads), spec(kv_heads), spec(kv_heads), spec(heads))
        except Exception as e:  # a kernel this platform cannot lower (splash off a TPU without --interpret)
            self.lowered, self.error = None, f"lowering: {type(e).__name__}: {str(e).splitlines()[0][:300]}"

    def compile(self) -> "KernelProgram":
        if self.lowered is None:
            return self
        t0 = time.perf_counter()
        try:
            self.compiled = self.lowered.compile()
        except Exception as e:  # XLA refuses a program larger than the device's memory
            self.error = f"compile: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
        self.compile_s = time.perf_counter() - t0
        return self

    def run(self, reps: int, peak: float | None) -> dict[str, Any]:
        batch, heads, _, head_dim = self.shape
        row: dict[str, Any] = {"kernel": self.name, "seq": self.seq, "compile_s": self.compile_s}
        if self.compiled is None:
            return row | {"error": self.error}
        mem = self.compiled.memory_analysis()
        row["temp_bytes"] = None if mem is None else int(mem.temp_size_in_bytes)
        keys = jax.random.split(jax.random.key(0), 4)
        shapes = [heads, self.shape[2], self.shape[2], heads]
        args = [
            jax.random.normal(k, (batch, self.seq, h, head_dim), jnp.float32).astype(self.dtype)
            for k, h in zip(keys, shapes)
        ]
        try:
            jax.block_until_ready(self.compiled(*args))
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                jax.block_until_ready(self.compiled(*args))
                times.append(time.perf_counter() - t0)
        except Exception as e:  # out of memory at run time
            return row | {"error": f"run: {type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        finally:
            for a in args:
                a.delete()
        q1, med, q3 = quartiles(times)
        # Causal attention's model FLOPs: two [S S] products of 2 B S^2 H D halved, x3 with the backward.
        flops = 3 * 2 * batch * self.seq**2 * heads * head_dim
        row |= {"ms": 1e3 * med, "ms_q1": 1e3 * q1, "ms_q3": 1e3 * q3, "tflops_per_s": flops / med / 1e12}
        row["fraction_of_peak"] = None if peak is None else row["tflops_per_s"] / peak
        return row


def _peak_tflops() -> float | None:
    from equipax.launch.hardware.accelerators import peak_tflops_of

    return peak_tflops_of(jax.devices()[0].device_kind)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--exp", default="llama3_2_1b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=8192, help="tokens per sequence of the train step")
    p.add_argument("--batch", type=int, default=1, help="sequences per step")
    p.add_argument("--remat", default="full", help="model.transformer.remat")
    p.add_argument("--attention", default="auto", help="model.transformer.attention_impl (auto: splash on a TPU)")
    p.add_argument("--model-dims", type=int, default=None, help="default: the experiment's")
    p.add_argument("--heads", type=int, default=None, help="default: the experiment's")
    p.add_argument("--kv-heads", type=int, default=None, help="default: the experiment's")
    p.add_argument("--head-dim", type=int, default=None, help="default: the experiment's")
    p.add_argument("--hidden-dims", type=int, default=None, help="default: the experiment's")
    p.add_argument("--dtype", default=None, help="model.dtype (default: the experiment's)")
    p.add_argument("--steps", type=int, default=10, help="timed train steps (0: lower only, time no step)")
    p.add_argument(
        "--time-layouts",
        default="ring",
        help="the steps timed, of none, all_gather, ring (the ring's is all_gather's program: see `programs`)",
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after the first")
    p.add_argument("--kernel-seqs", default="4096,8192", help="sequence lengths of the kernel runs ('' = none)")
    p.add_argument("--kernels", default=",".join(KERNELS))
    p.add_argument("--reps", type=int, default=10, help="timed calls per kernel")
    p.add_argument("--interpret", action="store_true", help="the splash kernels in the Pallas interpreter (CPU)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the measurements, print a summary, write the JSON results.

    Arguments:
        argv: command-line arguments (without the program name); None reads `sys.argv`.

    Returns:
        What is written to `--out`: `programs` (hashes and differing lines), `train_steps`
        (per timed layout: step time, tokens/s, MFU) and `kernels` (one row per kernel and
        sequence length).
    """
    args = _parser().parse_args(argv)
    device = jax.devices()[0]
    steps = {layout: PreparedStep(experiment(args, layout), [device]) for layout in ("none", "all_gather", "ring")}
    identity = program_identity(steps)
    cfg = steps["ring"].cfg
    t = cfg.model.transformer
    dtype = jnp.dtype({"bfloat16": jnp.bfloat16, "float32": jnp.float32}[cfg.model.dtype])
    shape = (1, t.num_heads, t.num_kv_heads or t.num_heads, t.head_dim)
    seqs = [int(s) for s in args.kernel_seqs.split(",") if s.strip()]
    kernels = [KernelProgram(k, s, shape, dtype, args.interpret) for s in seqs for k in args.kernels.split(",")]
    layouts = [x for x in args.time_layouts.split(",") if x.strip()] if args.steps else []
    if set(layouts) - set(steps):
        raise SystemExit(f"--time-layouts: expected names from {sorted(steps)}, got {layouts}")
    same = identity["sha256"]["ring"] == identity["sha256"]["all_gather"]
    print(f"one {device.device_kind}: context axis 1 (nothing rotates; N > 1 needs N chips)", flush=True)
    print(
        f"  programs: ring {'==' if same else '!='} all_gather; ring vs no context axis: "
        f"{identity['ring_vs_none_differing_line_count']} differing lines",
        flush=True,
    )
    t0 = time.perf_counter()
    compile_all([*(steps[x] for x in layouts), *kernels])
    compile_wall = time.perf_counter() - t0
    print(f"  compiled {len(layouts) + len(kernels)} programs at once in {compile_wall:.0f} s", flush=True)
    peak = _peak_tflops()

    train: dict[str, Any] = {}
    for layout in layouts:  # each in turn, its state freed before the next
        step = steps[layout]
        run = step.start()
        start = time.perf_counter()
        run(1)
        first = time.perf_counter() - start
        run(args.warmup)
        times = run(args.steps)
        loss = run.metrics.get("loss")
        run.close()
        q1, med, q3 = quartiles(times)
        tokens = cfg.global_batch_size * cfg.data.seq_len
        flops = transformer_lm_flops_per_token(t, vocab_size=cfg.model.vocab_size, seq_len=cfg.data.seq_len)
        row = {
            "lower_s": step.lower_s,
            "compile_s": step.compile_s,
            "first_step_s": first,
            "last_loss": loss,
            "xla_memory_bytes": step.memory(),
            "step_s": med,
            "step_q1_s": q1,
            "step_q3_s": q3,
            "steps_s": times,
            "tokens_per_step": tokens,
            "tokens_per_s": tokens / med,
            "model_tflops_per_s": flops["training"] * tokens / med / 1e12,
        }
        row["mfu"] = None if peak is None else row["model_tflops_per_s"] / peak
        train[layout] = row
        mfu = "-" if row["mfu"] is None else f"{row['mfu']:.1%}"
        print(
            f"  train step, {layout} (seq {args.seq}): {1e3 * med:.1f} ms, {row['tokens_per_s']:,.0f} tokens/s, "
            f"MFU {mfu}",
            flush=True,
        )
    print(f"  {'kernel':<12} {'seq':>6} {'fwd+bwd ms':>11} {'TFLOP/s':>8}", flush=True)
    rows = []
    for k in kernels:
        r = k.run(args.reps, peak)
        rows.append(r)
        cell = f"{r['ms']:>11.2f} {r['tflops_per_s']:>8.1f}" if "ms" in r else f"  {r.get('error', '')[:90]}"
        print(f"  {r['kernel']:<12} {r['seq']:>6} {cell}", flush=True)
    print(f"  (median of {args.reps})")
    from equipax.core.nn.fused_attention import attention_kernel

    results = {
        "benchmark": "ring_one_chip",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax_version": jax.__version__,
        "device_kind": device.device_kind,
        "platform": device.platform,
        "cpu_count": os.cpu_count(),
        "peak_tflops": peak,
        "limitation": "one device: the context axis is 1, so no key/value block is rotated; the ring's "
        "collectives, their overlap with compute and the zigzag balance need N > 1 chips",
        "model": {
            "exp": args.exp,
            "layers": t.num_layers,
            "model_dims": t.model_dims,
            "heads": t.num_heads,
            "kv_heads": t.num_kv_heads,
            "head_dim": t.head_dim,
            "vocab": cfg.model.vocab_size,
            "dtype": cfg.model.dtype,
            "remat": t.remat,
            "attention_impl": attention_kernel(t, device.platform, seq_len=args.seq, dtype=dtype),
            "seq": args.seq,
            "batch": args.batch,
        },
        "programs": identity,
        "compile_wall_s": compile_wall,
        "train_steps": train,
        "kernels": rows,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
