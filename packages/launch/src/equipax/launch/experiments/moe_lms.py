"""The mixture-of-experts families (docs/moe.md): Mixtral 8x7B and Qwen3-30B-A3B, Llama-style blocks
whose feed-forward is a mixture of experts, as configurations of the one decoder stack
(`decoder_presets.decoder_lm` + the `num_experts` knobs), with the published sizes (Hugging Face's
`config.json` of `mistralai/Mixtral-8x7B-v0.1` and `Qwen/Qwen3-30B-A3B`).

- Mixtral 8x7B: 32 layers, d 4096, GQA 32/8, 8 experts of SwiGLU 14336, top-2, RoPE base 1e6,
  `router_aux_loss_coef` 0.02; 46,702,792,704 parameters, 12,879,925,248 active per token.
- Qwen3-30B-A3B: 48 layers, d 2048, GQA 32/4 with QK-norm, 128 experts of SwiGLU 768, top-8
  (renormalised), RoPE base 1e6, RMSNorm epsilon 1e-6, `router_aux_loss_coef` 0.001;
  30,532,122,624 parameters, 3,353,032,704 active.

The full-size experiments train on C4-format shards over one TPU slice with an `expert` mesh axis
(data, fsdp, expert, tensor). Mixtral uses a capacity factor of 1.25 (static `[experts, capacity]`
buffers exchanged by all-to-all; with top-2 the dropless all-gather would move 4x more over an
`expert` axis of 8); Qwen3-30B-A3B is dropless (top-8: the all-gather moves about what the
all-to-all would). `*_smoke` variants run at toy size on 8 simulated CPU devices with an `expert`
axis (Qwen3's 128 experts shrunk to 16, top-4).
"""

import dataclasses

from equipax.core.mesh_config import EXPERT_AXES, MeshConfig
from equipax.launch.configs.experiment import ExperimentConfig
from equipax.launch.experiments.decoder_presets import decoder_lm, full_size, smoke
from equipax.launch.experiments.registry import register
from equipax.models.configs import LMConfig

__all__ = [
    "MIXTRAL_8X7B",
    "QWEN3_30B_A3B",
    "mixtral_8x7b",
    "mixtral_8x7b_smoke",
    "qwen3_30b_a3b",
    "qwen3_30b_a3b_smoke",
]


def _with_experts(model: LMConfig, **moe: object) -> LMConfig:
    return dataclasses.replace(model, transformer=dataclasses.replace(model.transformer, **moe))  # pyright: ignore[reportArgumentType]


def _expert_mesh(ici: tuple[int, int, int, int]) -> MeshConfig:
    """A single-slice mesh over (data, fsdp, expert, tensor)."""
    return MeshConfig(ici_mesh_shape=ici, dcn_mesh_shape=(1, 1, 1, 1), axis_names=EXPERT_AXES)


MIXTRAL_8X7B = _with_experts(
    decoder_lm(
        vocab_size=32_000,
        max_seq_len=32_768,
        num_layers=32,
        model_dims=4096,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        hidden_dims=14_336,
        rope_theta=1_000_000.0,
    ),
    num_experts=8,
    num_experts_per_tok=2,
    capacity_factor=1.25,
    router_aux_loss_coef=0.02,
)

QWEN3_30B_A3B = _with_experts(
    decoder_lm(
        vocab_size=151_936,
        max_seq_len=40_960,
        num_layers=48,
        model_dims=2048,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        hidden_dims=6144,
        rope_theta=1_000_000.0,
        norm_eps=1e-6,
        qk_norm=True,
    ),
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    norm_topk_prob=True,
    router_aux_loss_coef=0.001,
)


@register
def mixtral_8x7b() -> ExperimentConfig:
    """Mixtral 8x7B (46.7B parameters, 12.9B active; 8 experts, top-2) on C4, fsdp 8 x expert 8 (v5p-128)."""
    cfg = full_size(
        "mixtral_8x7b",
        "Mixtral 8x7B (8 experts, top-2, capacity 1.25) on C4-format shards.",
        MIXTRAL_8X7B,
        seq_len=4096,
        per_device_batch=2,
        ici=(1, 64, 1),
    )
    return dataclasses.replace(cfg, mesh=_expert_mesh((1, 8, 8, 1)))


@register
def qwen3_30b_a3b() -> ExperimentConfig:
    """Qwen3-30B-A3B (30.5B parameters, 3.3B active; 128 experts, top-8) on C4, fsdp 4 x expert 8 (v5p-64)."""
    cfg = full_size(
        "qwen3_30b_a3b",
        "Qwen3-30B-A3B (128 experts, top-8, dropless, QK-norm) on C4-format shards.",
        QWEN3_30B_A3B,
        seq_len=4096,
        per_device_batch=4,
        ici=(1, 32, 1),
    )
    return dataclasses.replace(cfg, mesh=_expert_mesh((1, 4, 8, 1)))


def _moe_smoke(cfg: ExperimentConfig, ici: tuple[int, int, int, int], **moe: object) -> ExperimentConfig:
    """`smoke(cfg)` on an 8-device mesh with an `expert` axis, the experts shrunk by `moe`."""
    small = smoke(cfg)
    assert isinstance(small.model, LMConfig)
    return dataclasses.replace(small, model=_with_experts(small.model, **moe), mesh=_expert_mesh(ici))


@register
def mixtral_8x7b_smoke() -> ExperimentConfig:
    """`mixtral_8x7b`'s code path (8 experts top-2 with capacity, GQA) at toy size: fsdp 2 x expert 4."""
    return _moe_smoke(mixtral_8x7b(), (1, 2, 4, 1))


@register
def qwen3_30b_a3b_smoke() -> ExperimentConfig:
    """`qwen3_30b_a3b`'s code path (dropless, QK-norm) at toy size: 16 experts of 32, top-4, expert 8."""
    return _moe_smoke(qwen3_30b_a3b(), (1, 1, 8, 1), num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32)
