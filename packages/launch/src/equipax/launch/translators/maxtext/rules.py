"""The MaxText <-> equipax translation table (`RULES`): each rule (`Rule`) reads some MaxText keys
and sets some equipax knobs, and says how in one line (docs/maxtext.md shows them). What they
convert with is in `values.py`, `blocks.py`, `mesh.py` and `training.py`; the entry points that
apply them are in `translate.py`."""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from equipax.launch.translators.maxtext.blocks import block_to_equipax, block_to_maxtext, moe_to_equipax, moe_to_maxtext
from equipax.launch.translators.maxtext.mesh import (
    mesh_to_equipax,
    mesh_to_maxtext,
    per_device_batch_to_equipax,
    per_device_batch_to_maxtext,
    pipeline_to_equipax,
    pipeline_to_maxtext,
)
from equipax.launch.translators.maxtext.training import (
    C4_TFDS,
    OPTIMIZERS,
    data_to_equipax,
    data_to_maxtext,
    optimizer_to_equipax,
    profiler_to_equipax,
    profiler_to_maxtext,
    schedule_to_equipax,
    schedule_to_maxtext,
    steps_to_equipax,
    tokenizer_to_equipax,
    tokenizer_to_maxtext,
)
from equipax.launch.translators.maxtext.values import (
    BLOCK_KNOBS,
    MAXTEXT_MESH_AXES,
    MOE_KNOBS,
    OTHER_AXES,
    TRANSFORMER,
    Values,
    activation_to_equipax,
    activation_to_maxtext,
    dims_to_equipax,
    dims_to_maxtext,
    inverted,
    logit_cap,
    one_of,
    positive_int,
)

__all__ = ["ATTENTION_IMPLS", "direct", "DTYPES", "QUANTIZATIONS", "QUANTIZATIONS_BACK", "REMATS", "Rule", "RULES"]


@dataclasses.dataclass(frozen=True)
class Rule:
    """MaxText keys -> equipax knobs (`forward`) and back (`reverse`, from flat knobs). An
    `architecture` rule applies whenever a decoder block is translated (its keys' MaxText
    defaults define the model too); an `always` rule to every config (its key's MaxText default
    where the config has none, never the base experiment's value); the others only to the keys a
    config sets."""

    maxtext: tuple[str, ...]
    equipax: tuple[str, ...]
    how: str
    forward: Callable[[Values], dict[str, Any]]
    reverse: Callable[[Mapping[str, Any]], dict[str, Any]]
    architecture: bool = False
    always: bool = False


def direct(
    key: str,
    knob: str,
    how: str = "same value",
    to: Callable[[Any], Any] = lambda v: v,
    back: Callable[[Any], Any] = lambda v: v,
    architecture: bool = False,
    always: bool = False,
) -> Rule:
    forward, reverse = (lambda v: {knob: to(v.get(key))}), (lambda k: {key: back(k[knob])})
    return Rule((key,), (knob,), how, forward, reverse, architecture, always)


REMATS = {"full": "full", "minimal": "dots_saveable"}
DTYPES = {"bfloat16": "bfloat16", "float32": "float32"}
# MaxText's `attention` kernels -> equipax's attention_impl (docs/attention.md): `flash` is
# MaxText's Pallas splash kernel on TPU, `cudnn_flash_te` cuDNN's fused attention on GPU.
CONTEXT_STRATEGIES = {"all_gather": "all_gather", "ring": "ring"}
ATTENTION_IMPLS = {"autoselected": "auto", "dot_product": "xla", "flash": "splash", "cudnn_flash_te": "cudnn"}
# MaxText's `quantization` -> equipax's model.quantization (docs/quantization.md); "" is MaxText's none.
# "int8w" (weight-only int8) is read from earlier MaxText configs; MaxText 0.2.5 has no such value.
QUANTIZATIONS = {"": "none", "int8": "int8", "int8w": "int8w", "fp8": "fp8"}
QUANTIZATIONS_BACK = {"none": "", "int8": "int8", "fp8": "fp8"}


RULES: tuple[Rule, ...] = (
    Rule(
        (
            "global_parameter_scale",
            "base_num_decoder_layers",
            "base_emb_dim",
            "base_mlp_dim",
            "base_num_query_heads",
            "base_num_heads",
            "base_num_kv_heads",
        ),
        tuple(TRANSFORMER + k for k in ("num_layers", "model_dims", "hidden_dims", "num_heads", "num_kv_heads")),
        "base size x scale (see --scale-rule); fewer key/value heads = grouped-query attention (fused_qkv=False)",
        dims_to_equipax,
        dims_to_maxtext,
        architecture=True,
    ),
    direct("head_dim", TRANSFORMER + "head_dim", to=int, architecture=True),
    direct("vocab_size", "model.vocab_size", to=int, architecture=True),
    Rule(
        (
            "decoder_block",
            "model_name",
            "normalization_layer_epsilon",
            "rope_max_timescale",
            "rope_type",
            "rope_use_scale",
            "logits_via_embedding",
            "normalize_embedding_logits",
            "use_qk_norm",
            "fused_qkv",
            "attention_type",
            "sliding_window_size",
        ),
        BLOCK_KNOBS,
        "llama2 (Llama 2/3; 3.1 by model_name or rope_type), mistral, qwen3, mixtral, qwen3_moe: Llama's block "
        "(docs/maxtext.md, 'Decoder blocks'); without decoder_block the base experiment's block is kept",
        block_to_equipax,
        block_to_maxtext,
        architecture=True,
    ),
    Rule(
        (
            "num_experts",
            "num_experts_per_tok",
            "base_moe_mlp_dim",
            "capacity_factor",
            "shared_experts",
            "load_balance_loss_weight",
            "norm_topk_prob",
        ),
        MOE_KNOBS,
        "mixtral, qwen3_moe: experts, top-k (renormalised), capacity (-1 = dropless), shared experts, aux loss",
        moe_to_equipax,
        moe_to_maxtext,
        architecture=True,
    ),
    Rule(
        ("mlp_activations",),
        (TRANSFORMER + "activation", TRANSFORMER + "gated"),
        "[act] or gated [act, 'linear']",
        activation_to_equipax,
        activation_to_maxtext,
        architecture=True,
    ),
    direct(
        "attn_logits_soft_cap",
        TRANSFORMER + "atten_logit_cap",
        "0/null = no cap",
        logit_cap,
        lambda c: c or 0.0,
        architecture=True,
    ),
    direct(
        "final_logits_soft_cap",
        "model.output_logit_cap",
        "0/null = no cap",
        logit_cap,
        lambda c: c or 0.0,
        architecture=True,
    ),
    Rule(
        ("max_target_length",),
        ("model.max_seq_len", "data.seq_len"),
        "both",
        lambda v: dict.fromkeys(("model.max_seq_len", "data.seq_len"), int(v.given["max_target_length"])),
        lambda k: {"max_target_length": k["data.seq_len"]},
    ),
    direct("dtype", "model.dtype", "bfloat16 or float32", one_of("dtype", DTYPES), one_of("model.dtype", DTYPES)),
    direct(
        "quantization",
        "model.quantization",
        "'' (none), int8 (int8 forward and backward), fp8; int8w (int8 weights) of earlier MaxText configs is "
        "read, not written (MaxText 0.2.5 has no weight-only int8); int4, intmp and the other fp8 variants "
        "are not translated",
        one_of("quantization", QUANTIZATIONS),
        one_of("model.quantization", QUANTIZATIONS_BACK),
    ),
    Rule(
        ("per_device_batch_size",),
        ("data.per_device_batch", "data.batch_size"),
        "whole examples per device, or a fraction below 1 (e.g. 0.25 with context parallelism: one "
        "sequence per 4 devices) = the global batch_size over the mesh",
        per_device_batch_to_equipax,
        per_device_batch_to_maxtext,
    ),
    Rule(
        (
            *(f"{w}_{a}_parallelism" for w in ("ici", "dcn") for a in (*MAXTEXT_MESH_AXES.values(), *OTHER_AXES)),
            "num_slices",
        ),
        ("mesh.ici_mesh_shape", "mesh.dcn_mesh_shape", "mesh.axis_names"),
        "data, fsdp, tensor (and expert for MoE experiments) sizes; other axes only at 1; DCN -1 = num_slices",
        mesh_to_equipax,
        mesh_to_maxtext,
    ),
    Rule(
        (
            "ici_pipeline_parallelism",
            "dcn_pipeline_parallelism",
            "num_pipeline_microbatches",
            "num_pipeline_repeats",
            "num_layers_per_pipeline_stage",
        ),
        tuple(
            TRANSFORMER + k
            for k in (
                "pipeline_stages",
                "pipeline_schedule",
                "pipeline_repeats",
                "pipeline_microbatches",
                "pipeline_microbatch_size",
            )
        ),
        "stages = pipeline parallelism (a `stage` mesh axis); repeats > 1 = circular; microbatches -1 = stages",
        pipeline_to_equipax,
        pipeline_to_maxtext,
    ),
    direct(
        "context_parallel_strategy",
        TRANSFORMER + "context_parallel_strategy",
        "all_gather or ring (MaxText's ulysses and usp are not translated); MaxText's loader takes ring "
        "only with `attention: flash` and `use_tokamax_splash: true`, so `show` writes those for a ring, "
        "and `convert` reads them back as `attention_impl='auto'` (equipax's ring chooses each device's "
        "block kernel)",
        one_of("context_parallel_strategy", CONTEXT_STRATEGIES),
        one_of("model.transformer.context_parallel_strategy", CONTEXT_STRATEGIES),
    ),
    direct("context_parallel_load_balance", TRANSFORMER + "context_parallel_load_balance", to=bool),
    direct("scan_layers", TRANSFORMER + "scan_layers", to=bool),
    direct(
        "attention",
        TRANSFORMER + "attention_impl",
        "autoselected -> auto, dot_product -> xla, flash -> splash, cudnn_flash_te -> cudnn",
        one_of("attention", ATTENTION_IMPLS),
        one_of("model.transformer.attention_impl", inverted(ATTENTION_IMPLS)),
    ),
    direct(
        "remat_policy",
        TRANSFORMER + "remat",
        "full; minimal -> dots_saveable (checkpoint dots without batch dims); always written (MaxText's "
        "default full where the config has none), so a converted config keeps MaxText's policy, never the "
        "base experiment's (`auto`, chosen by compiling, is not MaxText's)",
        one_of("remat_policy", REMATS),
        one_of("model.transformer.remat", inverted(REMATS)),
        always=True,
    ),
    Rule(
        (
            "learning_rate",
            "lr_schedule_type",
            "warmup_steps_fraction",
            "learning_rate_final_fraction",
            "cosine_learning_rate_final_fraction",
            "learning_rate_schedule_steps",
        ),
        tuple(
            f"learner.schedule.{k}"
            for k in ("kind", "peak_learning_rate", "warmup_steps", "decay_steps", "final_fraction")
        ),
        "cosine -> warmup_cosine: warmup = fraction x schedule steps (-1 = steps), cosine for the rest",
        schedule_to_equipax,
        schedule_to_maxtext,
    ),
    Rule(
        ("opt_type",),
        ("learner.kind", "learner.clip_update_rms"),
        "adamw (clip_update_rms=None); adam_pax -> pax_adam",
        optimizer_to_equipax,
        lambda k: {"opt_type": one_of("learner.kind", inverted(OPTIMIZERS))(k["learner.kind"])},
    ),
    direct("adam_b1", "learner.b1", to=float),
    direct("adam_b2", "learner.b2", to=float),
    direct("adam_eps", "learner.eps", to=float),
    direct("adam_weight_decay", "learner.weight_decay", "decoupled, times the learning rate in both", float),
    direct("gradient_clipping_threshold", "learner.clip_gradient_norm", "0 = no clip", logit_cap, lambda c: c or 0.0),
    Rule(
        ("steps",),
        ("train.num_steps",),
        "-1 = learning_rate_schedule_steps",
        steps_to_equipax,
        lambda k: {"steps": k["train.num_steps"]},
    ),
    direct("checkpoint_period", "train.checkpoint_every", to=positive_int("checkpoint_period", "must be > 0")),
    direct(
        "eval_interval",
        "train.eval_every",
        "-1 (no eval) is not translated",
        positive_int("eval_interval", "MaxText then never evaluates; equipax evaluates at least at the end"),
    ),
    direct(
        "eval_steps", "train.eval_batches", "-1 (the whole eval split) = 0", lambda n: max(int(n), 0), lambda n: n or -1
    ),
    Rule(
        ("dataset_type", "dataset_name", "dataset_path", "packing"),
        ("data.source", "data.path", "data.packing"),
        f"synthetic (packing off); tfds {C4_TFDS} -> c4 shards in a directory (not TFDS)",
        data_to_equipax,
        data_to_maxtext,
    ),
    Rule(
        ("tokenizer_type", "tokenizer_path"),
        ("data.tokenizer", "data.vocab_path"),
        "sentencepiece or huggingface, with a tokenizer_path (a local file)",
        tokenizer_to_equipax,
        tokenizer_to_maxtext,
    ),
    Rule(
        (
            "profiler",
            "enable_profiler",
            "skip_first_n_steps_for_profiler",
            "profiler_steps",
            "upload_all_profiler_results",
        ),
        ("train.profile.steps", "train.profile.start_step", "train.profile.all_processes"),
        "xplane: steps n+1..n+profiler_steps",
        profiler_to_equipax,
        profiler_to_maxtext,
    ),
)
