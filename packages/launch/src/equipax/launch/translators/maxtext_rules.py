"""The MaxText <-> equipax translation table (`RULES`): each rule reads some MaxText keys and sets
some equipax knobs, and says how in one line (docs/maxtext.md shows them). What they are made of
is in `maxtext_converters.py`; the public functions are in `maxtext.py`."""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from equipax.launch.translators.maxtext_converters import (
    MESH_AXES,
    OTHER_AXES,
    TRANSFORMER,
    Values,
    activation_to_equipax,
    activation_to_maxtext,
    batch_size,
    dims_to_equipax,
    dims_to_maxtext,
    inverted,
    logit_cap,
    mesh_to_equipax,
    mesh_to_maxtext,
    one_of,
    positive_int,
    profiler_to_equipax,
    profiler_to_maxtext,
    schedule_to_equipax,
    schedule_to_maxtext,
    steps_to_equipax,
)

__all__ = ["DATASETS", "direct", "DTYPES", "OPTIMIZERS", "REMATS", "Rule", "RULES"]


@dataclasses.dataclass(frozen=True)
class Rule:
    """MaxText keys -> equipax knobs (`forward`) and back (`reverse`, from flat knobs)."""

    maxtext: tuple[str, ...]
    equipax: tuple[str, ...]
    how: str
    forward: Callable[[Values], dict[str, Any]]
    reverse: Callable[[Mapping[str, Any]], dict[str, Any]]


def direct(
    key: str,
    knob: str,
    how: str = "same value",
    to: Callable[[Any], Any] = lambda v: v,
    back: Callable[[Any], Any] = lambda v: v,
) -> Rule:
    return Rule((key,), (knob,), how, lambda v: {knob: to(v.get(key))}, lambda k: {key: back(k[knob])})


REMATS = {"none": "none", "full": "full", "minimal": "dots_saveable"}
OPTIMIZERS = {"adamw": "adamw", "adam_pax": "pax_adam"}
DTYPES = {"bfloat16": "bfloat16", "float32": "float32"}
DATASETS = {"c4": "c4", "synthetic": "synthetic"}

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
        tuple(TRANSFORMER + k for k in ("num_layers", "model_dims", "hidden_dims", "num_heads")),
        "base size x scale (see --scale-rule); key/value heads must equal query heads",
        dims_to_equipax,
        dims_to_maxtext,
    ),
    direct("head_dim", TRANSFORMER + "head_dim"),
    direct("vocab_size", "model.vocab_size"),
    Rule(
        ("max_target_length",),
        ("model.max_seq_len", "data.seq_len"),
        "both",
        lambda v: dict.fromkeys(("model.max_seq_len", "data.seq_len"), int(v.given["max_target_length"])),
        lambda k: {"max_target_length": k["data.seq_len"]},
    ),
    direct("dtype", "model.dtype", "bfloat16 or float32", one_of("dtype", DTYPES), one_of("model.dtype", DTYPES)),
    direct("per_device_batch_size", "data.per_device_batch", "whole examples only", batch_size),
    Rule(
        tuple(f"{w}_{a}_parallelism" for w in ("ici", "dcn") for a in (*MESH_AXES, *OTHER_AXES)),
        ("mesh.ici_mesh_shape", "mesh.dcn_mesh_shape"),
        "(data, fsdp, tensor) sizes; other axes only at 1; DCN -1 needs the slice count",
        mesh_to_equipax,
        mesh_to_maxtext,
    ),
    direct("scan_layers", TRANSFORMER + "scan_layers", to=bool),
    direct(
        "remat_policy",
        TRANSFORMER + "remat",
        "none, full; minimal -> dots_saveable (checkpoint dots without batch dims)",
        one_of("remat_policy", REMATS),
        one_of("model.transformer.remat", inverted(REMATS)),
    ),
    Rule(
        ("mlp_activations",),
        (TRANSFORMER + "activation", TRANSFORMER + "gated"),
        "[act] or gated [act, 'linear']",
        activation_to_equipax,
        activation_to_maxtext,
    ),
    direct("attn_logits_soft_cap", TRANSFORMER + "atten_logit_cap", "0/null = no cap", logit_cap, lambda c: c or 0.0),
    direct("final_logits_soft_cap", "model.output_logit_cap", "0/null = no cap", logit_cap, lambda c: c or 0.0),
    Rule(
        (
            "learning_rate",
            "warmup_steps_fraction",
            "cosine_learning_rate_final_fraction",
            "learning_rate_schedule_steps",
        ),
        tuple(
            f"learner.schedule.{k}"
            for k in ("kind", "peak_learning_rate", "warmup_steps", "decay_steps", "final_fraction")
        ),
        "warmup_cosine: warmup = fraction x schedule steps (-1 = steps), cosine for the rest",
        schedule_to_equipax,
        schedule_to_maxtext,
    ),
    direct(
        "opt_type",
        "learner.kind",
        "adamw; adam_pax -> pax_adam",
        one_of("opt_type", OPTIMIZERS),
        one_of("learner.kind", inverted(OPTIMIZERS)),
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
        "dataset_type",
        "data.source",
        "c4 or synthetic",
        one_of("dataset_type", DATASETS),
        one_of("data.source", DATASETS),
    ),
    direct("dataset_path", "data.path", "a directory of c4-train.*/c4-validation.* shards (not TFDS)", str),
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

# Keys known to have no equipax knob, with why (anything else: "no equipax knob").
