"""The config classes of `equipax.models`: frozen dataclasses, validated when built, and no JAX.

`LMConfig` (every language-model family: Pax's GPT, Llama, Qwen, Mistral are presets of it) and
`CNNConfig` are defined here and re-exported by the model modules (`equipax.models.lm`,
`.cnn`), so that building or printing an experiment (`launch list`, `launch show`, knob errors)
does not import JAX (benchmarks/README.md, "CLI latency"). Nothing here may import jax or equinox.
"""

import dataclasses
import math
from typing import Any, ClassVar, Literal

from equipax.core.config_checks import check_experts, check_pipeline
from equipax.core.configs import QUANTIZATIONS, RopeScalingConfig, TransformerConfig
from equipax.core.context_config import check_context
from equipax.core.flops import lm_param_counts, transformer_lm_flops_per_token
from equipax.core.mesh_config import MeshConfig
from equipax.core.paths import local_only_problem

__all__ = ["CNNConfig", "cnn_param_count", "DTYPES", "LMConfig", "LORA_TARGETS", "LoRAConfig", "RopeScalingConfig"]

# Activation dtypes a model config may name (`dtype`); the model modules map them to jnp dtypes.
DTYPES = ("float32", "bfloat16")
_POSITIONS = ("sinusoidal", "rope", "none")
# The projections LoRA adapts, by the names Hugging Face PEFT gives them (`q_proj`, ...).
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """Low-rank adapters (LoRA) on a language model's projections (`equipax.models.LoRALM`).

    Attributes:
        enabled: train adapters on a frozen base model (False: train the whole model).
        rank: the adapters' rank r: each adapted weight W gets `W + (alpha / r) * A @ B` with
            A `[in, r]` and B `[r, out]` (B starts at zero, so training starts at the base model).
        alpha: the scale's numerator (PEFT's `lora_alpha`).
        targets: the projections adapted: attention `q`, `k`, `v`, `o`, feed-forward `gate`,
            `up`, `down` (PEFT's `q_proj` ... `down_proj`).
    """

    enabled: bool = False
    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("q", "k", "v", "o")

    def __post_init__(self) -> None:
        # Ranges are checked whether or not the adapters are on (a value out of range is a mistake
        # either way); the rank against the model's widths is `LMConfig`'s.
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(
                f"model.lora.rank must be a positive int; got {self.rank!r}. E.g. --set model.lora.rank=16."
            )
        alpha = self.alpha
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 < alpha < math.inf:
            raise ValueError(
                f"model.lora.alpha must be a finite number > 0 (the adapters' scale is alpha / rank); got "
                f"{alpha!r}. E.g. --set model.lora.alpha={2 * self.rank} (twice the rank, as PEFT's examples)."
            )
        if not self.enabled:
            return
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown or not self.targets:
            raise ValueError(
                f"model.lora.targets={self.targets!r} names no projection {unknown or ''}; choose among "
                f"{', '.join(LORA_TARGETS)}, e.g. --set \"model.lora.targets=('q', 'v')\"."
            )

    @property
    def scale(self) -> float:
        """The factor of `A @ B`: `alpha / rank`."""
        return self.alpha / self.rank


@dataclasses.dataclass(frozen=True, kw_only=True)
class LMConfig:
    """Hyperparameters of a decoder-only language model: every family is a value of this class.

    Pax's GPT is the default (tied embedding scaled by sqrt(model_dims), sinusoidal positions,
    output logit cap); a Llama-style model sets rotary positions, untied embeddings and no
    multiplier (`equipax.launch.experiments` has the presets; docs/extending.md, "Adding a family").

    Attributes:
        vocab_size: token ids are in `[0, vocab_size)`: the embedding table's rows (and the
            size the SentencePiece tokenizer is trained to).
        max_seq_len: the longest sequence the model takes (prompt and generated tokens together).
        transformer: the block stack's hyperparameters.
        output_logit_cap: soft cap on the output logits, `cap * tanh(logits / cap)` (Pax's
            soft-capped logits); None = off.
        position: "sinusoidal" position embeddings added to the token embeddings (Pax), "rope"
            (rotary positions in every attention layer: Llama, Qwen, Mistral), or "none".
        rope_theta: base of the rotary frequencies (1e4 Llama 2, 5e5 Llama 3, 1e6 Qwen3).
        rope_scaling: rescaled rotary frequencies for a longer context (Llama 3.1's "llama3"
            rule); None = none.
        tie_embeddings: the output logits use the input embedding table (Pax, Llama 3.2, Qwen3
            0.6B); False = a separate `[embed vocab]` output projection (Llama 2/3/3.1, Mistral).
        embedding_multiplier: the token embeddings are multiplied by this: "sqrt_model_dims" (Pax,
            Gemma), a number, or None (x 1: Llama).
        embedding_init_std: standard deviation of the input table's initial entries; None =
            1/sqrt(model_dims) (Pax's shared softmax). 1.0 (torchtitan's Llama init) starts the
            residual stream at unit RMS when there is no multiplier (the scale of what each block
            adds to it). Initialisation only.
        dtype: the activations' dtype; parameters and logits stay float32.
        init_from: "hf:DIR": a run that has no checkpoint yet starts from the weights of the Hugging
            Face model directory DIR (config.json + safetensors) instead of a random init; its
            config.json must describe this architecture (docs/hf.md). None = random init.
        lora: low-rank adapters trained on the frozen model (`LoRAConfig`; off by default).
        z_loss_coef: weight of the output z-loss, the weighted mean over tokens of
            `logsumexp(logits)**2` (PaLM's 1e-4; MaxText's `z_loss_multiplier`): keeps the softmax
            normaliser near 1 in long bf16 runs. A named loss `z_loss` beside `cross_entropy` (and a
            mixture of experts' `router_aux`, `router_z`), each logged as `loss/<name>` and
            evaluated (docs/extending.md, "Several losses"). 0 = off.
        num_vocab_tiling: compute the loss a chunk of the vocabulary at a time (MaxText's
            `num_vocab_tiling`): > 1 never holds the `[batch seq vocab]` logits, only a chunk of
            `vocab / num_vocab_tiling` at a time, for one more head matmul per step (the backward
            pass recomputes each chunk). 1 = the whole head at once, which moves the fewest bytes
            and no extra FLOPs (docs/lm_families.md, "The output head and its loss"). Must divide
            `vocab_size`.
        quantization: how the attention projections and the feed-forward's matmuls compute
            (MaxText's `quantization`, Pax's AQT; docs/quantization.md): "none" (in `dtype`); "int8"
            (int8 forward and backward: activations scaled per token, weights per output channel,
            int32 sums; a TPU's int8 rate is twice its bfloat16 rate); "int8w" (weights rounded to
            int8 per output channel; decoding reads an int8 copy made once at load); "fp8" (float8,
            GPUs with FP8 units only). The embedding, the output logits and the attention scores
            stay in `dtype`, and checkpoints hold float weights whatever the mode: a job may
            switch it at resume. A mixture of experts computes in float (refused here).
    """

    # Knobs the Llama experiments had before the LM families shared this config, and where they are
    # now: `--set` of an old path names the new one (docs/knobs.md, "Renamed knobs").
    RENAMED: ClassVar[dict[str, str]] = {
        name: f"transformer.{name}"
        for name in (
            "num_layers",
            "model_dims",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "hidden_dims",
            "norm_eps",
            "scan_layers",
            "remat",
        )
    }

    vocab_size: int = 2048
    max_seq_len: int = 128
    transformer: TransformerConfig = dataclasses.field(default_factory=TransformerConfig)
    output_logit_cap: float | None = 30.0
    position: Literal["sinusoidal", "rope", "none"] = "sinusoidal"
    rope_theta: float = 10_000.0
    rope_scaling: RopeScalingConfig | None = None
    tie_embeddings: bool = True
    embedding_multiplier: float | Literal["sqrt_model_dims"] | None = "sqrt_model_dims"
    embedding_init_std: float | None = None
    dtype: Literal["float32", "bfloat16"] = "float32"
    init_from: str | None = None
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)
    z_loss_coef: float = 0.0
    num_vocab_tiling: int = 1
    quantization: Literal["none", "int8", "int8w", "fp8"] = "none"

    @classmethod
    def saved_layout_error(cls, data: Any) -> str | None:
        """Why a saved config dict in the earlier Llama layout does not read (None: it reads).

        Its flat block knobs would move to `transformer`, but the Llama block it described (RMSNorm,
        SwiGLU, rotary positions, untied output) was implied by its class and is not in the dict, and
        its checkpoints hold another parameter layout: read as this class it would be another model.
        """
        old = sorted(k for k in cls.RENAMED if k in data and not isinstance(data[k], dict))
        if not old:
            return None
        return (
            f"This model config was saved by an earlier equipax whose Llama model had its own config class "
            f"(flat knobs {', '.join(f'model.{k}' for k in old)}; now under model.transformer, docs/knobs.md "
            "\"Renamed knobs\"). Its job's checkpoints hold that model's parameter layout, which this version "
            "does not read: retrain the experiment (e.g. `launch run --exp llama3_8b`), or use the earlier "
            "equipax for that job. Nothing in the job directory was changed."
        )

    def __post_init__(self) -> None:
        for name, low in (("vocab_size", 2), ("max_seq_len", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"LMConfig.{name} must be an int >= {low}, got {value!r}.")
        if not isinstance(self.transformer, TransformerConfig):
            raise ValueError(
                f"LMConfig.transformer must be a TransformerConfig, got {type(self.transformer).__name__}."
            )
        z = self.z_loss_coef
        if isinstance(z, bool) or not isinstance(z, (int, float)) or not 0 <= z < math.inf:
            raise ValueError(
                f"model.z_loss_coef must be a finite number >= 0, got {z!r}; PaLM used 1e-4, 0 turns it off."
            )
        self._check_tiling()
        cap = self.output_logit_cap
        if cap is not None and not cap > 0:
            raise ValueError(f"LMConfig.output_logit_cap must be > 0 or None, got {cap!r}.")
        if self.position not in _POSITIONS:
            raise ValueError(f"model.position must be one of {_POSITIONS}, got {self.position!r}.")
        if self.dtype not in DTYPES:
            raise ValueError(f"LMConfig.dtype must be one of {DTYPES}, got {self.dtype!r}; use 'float32' on CPU.")
        self._check_positions()
        self._check_embedding()
        self._check_quantization()
        if self.lora.enabled and "gate" in self.lora.targets and not self.transformer.gated:
            present = [t for t in LORA_TARGETS if t != "gate"]
            raise ValueError(
                f"model.lora.targets names 'gate', which this model does not have (its feed-forward is not gated: "
                f"model.transformer.gated=False); its projections are {', '.join(present)}."
            )
        if self.lora.enabled:
            self._check_lora_rank()
        src = self.init_from
        if src is not None and (not isinstance(src, str) or not src.startswith("hf:") or not src[3:].strip()):
            raise ValueError(
                f"model.init_from must be 'hf:DIR' (a Hugging Face model directory) or None, got {src!r}; e.g. "
                "--set model.init_from=hf:/models/Llama-3.2-1B."
            )
        if src is not None and (problem := local_only_problem(src[3:].strip(), "model.init_from's directory")):
            raise ValueError(problem + ".")

    def _check_positions(self) -> None:
        if not 0 < self.rope_theta < math.inf:
            raise ValueError(f"model.rope_theta must be a finite number > 0, got {self.rope_theta!r}.")
        head_dim = self.transformer.head_dim
        if self.position == "rope" and head_dim % 2:
            raise ValueError(
                f"model.position='rope' rotates pairs of each head's dimensions, but model.transformer.head_dim="
                f"{head_dim} is odd; use an even head_dim, or model.position='sinusoidal' / 'none'."
            )
        if self.rope_scaling is not None and self.position != "rope":
            raise ValueError(
                f"model.rope_scaling rescales rotary frequencies, but model.position={self.position!r}; set "
                "model.position='rope', or model.rope_scaling=None."
            )

    def _check_tiling(self) -> None:
        n, vocab = self.num_vocab_tiling, self.vocab_size
        if isinstance(n, bool) or not isinstance(n, int) or n < 1 or vocab % n:
            near = [d for d in range(2, min(vocab, 512) + 1) if vocab % d == 0][-8:]
            raise ValueError(
                f"model.num_vocab_tiling must be a whole number >= 1 that divides model.vocab_size={vocab} (the "
                f"loss takes vocab / num_vocab_tiling columns at a time), got {n!r}; e.g. one of {near}, or 1 "
                "(the whole head at once)."
            )

    def _check_quantization(self) -> None:
        q = self.quantization
        if q not in QUANTIZATIONS:
            raise ValueError(
                f"model.quantization must be one of {', '.join(map(repr, QUANTIZATIONS))}, got {q!r}; e.g. "
                "--set model.quantization=int8 (docs/quantization.md)."
            )
        if q != "none" and self.transformer.num_experts:
            raise ValueError(
                f"model.quantization={q!r} quantizes the dense projections, but this model is a mixture of "
                f"experts (model.transformer.num_experts={self.transformer.num_experts}), whose grouped expert "
                "matmuls have no quantized form here; set model.quantization='none' for it."
            )

    def _check_embedding(self) -> None:
        m = self.embedding_multiplier
        if m is not None and m != "sqrt_model_dims" and not (isinstance(m, (int, float)) and 0 < m < math.inf):
            raise ValueError(
                f"model.embedding_multiplier must be 'sqrt_model_dims', a finite number > 0 or None (x 1), got {m!r}."
            )
        std = self.embedding_init_std
        if std is not None and not 0 < std < math.inf:
            raise ValueError(
                f"model.embedding_init_std must be a finite number > 0, or None for 1/sqrt(model_dims), got {std!r}."
            )

    def _check_lora_rank(self) -> None:
        """An adapter `A @ B` on an `[in, out]` weight has rank at most min(in, out): a larger
        `lora.rank` only adds parameters that change nothing."""
        t = self.transformer
        q, kv = t.num_heads * t.head_dim, t.kv_heads * t.head_dim
        shapes = {
            "q": (t.model_dims, q),
            "k": (t.model_dims, kv),
            "v": (t.model_dims, kv),
            "o": (q, t.model_dims),
            "gate": (t.model_dims, t.hidden_dims),
            "up": (t.model_dims, t.hidden_dims),
            "down": (t.hidden_dims, t.model_dims),
        }
        target = min(self.lora.targets, key=lambda name: min(shapes[name]))
        width = min(shapes[target])
        if self.lora.rank > width:
            fix = f"set model.lora.rank <= {width}"
            wider = [n for n in self.lora.targets if min(shapes[n]) >= self.lora.rank]
            if wider:
                fix += f", or adapt only {', '.join(map(repr, wider))} (model.lora.targets)"
            raise ValueError(
                f"model.lora.rank={self.lora.rank} exceeds the width of the {target!r} projection it adapts "
                f"({shapes[target][0]} -> {shapes[target][1]} per layer): an adapter A @ B on it has rank at "
                f"most {width}, so the rest only adds parameters that change nothing; {fix}."
            )

    @property
    def embedding_scale(self) -> float | None:
        """The number the token embeddings are multiplied by (None: not multiplied)."""
        m = self.embedding_multiplier
        return math.sqrt(self.transformer.model_dims) if m == "sqrt_model_dims" else m  # pyright: ignore[reportReturnType]

    def check_mesh(self, mesh: MeshConfig, global_batch: int, seq_len: int | None = None) -> None:
        """Raise ConfigError unless the pipeline knobs fit `mesh` and `global_batch`, the
        `expert` axis divides the experts, and the model and `seq_len` (positions per example)
        can be split over the `context` axis."""
        check_pipeline(self.transformer, mesh, global_batch)
        check_experts(self.transformer, mesh)
        check_context(self.transformer, mesh, seq_len)

    @property
    def pipeline_stages(self) -> int:
        """Pipeline stages of the block stack (1 = not pipelined)."""
        return self.transformer.pipeline_stages

    def param_counts(self) -> dict[str, int]:
        """Analytic parameter counts: `total`, `embedding` (both tables when untied), `per_layer`, ..."""
        return lm_param_counts(self.transformer, self.vocab_size, tie_embeddings=self.tie_embeddings)

    def flops_per_token(self, *, seq_len: int) -> dict[str, float]:
        """Model FLOPs per token (`training`, `attention`, `remat`, ...) at `seq_len`."""
        return transformer_lm_flops_per_token(self.transformer, vocab_size=self.vocab_size, seq_len=seq_len)


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
        for name in ("num_classes", "in_channels", "stem_channels", "blocks_per_stage", "num_heads", "hidden_dims"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model.{name} must be a positive int; got {value!r}.")
        if self.num_classes < 2:
            raise ValueError(f"model.num_classes must be >= 2; got {self.num_classes}.")
        if not self.stage_channels or any(c < 1 for c in self.stage_channels):
            raise ValueError(
                f"model.stage_channels must be positive channel counts, e.g. (64, 128); got {self.stage_channels!r}."
            )
        if self.stage_channels[-1] % self.num_heads:
            raise ValueError(
                f"model.num_heads={self.num_heads} must divide the attention width "
                f"model.stage_channels[-1]={self.stage_channels[-1]}; change either."
            )
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
