"""Attention benchmarks registered as experiments (`launch run --exp attention_bench`)."""

from equipax.launch.commands.bench import AttentionBenchConfig
from equipax.launch.experiments.registry import register_benchmark


@register_benchmark
def attention_bench() -> AttentionBenchConfig:
    """The linear-attention article's benchmark: batch 32, d_k 64, N = 128..6000, 100 runs."""
    return AttentionBenchConfig()
