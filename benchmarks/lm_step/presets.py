"""The benchmarked models (`PRESETS`), the command line's knob overrides on them, and the
experiment each one builds: what `launch run` would build from the same config, "auto" remat and
attention resolved as `launch run` resolves them."""

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import jax

from equipax.core.mesh import build_mesh
from equipax.core.nn import TransformerConfig
from equipax.core.nn.fused_attention import resolve_attention as resolve_kernel
from equipax.core.optim import LearnerConfig
from equipax.launch.configs.experiment import DataConfig, ExperimentConfig
from equipax.launch.program.training import Training, build_training
from equipax.models.lm import LMConfig


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


def with_overrides(
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


def resolve_attention(preset: Preset, platform: str | None = None) -> Preset:
    """`attention_impl="auto"` replaced by the kernel the model's train step computes with on
    `platform` (default: JAX's), resolved as `launch run`'s task resolves and records it
    (`equipax.core.nn.fused_attention.resolve_attention`, without a context axis: the plain side
    has none), so the plain side runs the same one; other presets unchanged."""
    t = preset.model.transformer
    if t.attention_impl != "auto":
        return preset
    kernel = resolve_kernel(t, platform or jax.default_backend(), seq_len=preset.seq_len, dtype=preset.model.dtype)
    if kernel is None:  # no softmax attention: no kernel to pick
        return preset
    return with_overrides(preset, scan=None, remat=None, attention=kernel)


def resolve_auto_remat(preset: Preset) -> Preset:
    """`remat="auto"` chosen as `launch run` chooses it (compiling the candidates against this
    device's memory, `equipax.launch.aot.remat.choose_remat`); other presets unchanged."""
    if preset.model.transformer.remat != "auto":
        return preset
    from equipax.launch.aot.remat import choose_remat
    from equipax.launch.training.loop import remat_target

    cfg = preset_config(preset)
    mesh = build_mesh(cfg.mesh)
    budget, roofline, target = remat_target(cfg, mesh.devices.flat[0])
    choice = choose_remat(
        cfg,
        mesh,
        budget_gib=budget,
        margin=cfg.train.hbm_margin,
        roofline=roofline,
        target=target,
        log=lambda m: print(f"[{preset.name}] {m}", file=sys.stderr, flush=True),
    )
    print(f"[{preset.name}] remat auto -> {choice.policy}", file=sys.stderr, flush=True)
    model = choice.cfg.model
    return dataclasses.replace(preset, model=model, experiment=choice.cfg if preset.experiment else None)


def preset_training(preset: Preset) -> Training:
    """The preset's experiment built by `build_training` (the step `launch run` runs)."""
    cfg = preset_config(preset)
    return build_training(cfg, build_mesh(cfg.mesh))
