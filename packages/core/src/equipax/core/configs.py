"""The config classes of `equipax.core`: frozen dataclasses, validated when built, and no JAX.

`ScheduleConfig`, `LearnerConfig`, `TransformerConfig` and `RopeScalingConfig` are defined here,
`MeshConfig` and the mesh-axis names in `_mesh_config.py`, the cross-field and mesh checks in
`_config_checks.py` (both re-exported here); all are re-exported
where they are used (`equipax.core.mesh`, `equipax.core.optim`, `equipax.core.nn`): a module that
only builds or prints configs (the CLI's `list`, `show` and knob errors) imports this one and does
not pay for importing JAX (benchmarks/README.md, "CLI latency"). Keep it that way: nothing here may
import jax, numpy-heavy code or equinox. (`equipax.core.knobs` is the machinery that applies `--set`
overrides to any of them.)
"""

import dataclasses
import math
import re
from typing import Any, Literal

from equipax.core._config_checks import (
    bubble_fraction,
    check_attention_impl,
    check_experts,
    check_heads,
    check_moe,
    check_pipeline,
    check_pipeline_knobs,
    num_microbatches,
)
from equipax.core._context_config import CONTEXT_PARALLEL_STRATEGIES, check_context
from equipax.core._mesh_config import (
    AXES,
    BATCH_AXES,
    CONTEXT,
    CONTEXT_AXES,
    DATA,
    DEFAULT_LOGICAL_AXIS_RULES,
    EXPERT,
    EXPERT_AXES,
    FSDP,
    PIPELINE_AXES,
    STAGE,
    TENSOR,
    LogicalAxisRules,
    MeshConfig,
)
from equipax.core.knobs import ConfigError

__all__ = [
    "AXES",
    "LINEAR_ATTENTION_CHUNK_SIZE",
    "BATCH_AXES",
    "CONTEXT",
    "CONTEXT_AXES",
    "DATA",
    "DEFAULT_LOGICAL_AXIS_RULES",
    "EXPERT",
    "EXPERT_AXES",
    "FSDP",
    "LearnerConfig",
    "LearnerKind",
    "LogicalAxisRules",
    "MeshConfig",
    "ParamGroupConfig",
    "PIPELINE_AXES",
    "RopeScalingConfig",
    "ScheduleConfig",
    "ScheduleKind",
    "STAGE",
    "TENSOR",
    "TransformerConfig",
    "VariationalNoiseConfig",
    "bubble_fraction",
    "check_context",
    "check_experts",
    "check_pipeline",
    "check_pipeline_knobs",
    "num_microbatches",
]

# Positions per chunk of the chunked causal linear attention (`attention="linear"`;
# `equipax.core.nn.linear_attention.DEFAULT_CHUNK_SIZE`, and the FLOP count of `equipax.core.flops`).
LINEAR_ATTENTION_CHUNK_SIZE = 64


ScheduleKind = Literal["constant", "warmup_cosine", "linear_rampup_exponential_decay"]
LearnerKind = Literal["adamw", "pax_adam"]

_SCHEDULE_KINDS = ("constant", "warmup_cosine", "linear_rampup_exponential_decay")
_LEARNER_KINDS = ("adamw", "pax_adam")


def _bad(field: str, expected: str, found: Any, fix: str = "") -> ConfigError:
    msg = f"{field}: expected {expected}, found {found!r}."
    return ConfigError(f"{msg} {fix}".strip())


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """A learning-rate schedule.

    Arguments:
        kind: `constant` (always `peak_learning_rate`); `warmup_cosine` (linear 0 -> peak over
            `warmup_steps`, then cosine decay over `decay_steps` to `final_fraction * peak`);
            `linear_rampup_exponential_decay` (Pax's LinearRampupExponentialDecay: linear
            0 -> peak over `warmup_steps`, constant until `decay_start`, exponential decay to
            `final_fraction * peak` at step `decay_steps`, constant after).
        peak_learning_rate: the largest learning rate.
        warmup_steps: length of the linear warmup from 0.
        decay_steps: `warmup_cosine`: steps of the cosine after warmup; exponential decay: the
            step at which the decay ends (Pax's `decay_end`).
        final_fraction: the floor as a fraction of the peak (cosine `alpha`, Pax's `min_ratio`).
        decay_start: exponential decay only: the step at which the decay starts (Pax's
            `decay_start`); 0 means "at the end of warmup".
    """

    kind: ScheduleKind = "constant"
    peak_learning_rate: float = 1e-3
    warmup_steps: int = 0
    decay_steps: int = 0
    final_fraction: float = 0.1
    decay_start: int = 0

    def __post_init__(self) -> None:
        if self.kind not in _SCHEDULE_KINDS:
            raise _bad("schedule.kind", f"one of {_SCHEDULE_KINDS}", self.kind)
        if not 0 < self.peak_learning_rate < math.inf:  # refuses nan and inf alike
            raise _bad("schedule.peak_learning_rate", "a finite number > 0", self.peak_learning_rate)
        for name in ("warmup_steps", "decay_steps", "decay_start"):
            value = getattr(self, name)
            if value < 0:
                raise _bad(f"schedule.{name}", "an integer >= 0", value)
        if self.kind == "warmup_cosine":
            if self.decay_steps <= 0:
                raise _bad(
                    "schedule.decay_steps",
                    "> 0 for kind='warmup_cosine' (the length of the cosine after warmup)",
                    self.decay_steps,
                )
            if not 0 <= self.final_fraction <= 1:
                raise _bad("schedule.final_fraction", "a number in [0, 1]", self.final_fraction)
        if self.kind == "linear_rampup_exponential_decay":
            if not 0 < self.final_fraction <= 1:
                raise _bad(
                    "schedule.final_fraction", "a number in (0, 1] for an exponential decay", self.final_fraction
                )
            if self.decay_start and self.decay_start < self.warmup_steps:
                raise _bad("schedule.decay_start", f"0 or >= warmup_steps ({self.warmup_steps})", self.decay_start)
            if self.decay_steps <= self.effective_decay_start:
                raise _bad(
                    "schedule.decay_steps",
                    f"the step the decay ends, > decay start ({self.effective_decay_start})",
                    self.decay_steps,
                )

    @property
    def effective_decay_start(self) -> int:
        """The step where the exponential decay begins (`decay_start`, or the warmup's end)."""
        return self.decay_start or self.warmup_steps


@dataclasses.dataclass(frozen=True, kw_only=True)
class LearnerConfig:
    """An optimizer: schedule, Adam hyperparameters, clipping and weight decay.

    Arguments:
        kind: `adamw` (optax AdamW after a global-norm clip) or `pax_adam` (Pax's Adam: global-norm
            clip, Adam, per-tensor update-RMS clip, decoupled weight decay, learning rate).
        schedule: the learning-rate schedule.
        b1, b2, eps: Adam's moment decays and denominator epsilon.
        weight_decay: decoupled weight decay (multiplied by the learning rate), on `ndim >= 2`
            parameters only.
        clip_gradient_norm: clip the global gradient norm to this value; None for no clip.
        clip_update_rms: `pax_adam` only: scale each tensor's Adam update so its RMS is at most
            this value; None for no clip.
        groups: parameter groups with their own learner (Pax's several learners;
            `ParamGroupConfig`): each parameter whose path a group's `regex` matches is updated by
            that group's learner (or not at all: a frozen group); the rest by this one.
    """

    kind: LearnerKind = "adamw"
    schedule: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip_gradient_norm: float | None = 1.0
    clip_update_rms: float | None = None
    groups: tuple["ParamGroupConfig", ...] = ()

    def __post_init__(self) -> None:
        names = [g.name for g in self.groups]
        for g in self.groups:
            if g.learner is not None and g.learner.groups:
                raise _bad(f"learner.groups[{g.name!r}].learner.groups", "() (groups do not nest)", g.learner.groups)
            if g.name == "default" or names.count(g.name) > 1:
                raise _bad(
                    "learner.groups",
                    "groups with distinct names other than 'default' (the parameters no group matches)",
                    names,
                )
        if self.kind not in _LEARNER_KINDS:
            raise _bad("learner.kind", f"one of {_LEARNER_KINDS}", self.kind)
        for name in ("b1", "b2"):
            value = getattr(self, name)
            if not 0 <= value < 1:
                raise _bad(f"learner.{name}", "a number in [0, 1)", value)
        if not 0 <= self.eps < math.inf:
            raise _bad("learner.eps", "a finite number >= 0", self.eps)
        if not 0 <= self.weight_decay < math.inf:
            raise _bad("learner.weight_decay", "a finite number >= 0", self.weight_decay)
        if self.clip_gradient_norm is not None and not self.clip_gradient_norm > 0:
            raise _bad("learner.clip_gradient_norm", "a number > 0, or None for no clip", self.clip_gradient_norm)
        if self.clip_update_rms is not None:
            if not self.clip_update_rms > 0:
                raise _bad("learner.clip_update_rms", "a number > 0, or None for no clip", self.clip_update_rms)
            if self.kind != "pax_adam":
                raise _bad(
                    "learner.clip_update_rms",
                    "None unless kind='pax_adam'",
                    self.clip_update_rms,
                    "Set learner.kind='pax_adam' or learner.clip_update_rms=None.",
                )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParamGroupConfig:
    """A group of parameters with its own learner (`learner.groups`; Pax's several learners).

    Arguments:
        name: the group's name (its learning rate is logged as `learning_rate/<name>`).
        regex: `re.search`ed in each trained parameter's path, written with `/` between its parts
            (`embedding/weight`, `stack/layers/0/attention/qkv`; `equipax.core.param_paths`). A
            group that matches no parameter, or a parameter two groups match, is a ConfigError.
        learner: the group's optimizer and schedule (its own clipping: the global-norm clip is
            over the group's gradients); None = frozen (never updated).
    """

    name: str
    regex: str
    learner: LearnerConfig | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise _bad("learner.groups[].name", "a non-empty name", self.name)
        try:
            re.compile(self.regex)
        except re.error as e:
            raise _bad(
                f"learner.groups[{self.name!r}].regex", "a valid regular expression", self.regex, f"({e})."
            ) from None


_KNOB = "model.transformer"
_ACTIVATIONS = ("gelu", "relu", "silu")
_NORMS = ("layernorm", "rmsnorm")
# From the least recompute (and most memory) to the most; "auto" is chosen among them by compiling
# (equipax.launch.aot.remat) before a model is built.
REMAT_POLICIES = ("none", "dots_saveable", "save_attention_out", "offload_attention_out", "full")
_REMATS = (*REMAT_POLICIES, "auto")
_ATTENTIONS = ("softmax", "linear")
_ATTENTION_IMPLS = ("xla", "cudnn", "splash", "auto")
_SCHEDULES = ("gpipe", "circular")


@dataclasses.dataclass(frozen=True, kw_only=True)
class VariationalNoiseConfig:
    """Gaussian weight noise in the training forward pass (Praxis' `vn`; `train.vn.*`).

    From step `vn_start_step` on, every trained parameter whose path matches `vn_regex` gets noise
    drawn from N(0, vn_scale^2) added for the loss and its gradient; the update is applied to the
    noise-free parameters, and evaluation and decoding never see noise
    (`equipax.core.variational_noise`).

    vn_scale: the noise's standard deviation; 0 = off (Pax's default).
    vn_regex: `re.search`ed in each parameter's path with `/` between its parts (Pax's spelling,
        e.g. `blocks/attention|embed`); "" = every trained parameter.
    vn_start_step: the first step that gets noise.
    vn_seed: None = the noise comes from the run's step key (`train.seed`, new each step);
        an int = from this seed folded with the step, so the noise does not change with `train.seed`.
    """

    vn_scale: float = 0.0
    vn_regex: str = ""
    vn_start_step: int = 0
    vn_seed: int | None = None

    def __post_init__(self) -> None:
        scale = self.vn_scale
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not 0 <= scale < math.inf:
            raise _bad("train.vn.vn_scale", "a finite number >= 0 (0 = no noise)", scale)
        if not isinstance(self.vn_regex, str):
            raise _bad("train.vn.vn_regex", "a regular expression (a string)", self.vn_regex)
        try:
            re.compile(self.vn_regex)
        except re.error as e:
            raise _bad("train.vn.vn_regex", "a valid regular expression", self.vn_regex, f"({e}).") from None
        if isinstance(self.vn_start_step, bool) or not isinstance(self.vn_start_step, int) or self.vn_start_step < 0:
            raise _bad("train.vn.vn_start_step", "an int >= 0", self.vn_start_step)
        seed = self.vn_seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise _bad("train.vn.vn_seed", "an int or None (the run's step key)", seed)

    @property
    def enabled(self) -> bool:
        return self.vn_scale > 0


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
            least recompute to the most: "none" (everything), "dots_saveable" (matrix-multiply
            outputs without batch dimensions: the projections; attention is recomputed),
            "save_attention_out" (the attention context and the residual stream entering the
            MLP; the QKV and MLP input projections and the attention scores are recomputed),
            "offload_attention_out" (the same two tensors, moved to host memory; TPU and GPU),
            "full" (only the block's input); "auto": the cheapest of these whose compiled step
            fits the device memory (`launch run` / `launch compile`, docs/compile.md).
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
    remat: Literal["none", "dots_saveable", "save_attention_out", "offload_attention_out", "full", "auto"] = "none"
    # "linear": phi = elu + 1 linear attention (O(seq) cost; atten_logit_cap then unused).
    attention: Literal["softmax", "linear"] = "softmax"
    # The softmax kernel (docs/attention.md; MaxText's `attention`): "xla" = plain einsums on
    # every platform; "cudnn" = cuDNN flash attention (CUDA GPU, model.dtype='bfloat16', no
    # atten_logit_cap); "splash" = Pallas splash attention (TPU; seq a multiple of 128);
    # "auto" = splash on TPU, cudnn on GPU where they can run the shapes, else xla.
    attention_impl: Literal["xla", "cudnn", "splash", "auto"] = "xla"
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
