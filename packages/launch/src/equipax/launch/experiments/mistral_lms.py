"""Mistral 7B (v0.1): Llama's block with sliding-window attention (each token attends to itself
and the 4,095 tokens before it) and grouped-query attention, as a configuration of the one
decoder stack (`decoder_presets.decoder_lm`). Every attention kernel honours the window (XLA's
mask, cuDNN's `local_window_size`, splash's `LocalMask`), and KV-cache decoding masks it too.
Full size: C4-format shards with a 32,000-piece SentencePiece vocabulary (`data.vocab_path` may
name Mistral's own `tokenizer.model`), sequences of 8,192 so that the window matters.
`mistral_7b_smoke` shrinks the window to 8 positions of its 32.
"""

from equipax.launch.configs.experiment import ExperimentConfig
from equipax.launch.experiments.decoder_presets import decoder_lm, full_size, smoke
from equipax.launch.experiments.registry import register

__all__ = ["MISTRAL_7B", "mistral_7b", "mistral_7b_smoke"]

MISTRAL_7B = decoder_lm(
    vocab_size=32_000,
    max_seq_len=32_768,
    num_layers=32,
    model_dims=4096,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    hidden_dims=14_336,
    rope_theta=10_000.0,
    sliding_window=4096,
)


@register
def mistral_7b() -> ExperimentConfig:
    """Mistral 7B (7,241,732,096 parameters; sliding window 4096, GQA 32/8) on C4, FSDP over 32 chips (v5p-64)."""
    return full_size(
        "mistral_7b",
        "Mistral 7B (sliding-window attention) on C4-format shards.",
        MISTRAL_7B,
        seq_len=8192,
        per_device_batch=2,
        ici=(1, 32, 1),
    )


@register
def mistral_7b_smoke() -> ExperimentConfig:
    """`mistral_7b`'s code path (sliding window of 8 over 32 positions, GQA, FSDP) at toy size on 8 CPU devices."""
    return smoke(mistral_7b(), sliding_window=8)
