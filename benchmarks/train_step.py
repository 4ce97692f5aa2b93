"""Train-step benchmark: compile time, step time, tokens/s, model FLOP/s and MFU of the LM.

Runs the real train step (`equipax.launch.training.build.build_training`: the step `launch run`
executes, with the LM Task, the learner and the in-graph non-finite skip) on a fixed random
batch, so the figures cover grad + optimizer update + metrics and nothing of the input pipeline.
MFU is model FLOPs (analytic, `equipax.core.flops`, PaLM definition, no remat) per second over a
peak: the rate of a jitted f32 `a @ b` measured in the same run, and a theoretical peak given on
the command line (default: 156.5 GFLOP/s, a 2-core AVX2 Zen 3's f32 peak; benchmarks/README.md).

    uv run python benchmarks/train_step.py --presets default,20m,deep12 --steps 10 --warmup 2

Importable: `main(argv) -> dict` returns what it writes to `--out`.
"""

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from equipax.core.flops import count_params, transformer_lm_flops_per_token
from equipax.core.mesh import build_mesh
from equipax.core.nn import TransformerConfig
from equipax.core.optim import LearnerConfig
from equipax.core.step import Batch
from equipax.launch.configs.experiment import DataConfig, ExperimentConfig
from equipax.launch.training.build import Training, build_training
from equipax.models.lm import LMConfig

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "train_step.json"
COMPARE_OUT = Path(__file__).resolve().parent / "results" / "train_step_compare.json"
# 2 cores x 32 f32 FLOP/cycle (2 AVX2 FMA units x 8 lanes x 2) x 2.445 GHz (benchmarks/README.md).
THEORETICAL_PEAK_GFLOPS = 156.5


@dataclasses.dataclass(frozen=True, kw_only=True)
class Preset:
    """One benchmarked model: its config, the batch shape and the learner."""

    name: str
    description: str
    model: LMConfig
    batch_size: int
    seq_len: int
    learner: LearnerConfig


def _toy(
    name: str,
    description: str,
    *,
    vocab: int,
    layers: int,
    dims: int,
    heads: int,
    head_dim: int,
    hidden: int,
    seq_len: int,
    batch_size: int,
) -> Preset:
    transformer = TransformerConfig(
        num_layers=layers,
        model_dims=dims,
        num_heads=heads,
        head_dim=head_dim,
        hidden_dims=hidden,
        activation="gelu",
        norm="layernorm",
        scan_layers=False,
        remat="none",
    )
    return Preset(
        name=name,
        description=description,
        model=LMConfig(vocab_size=vocab, max_seq_len=seq_len, transformer=transformer),
        batch_size=batch_size,
        seq_len=seq_len,
        learner=LearnerConfig(kind="adamw", weight_decay=1e-4),
    )


def _registered_preset(name: str, experiment: str, description: str) -> Preset:
    # Imported here: the registry pulls in the launch package (data, CLI), which the
    # toy presets don't need.
    from equipax.launch.experiments.registry import get_experiment

    exp = get_experiment(experiment)
    return Preset(
        name=name,
        description=description,
        model=exp.model,
        batch_size=exp.data.batch_size,
        seq_len=exp.data.seq_len,
        learner=exp.learner,
    )


PRESETS: dict[str, Callable[[], Preset]] = {
    "default": lambda: _registered_preset(
        "default", "shakespeare_tiny", "shakespeare_tiny (the default experiment), from the registry"
    ),
    "llama": lambda: _registered_preset(
        "llama", "shakespeare_llama_tiny", "shakespeare_llama_tiny (the Llama block: RoPE, GQA 4/2, SwiGLU, RMSNorm)"
    ),
    "20m": lambda: _toy(
        "20m",
        "~20M-param LM (d 512, 6 layers)",
        vocab=2048,
        layers=6,
        dims=512,
        heads=8,
        head_dim=64,
        hidden=2048,
        seq_len=256,
        batch_size=8,
    ),
    # Guards the deep-unrolled LayerNorm trap (benchmarks/README.md): a two-pass LayerNorm made this
    # 1.65-1.75x slower with 3-4x the compile time.
    "deep12": lambda: _toy(
        "deep12",
        "12-layer toy, unrolled LayerNorm stack",
        vocab=4096,
        layers=12,
        dims=256,
        heads=4,
        head_dim=64,
        hidden=1024,
        seq_len=256,
        batch_size=4,
    ),
    "tiny": lambda: _toy(
        "tiny",
        "2-layer smoke test",
        vocab=256,
        layers=2,
        dims=64,
        heads=2,
        head_dim=32,
        hidden=256,
        seq_len=32,
        batch_size=2,
    ),
    "llama_tiny": lambda: _llama_tiny(),
}


def _llama_tiny() -> Preset:
    """2-layer Llama-block smoke test (GQA 4/2), the same learner as `tiny`."""
    tiny = PRESETS["tiny"]()
    t = dataclasses.replace(
        tiny.model.transformer,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        activation="silu",
        gated=True,
        norm="rmsnorm",
        norm_eps=1e-5,
        fused_qkv=False,
        atten_logit_cap=None,
    )
    model = dataclasses.replace(
        tiny.model,
        transformer=t,
        position="rope",
        output_logit_cap=None,
        tie_embeddings=False,
        embedding_multiplier=None,
        embedding_init_std=1.0,
    )
    return dataclasses.replace(tiny, name="llama_tiny", description="2-layer Llama-block smoke test", model=model)


def _with_overrides(preset: Preset, *, scan: bool | None, remat: str | None) -> Preset:
    changes: dict[str, Any] = {}
    if scan is not None:
        changes["scan_layers"] = scan
    if remat is not None:
        changes["remat"] = remat
    if not changes:
        return preset
    transformer = dataclasses.replace(preset.model.transformer, **changes)
    return dataclasses.replace(preset, model=dataclasses.replace(preset.model, transformer=transformer))


def _summary(times_s: Sequence[float]) -> dict[str, float]:
    q1, median, q3 = np.percentile(np.asarray(times_s), [25, 50, 75])
    return {"median_s": float(median), "iqr_s": float(q3 - q1), "min_s": float(min(times_s))}


def measure_matmul(n: int, *, repeats: int, warmup: int = 1) -> dict[str, float]:
    """Rate of a jitted f32 `a @ b` of two `n x n` matrices, timed like the train step.

    Arguments:
        n: matrix size.
        repeats: timed calls (after `warmup` untimed ones).
        warmup: untimed calls after the compiling one.

    Returns:
        `n`, `median_s`, `iqr_s`, `min_s` and `gflops` (at the median time).
    """
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), jnp.float32)
    b = jax.random.normal(kb, (n, n), jnp.float32)
    matmul = jax.jit(jnp.matmul)
    for _ in range(1 + warmup):
        matmul(a, b).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        matmul(a, b).block_until_ready()
        times.append(time.perf_counter() - t0)
    stats = _summary(times)
    return {"n": n, **stats, "gflops": 2.0 * n**3 / stats["median_s"] / 1e9}


# JAX's own timings of the stages of a jit compile (jax._src.dispatch), summed per stage.
_COMPILE_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
    "/jax/core/compile/backend_compile_duration": "xla_compile_s",
}


class _CompileTimer:
    """Sums JAX's compile-stage durations recorded while the context is open."""

    def __init__(self):
        self.totals = dict.fromkeys(_COMPILE_EVENTS.values(), 0.0)

    def _listen(self, event: str, duration_secs: float, **kwargs: Any) -> None:
        del kwargs
        stage = _COMPILE_EVENTS.get(event)
        if stage is not None:
            self.totals[stage] += duration_secs

    def __enter__(self) -> "_CompileTimer":
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc: object) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listen)


def _random_batch(preset: Preset, key: jax.Array) -> Batch:
    shape = (preset.batch_size, preset.seq_len)
    ids = jax.random.randint(key, shape, 0, preset.model.vocab_size, jnp.int32)
    return {"ids": ids, "labels": jnp.roll(ids, -1, axis=1), "weights": jnp.ones(shape, jnp.float32)}


def preset_training(preset: Preset) -> Training:
    """The preset as a one-device experiment, built by `build_training` (the step `launch run` runs)."""
    cfg = ExperimentConfig(
        name=preset.name,
        model=preset.model,
        learner=preset.learner,
        data=DataConfig(source="synthetic", tokenizer="byte", seq_len=preset.seq_len, batch_size=preset.batch_size),
    )
    return build_training(cfg, build_mesh(cfg.mesh))


def benchmark_preset(preset: Preset, *, steps: int, warmup: int) -> dict[str, Any]:
    """Time the train step of one preset.

    The first call traces, compiles and runs one step (`first_step_s`); `compile_s` is the
    part JAX records as tracing, lowering and XLA compilation. Then `warmup` untimed steps and
    `steps` timed ones, each blocked on.

    Arguments:
        preset: the model and batch.
        steps: timed steps (>= 1).
        warmup: untimed steps after the first.

    Returns:
        Config, parameter count, FLOPs per token and the step-time figures (no MFU; see `main`).
    """
    training = preset_training(preset)
    train_step, step_key = training.train_step, training.keys.step
    state = training.init_state()
    batch = _random_batch(preset, jax.random.key(1))
    jax.block_until_ready((state, batch))

    with _CompileTimer() as compile_timer:
        t0 = time.perf_counter()
        state, metrics = train_step(state, batch, step_key)
        jax.block_until_ready((state, metrics))
        first_step_s = time.perf_counter() - t0
    first_loss = float(metrics["loss"])

    for _ in range(warmup):
        state, metrics = train_step(state, batch, step_key)
        jax.block_until_ready((state, metrics))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = train_step(state, batch, step_key)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t0)
    stats = _summary(times)

    tcfg = preset.model.transformer
    flops = transformer_lm_flops_per_token(tcfg, vocab_size=preset.model.vocab_size, seq_len=preset.seq_len)
    tokens_per_step = preset.batch_size * preset.seq_len
    model_flops_per_step = flops["training"] * tokens_per_step
    return {
        "description": preset.description,
        "config": {
            "vocab_size": preset.model.vocab_size,
            "num_layers": tcfg.num_layers,
            "model_dims": tcfg.model_dims,
            "num_heads": tcfg.num_heads,
            "head_dim": tcfg.head_dim,
            "hidden_dims": tcfg.hidden_dims,
            "norm": tcfg.norm,
            "scan_layers": tcfg.scan_layers,
            "remat": tcfg.remat,
            "seq_len": preset.seq_len,
            "batch_size": preset.batch_size,
            "learner": preset.learner.kind,
        },
        "params": count_params(state.model),
        "tokens_per_step": tokens_per_step,
        "model_flops_per_token": flops["training"],
        "hardware_flops_per_token": flops["training_with_remat"],
        "first_step_s": first_step_s,
        # Trace + lower to StableHLO + XLA compile, as JAX records them.
        "compile_s": sum(compile_timer.totals.values()),
        "compile_stages_s": compile_timer.totals,
        "step_s": stats,
        "steps": steps,
        "warmup": warmup,
        "tokens_per_s": tokens_per_step / stats["median_s"],
        "model_gflops_per_s": model_flops_per_step / stats["median_s"] / 1e9,
        "first_loss": first_loss,
        "last_loss": float(metrics["loss"]),
    }


def _baseline_module() -> Any:
    """`benchmarks/baseline_lm.py`, loaded by path (the benchmarks folder is not a package)."""
    import importlib.util

    path = Path(__file__).resolve().parent / "baseline_lm.py"
    spec = importlib.util.spec_from_file_location("benchmarks_baseline_lm", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def baseline_for(preset: Preset) -> Any:
    """The plain-JAX `BaselineConfig` of the same math as `preset` (caps, clip, decay included)."""
    m, t, lr = preset.model, preset.model.transformer, preset.learner
    llama = m.position == "rope"
    shared = {
        "use_bias": (t.use_bias, False),
        "scan_layers": (t.scan_layers, False),
        "remat": (t.remat, "none"),
        "attention": (t.attention, "softmax"),
        "dtype": (m.dtype, "float32"),
        "learner.kind": (lr.kind, "adamw"),
        "qk_norm": (t.qk_norm, False),
        "sliding_window": (t.sliding_window, None),
    }
    family = {  # the block each family's baseline writes out
        "norm": (t.norm, "rmsnorm" if llama else "layernorm"),
        "activation": (t.activation, "silu" if llama else "gelu"),
        "gated": (t.gated, llama),
        "fused_qkv": (t.fused_qkv, not llama),
        "tie_embeddings": (m.tie_embeddings, not llama),
        "rope_scaling": (m.rope_scaling, None),
        "embedding_multiplier": (m.embedding_multiplier, None if llama else "sqrt_model_dims"),
        "position": (m.position, "rope" if llama else "sinusoidal"),
    } | (
        {"atten_logit_cap": (t.atten_logit_cap, None), "output_logit_cap": (m.output_logit_cap, None)} if llama else {}
    )
    bad = {k: found for k, (found, want) in (shared | family).items() if found != want}
    if bad:
        raise SystemExit(
            f"--compare: preset {preset.name!r} has {bad}; the plain-JAX baseline implements the presets' "
            "unrolled pre-LN GELU GPT and Llama-block LM with AdamW only. Drop --scan/--remat or pick another preset."
        )
    return _baseline_module().BaselineConfig(
        vocab_size=m.vocab_size,
        num_layers=t.num_layers,
        model_dims=t.model_dims,
        num_heads=t.num_heads,
        head_dim=t.head_dim,
        hidden_dims=t.hidden_dims,
        seq_len=preset.seq_len,
        batch_size=preset.batch_size,
        atten_logit_cap=t.atten_logit_cap,
        output_logit_cap=m.output_logit_cap,
        clip_gradient_norm=lr.clip_gradient_norm,
        weight_decay=lr.weight_decay,
        b1=lr.b1,
        b2=lr.b2,
        eps=lr.eps,
        layernorm_eps=t.norm_eps,
        family="llama" if llama else "gpt",
        num_kv_heads=t.num_kv_heads,
        rope_theta=m.rope_theta,
    )


def baseline_params(model: Any) -> dict[str, Any]:
    """The equipax `TransformerLM`'s parameters in the baseline's dict layout (copies)."""
    copy = lambda x: jnp.array(x, copy=True)  # noqa: E731 (both steps donate their inputs)
    if model.unembed is not None:  # the Llama block
        blocks = [
            {
                "ln1": copy(b.atten_norm.scale),
                "q": copy(b.attention.q),
                "kv": copy(b.attention.kv),
                "out": copy(b.attention.out),
                "ln2": copy(b.ffn_norm.scale),
                "gate": copy(b.ffn.gate.weight),
                "up": copy(b.ffn.up.weight),
                "down": copy(b.ffn.down.weight),
            }
            for b in model.stack.layers
        ]
        return {
            "embed": copy(model.embedding.weight),
            "layers": blocks,
            "final_ln": copy(model.final_norm.scale),
            "unembed": copy(model.unembed.weight),
        }
    layers = [
        {
            "ln1": copy(b.atten_norm.scale),
            "qkv": copy(b.attention.qkv),
            "out": copy(b.attention.out),
            "ln2": copy(b.ffn_norm.scale),
            "up": copy(b.ffn.up.weight),
            "down": copy(b.ffn.down.weight),
        }
        for b in model.stack.layers
    ]
    return {"embed": copy(model.embedding.weight), "layers": layers, "final_ln": copy(model.final_norm.scale)}


def _timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """`(result, host seconds until fn returned, wall seconds until the result was ready)`."""
    t0 = time.perf_counter()
    out = fn()
    t1 = time.perf_counter()
    jax.block_until_ready(out)
    return out, t1 - t0, time.perf_counter() - t0


def compare_preset(preset: Preset, *, steps: int, warmup: int) -> dict[str, Any]:
    """Time the equipax step against the plain-JAX baseline, interleaved, on the same batch.

    Both start from the same parameters (the baseline's are converted from the equipax model),
    so their first losses agree; each timed round runs one step of each, alternating which
    goes first. `ratio` is the median over rounds of baseline time / equipax time (> 1: equipax
    faster); `dispatch_ms` is the host time until the call returned (before the device is done).

    Arguments:
        preset: the model and batch.
        steps: timed rounds.
        warmup: untimed rounds after the compiling calls.

    Returns:
        Per side (`equipax`, `baseline`): compile seconds, step and dispatch medians, tokens/s,
        first and last loss; plus `ratio`, `ratio_iqr` and `max_first_loss_diff`.
    """
    bl = _baseline_module()
    bcfg = baseline_for(preset)
    training = preset_training(preset)
    train_step, step_key = training.train_step, training.keys.step
    state = training.init_state()
    params = baseline_params(state.model)
    optimizer = bl.make_optimizer(bcfg, training.learner.schedule)
    opt_state = optimizer.init(params)
    base_step = bl.make_step(bcfg, optimizer)
    batch = _random_batch(preset, jax.random.key(1))
    jax.block_until_ready((state, params, opt_state, batch))

    def run_equipax():
        nonlocal state
        state, metrics = train_step(state, batch, step_key)
        return metrics["loss"]

    def run_baseline():
        nonlocal params, opt_state
        params, opt_state, loss = base_step(params, opt_state, batch)
        return loss

    sides = {"equipax": run_equipax, "baseline": run_baseline}
    out: dict[str, dict[str, Any]] = {name: {} for name in sides}
    for name, fn in sides.items():
        with _CompileTimer() as timer:
            loss, _, wall = _timed(fn)
        out[name] |= {"compile_s": sum(timer.totals.values()), "first_step_s": wall, "first_loss": float(loss)}
    times: dict[str, list[float]] = {name: [] for name in sides}
    dispatch: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(warmup + steps):
        order = list(sides) if i % 2 == 0 else list(sides)[::-1]
        for name in order:
            loss, host_s, wall_s = _timed(sides[name])
            if i >= warmup:
                times[name].append(wall_s)
                dispatch[name].append(host_s)
            out[name]["last_loss"] = float(loss)
    tokens = preset.batch_size * preset.seq_len
    for name in sides:
        med = statistics.median(times[name])
        out[name] |= {
            "step_s": _summary(times[name]),
            "dispatch_ms": statistics.median(dispatch[name]) * 1e3,
            "tokens_per_s": tokens / med,
        }
    ratios = [b / e for b, e in zip(times["baseline"], times["equipax"])]
    q1, q3 = np.percentile(ratios, [25, 75])
    return {
        "description": preset.description,
        "params": count_params(state.model),
        "tokens_per_step": tokens,
        **out,
        "ratio": statistics.median(ratios),
        "ratio_iqr": float(q3 - q1),
        "max_first_loss_diff": abs(out["equipax"]["first_loss"] - out["baseline"]["first_loss"]),
        "steps": steps,
        "warmup": warmup,
    }


def _compare_table(results: dict[str, Any]) -> str:
    headers = [
        "preset",
        "params",
        "equipax ms",
        "plain ms",
        "equipax tok/s",
        "plain tok/s",
        "ratio (IQR)",
        "compile s eqx/plain",
        "dispatch ms eqx/plain",
        "first loss eqx/plain",
    ]
    rows = []
    for name, r in results["presets"].items():
        e, b = r["equipax"], r["baseline"]
        rows.append(
            [
                name,
                f"{r['params'] / 1e6:.2f}M",
                f"{e['step_s']['median_s'] * 1e3:.1f}",
                f"{b['step_s']['median_s'] * 1e3:.1f}",
                f"{e['tokens_per_s']:,.0f}",
                f"{b['tokens_per_s']:,.0f}",
                f"{r['ratio']:.3f} ({r['ratio_iqr']:.3f})",
                f"{e['compile_s']:.2f}/{b['compile_s']:.2f}",
                f"{e['dispatch_ms']:.2f}/{b['dispatch_ms']:.2f}",
                f"{e['first_loss']:.4f}/{b['first_loss']:.4f}",
            ]
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    lines = [fmt.format(*headers), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*row) for row in rows]
    lines.append(
        "ratio: median over interleaved rounds of plain-JAX step time / equipax step time (> 1: equipax faster)"
    )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Benchmark the equipax LM train step (step time, tokens/s, model FLOP/s, MFU)."
    )
    p.add_argument(
        "--presets",
        default="default,20m,deep12",
        help=f"comma-separated presets, from {', '.join(PRESETS)} (default: %(default)s)",
    )
    p.add_argument("--steps", type=int, default=10, help="timed steps per preset")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after the compiling one")
    p.add_argument(
        "--scan",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="override TransformerConfig.scan_layers for every preset (default: keep the preset's)",
    )
    p.add_argument(
        "--remat",
        choices=("none", "full", "dots_saveable"),
        default=None,
        help="override TransformerConfig.remat for every preset (default: keep the preset's)",
    )
    p.add_argument("--matmul-n", type=int, default=2048, help="size of the peak-rate matmul")
    p.add_argument("--matmul-repeats", type=int, default=5, help="timed peak-rate matmuls")
    p.add_argument(
        "--theoretical-peak-gflops",
        type=float,
        default=THEORETICAL_PEAK_GFLOPS,
        help="theoretical f32 peak of the machine for the second MFU (default: %(default)s, "
        "2-core Zen 3 of benchmarks/README.md); 0 to omit",
    )
    p.add_argument(
        "--warm-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compile and run one step of the 'tiny' preset first, unreported, so the first "
        "preset's compile time does not carry the process's one-time XLA start-up (~1.5 s)",
    )
    p.add_argument(
        "--compare",
        action="store_true",
        help="time the equipax step against the plain-JAX baseline (benchmarks/baseline_lm.py), "
        "interleaved in this process, and print the ratio per preset",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"JSON results file (default: {DEFAULT_OUT}, or {COMPARE_OUT} with --compare)",
    )
    return p


def _table(results: dict[str, Any]) -> str:
    theo = results["theoretical_peak_gflops"]
    headers = [
        "preset",
        "params",
        "scan",
        "remat",
        "tok/step",
        "compile s",
        "step ms",
        "IQR ms",
        "tokens/s",
        "model GFLOP/s",
        "matmul GFLOP/s",
        "MFU meas",
        "MFU theo",
    ]
    rows = []
    for name, r in results["presets"].items():
        rows.append(
            [
                name,
                f"{r['params'] / 1e6:.2f}M",
                "y" if r["config"]["scan_layers"] else "n",
                r["config"]["remat"],
                f"{r['tokens_per_step']}",
                f"{r['compile_s']:.2f}",
                f"{r['step_s']['median_s'] * 1e3:.1f}",
                f"{r['step_s']['iqr_s'] * 1e3:.1f}",
                f"{r['tokens_per_s']:,.0f}",
                f"{r['model_gflops_per_s']:.1f}",
                f"{r['matmul']['gflops']:.1f}",
                f"{r['mfu_vs_measured']:.1%}",
                f"{r['mfu_vs_theoretical']:.1%}" if r["mfu_vs_theoretical"] is not None else "-",
            ]
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    lines = [fmt.format(*headers), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*row) for row in rows]
    lines.append(
        f"matmul GFLOP/s: jitted f32 a @ b, n={results['matmul_n']}, measured before each preset; "
        f"MFU meas = model GFLOP/s / that" + (f"; MFU theo = model GFLOP/s / {theo:.1f}" if theo else "")
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print a table, write the JSON results.

    Arguments:
        argv: command-line arguments (without the program name); None reads `sys.argv`.

    Returns:
        The results written to `--out`: `presets` (per preset, each with its `matmul`),
        `jax_version`, `device_kind`, `date` and the settings.
    """
    args = _parser().parse_args(argv)
    names = [n.strip() for n in args.presets.split(",") if n.strip()]
    unknown = [n for n in names if n not in PRESETS]
    if unknown or not names:
        raise SystemExit(f"--presets: expected names from {list(PRESETS)}, found {unknown or names!r}.")
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit(f"--steps must be >= 1 and --warmup >= 0; got {args.steps}, {args.warmup}.")

    device = jax.devices()[0]
    theo = args.theoretical_peak_gflops or None
    if args.warm_process:
        benchmark_preset(PRESETS["tiny"](), steps=1, warmup=0)
    if args.compare:
        return _main_compare(args, names)
    per_preset: dict[str, Any] = {}
    for name in dict.fromkeys(names):
        preset = _with_overrides(PRESETS[name](), scan=args.scan, remat=args.remat)
        print(f"[{name}] {preset.description} ...", file=sys.stderr, flush=True)
        # The peak is measured next to each preset: on a shared machine the load drifts.
        matmul = measure_matmul(args.matmul_n, repeats=args.matmul_repeats)
        r = benchmark_preset(preset, steps=args.steps, warmup=args.warmup)
        r["matmul"] = matmul
        r["mfu_vs_measured"] = r["model_gflops_per_s"] / matmul["gflops"]
        r["mfu_vs_theoretical"] = r["model_gflops_per_s"] / theo if theo else None
        if theo and matmul["gflops"] > theo:
            print(
                f"[{name}] measured matmul {matmul['gflops']:.1f} GFLOP/s exceeds "
                f"--theoretical-peak-gflops={theo}: the peak is for another machine; pass "
                "this machine's peak (cores x FLOP/cycle x GHz).",
                file=sys.stderr,
            )
        per_preset[name] = r

    results = {
        "benchmark": "train_step",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax_version": jax.__version__,
        "backend": jax.default_backend(),
        "device_kind": device.device_kind,
        "num_devices": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "settings": {
            "steps": args.steps,
            "warmup": args.warmup,
            "scan_override": args.scan,
            "remat_override": args.remat,
            "warm_process": args.warm_process,
        },
        "theoretical_peak_gflops": theo,
        "matmul_n": args.matmul_n,
        "presets": per_preset,
    }
    print(_table(results))
    return _write(results, args.out or DEFAULT_OUT)


def _environment() -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax_version": jax.__version__,
        "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
        "cpu_count": os.cpu_count(),
        "load_average": list(os.getloadavg()),
        "python": platform.python_version(),
    }


def _main_compare(args: argparse.Namespace, names: list[str]) -> dict[str, Any]:
    per_preset = {}
    for name in dict.fromkeys(names):
        preset = _with_overrides(PRESETS[name](), scan=args.scan, remat=args.remat)
        print(f"[{name}] {preset.description}: equipax vs plain JAX ...", file=sys.stderr, flush=True)
        per_preset[name] = compare_preset(preset, steps=args.steps, warmup=args.warmup)
    results = {
        "benchmark": "train_step_compare",
        **_environment(),
        "settings": {"steps": args.steps, "warmup": args.warmup},
        "presets": per_preset,
    }
    print(_compare_table(results))
    return _write(results, args.out or COMPARE_OUT)


def _write(results: dict[str, Any], out: Path) -> dict[str, Any]:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return results


if __name__ == "__main__":
    main()
