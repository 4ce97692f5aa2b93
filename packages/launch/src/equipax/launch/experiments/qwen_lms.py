"""The Qwen3 dense family: Llama's block with QK-norm (an RMSNorm over each head's queries and keys
before the rotation), `rope_theta` 1,000,000 and RMSNorm epsilon 1e-6, as configurations of the one
decoder stack (`decoder_presets.decoder_lm`). Qwen3 0.6B ties its input and output embeddings,
8B does not. Full size: C4-format shards with a 151,936-piece vocabulary (`data.vocab_path`; Qwen's
own tokenizer is byte-level BPE, which equipax does not read). `*_smoke` variants run at toy size
on 8 simulated CPU devices.
"""

from equipax.launch.configs.experiment import ExperimentConfig
from equipax.launch.experiments.decoder_presets import decoder_lm, full_size, smoke
from equipax.launch.experiments.registry import register

__all__ = ["QWEN3_0_6B", "qwen3_0_6b", "qwen3_0_6b_smoke", "QWEN3_8B", "qwen3_8b", "qwen3_8b_smoke"]

QWEN3_0_6B = decoder_lm(
    vocab_size=151_936,
    max_seq_len=32_768,
    num_layers=28,
    model_dims=1024,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    hidden_dims=3072,
    rope_theta=1_000_000.0,
    norm_eps=1e-6,
    qk_norm=True,
    tie_embeddings=True,
    # The attention's context kept (with splash, its log-sum-exp), the rest recomputed: on its
    # v5p-8 and cut to one v5e (batch 2) it fits and is projected faster than full remat and than
    # what "auto" picks, within 0.3% of the fastest that fits (benchmarks/README.md, "Splash's
    # residuals under remat"), and a run spends no start-up choosing.
    remat="save_context",
)

QWEN3_8B = decoder_lm(
    vocab_size=151_936,
    max_seq_len=32_768,
    num_layers=36,
    model_dims=4096,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    hidden_dims=12_288,
    rope_theta=1_000_000.0,
    norm_eps=1e-6,
    qk_norm=True,
)


@register
def qwen3_0_6b() -> ExperimentConfig:
    """Qwen3 0.6B (596,049,920 parameters; QK-norm, tied embeddings) on C4, FSDP over 4 chips (v5p-8),
    remat "save_context"."""
    return full_size(
        "qwen3_0_6b",
        "Qwen3 0.6B (QK-norm, tied embeddings) on C4-format shards.",
        QWEN3_0_6B,
        seq_len=4096,
        per_device_batch=8,
        ici=(1, 4, 1),
    )


@register
def qwen3_8b() -> ExperimentConfig:
    """Qwen3 8B (8,190,735,360 parameters; QK-norm, GQA 32/8) on C4, FSDP over 64 chips (v5p-128)."""
    return full_size(
        "qwen3_8b",
        "Qwen3 8B (QK-norm, untied embeddings) on C4-format shards.",
        QWEN3_8B,
        seq_len=4096,
        per_device_batch=4,
        ici=(1, 64, 1),
    )


@register
def qwen3_0_6b_smoke() -> ExperimentConfig:
    """`qwen3_0_6b`'s code path (QK-norm, tied embeddings, GQA, FSDP) at toy size on 8 CPU devices."""
    return smoke(qwen3_0_6b())


@register
def qwen3_8b_smoke() -> ExperimentConfig:
    """`qwen3_8b`'s code path (QK-norm, GQA, FSDP) at toy size on 8 CPU devices."""
    return smoke(qwen3_8b())
