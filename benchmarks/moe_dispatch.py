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

On the host's own devices (`--real-devices`, e.g. one TPU chip: benchmarks/tpu/run.sh's `moe`
part): the meshes span the first `--devices` of them (one chip: EP 1 only), the model is sized by
`--layers`, `--hidden-dims`, `--heads`, `--kv-heads`, `--vocab`, `--dtype` and `--remat`, and with
`--parallel-compile` every configuration is lowered, then all compiled at once in threads
(XLA:TPU takes about a minute of one core for such a step), before any runs. With `--rounds 1`
each configuration then runs in turn and frees its state before the next (one chip's memory holds
one train state at a time). The table adds tokens/s and MFU (model FLOPs of the active experts,
`equipax.core.flops`, over the chip's datasheet bf16 peak), and the JSON XLA's memory figures,
the capacity dispatch's dropped fraction and how many of the step's `jax.lax.ragged_dot`s XLA
compiled to grouped-matmul kernels (`ragged_dot_kernels`).

    python benchmarks/moe_dispatch.py --real-devices --devices 1 --ep 1 --dtype bfloat16 \\
        --model-dims 1024 --hidden-dims 3584 --layers 4 --heads 8 --kv-heads 2 --head-dim 128 \\
        --vocab 32000 --remat none --seq 1024 --per-device-batch 4 --parallel-compile --rounds 1 --steps 10

Importable: `main(argv) -> dict` returns what it writes to `--out`.
"""

import os
import sys

if "--real-devices" not in sys.argv[1:]:  # a script's own: 8 simulated CPU devices (set before JAX starts)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import argparse
import datetime
import json
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file, `python benchmarks/moe_dispatch.py`: the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax

from benchmarks.step_timing import PreparedStep, compile_all, quartiles
from equipax.core.flops import transformer_lm_flops_per_token
from equipax.core.knobs import set_knobs
from equipax.launch.experiments.registry import get_experiment

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "moe_dispatch.json"


def mesh_shape(ep: int, devices: int) -> tuple[int, int, int, int]:
    """(data, fsdp, expert, tensor) over `devices`: the experts split `ep` ways, the rest data."""
    if ep < 1 or devices % ep:
        raise SystemExit(f"--ep {ep} does not divide the {devices} devices (--devices)")
    return (devices // ep, 1, ep, 1)


def experiment(ep: int, capacity_factor: float | None, args: argparse.Namespace) -> Any:
    """The smoke experiment at this expert parallelism, dispatch and size."""
    d = args.model_dims
    knobs: dict[str, Any] = {
        "mesh.ici_mesh_shape": mesh_shape(ep, args.devices),
        "model.transformer.capacity_factor": capacity_factor,
        "model.transformer.model_dims": d,
        "model.transformer.hidden_dims": args.hidden_dims or 2 * d,
        "model.transformer.head_dim": args.head_dim or d // 4,
        "model.max_seq_len": args.seq,
        "data.seq_len": args.seq,
        "data.per_device_batch": args.per_device_batch,
    }
    optional = {
        "model.transformer.num_layers": args.layers,
        "model.transformer.num_heads": args.heads,
        "model.transformer.num_kv_heads": args.kv_heads,
        "model.vocab_size": args.vocab,
        "model.dtype": args.dtype,
        "model.transformer.attention_impl": args.attention,
        "model.transformer.remat": args.remat,
    }
    return set_knobs(get_experiment("mixtral_8x7b_smoke"), knobs | {k: v for k, v in optional.items() if v is not None})


def _ragged_dot_kernels(step: PreparedStep) -> int | None:
    """How many of the compiled step's `ragged_dot`s are grouped-matmul kernels (XLA:TPU's
    `ragged-dot` custom calls); None before a compile."""
    if step.compiled is None:
        return None
    return len(re.findall(r"%ragged-dot-(?!metadata)[\w.-]* = \S+ custom-call\(", step.compiled.as_text()))


def _peak_tflops() -> float | None:
    from equipax.launch.hardware.accelerators import peak_tflops_of

    return peak_tflops_of(jax.devices()[0].device_kind)


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
    parser.add_argument(
        "--real-devices", action="store_true", help="the host's own devices (e.g. a TPU chip), not 8 simulated CPUs"
    )
    parser.add_argument("--devices", type=int, default=8, help="devices the meshes span (the first N)")
    parser.add_argument("--layers", type=int, default=None, help="model.transformer.num_layers (default: the smoke's)")
    parser.add_argument("--hidden-dims", type=int, default=None, help="each expert's hidden units (default: 2 x dims)")
    parser.add_argument("--heads", type=int, default=None, help="query heads (default: the smoke's)")
    parser.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: the smoke's)")
    parser.add_argument("--head-dim", type=int, default=None, help="default: dims / 4")
    parser.add_argument("--vocab", type=int, default=None, help="model.vocab_size (default: the smoke's)")
    parser.add_argument("--dtype", default=None, help="model.dtype (default: the smoke's float32)")
    parser.add_argument("--attention", default=None, help="model.transformer.attention_impl (default: the smoke's)")
    parser.add_argument("--remat", default=None, help="model.transformer.remat (default: the smoke's full)")
    parser.add_argument(
        "--parallel-compile", action="store_true", help="compile every configuration at once (threads) before running"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if jax.device_count() < args.devices:
        raise SystemExit(
            f"--devices {args.devices}: JAX has {jax.device_count()} ({jax.devices()[0].platform}); run in a fresh "
            "process (8 simulated CPU devices) or pass --real-devices --devices N"
        )
    devices = jax.devices()[: args.devices]

    configs = []
    for ep in (int(e) for e in args.ep.split(",")):
        for cf in (None, args.capacity_factor):
            cfg = experiment(ep, cf, args)
            dispatch = "dropless" if cf is None else f"capacity {cf:g}"
            configs.append({"ep": ep, "dispatch": dispatch, "steps_s": [], "step": PreparedStep(cfg, devices)})
    if args.parallel_compile:
        t0 = time.perf_counter()
        compile_all([c["step"] for c in configs])
        print(f"compiled {len(configs)} steps at once in {time.perf_counter() - t0:.0f} s", flush=True)

    def warm(c: dict[str, Any]) -> Any:
        run = c["step"].start()
        start = time.perf_counter()
        run(1)
        c["first_step_s"] = time.perf_counter() - start
        run(args.warmup)
        return run

    def finish(c: dict[str, Any], run: Any) -> None:
        c["last_metrics"] = {k: v for k, v in run.metrics.items() if k in ("loss", "moe_dropped_fraction")}

    if args.rounds == 1:  # each in turn, its state freed before the next starts
        for c in configs:
            run = warm(c)
            c["steps_s"] += run(args.steps)
            finish(c, run)
            run.close()
            q1, med, q3 = quartiles(c["steps_s"])
            print(f"EP {c['ep']} {c['dispatch']}: {1e3 * med:.1f} ms ({1e3 * q1:.1f}-{1e3 * q3:.1f})", flush=True)
    else:
        runs = [warm(c) for c in configs]
        for _ in range(args.rounds):
            for c, run in zip(configs, runs):
                c["steps_s"] += run(args.steps)
        for c, run in zip(configs, runs):
            finish(c, run)
    peak = _peak_tflops()
    for c in configs:
        step: PreparedStep = c.pop("step")
        c["step_q1_s"], c["step_s"], c["step_q3_s"] = quartiles(c["steps_s"])
        cfg = step.cfg
        tokens = cfg.global_batch_size * cfg.data.seq_len
        flops = transformer_lm_flops_per_token(
            cfg.model.transformer, vocab_size=cfg.model.vocab_size, seq_len=cfg.data.seq_len
        )["training"]
        c["tokens_per_step"] = tokens
        c["tokens_per_s"] = tokens / c["step_s"]
        c["model_tflops_per_s"] = flops * tokens / c["step_s"] / 1e12
        c["mfu"] = None if peak is None else c["model_tflops_per_s"] / (peak * len(devices))
        c["lower_s"], c["compile_s"] = step.lower_s, step.compile_s
        c["xla_memory_bytes"] = step.memory()
        c["ragged_dot_kernels"] = _ragged_dot_kernels(step)
    base = next(c for c in configs if c["ep"] == min(r["ep"] for r in configs) and c["dispatch"] == "dropless")
    for c in configs:
        c["vs_dropless_lowest_ep"] = c["step_s"] / base["step_s"]
    stats = jax.devices()[0].memory_stats() or {}
    simulated = not args.real_devices and jax.devices()[0].platform == "cpu"
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "jax_version": jax.__version__,
        "devices": f"{len(devices)} {'simulated ' if simulated else ''}{jax.devices()[0].platform} devices "
        f"({jax.devices()[0].device_kind}) on {os.cpu_count()} cores",
        "peak_tflops_per_device": peak,
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
        "load_average": os.getloadavg(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": configs,
    }
    print(
        f"{'EP':>3} {'dispatch':>13} {'step ms':>8} {'IQR ms':>11} {'relative':>8} {'tokens/s':>10} {'MFU':>6}"
        "  (relative: to dropless at the lowest EP)"
    )
    for r in configs:
        iqr = f"{1e3 * r['step_q1_s']:.0f}-{1e3 * r['step_q3_s']:.0f}"
        mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
        print(
            f"{r['ep']:>3} {r['dispatch']:>13} {1e3 * r['step_s']:>8.1f} {iqr:>11} {r['vs_dropless_lowest_ep']:>8.2f}"
            f" {r['tokens_per_s']:>10,.0f} {mfu:>6}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
