"""Attention benchmarks registered as experiments (`launch run --exp attention_bench`)."""

from equipax.launch.bench import AttentionBenchConfig
from equipax.launch.registry import register


@register
def attention_bench() -> AttentionBenchConfig:
    """The linear-attention article's benchmark: batch 32, d_k 64, N = 128..6000, 100 runs."""
    return AttentionBenchConfig()
