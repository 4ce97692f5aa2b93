"""Attention benchmarks registered as experiments (`launch run --exp attention_bench`), and their
config (`launch bench attention` builds the same one). No JAX here: `launch list` imports this."""

import dataclasses

from equipax.launch.experiments.registry import register_benchmark

__all__ = ["attention_bench", "AttentionBenchConfig", "IMPLEMENTATIONS"]

# name -> (family, number of [batch heads N N] float32 intermediates the estimate assumes).
IMPLEMENTATIONS: dict[str, tuple[str, int]] = {
    "softmax_reference": ("softmax", 2),
    "softmax": ("softmax", 2),
    "softmax_jax_nn": ("softmax", 2),
    "linear": ("linear", 0),
    "linear_reference": ("linear", 2),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionBenchConfig:
    """The attention benchmark: what `launch bench attention` and `--exp attention_bench` run."""

    name: str = "attention_bench"
    description: str = "Forward time and memory of softmax vs linear attention by sequence length."
    seq_lens: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096, 6000)
    batch_size: int = 32
    num_heads: int = 1
    head_dim: int = 64
    repeats: int = 100
    causal: bool = False
    implementations: tuple[str, ...] = ("softmax_reference", "softmax", "softmax_jax_nn", "linear")
    chunk_size: int = 64
    # None: the machine's available memory (MemAvailable) when the benchmark starts.
    memory_limit_gb: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.seq_lens or any(n < 1 for n in self.seq_lens):
            raise ValueError(f"seq_lens must be positive lengths, e.g. (128, 512); got {self.seq_lens!r}.")
        for name in ("batch_size", "num_heads", "head_dim", "repeats", "chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)!r}.")
        unknown = [i for i in self.implementations if i not in IMPLEMENTATIONS]
        if unknown or not self.implementations:
            raise ValueError(
                f"Unknown attention implementation(s) {unknown or self.implementations!r}; "
                f"choose from {', '.join(IMPLEMENTATIONS)}."
            )
        if self.memory_limit_gb is not None and not self.memory_limit_gb > 0:
            raise ValueError(f"memory_limit_gb must be > 0 or None; got {self.memory_limit_gb!r}.")


@register_benchmark
def attention_bench() -> AttentionBenchConfig:
    """The linear-attention article's benchmark: batch 32, d_k 64, N = 128..6000, 100 runs."""
    return AttentionBenchConfig()
