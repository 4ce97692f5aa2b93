"""The transformer's config classes, `TransformerConfig` and `RopeScalingConfig`: frozen
dataclasses, validated when built, and no JAX.

The other configs of `equipax.core` live in modules of their own, equally JAX-free:
`learner_config.py` (`ScheduleConfig`, `LearnerConfig`, `ParamGroupConfig`,
`VariationalNoiseConfig`), `mesh_config.py` (`MeshConfig` and the mesh-axis names), and the
cross-field and mesh checks in `config_checks.py` and `context_config.py`; the modules that use
them re-export them (`equipax.core.mesh`, `equipax.core.optim`, `equipax.core.nn`). A module that
only builds or prints configs (the CLI's `list`, `show` and knob errors) imports these and does
not pay for importing JAX (benchmarks/README.md, "CLI latency"). Keep it that way: nothing here may
import jax, numpy-heavy code or equinox. (`equipax.core.knobs` is the machinery that applies `--set`
overrides to any of them.)
"""

import dataclasses
import math
from typing import Literal

from equipax.core.config_checks import (
    check_attention_impl,
    check_heads,
    check_layer_groups,
    check_moe,
    check_pipeline_knobs,
)
from equipax.core.context_config import CONTEXT_PARALLEL_STRATEGIES

__all__ = ["LINEAR_ATTENTION_CHUNK_SIZE", "QUANTIZATIONS", "REMAT_POLICIES", "RopeScalingConfig", "TransformerConfig"]

# Positions per chunk of the chunked causal linear attention (`attention="linear"`;
# `equipax.core.nn.linear_attention.DEFAULT_CHUNK_SIZE`, and the FLOP count of `equipax.core.flops`).
LINEAR_ATTENTION_CHUNK_SIZE = 64


# How the transformer block's projections compute (an LM's `model.quantization`; docs/quantization.md,
# `equipax.core.nn.quantization`): in float, int8 forward and backward, int8 weights only, or float8.
QUANTIZATIONS = ("none", "int8", "int8w", "fp8")

_KNOB = "model.transformer"
_ACTIVATIONS = ("gelu", "relu", "silu")
_NORMS = ("layernorm", "rmsnorm")
# From the least recompute (and most memory) to the most; "auto" is chosen among them by compiling
# (equipax.launch.aot.remat) before a model is built.
REMAT_POLICIES = (
    "none",
    "dots_with_context",
    "dots_saveable",
    "save_attention_out",
    "offload_attention_out",
    "save_context",
    "full",
)
_REMATS = (*REMAT_POLICIES, "auto")
_ATTENTIONS = ("softmax", "linear")
_ATTENTION_IMPLS = ("xla", "cudnn", "splash", "auto")
_SCHEDULES = ("gpipe", "circular")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    """Hyperparameters of a decoder-only transformer stack: one block for every LM family.

    The defaults are Pax's GPT block; a Llama, Qwen or Mistral block is the same class with other
    values (docs/extending.md, "Adding a family").

    Attributes:
        num_layers: transformer blocks in the stack.
        model_dims: width of the residual stream (`embed`).
        num_heads: attention (query) heads per block.
        num_kv_heads: key/value heads, shared by groups of `num_heads / num_kv_heads` query heads
            (grouped-query attention; 1 = multi-query); None = `num_heads` (multi-head).
        head_dim: dimensions per head (`num_heads * head_dim` need not equal `model_dims`).
        hidden_dims: width of the feed-forward layer's hidden activations.
        activation: the feed-forward nonlinearity.
        gated: a gated feed-forward (GLU: `act(x W1) * (x W2)`, then the output projection);
            with activation="silu" this is SwiGLU (Llama).
        norm: the normalisation before attention and before the feed-forward (pre-norm).
        norm_eps: the norms' epsilon (added to the variance / mean square).
        use_bias: biases in the attention and feed-forward projections (and the LayerNorms).
        fused_qkv: one `[embed 3 heads head_dim]` projection for queries, keys and values (Pax's
            COMBINE_QKV layout; needs num_kv_heads == num_heads); False: separate query and
            key/value projections (Llama's layout). The same numbers either way.
        qk_norm: RMSNorm over each head's queries and keys before the rotation (Qwen3).
        sliding_window: each query attends to itself and the `sliding_window - 1` positions
            before it (Mistral); None = the whole causal prefix.
        atten_logit_cap: soft cap on the attention logits, `cap * tanh(logits / cap)`; None = off.
        scan_layers: run the blocks as one `jax.lax.scan` over stacked weights (compile time
            independent of depth) instead of a Python loop.
        remat: what each block saves for the backward pass (the rest is recomputed), from the
            least recompute to the most: "none" (everything), "dots_with_context" (the
            projections' outputs and the attention context, MaxText's former "minimal_flash": only the
            elementwise work and, but for splash, the attention scores are recomputed),
            "dots_saveable" (matrix-multiply outputs without batch dimensions: the projections;
            attention is recomputed),
            "save_attention_out" (the attention context and the residual stream entering the
            MLP; the QKV and MLP input projections and the attention scores are recomputed),
            "offload_attention_out" (the same two tensors, moved to host memory; TPU and GPU),
            "save_context" (only the attention context, Pax's SAVE_CONTEXT: the projections,
            the MLP and the attention scores are recomputed; the least memory after "full"),
            "full" (only the block's input). With splash attention the context kept includes the
            kernel's log-sum-exp and the scores are not recomputed: under the policies that keep
            the context the backward pass never runs the forward kernel again.
            "auto": the cheapest of these whose compiled step fits the device memory
            (`launch run` / `launch compile`, docs/compile.md).
        num_experts: routed experts of a mixture-of-experts feed-forward in every block
            (docs/moe.md; Mixtral, Qwen3-MoE); 0 = the dense feed-forward.
        num_experts_per_tok: experts each token is routed to (top-k), 1 to num_experts.
        moe_intermediate_size: each expert's hidden width; None = hidden_dims.
        norm_topk_prob: renormalise each token's top-k router probabilities to sum to 1.
        capacity_factor: None = dropless dispatch (grouped matmuls); a number > 0 = each expert
            takes at most ceil(capacity_factor * seq * num_experts_per_tok / num_experts)
            assignments per sequence, the rest are dropped (counted in the metrics).
        shared_expert_intermediate_size: hidden width of a shared SwiGLU MLP every token also goes
            through (DeepSeek's shared experts); 0 = none.
        router_aux_loss_coef: weight of the load-balancing loss in the training loss (Mixtral 0.02,
            Qwen3-MoE 0.001).
        router_z_loss_coef: weight of the router z-loss in the training loss (ST-MoE 0.001).
        router_bias_update_rate: auxiliary-loss-free balancing (DeepSeek-V3's bias update speed,
            0.001 there): each layer keeps per-expert biases added to the router probabilities
            for choosing the experts (not for weighting them), and after each training step every
            bias moves by this rate towards balance (+rate if the expert got fewer assignments
            than the mean, -rate if more); 0 = off.
        num_hidden_groups: shared layers (ALBERT's `num_hidden_groups`): the stack holds this many
            blocks and applies each to `num_layers / num_hidden_groups` consecutive layers, so
            every use of a block trains one set of weights (gradients summed over its uses),
            stored once in the checkpoint and counted once in the parameters; the FLOPs are those
            of `num_layers` blocks. 1 = every layer the same block; None = no sharing.
    """

    num_layers: int = 4
    model_dims: int = 256
    num_heads: int = 4
    num_kv_heads: int | None = None
    head_dim: int = 64
    hidden_dims: int = 1024
    activation: Literal["gelu", "relu", "silu"] = "gelu"
    gated: bool = False
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    norm_eps: float = 1e-6
    use_bias: bool = False
    fused_qkv: bool = True
    qk_norm: bool = False
    sliding_window: int | None = None
    atten_logit_cap: float | None = 50.0
    scan_layers: bool = True
    remat: Literal[
        "none",
        "dots_with_context",
        "dots_saveable",
        "save_attention_out",
        "offload_attention_out",
        "save_context",
        "full",
        "auto",
    ] = "none"
    # "linear": phi = elu + 1 linear attention (O(seq) cost; atten_logit_cap then unused).
    attention: Literal["softmax", "linear"] = "softmax"
    # The softmax kernel (docs/attention.md; MaxText's `attention`): "xla" = plain einsums on
    # every platform; "cudnn" = cuDNN flash attention (CUDA GPU, model.dtype='bfloat16', no
    # atten_logit_cap); "splash" = Pallas splash attention (TPU; seq a multiple of 128);
    # "auto" (default) = splash on TPU, cudnn on GPU where they can run the shapes, else xla
    # (inside a pipeline stage or tensor_parallel='shard_map': xla).
    attention_impl: Literal["xla", "cudnn", "splash", "auto"] = "auto"
    # How a sharded block computes: "gspmd" lets XLA place collectives from the parameter
    # shardings; "shard_map" runs nn/tensor_parallel.py with the collectives written out.
    tensor_parallel: Literal["gspmd", "shard_map"] = "gspmd"
    # Pipeline parallelism (docs/pipeline.md; Pax's PipelinedTransformer knobs in brackets).
    # pipeline_stages [NUM_STAGES]: consecutive groups of layers, one per `stage` mesh slice
    # (1 = no pipeline). The batch is split into pipeline_microbatches [NUM_MICROBATCHES] or
    # microbatches of pipeline_microbatch_size [MICROBATCH_SIZE] examples (set at most one;
    # neither = one microbatch per stage). pipeline_schedule "gpipe" runs each microbatch
    # through the stages once; "circular" [CIRCULAR_REPEAT > 1] splits each device's layers
    # into pipeline_repeats virtual stages visited round-robin (a smaller bubble).
    pipeline_stages: int = 1
    pipeline_microbatches: int | None = None
    pipeline_microbatch_size: int | None = None
    pipeline_schedule: Literal["gpipe", "circular"] = "gpipe"
    pipeline_repeats: int = 1
    # Context parallelism over a `context` mesh axis (docs/long_context.md; MaxText's knob names):
    # "all_gather" gathers each layer's keys and values over the axis, "ring" rotates them in
    # blocks (O(seq / context) keys and values per device).
    context_parallel_strategy: Literal["all_gather", "ring"] = "all_gather"
    # The zigzag layout on a `context` axis of N: the loss reorders each batch so that device i
    # holds sequence chunks i and 2N-1-i of 2N (even causal work; data.seq_len a multiple of 2N);
    # False = contiguous blocks (a multiple of N).
    context_parallel_load_balance: bool = True
    # Mixture of experts (docs/moe.md; Hugging Face's Mixtral / Qwen3-MoE config names).
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = True
    capacity_factor: float | None = None
    shared_expert_intermediate_size: int = 0
    router_aux_loss_coef: float = 0.001
    router_z_loss_coef: float = 0.0
    router_bias_update_rate: float = 0.0
    num_hidden_groups: int | None = None

    @property
    def layer_groups(self) -> int:
        """Distinct blocks the stack holds (`num_hidden_groups`, or `num_layers` when None)."""
        return self.num_layers if self.num_hidden_groups is None else self.num_hidden_groups

    @property
    def kv_heads(self) -> int:
        """Key/value heads per block (`num_kv_heads`, or `num_heads` when None)."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def expert_hidden_dims(self) -> int:
        """Each expert's hidden width (`moe_intermediate_size`, or `hidden_dims` when None)."""
        return self.hidden_dims if self.moe_intermediate_size is None else self.moe_intermediate_size

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "model_dims",
            "num_heads",
            "head_dim",
            "hidden_dims",
            "pipeline_stages",
            "pipeline_repeats",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"TransformerConfig.{name} must be a positive int, got {value!r}; set {name}=<int >= 1>."
                )
        for name, allowed in (
            ("activation", _ACTIVATIONS),
            ("norm", _NORMS),
            ("remat", _REMATS),
            ("attention", _ATTENTIONS),
            ("attention_impl", _ATTENTION_IMPLS),
            ("tensor_parallel", ("gspmd", "shard_map")),
            ("pipeline_schedule", _SCHEDULES),
            ("context_parallel_strategy", CONTEXT_PARALLEL_STRATEGIES),
        ):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"TransformerConfig.{name} must be one of {allowed}, got {value!r}.")
        cap = self.atten_logit_cap
        if cap is not None and not cap > 0:
            raise ValueError(f"TransformerConfig.atten_logit_cap must be > 0 or None (no cap), got {cap!r}.")
        if not 0 < self.norm_eps < 1:
            raise ValueError(
                f"{_KNOB}.norm_eps must be a number in (0, 1), got {self.norm_eps!r} "
                "(Pax's LayerNorm uses 1e-6, Llama's RMSNorm 1e-5)."
            )
        check_heads(self)
        check_moe(self)
        check_pipeline_knobs(self)
        check_attention_impl(self)
        check_layer_groups(self)


_ROPE_KINDS = ("llama3",)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScalingConfig:
    """Rescaled rotary frequencies for contexts longer than pre-training's (`model.rope_scaling`).

    kind "llama3" (Llama 3.1/3.2; the numbers Hugging Face transformers' `rope_type="llama3"`
    computes): wavelengths `2 pi / freq` shorter than `original_max_seq_len / high_freq_factor` keep
    their frequency, longer than `original_max_seq_len / low_freq_factor` are divided by `factor`,
    and those between interpolate smoothly between the two (equipax.core.nn.rotary).

    Attributes:
        kind: the scaling rule.
        factor: how much longer the new context is (8 for Llama 3.1).
        low_freq_factor, high_freq_factor: the band edges, as fractions of the original context
            per wavelength (1 and 4 for Llama 3.1).
        original_max_seq_len: the context length the frequencies were trained for (8192).
    """

    kind: Literal["llama3"] = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192

    def __post_init__(self) -> None:
        knob = "model.rope_scaling"
        if self.kind not in _ROPE_KINDS:
            raise ValueError(f"{knob}.kind must be one of {_ROPE_KINDS}, got {self.kind!r}.")
        if not 1.0 <= self.factor < math.inf:
            raise ValueError(
                f"{knob}.factor must be a finite number >= 1 (how many times longer the context is), "
                f"got {self.factor!r}; set model.rope_scaling=None for no scaling."
            )
        if not 0 < self.low_freq_factor < self.high_freq_factor < math.inf:
            raise ValueError(
                f"{knob}: expected 0 < low_freq_factor < high_freq_factor, found low_freq_factor="
                f"{self.low_freq_factor!r} and high_freq_factor={self.high_freq_factor!r} (Llama 3.1: 1 and 4)."
            )
        value = self.original_max_seq_len
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"{knob}.original_max_seq_len must be a positive int (the pre-training context, "
                f"8192 for Llama 3), got {value!r}."
            )
