"""Measuring: the train step of a preset timed alone (`benchmark_preset`), the peak-rate matmul
it is compared with, JAX's compile-stage timings, and what both sides of a comparison record
(step FLOPs, the device's datasheet peak, peak memory, profiler traces, the environment)."""

import datetime
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.lm_step.presets import Preset, preset_training
from equipax.core.flops import count_params, transformer_lm_flops_per_token
from equipax.core.task import Batch


def summary(times_s: Sequence[float]) -> dict[str, float]:
    """Median, interquartile range and minimum of step times, in seconds."""
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
    stats = summary(times)
    return {"n": n, **stats, "gflops": 2.0 * n**3 / stats["median_s"] / 1e9}


# JAX's own timings of the stages of a jit compile (jax._src.dispatch), summed per stage.
COMPILE_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
    "/jax/core/compile/backend_compile_duration": "xla_compile_s",
}


class CompileTimer:
    """Sums JAX's compile-stage durations recorded while the context is open."""

    def __init__(self):
        self.totals = dict.fromkeys(COMPILE_EVENTS.values(), 0.0)

    def _listen(self, event: str, duration_secs: float, **kwargs: Any) -> None:
        del kwargs
        stage = COMPILE_EVENTS.get(event)
        if stage is not None:
            self.totals[stage] += duration_secs

    def __enter__(self) -> "CompileTimer":
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc: object) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listen)


def random_batch(preset: Preset, key: jax.Array) -> Batch:
    """One batch of the preset's shape: random token ids, next-token labels, unit weights."""
    shape = (preset.batch_size, preset.seq_len)
    ids = jax.random.randint(key, shape, 0, preset.model.vocab_size, jnp.int32)
    return {"ids": ids, "labels": jnp.roll(ids, -1, axis=1), "weights": jnp.ones(shape, jnp.float32)}


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
        Config, parameter count, FLOPs per token and the step-time figures (no MFU: `train_step.main` adds it).
    """
    training = preset_training(preset)
    train_step, step_key = training.train_step, training.keys.step
    state = training.init_state()
    batch = random_batch(preset, jax.random.key(1))
    jax.block_until_ready((state, batch))

    with CompileTimer() as compile_timer:
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
    stats = summary(times)

    tcfg = preset.model.transformer
    flops = transformer_lm_flops_per_token(tcfg, vocab_size=preset.model.vocab_size, seq_len=preset.seq_len)
    tokens_per_step = preset.batch_size * preset.seq_len
    flops_per_step = flops["training"] * tokens_per_step
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
        "model_gflops_per_s": flops_per_step / stats["median_s"] / 1e9,
        "first_loss": first_loss,
        "last_loss": float(metrics["loss"]),
    }


def timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """`(result, host seconds until fn returned, wall seconds until the result was ready)`."""
    t0 = time.perf_counter()
    out = fn()
    t1 = time.perf_counter()
    jax.block_until_ready(out)
    return out, t1 - t0, time.perf_counter() - t0


def peak_hbm_bytes() -> int | None:
    """The device allocator's peak bytes in use so far in this process (None where the backend
    keeps no statistics, e.g. CPU)."""
    stats = jax.devices()[0].memory_stats()
    return None if not stats else stats.get("peak_bytes_in_use")


def peak_tflops() -> float | None:
    """Datasheet dense bf16 peak per chip of this device (the accelerator table `launch` uses
    for MFU: equipax.launch.hardware.accelerators; 197 for a TPU v5e), None on CPU or unknown."""
    from equipax.launch.hardware.accelerators import peak_tflops_of

    return peak_tflops_of(jax.devices()[0].device_kind)


def model_flops_per_step(preset: Preset) -> float:
    """Training FLOPs per step by the PaLM definition (3x forward, causal attention halved, no
    remat recompute: `equipax.core.flops`), the same for both sides."""
    flops = transformer_lm_flops_per_token(
        preset.model.transformer, vocab_size=preset.model.vocab_size, seq_len=preset.seq_len
    )
    return flops["training"] * preset.batch_size * preset.seq_len


def trace_steps(fn: Callable[[], Any], log_dir: Path, steps: int) -> str | None:
    """Trace `steps` calls of `fn` (each blocked on) with `jax.profiler` into `log_dir`, as
    `launch run --profile` does (one `train` step annotation per step); returns the Perfetto
    trace file written (`plugins/profile/<run>/perfetto_trace.json.gz`), or None."""
    log_dir.mkdir(parents=True, exist_ok=True)
    with jax.profiler.trace(str(log_dir), create_perfetto_trace=True):
        for i in range(steps):
            with jax.profiler.StepTraceAnnotation("train", step_num=i):
                jax.block_until_ready(fn())
    found = sorted(log_dir.glob("plugins/profile/*/perfetto_trace.json.gz"), key=lambda f: f.stat().st_mtime)
    return str(found[-1]) if found else None


def environment() -> dict[str, Any]:
    """The machine and the moment a comparison ran on (JSON-ready)."""
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax_version": jax.__version__,
        "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
        "cpu_count": os.cpu_count(),
        "load_average": list(os.getloadavg()),
        "python": platform.python_version(),
    }
