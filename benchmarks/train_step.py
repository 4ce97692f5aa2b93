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
    # A registry experiment with knob overrides (the chip presets): built as `launch run` builds
    # it, its train/learner settings included; None = a one-device experiment of the fields above.
    experiment: ExperimentConfig | None = None
    # Sized for one accelerator chip: --compare runs each side in its own process (--isolate).
    chip: bool = False
    # The plain side's XLA attention keeps the q.k logits in float32 out of the matmul, as
    # equipax's does (--plain-float32-logits); default: rounded to the compute dtype first.
    plain_float32_logits: bool = False


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
    "c4_1b_6l": lambda: _chip_preset(
        "c4_1b_6l",
        "c4_1b at 6 layers (d 2560, 20x128 heads, MLP 10240 GELU, vocab 32000), seq 1024, batch 8",
        "c4_1b",
        {"model.transformer.num_layers": 6, "model.transformer.atten_logit_cap": None, "model.output_logit_cap": None},
        per_device_batch=8,
    ),
    "llama_1b": lambda: _chip_preset(
        "llama_1b",
        "llama3_2_1b at 4 layers (d 2048, GQA 32/8 x 64, SwiGLU 8192, vocab 128256, tied, RoPE x32), seq 1024, batch 4",
        "llama3_2_1b",
        {"model.transformer.num_layers": 4, "model.max_seq_len": 1024},
        per_device_batch=4,
    ),
}


def _chip_preset(
    name: str, description: str, experiment: str, knobs: dict[str, Any], *, per_device_batch: int
) -> Preset:
    """A registry experiment on one chip: the knobs, a one-device mesh, synthetic tokens of the
    experiment's vocabulary, seq 1024, and AdamW with the experiment's clip, betas and decay (the
    plain-JAX side is optax's adamw: both sides then run the same update; `pax_adam`'s update-RMS
    clip is off). What `launch run --exp EXPERIMENT --set ...` with these knobs would build."""
    from equipax.core.knobs import set_knobs
    from equipax.launch.experiments.registry import get_experiment

    cfg = get_experiment(experiment)
    cfg = set_knobs(
        cfg,
        {
            **knobs,
            "mesh.ici_mesh_shape": (1, 1, 1),
            "mesh.dcn_mesh_shape": (1, 1, 1),
            "data.source": "synthetic",
            "data.packing": False,
            "data.tokenizer": "byte",
            "data.seq_len": 1024,
            "data.per_device_batch": per_device_batch,
            "learner.kind": "adamw",
            "learner.clip_update_rms": None,
        },
    )
    assert isinstance(cfg.model, LMConfig) and isinstance(cfg.data, DataConfig)
    return Preset(
        name=name,
        description=description,
        model=cfg.model,
        batch_size=cfg.global_batch_size,
        seq_len=cfg.data.seq_len,
        learner=cfg.learner,
        experiment=cfg,
        chip=True,
    )


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


def _with_overrides(
    preset: Preset, *, scan: bool | None, remat: str | None, attention: str | None = None, dtype: str | None = None
) -> Preset:
    """The preset with knob overrides (None keeps the preset's), applied through
    `equipax.core.knobs.set_knobs` (type-checked and validated as `launch run --set` does)."""
    from equipax.core.knobs import set_knobs

    knobs: dict[str, Any] = {}
    if scan is not None:
        knobs["model.transformer.scan_layers"] = scan
    if remat is not None:
        knobs["model.transformer.remat"] = remat
    if attention is not None:
        knobs["model.transformer.attention_impl"] = attention
    if dtype is not None:
        knobs["model.dtype"] = dtype
    if not knobs:
        return preset
    if preset.experiment is not None:
        cfg = set_knobs(preset.experiment, knobs)
        return dataclasses.replace(preset, model=cfg.model, experiment=cfg)
    model = set_knobs(preset.model, {k.removeprefix("model."): v for k, v in knobs.items()})
    return dataclasses.replace(preset, model=model)


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


def preset_config(preset: Preset) -> ExperimentConfig:
    """The preset's experiment: its registry config, else a one-device experiment of its fields."""
    if preset.experiment is not None:
        return preset.experiment
    return ExperimentConfig(
        name=preset.name,
        model=preset.model,
        learner=preset.learner,
        data=DataConfig(source="synthetic", tokenizer="byte", seq_len=preset.seq_len, batch_size=preset.batch_size),
    )


def resolve_auto_remat(preset: Preset) -> Preset:
    """`remat="auto"` chosen as `launch run` chooses it (compiling the candidates against this
    device's memory, `equipax.launch.aot.remat.choose_remat`); other presets unchanged."""
    if preset.model.transformer.remat != "auto":
        return preset
    from equipax.launch.aot.hlo_cost import NOMINAL_HOST, Roofline
    from equipax.launch.aot.remat import choose_remat
    from equipax.launch.cluster.accelerators import accelerator_of
    from equipax.launch.training.loop import local_device_memory_gib

    cfg = preset_config(preset)
    accelerator = accelerator_of(jax.devices()[0].device_kind)
    choice = choose_remat(
        cfg,
        build_mesh(cfg.mesh),
        budget_gib=cfg.train.hbm_gib_per_device or local_device_memory_gib(),
        margin=cfg.train.hbm_margin,
        roofline=Roofline.of(accelerator) if accelerator is not None else NOMINAL_HOST,
        log=lambda m: print(f"[{preset.name}] {m}", file=sys.stderr, flush=True),
    )
    print(f"[{preset.name}] remat auto -> {choice.policy}", file=sys.stderr, flush=True)
    model = choice.cfg.model
    return dataclasses.replace(preset, model=model, experiment=choice.cfg if preset.experiment else None)


def preset_training(preset: Preset) -> Training:
    """The preset's experiment built by `build_training` (the step `launch run` runs)."""
    cfg = preset_config(preset)
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
    return _load_benchmark_module("baseline_lm")


def _load_benchmark_module(name: str) -> Any:
    """`benchmarks/<name>.py`, loaded by path once per process."""
    import importlib.util

    if f"benchmarks_{name}" in sys.modules:
        return sys.modules[f"benchmarks_{name}"]
    path = Path(__file__).resolve().parent / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def baseline_for(preset: Preset, *, remat: str | None = None) -> Any:
    """The plain-JAX `BaselineConfig` of the same math as `preset` (caps, clip, decay, scan, remat,
    dtype and attention kernel included); `remat` overrides the plain side's policy only.
    Attention "auto" (the default) is resolved for this platform first (`resolve_attention`)."""
    preset = resolve_attention(preset)
    m, t, lr = preset.model, preset.model.transformer, preset.learner
    llama = m.position == "rope"
    shared = {
        "use_bias": (t.use_bias, False),
        "attention": (t.attention, "softmax"),
        "learner.kind": (lr.kind, "adamw"),
        "learner.clip_update_rms": (lr.clip_update_rms, None),
        "qk_norm": (t.qk_norm, False),
        "sliding_window": (t.sliding_window, None),
        "z_loss_coef": (m.z_loss_coef, 0.0),
        "pipeline_stages": (t.pipeline_stages, 1),
        "num_experts": (t.num_experts, 0),
    }
    family = {  # the block each family's baseline writes out
        "norm": (t.norm, "rmsnorm" if llama else "layernorm"),
        "activation": (t.activation, "silu" if llama else "gelu"),
        "gated": (t.gated, llama),
        "fused_qkv": (t.fused_qkv, not llama),
        "rope_scaling": (m.rope_scaling if not llama else None, None),  # Llama's "llama3" rule is written out
        "embedding_multiplier": (m.embedding_multiplier, None if llama else "sqrt_model_dims"),
        "position": (m.position, "rope" if llama else "sinusoidal"),
    } | (
        {"atten_logit_cap": (t.atten_logit_cap, None), "output_logit_cap": (m.output_logit_cap, None)} if llama else {}
    )
    bad = {k: found for k, (found, want) in (shared | family).items() if found != want}
    if t.remat not in ("none", "full", "dots_saveable"):
        bad["remat"] = t.remat
    if t.attention_impl not in ("xla", "splash"):
        bad["attention_impl"] = t.attention_impl
    if bad:
        raise SystemExit(
            f"--compare: preset {preset.name!r} has {bad}; the plain-JAX baseline implements the presets' "
            "pre-LN GELU GPT and Llama-block LM with AdamW, remat none/full/dots_saveable and attention "
            "xla/splash only (--attention auto is resolved first). Pick other overrides or another preset."
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
        rope_scaling=None
        if m.rope_scaling is None
        else (
            m.rope_scaling.factor,
            m.rope_scaling.low_freq_factor,
            m.rope_scaling.high_freq_factor,
            m.rope_scaling.original_max_seq_len,
        ),
        tie_embeddings=m.tie_embeddings,
        scan_layers=t.scan_layers,
        remat=remat or t.remat,
        dtype=m.dtype,
        attention_impl=t.attention_impl,
        float32_logits=preset.plain_float32_logits,
    )


def resolve_attention(preset: Preset) -> Preset:
    """`attention_impl="auto"` replaced by the kernel equipax picks for it on this platform (so
    the plain side runs the same one); other presets unchanged."""
    t = preset.model.transformer
    if t.attention_impl != "auto":
        return preset
    from equipax.core.nn.fused_attention import resolve_attention_impl

    impl = resolve_attention_impl(
        "auto", jax.default_backend(), seq_len=preset.seq_len, dtype=preset.model.dtype, logit_cap=t.atten_logit_cap
    )
    return _with_overrides(preset, scan=None, remat=None, attention=impl)


def _block_params(b: Any, copy: Callable[[Any], Any]) -> dict[str, Any]:
    """One equipax block's (or a stacked block's) arrays in the baseline's names."""
    if b.attention.qkv is None:  # the Llama block
        return {
            "ln1": copy(b.atten_norm.scale),
            "q": copy(b.attention.q),
            "kv": copy(b.attention.kv),
            "out": copy(b.attention.out),
            "ln2": copy(b.ffn_norm.scale),
            "gate": copy(b.ffn.gate.weight),
            "up": copy(b.ffn.up.weight),
            "down": copy(b.ffn.down.weight),
        }
    return {
        "ln1": copy(b.atten_norm.scale),
        "qkv": copy(b.attention.qkv),
        "out": copy(b.attention.out),
        "ln2": copy(b.ffn_norm.scale),
        "up": copy(b.ffn.up.weight),
        "down": copy(b.ffn.down.weight),
    }


def baseline_params(model: Any) -> dict[str, Any]:
    """The equipax `TransformerLM`'s parameters in the baseline's dict layout (copies): a list of
    layer dicts (unrolled) or one dict of stacked arrays (scanned), and `unembed` when untied."""
    copy = lambda x: jnp.array(x, copy=True)  # noqa: E731 (both steps donate their inputs)
    layers = model.stack.layers
    params: dict[str, Any] = {"embed": copy(model.embedding.weight), "final_ln": copy(model.final_norm.scale)}
    if isinstance(layers, tuple):
        params["layers"] = [_block_params(b, copy) for b in layers]
    else:  # scanned: one block whose arrays carry a leading layer axis
        params["layers"] = _block_params(layers, copy)
    if model.unembed is not None:
        params["unembed"] = copy(model.unembed.weight)
    return params


def _timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """`(result, host seconds until fn returned, wall seconds until the result was ready)`."""
    t0 = time.perf_counter()
    out = fn()
    t1 = time.perf_counter()
    jax.block_until_ready(out)
    return out, t1 - t0, time.perf_counter() - t0


def _peak_hbm_bytes() -> int | None:
    """The device allocator's peak bytes in use so far in this process (None where the backend
    keeps no statistics, e.g. CPU)."""
    stats = jax.devices()[0].memory_stats()
    return None if not stats else stats.get("peak_bytes_in_use")


def _peak_tflops() -> float | None:
    """Datasheet dense bf16 peak per chip of this device (the accelerator table `launch` uses
    for MFU: equipax.launch.cluster.accelerators; 197 for a TPU v5e), None on CPU or unknown."""
    from equipax.launch.cluster.accelerators import peak_tflops_of

    return peak_tflops_of(jax.devices()[0].device_kind)


def _model_flops_per_step(preset: Preset) -> float:
    """Training FLOPs per step by the PaLM definition (3x forward, causal attention halved, no
    remat recompute: `equipax.core.flops`), the same for both sides."""
    flops = transformer_lm_flops_per_token(
        preset.model.transformer, vocab_size=preset.model.vocab_size, seq_len=preset.seq_len
    )
    return flops["training"] * preset.batch_size * preset.seq_len


def _trace_steps(fn: Callable[[], Any], log_dir: Path, steps: int) -> str | None:
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


def _side_figures(preset: Preset, times: Sequence[float], dispatch: Sequence[float]) -> dict[str, Any]:
    med = statistics.median(times)
    tokens = preset.batch_size * preset.seq_len
    peak = _peak_tflops()
    model_flops = _model_flops_per_step(preset)
    return {
        "step_s": _summary(times),
        "dispatch_ms": statistics.median(dispatch) * 1e3,
        "tokens_per_s": tokens / med,
        "model_tflops_per_s": model_flops / med / 1e12,
        "mfu": model_flops / med / (peak * 1e12) if peak else None,
    }


def compare_preset(
    preset: Preset,
    *,
    steps: int,
    warmup: int,
    profile_dir: Path | None = None,
    profile_steps: int = 3,
    plain_remat: str | None = None,
) -> dict[str, Any]:
    """Time the equipax step against the plain-JAX baseline, interleaved, on the same batch.

    Both start from the same parameters (the baseline's are converted from the equipax model),
    so their first losses agree; each timed round runs one step of each, alternating which
    goes first. `ratio` is the median over rounds of baseline time / equipax time (> 1: equipax
    faster); `dispatch_ms` is the host time until the call returned (before the device is done).

    Arguments:
        preset: the model and batch.
        steps: timed rounds.
        warmup: untimed rounds after the compiling calls.
        profile_dir: if set, trace `profile_steps` steps of each side afterwards into
            `profile_dir/equipax` and `profile_dir/plain`.
        profile_steps: steps traced per side.
        plain_remat: the plain side's remat policy, if not the preset's.

    Returns:
        Per side (`equipax`, `baseline`): compile seconds, step and dispatch medians, tokens/s,
        MFU, first and last loss (and `trace`); plus `ratio`, `ratio_iqr`, `max_first_loss_diff`
        and the process's `peak_hbm_bytes` (both sides together: see `isolated_compare`).
    """
    bl = _baseline_module()
    bcfg = baseline_for(preset, remat=plain_remat)
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
    for name in sides:
        out[name] |= _side_figures(preset, times[name], dispatch[name])
        if profile_dir is not None:
            where = profile_dir / preset.name / ("plain" if name == "baseline" else name)
            out[name]["trace"] = _trace_steps(sides[name], where, profile_steps)
    ratios = [b / e for b, e in zip(times["baseline"], times["equipax"])]
    q1, q3 = np.percentile(ratios, [25, 75])
    return {
        "description": preset.description,
        "params": count_params(state.model),
        "tokens_per_step": preset.batch_size * preset.seq_len,
        "model_flops_per_step": _model_flops_per_step(preset),
        "peak_tflops": _peak_tflops(),
        "remat": {"equipax": preset.model.transformer.remat, "baseline": bcfg.remat},
        "attention_impl": preset.model.transformer.attention_impl,
        "dtype": preset.model.dtype,
        **out,
        "ratio": statistics.median(ratios),
        "ratio_iqr": float(q3 - q1),
        "max_first_loss_diff": abs(out["equipax"]["first_loss"] - out["baseline"]["first_loss"]),
        "peak_hbm_bytes": _peak_hbm_bytes(),
        "mode": "interleaved",
        "steps": steps,
        "warmup": warmup,
    }


def run_side(
    preset: Preset,
    side: str,
    *,
    steps: int,
    warmup: int,
    profile_dir: Path | None = None,
    profile_steps: int = 3,
    plain_remat: str | None = None,
) -> dict[str, Any]:
    """One side of the comparison alone in this process (`--side`): build, compile, time, trace.

    The plain side starts from the equipax model's initial parameters (the same init key, so the
    same numbers), built without the equipax optimizer state, then freed: its peak memory is
    its own step's.

    Arguments:
        preset: the model and batch (remat and attention already resolved).
        side: "equipax" or "baseline".
        steps, warmup, profile_dir, profile_steps, plain_remat: as `compare_preset`.

    Returns:
        The side's figures (as one side of `compare_preset`) with `params` and `peak_hbm_bytes`.
    """
    import equinox as eqx

    training = preset_training(preset)
    batch = _random_batch(preset, jax.random.key(1))
    if side == "equipax":
        train_step, step_key = training.train_step, training.keys.step
        state = training.init_state()
        n_params = count_params(state.model)

        def run():
            nonlocal state
            state, metrics = train_step(state, batch, step_key)
            return metrics["loss"]

    else:
        bl = _baseline_module()
        bcfg = baseline_for(preset, remat=plain_remat)
        model, _ = eqx.filter_jit(training.task.init)(training.keys.init)
        n_params = count_params(model)
        params = baseline_params(model)
        del model
        optimizer = bl.make_optimizer(bcfg, training.learner.schedule)
        opt_state = jax.jit(optimizer.init)(params)
        base_step = bl.make_step(bcfg, optimizer)

        def run():
            nonlocal params, opt_state
            params, opt_state, loss = base_step(params, opt_state, batch)
            return loss

    label = f"[{preset.name}:{'plain' if side == 'baseline' else side}]"
    print(f"{label} compiling and running the first step ...", file=sys.stderr, flush=True)
    with _CompileTimer() as timer:
        loss, _, wall = _timed(run)
    out: dict[str, Any] = {"compile_s": sum(timer.totals.values()), "first_step_s": wall, "first_loss": float(loss)}
    print(f"{label} first step {wall:.1f} s, loss {float(loss):.4f}; timing ...", file=sys.stderr, flush=True)
    times, dispatch = [], []
    for i in range(warmup + steps):
        loss, host_s, wall_s = _timed(run)
        if i >= warmup:
            times.append(wall_s)
            dispatch.append(host_s)
    out["last_loss"] = float(loss)
    out |= _side_figures(preset, times, dispatch)
    print(
        f"{label} {out['step_s']['median_s'] * 1e3:.1f} ms/step, {out['tokens_per_s']:,.0f} tokens/s",
        file=sys.stderr,
        flush=True,
    )
    out["peak_hbm_bytes"] = _peak_hbm_bytes()
    if profile_dir is not None:
        where = profile_dir / preset.name / ("plain" if side == "baseline" else side)
        out["trace"] = _trace_steps(run, where, profile_steps)
        print(f"{label} trace: {out['trace']}", file=sys.stderr, flush=True)
    out["params"] = n_params
    return out


def isolated_compare(preset_name: str, args: argparse.Namespace) -> dict[str, Any]:
    """`compare_preset` with each side in its own process of this script (`--side`), one after
    the other: on one accelerator chip the two train states do not fit together, and each side's
    peak HBM is then its own. This process never touches the device (a chip is held by one
    process at a time). `ratio` = plain median / equipax median (the sides are not paired)."""
    import subprocess
    import tempfile

    out: dict[str, Any] = {}
    remat = args.remat
    with tempfile.TemporaryDirectory() as tmp:
        for side in ("equipax", "baseline"):
            result = Path(tmp) / f"{side}.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--side", side, "--presets", preset_name]
            cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--out", str(result)]
            cmd += ["--no-warm-process", "--profile-steps", str(args.profile_steps)]
            for flag, value in (("--attention", args.attention), ("--dtype", args.dtype), ("--remat", remat)):
                if value is not None:
                    cmd += [flag, value]
            if args.plain_remat is not None:
                cmd += ["--plain-remat", args.plain_remat]
            for knob in args.set:
                cmd += ["--set", knob]
            if args.plain_float32_logits:
                cmd.append("--plain-float32-logits")
            if args.scan is not None:
                cmd.append("--scan" if args.scan else "--no-scan")
            if args.profile is not None:
                cmd += ["--profile", str(args.profile)]
            print(f"[{preset_name}] {side} in its own process ...", file=sys.stderr, flush=True)
            subprocess.run(cmd, check=True)
            out[side] = json.loads(result.read_text())
            # The plain side runs the policy "auto" chose for equipax (and the same kernel).
            remat = out[side]["remat"]["equipax"]
    e, b = out["equipax"], out["baseline"]
    return {
        **{k: e[k] for k in ("description", "params", "tokens_per_step", "model_flops_per_step", "peak_tflops")},
        "remat": {"equipax": e["remat"]["equipax"], "baseline": b["remat"]["baseline"]},
        "attention_impl": e["attention_impl"],
        "dtype": e["dtype"],
        "equipax": e["side"],
        "baseline": b["side"],
        "ratio": b["side"]["step_s"]["median_s"] / e["side"]["step_s"]["median_s"],
        "ratio_iqr": None,
        "max_first_loss_diff": abs(e["side"]["first_loss"] - b["side"]["first_loss"]),
        "mode": "isolated",
        "environment": e["environment"],
        "steps": args.steps,
        "warmup": args.warmup,
    }


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def _compare_table(results: dict[str, Any]) -> str:
    headers = [
        "preset",
        "params",
        "remat eqx/plain",
        "attn",
        "dtype",
        "equipax ms (IQR)",
        "plain ms (IQR)",
        "equipax tok/s",
        "plain tok/s",
        "ratio (IQR)",
        "MFU eqx/plain",
        "peak HBM GiB eqx/plain",
        "compile s eqx/plain",
        "dispatch ms eqx/plain",
        "first loss eqx/plain",
    ]
    rows = []
    for name, r in results["presets"].items():
        e, b = r["equipax"], r["baseline"]
        if r["mode"] == "isolated":
            hbm = f"{_gib(e.get('peak_hbm_bytes'))}/{_gib(b.get('peak_hbm_bytes'))}"
        else:
            hbm = f"{_gib(r.get('peak_hbm_bytes'))} (both)"
        mfu = "-" if e["mfu"] is None else f"{e['mfu']:.1%}/{b['mfu']:.1%}"
        iqr = "-" if r["ratio_iqr"] is None else f"{r['ratio_iqr']:.3f}"
        rows.append(
            [
                name,
                f"{r['params'] / 1e6:.2f}M",
                f"{r['remat']['equipax']}/{r['remat']['baseline']}",
                r["attention_impl"],
                r["dtype"],
                f"{e['step_s']['median_s'] * 1e3:.1f} ({e['step_s']['iqr_s'] * 1e3:.1f})",
                f"{b['step_s']['median_s'] * 1e3:.1f} ({b['step_s']['iqr_s'] * 1e3:.1f})",
                f"{e['tokens_per_s']:,.0f}",
                f"{b['tokens_per_s']:,.0f}",
                f"{r['ratio']:.3f} ({iqr})",
                mfu,
                hbm,
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
        "ratio: plain-JAX step time / equipax step time (> 1: equipax faster); interleaved: median over "
        "paired rounds, isolated: ratio of the medians. MFU: equipax.core.flops training FLOPs (PaLM, no "
        "remat) over the device's datasheet peak."
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
        choices=("none", "full", "dots_saveable", "auto"),
        default=None,
        help="override model.transformer.remat for every preset, on both sides of --compare (auto: "
        "chosen by compiling, as `launch run` does; the plain side then runs the chosen policy) "
        "(default: keep the preset's)",
    )
    p.add_argument(
        "--plain-remat",
        choices=("none", "full", "dots_saveable", "dots_all_saveable"),
        default=None,
        help="--compare: the plain side's remat policy if not equipax's (dots_all_saveable: JAX's "
        "dots_saveable, which also saves the attention matmuls)",
    )
    p.add_argument(
        "--attention",
        choices=("xla", "splash", "auto"),
        default=None,
        help="override model.transformer.attention_impl on both sides (splash: TPU only; auto: what "
        "equipax picks on this platform) (default: keep the preset's)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="override model.dtype (the compute dtype; weights stay float32) on both sides",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KNOB=VALUE",
        help="an equipax knob for the experiment, as `launch run --set` takes it (repeatable), e.g. "
        "train.check_update_norm=False; the plain side has no knobs",
    )
    p.add_argument(
        "--plain-float32-logits",
        action="store_true",
        help="--compare: the plain side's XLA attention keeps its q.k logits in float32 out of the "
        "matmul, as equipax's does (default: rounded to the compute dtype before the softmax)",
    )
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="--compare: after timing, trace --profile-steps steps of each side with jax.profiler into "
        "DIR/<preset>/{equipax,plain} and print the per-op comparison (benchmarks/op_profile.py)",
    )
    p.add_argument("--profile-steps", type=int, default=3, help="steps traced per side with --profile")
    p.add_argument("--top", type=int, default=25, help="ops listed per preset with --profile")
    p.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--compare: run each side in its own process, one after the other (default: on for the "
        "chip presets, whose two train states do not fit one chip together; off = interleaved)",
    )
    p.add_argument("--side", choices=("equipax", "baseline"), default=None, help=argparse.SUPPRESS)
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

    if args.side is not None:
        return _main_side(args, names)
    if args.compare and _isolate(args, names):
        # This process must not open the device: each side's process needs it to itself.
        return _main_compare(args, names, isolate=True)
    device = jax.devices()[0]
    theo = args.theoretical_peak_gflops or None
    if args.warm_process:
        benchmark_preset(PRESETS["tiny"](), steps=1, warmup=0)
    if args.compare:
        return _main_compare(args, names, isolate=False)
    per_preset: dict[str, Any] = {}
    for name in dict.fromkeys(names):
        preset = _resolved(name, args)
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


def _resolved(name: str, args: argparse.Namespace) -> Preset:
    """The preset with the command line's overrides, "auto" attention and remat resolved."""
    preset = PRESETS[name]()
    preset = _with_overrides(preset, scan=args.scan, remat=args.remat, attention=args.attention, dtype=args.dtype)
    if args.set:
        from equipax.core.knobs import apply_overrides

        cfg, _ = apply_overrides(preset_config(preset), args.set)
        # Both sides take the batch shape from the preset: `--set data.per_device_batch=16` (or
        # data.seq_len) changes it for the plain side too.
        seq_len = getattr(cfg.data, "seq_len", preset.seq_len)
        preset = dataclasses.replace(
            preset, model=cfg.model, experiment=cfg, batch_size=cfg.global_batch_size, seq_len=seq_len
        )
    if args.plain_float32_logits:
        preset = dataclasses.replace(preset, plain_float32_logits=True)
    return resolve_auto_remat(resolve_attention(preset))


def _isolate(args: argparse.Namespace, names: list[str]) -> bool:
    return args.isolate if args.isolate is not None else any(PRESETS[n]().chip for n in names)


def _main_side(args: argparse.Namespace, names: list[str]) -> dict[str, Any]:
    """One side of one preset in this process (what `isolated_compare` runs), JSON to --out."""
    if len(names) != 1 or args.out is None:
        raise SystemExit("--side runs one preset and needs --out.")
    preset = _resolved(names[0], args)
    bcfg = baseline_for(preset, remat=args.plain_remat)
    side = run_side(
        preset,
        args.side,
        steps=args.steps,
        warmup=args.warmup,
        profile_dir=args.profile,
        profile_steps=args.profile_steps,
        plain_remat=args.plain_remat,
    )
    results = {
        "description": preset.description,
        "params": side["params"],
        "tokens_per_step": preset.batch_size * preset.seq_len,
        "model_flops_per_step": _model_flops_per_step(preset),
        "peak_tflops": _peak_tflops(),
        "remat": {"equipax": preset.model.transformer.remat, "baseline": bcfg.remat},
        "attention_impl": preset.model.transformer.attention_impl,
        "dtype": preset.model.dtype,
        "side": side,
        "environment": _environment(),
    }
    return _write(results, args.out)


def _main_compare(args: argparse.Namespace, names: list[str], *, isolate: bool) -> dict[str, Any]:
    per_preset = {}
    for name in dict.fromkeys(names):
        if isolate:
            print(f"[{name}] equipax vs plain JAX, each in its own process ...", file=sys.stderr, flush=True)
            per_preset[name] = isolated_compare(name, args)
            continue
        preset = _resolved(name, args)
        print(f"[{name}] {preset.description}: equipax vs plain JAX ...", file=sys.stderr, flush=True)
        per_preset[name] = compare_preset(
            preset,
            steps=args.steps,
            warmup=args.warmup,
            profile_dir=args.profile,
            profile_steps=args.profile_steps,
            plain_remat=args.plain_remat,
        )
    env = next(iter(per_preset.values()))["environment"] if isolate else _environment()
    results = {
        "benchmark": "train_step_compare",
        **env,
        "settings": {
            "steps": args.steps,
            "warmup": args.warmup,
            "scan_override": args.scan,
            "remat_override": args.remat,
            "plain_remat": args.plain_remat,
            "equipax_knobs": args.set,
            "plain_float32_logits": args.plain_float32_logits,
            "attention_override": args.attention,
            "dtype_override": args.dtype,
            "isolate": isolate,
        },
        "presets": per_preset,
    }
    print(_compare_table(results))
    if args.profile is not None:
        op_profile = _load_benchmark_module("op_profile")
        results["op_profiles"] = {}
        for name, r in per_preset.items():
            traces = {label: r[side].get("trace") for label, side in (("equipax", "equipax"), ("plain", "baseline"))}
            if not all(traces.values()):
                print(f"[{name}] no trace file found: {traces}", file=sys.stderr)
                continue
            summary = op_profile.compare_traces(traces, steps=args.profile_steps, top=args.top)
            print(f"\n[{name}] per-op device time (benchmarks/op_profile.py)")
            print(op_profile.format_comparison(summary))
            out = args.profile / name / "op_profile.json"
            out.write_text(json.dumps(summary, indent=2) + "\n")
            results["op_profiles"][name] = str(out)
    return _write(results, args.out or COMPARE_OUT)


def _write(results: dict[str, Any], out: Path) -> dict[str, Any]:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return results


if __name__ == "__main__":
    main()
