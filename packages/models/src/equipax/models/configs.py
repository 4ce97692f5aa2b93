"""The config classes of `equipax.models`: frozen dataclasses, validated when built, and no JAX.

`LMConfig`, `LlamaConfig` and `CNNConfig` (and the analytic Llama parameter and FLOP counts) are
defined here and re-exported by the model modules (`equipax.models.lm`, `.llama`, `.cnn`), so
that building or printing an experiment (`launch list`, `launch show`, knob errors) does not
import JAX (benchmarks/README.md, "CLI latency"). Nothing here may import jax or equinox.
"""

import dataclasses
from typing import Literal

from equipax.core.configs import MeshConfig, TransformerConfig, check_pipeline
from equipax.core.flops import lm_param_counts, transformer_lm_flops_per_token

__all__ = ["CNNConfig", "cnn_param_count", "DTYPES", "LMConfig", "LlamaConfig", "llama_flops_per_token", "llama_param_counts"]

# Activation dtypes a model config may name (`dtype`); the model modules map them to jnp dtypes.
DTYPES = ("float32", "bfloat16")
_REMATS = ("none", "full", "dots_saveable")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LMConfig:
    """Hyperparameters of the transformer language model.

    Attributes:
        vocab_size: token ids are in `[0, vocab_size)`: the embedding table's rows (and the
            size the SentencePiece tokenizer is trained to).
        max_seq_len: the longest sequence the model takes (the sinusoidal table's length).
        transformer: the block stack's hyperparameters.
        output_logit_cap: soft cap on the output logits, `cap * tanh(logits / cap)` (Pax's
            soft-capped logits); None = off.
        position: "sinusoidal" position embeddings added to the token embeddings, or "none".
        dtype: the activations' dtype; parameters and logits stay float32.
    """

    vocab_size: int = 2048
    max_seq_len: int = 128
    transformer: TransformerConfig = dataclasses.field(default_factory=TransformerConfig)
    output_logit_cap: float | None = 30.0
    position: Literal["sinusoidal", "none"] = "sinusoidal"
    dtype: Literal["float32", "bfloat16"] = "float32"

    def __post_init__(self) -> None:
        for name, low in (("vocab_size", 2), ("max_seq_len", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"LMConfig.{name} must be an int >= {low}, got {value!r}.")
        if not isinstance(self.transformer, TransformerConfig):
            raise ValueError(
                f"LMConfig.transformer must be a TransformerConfig, "
                f"got {type(self.transformer).__name__}."
            )
        cap = self.output_logit_cap
        if cap is not None and not cap > 0:
            raise ValueError(f"LMConfig.output_logit_cap must be > 0 or None, got {cap!r}.")
        if self.position not in ("sinusoidal", "none"):
            raise ValueError(
                f"LMConfig.position must be 'sinusoidal' or 'none', got {self.position!r}."
            )
        if self.dtype not in DTYPES:
            raise ValueError(
                f"LMConfig.dtype must be one of {DTYPES}, got {self.dtype!r}; "
                "use 'float32' on CPU."
            )

    def check_mesh(self, mesh: MeshConfig, global_batch: int) -> None:
        """Raise ConfigError unless the pipeline knobs fit `mesh` and `global_batch`."""
        check_pipeline(self.transformer, mesh, global_batch)

    @property
    def pipeline_stages(self) -> int:
        """Pipeline stages of the block stack (1 = not pipelined)."""
        return self.transformer.pipeline_stages

    def param_counts(self) -> dict[str, int]:
        """Analytic parameter counts: `total`, `embedding` (tied table), `per_layer`, ..."""
        return lm_param_counts(self.transformer, self.vocab_size)

    def flops_per_token(self, *, seq_len: int) -> dict[str, float]:
        """Model FLOPs per token (`training`, `attention`, `remat`, ...) at `seq_len`."""
        return transformer_lm_flops_per_token(self.transformer, vocab_size=self.vocab_size, seq_len=seq_len)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Hyperparameters of the Llama-style decoder (defaults: a tiny CPU model).

    Attributes:
        vocab_size: token ids are in `[0, vocab_size)` (embedding and unembedding rows).
        max_seq_len: the longest sequence the model takes.
        num_layers: decoder blocks.
        model_dims: width of the residual stream (`embed`).
        num_heads: query heads per block.
        head_dim: dimensions per head.
        rope_theta: base of the rotary position frequencies.
        norm_eps: epsilon of the RMS norms.
        embedding_init_std: standard deviation of the input embedding's initial entries. 1.0
            (torchtitan's Llama init) starts the residual stream at unit RMS, the scale of
            what each block adds to it (projections are initialised with variance 1/fan_in)
            and the scale of the GPT's `embedding x sqrt(model_dims)`; 1/sqrt(model_dims)
            lets the blocks drown the token identity at first and learns worse (measured in
            equipax.launch.experiments.llama_lms). Initialisation only: the weights' shapes and
            the forward pass are the same whatever its value.
        scan_layers: run the blocks as one `jax.lax.scan` over stacked weights.
        remat: recompute each block in the backward pass: "none", "full" or "dots_saveable".
        dtype: the activations' dtype; parameters and logits stay float32.
    """

    vocab_size: int = 2048
    max_seq_len: int = 128
    num_layers: int = 4
    model_dims: int = 256
    num_heads: int = 4
    # Key/value heads shared by groups of query heads: num_heads = MHA, 1 = MQA.
    num_kv_heads: int = 2
    head_dim: int = 64
    # SwiGLU width (each of gate, up and down has model_dims x hidden_dims weights).
    hidden_dims: int = 688
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    embedding_init_std: float = 1.0
    scan_layers: bool = True
    remat: Literal["none", "full", "dots_saveable"] = "none"
    dtype: Literal["float32", "bfloat16"] = "float32"

    def __post_init__(self) -> None:
        for name, low in (
            ("vocab_size", 2), ("max_seq_len", 1), ("num_layers", 1), ("model_dims", 1),
            ("num_heads", 1), ("num_kv_heads", 1), ("head_dim", 2), ("hidden_dims", 1),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(
                    f"LlamaConfig.{name} must be an int >= {low}, got {value!r}; "
                    f"set {name}=<int >= {low}>."
                )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"LlamaConfig.num_heads={self.num_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads} (each key/value head serves a group of "
                "query heads); pick num_kv_heads among the divisors of num_heads."
            )
        if self.head_dim % 2:
            raise ValueError(
                f"LlamaConfig.head_dim must be even for rotary embeddings, got {self.head_dim}."
            )
        for name in ("rope_theta", "norm_eps", "embedding_init_std"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"LlamaConfig.{name} must be a number > 0, got {value!r}.")
        if self.remat not in _REMATS:
            raise ValueError(f"LlamaConfig.remat must be one of {_REMATS}, got {self.remat!r}.")
        if self.dtype not in DTYPES:
            raise ValueError(
                f"LlamaConfig.dtype must be one of {DTYPES}, got {self.dtype!r}; "
                "use 'float32' on CPU."
            )

    # The same derived numbers as LMConfig's, so the launcher never asks which LM family it has.
    pipeline_stages = 1  # Llama's stack is not pipelined

    def param_counts(self) -> dict[str, int]:
        """Analytic parameter counts; `embedding` counts both tables (untied input and output)."""
        counts = llama_param_counts(self)
        return counts | {"embedding": counts["embedding"] + counts["unembedding"]}

    def flops_per_token(self, *, seq_len: int) -> dict[str, float]:
        """Model FLOPs per token (`training`, `attention`, `remat`, ...) at `seq_len`."""
        return llama_flops_per_token(self, seq_len=seq_len)


def llama_param_counts(cfg: LlamaConfig) -> dict[str, int]:
    """Analytic parameter counts of `LlamaLM`.

    Arguments:
        cfg: model config.

    Returns:
        `embedding` (input table), `unembedding` (output projection), `per_layer` (one
        block: two norms, attention, SwiGLU), `final_norm` and `total`.
    """
    d, hd, f = cfg.model_dims, cfg.head_dim, cfg.hidden_dims
    attention = d * cfg.num_heads * hd * 2 + d * 2 * cfg.num_kv_heads * hd
    per_layer = 2 * d + attention + 3 * d * f
    counts = {
        "embedding": cfg.vocab_size * d,
        "unembedding": d * cfg.vocab_size,
        "per_layer": per_layer,
        "final_norm": d,
    }
    counts["total"] = (
        counts["embedding"] + counts["unembedding"] + cfg.num_layers * per_layer + d
    )
    return counts


def llama_flops_per_token(cfg: LlamaConfig, *, seq_len: int) -> dict[str, float]:
    """FLOPs per token of `LlamaLM`, with the accounting of
    `equipax.core.flops.transformer_lm_flops_per_token` (a matmul `[m k] @ [k n]` counts
    `2 m k n`; causal attention half of `QK^T` and `PV`; training 3x forward).

    Grouped-query attention projects `num_heads + 2 num_kv_heads` heads; the attention
    products themselves run over all `num_heads` query heads.

    Arguments:
        cfg: model config.
        seq_len: sequence length (for the attention term).

    Returns:
        Per-token FLOPs, all layers summed: `qkv_projection`, `output_projection`, `mlp`,
        `attention`, `unembedding`, `forward`, `training` (the model FLOPs), `remat` (extra
        forward work recomputed under `cfg.remat`) and `training_with_remat`.
    """
    d, h, hd, n = cfg.model_dims, cfg.num_heads, cfg.head_dim, cfg.num_layers
    qkv = 2.0 * d * (h + 2 * cfg.num_kv_heads) * hd
    out_proj = 2.0 * h * hd * d
    mlp = 2.0 * d * cfg.hidden_dims * 3
    attention = 2.0 * 2.0 * seq_len * h * hd / 2.0
    unembedding = 2.0 * d * cfg.vocab_size
    layers_forward = n * (qkv + out_proj + mlp + attention)
    forward = layers_forward + unembedding
    remat = {"full": layers_forward, "dots_saveable": n * attention}.get(cfg.remat, 0.0)
    return {
        "qkv_projection": n * qkv,
        "output_projection": n * out_proj,
        "mlp": n * mlp,
        "attention": n * attention,
        "unembedding": unembedding,
        "forward": forward,
        "training": 3.0 * forward,
        "remat": remat,
        "training_with_remat": 3.0 * forward + remat,
    }


@dataclasses.dataclass(frozen=True, kw_only=True)
class CNNConfig:
    """Hyperparameters of `AdvancedCNN` (defaults: the tutorial's).

    Arguments:
        num_classes: output classes.
        in_channels: channels of the input images (3 for RGB, 1 for grey).
        stem_channels: channels of the first 3x3 convolution.
        stage_channels: channels of the residual stages; a 2x2 max-pool separates stages.
        blocks_per_stage: residual blocks in each stage.
        num_heads: self-attention heads (the attention width is the last stage's channels).
        hidden_dims: width of the dense layer before dropout.
        dropout_rate: dropout probability in training.
        bn_momentum: BatchNorm running-average momentum.
    """

    num_classes: int = 10
    in_channels: int = 3
    stem_channels: int = 32
    stage_channels: tuple[int, ...] = (64, 128)
    blocks_per_stage: int = 2
    num_heads: int = 4
    hidden_dims: int = 256
    dropout_rate: float = 0.5
    bn_momentum: float = 0.99

    def __post_init__(self) -> None:
        for name in ("num_classes", "in_channels", "stem_channels", "blocks_per_stage", "num_heads",
                     "hidden_dims"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model.{name} must be a positive int; got {value!r}.")
        if self.num_classes < 2:
            raise ValueError(f"model.num_classes must be >= 2; got {self.num_classes}.")
        if not self.stage_channels or any(c < 1 for c in self.stage_channels):
            raise ValueError(f"model.stage_channels must be positive channel counts, e.g. (64, 128); "
                             f"got {self.stage_channels!r}.")
        if self.stage_channels[-1] % self.num_heads:
            raise ValueError(
                f"model.num_heads={self.num_heads} must divide the attention width "
                f"model.stage_channels[-1]={self.stage_channels[-1]}; change either.")
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ValueError(f"model.dropout_rate must be in [0, 1); got {self.dropout_rate}.")
        if not 0.0 <= self.bn_momentum < 1.0:
            raise ValueError(f"model.bn_momentum must be in [0, 1); got {self.bn_momentum}.")


def cnn_param_count(cfg: CNNConfig) -> int:
    """Analytic parameter count of `AdvancedCNN` (the BatchNorm running statistics are state,
    not parameters; each BatchNorm has a learned scale and bias). Equal to counting the traced
    model's arrays (tested), without importing JAX.

    Arguments:
        cfg: model config.

    Returns:
        The number of trained parameters.
    """

    def conv(cin: int, cout: int, k: int) -> int:
        return k * k * cin * cout + cout  # weight + bias

    total, channels = conv(cfg.in_channels, cfg.stem_channels, 3), cfg.stem_channels
    for width in cfg.stage_channels:
        for _ in range(cfg.blocks_per_stage):
            total += conv(channels, width, 3) + conv(width, width, 3) + 2 * (2 * width)
            total += conv(channels, width, 1) if channels != width else 0
            channels = width
    total += (channels * 3 * channels + 3 * channels) + (channels * channels + channels)  # attention
    total += channels * cfg.hidden_dims + cfg.hidden_dims  # dense
    return total + cfg.hidden_dims * cfg.num_classes + cfg.num_classes  # head
