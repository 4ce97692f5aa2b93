"""MaxText <-> equipax: the config keys of MaxText 0.2.5 (`base.yml`, `configs/models/*.yml`) as
equipax knobs, and back.

Pure functions on plain values (no JAX, no files). `rules.RULES` is the translation table: each
rule reads some MaxText keys and sets some equipax knobs, and says how in one line;
`launch convert maxtext`, `launch show --format maxtext` and docs/maxtext.md (`markdown_table`)
all come from it. A config with a `decoder_block` is translated onto an experiment of that
block's family (`blocks.py`), with every knob that defines the model set from the config
or MaxText's defaults; a config without one (an override file) translates only the keys it sets.
An architecture the stack lacks is a `ConfigError` naming the keys, never another model.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

from equipax.core.knobs import ConfigError, flatten, set_knobs
from equipax.core.mesh_config import CONTEXT_AXES, EXPERT_AXES, STAGE
from equipax.launch.translators.maxtext.blocks import (
    ARCHITECTURE_CHECKS,
    FAMILIES,
    architecture_problems,
    base_experiment,
    llama3_1_scaling,
    representable,
)
from equipax.launch.translators.maxtext.mesh import pipeline_stages
from equipax.launch.translators.maxtext.rules import RULES
from equipax.launch.translators.maxtext.values import MESH_AXES, OTHER_AXES, SCALE_RULES, Skip, Values, brief

__all__ = [
    "apply_translation",
    "merge",
    "settable",
    "NOT_TRANSLATED",
    "Translation",
    "markdown_table",
    "to_equipax",
    "to_maxtext",
]

NOT_TRANSLATED = {
    "run_name": "the job directory is `launch run --job-log-dir`",
    "base_output_directory": "the job directory is `launch run --job-log-dir`",
    "enable_checkpointing": "equipax always checkpoints (every train.checkpoint_every steps, at the end, on a stop)",
    "log_period": "MaxText flushes TensorBoard every log_period steps; equipax's train.log_every is how often "
    "metrics are read back (a different trade-off)",
    "init_weights_seed": "equipax splits one train.seed into init, data and step keys",
    "data_shuffle_seed": "equipax splits one train.seed into init, data and step keys",
    "weight_dtype": "equipax keeps parameters in float32",
    "adam_eps_root": "equipax's Adam has no epsilon inside the square root",
    "hardware": "the platform is JAX's (JAX_PLATFORMS)",
    "dropout_rate": "equipax's language models have no dropout",
    "enable_dropout": "equipax's language models have no dropout",
    "logical_axis_rules": "equipax's rules are mesh.logical_axis_rules, over its own logical axis names",
    "mesh_axes": "equipax's mesh axes are mesh.axis_names (data, fsdp, tensor; expert, stage)",
    "data_sharding": "equipax shards the batch over its batch axes (data, fsdp, expert)",
    "gradient_accumulation_steps": "equipax takes one optimizer step per batch (a larger data.per_device_batch "
    "or mesh instead)",
}
# values that already mean what equipax does (not listed as untranslated)
_QUIET = {
    ("enable_checkpointing", True),
    ("weight_dtype", "float32"),
    ("adam_eps_root", 0),
    ("adam_eps_root", 0.0),
    ("dropout_rate", 0),
    ("dropout_rate", 0.0),
    ("enable_dropout", False),
    ("override_model_config", False),
    ("gradient_accumulation_steps", 1),
}


@dataclasses.dataclass
class Translation:
    """equipax knobs of a MaxText config (dotted paths), the base experiment they apply to (None:
    the caller's), the keys with no translation (key -> why), those with no equipax meaning at all
    (key -> the value, briefly) and notes (dependent knobs set, behaviour that differs)."""

    knobs: dict[str, Any]
    skipped: dict[str, str]
    notes: list[str]
    exp: str | None = None
    ignored: dict[str, str] = dataclasses.field(default_factory=dict)


def merge(base: Mapping[str, Any], model: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """MaxText's merge: base.yml, then the model file, then the command line. A key both the model
    file and the command line set to different values is an error there (unless
    `override_model_config=true`, when the command line wins), and here."""
    clash = [k for k in model if k in overrides and model[k] != overrides[k]]
    if clash and not overrides.get("override_model_config", base.get("override_model_config", False)):
        raise ConfigError(
            f"The model file and the command line both set {', '.join(clash)} (to {brief(model[clash[0]])} and "
            f"{brief(overrides[clash[0]])}); MaxText refuses this. Drop the override, or add "
            "override_model_config=true to let the command line win."
        )
    return {**base, **model, **overrides}


def to_equipax(maxtext: Mapping[str, Any], *, scale_rule: str = "doubling") -> Translation:
    """Translate a MaxText config into equipax knobs (dotted paths) and the base experiment of its
    family; raise ConfigError for an architecture equipax's stack lacks."""
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {SCALE_RULES}; got {scale_rule!r}.")
    v = Values(dict(maxtext), scale_rule=scale_rule)
    try:
        exp = _block(v)
    except ConfigError:
        raise
    except (ValueError, TypeError, ArithmeticError) as e:
        raise _untranslatable(maxtext, _BLOCK_KEYS, e) from None
    knobs: dict[str, Any] = {}
    used: set[str] = set()
    for rule in RULES:
        if not v.has(*rule.maxtext) and not (rule.architecture and v.family) and not rule.always:
            continue
        used |= set(rule.maxtext)
        try:
            knobs |= rule.forward(v)
        except Skip as e:
            for key in rule.maxtext:
                if key in maxtext:
                    v.skipped.setdefault(key, str(e))
        except (ValueError, TypeError, ArithmeticError, KeyError) as e:
            raise _untranslatable(maxtext, rule.maxtext, e) from None
    for key, (_, what) in ARCHITECTURE_CHECKS.items():
        used.add(key)
        if v.family is None and key in maxtext and not representable(key, maxtext[key]):  # checked above with a block
            v.skipped[key] = f"{brief(maxtext[key])}: {what}, which the base experiment's block does not have"
    if maxtext.get("context_parallel_strategy") == "ring" and maxtext.get("use_tokamax_splash"):
        used.add("use_tokamax_splash")  # show's own case, reversed: MaxText's ring runs in its splash kernel
        if knobs.get("model.transformer.attention_impl") == "splash":
            knobs["model.transformer.attention_impl"] = "auto"
            v.notes.append("attention=flash with a ring: attention_impl='auto' (equipax's ring picks its block kernel)")
    ignored: dict[str, str] = {}
    for key, value in maxtext.items():
        if key in used or v.skipped.get(key) or _quiet(key, value):
            continue
        if key in NOT_TRANSLATED:
            v.skipped[key] = f"{brief(value)}: {NOT_TRANSLATED[key]}"
        else:
            ignored[key] = brief(value)
    return Translation(knobs, v.skipped, v.notes, exp, ignored)


# the keys `_block` reads before the rules run
_BLOCK_KEYS = (
    "decoder_block",
    "model_name",
    "rope_type",
    "rope_use_scale",
    "rope_max_timescale",
    "ici_pipeline_parallelism",
    "dcn_pipeline_parallelism",
    *ARCHITECTURE_CHECKS,
)


def _block(v: Values) -> str | None:
    """Set the decoder block (family, MoE, mesh axes) of `v`; its base experiment (None: no
    decoder_block). Raises ConfigError for an architecture the stack lacks."""
    exp = None
    if "decoder_block" in v.given:
        problems = architecture_problems(v)
        if problems:
            raise ConfigError(
                "This MaxText config describes an architecture equipax's decoder stack does not have: "
                + "; ".join(problems)
                + f". Translated decoder blocks are {', '.join(FAMILIES)} (docs/maxtext.md, 'Decoder blocks'); "
                "nothing was translated."
            )
        v.family = str(v.given["decoder_block"])
        v.moe = FAMILIES[v.family].moe
        v.axes = EXPERT_AXES if v.moe else MESH_AXES
        exp = base_experiment(v)
    context = int(v.given.get("ici_context_parallelism", 1)) * int(v.given.get("dcn_context_parallelism", 1))
    if context > 1:
        if v.axes != MESH_AXES:
            v.skipped["ici_context_parallelism"] = (
                f"{context}: equipax's context axis goes with data, fsdp, tensor and stage (no expert axis)"
            )
        else:
            v.axes = CONTEXT_AXES
    if pipeline_stages(v) > 1:
        if "expert" in v.axes:
            v.skipped["ici_pipeline_parallelism"] = (
                "equipax pipelines a dense stack (no expert and stage axes together)"
            )
        else:
            v.axes = (STAGE, *v.axes)
    return exp


def _untranslatable(maxtext: Mapping[str, Any], keys: tuple[str, ...], e: Exception) -> ConfigError:
    given = ", ".join(f"{k}={brief(maxtext[k])}" for k in keys if k in maxtext)
    return ConfigError(
        f"The MaxText value(s) {given} do not translate: {e}. Give each key a value of the kind "
        f"MaxText takes (a number for sizes and steps, e.g. steps=1000)."
    )


def _quiet(key: str, value: Any) -> bool:
    try:
        return (key, value) in _QUIET
    except TypeError:  # a list or dict value
        return False


def settable(cfg: Any, knobs: Mapping[str, Any]) -> dict[str, Any]:
    """A translation's knobs as `set_knobs` / `--set` take them on `cfg`: `model.rope_scaling` is a
    group of knobs where the base experiment has one (then set field by field) and a single knob
    where it has none (then set whole, as a dict). Raises ConfigError where a base with rotary
    scaling would keep it."""
    have = flatten(cfg)
    values = dict(knobs)
    scaling = values.pop("model.rope_scaling", None)
    grouped = "model.rope_scaling" not in have
    if "model.rope_scaling" in knobs and scaling is None and grouped:
        raise ConfigError(
            "This MaxText config has no rotary scaling, but the base experiment has model.rope_scaling; "
            "choose an --exp without it (e.g. --exp llama3_8b)."
        )
    if scaling is not None:
        if grouped:
            values |= {f"model.rope_scaling.{k}": v for k, v in scaling.items()}
        else:
            values["model.rope_scaling"] = scaling
    return values


C = TypeVar("C")


def apply_translation(cfg: C, knobs: Mapping[str, Any]) -> C:
    """`cfg` with a translation's knobs set (raises ConfigError where the result is invalid)."""
    return set_knobs(cfg, settable(cfg, knobs))


def to_maxtext(knobs: Mapping[str, Any]) -> Translation:
    """The MaxText keys of flat equipax knobs (`flatten(cfg)` of an LM experiment); `knobs` of the
    result holds MaxText keys, `skipped` the knobs MaxText cannot express (knob -> why)."""
    out: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for rule in RULES:
        try:
            out |= rule.reverse(knobs)
        except Skip as e:
            skipped[rule.equipax[0]] = str(e)
        except KeyError as e:
            skipped[rule.equipax[0]] = f"this experiment has no knob {e.args[0]}"
    if knobs["model.max_seq_len"] != knobs["data.seq_len"]:
        skipped["model.max_seq_len"] = (
            f"{knobs['model.max_seq_len']}: MaxText's max_target_length is both the training length "
            f"(data.seq_len={knobs['data.seq_len']}) and the longest sequence"
        )
    if knobs["data.per_device_batch"] is None and isinstance(out.get("per_device_batch_size"), int):
        skipped["data.per_device_batch"] = (
            f"None (a global data.batch_size={knobs['data.batch_size']}): written as per_device_batch_size="
            f"{out['per_device_batch_size']}, the batch over this mesh's devices"
        )
    if out.get("context_parallel_strategy") == "ring" and out.get("attention") == "autoselected":
        out |= {"attention": "flash", "use_tokamax_splash": True}  # MaxText's ring runs on that kernel only
        skipped["model.transformer.attention_impl"] = "'auto': written as flash (MaxText's ring needs it)"
    size = knobs.get("model.transformer.pipeline_microbatch_size")
    if size is not None and knobs["model.transformer.pipeline_stages"] > 1:
        skipped["model.transformer.pipeline_microbatch_size"] = (
            f"{size}: written as num_pipeline_microbatches={out.get('num_pipeline_microbatches')} (MaxText counts "
            "microbatches of the global batch)"
        )
        skipped["model.transformer.pipeline_microbatches"] = "None: set from pipeline_microbatch_size (the line above)"
    if knobs.get("model.rope_scaling.kind") is not None and not llama3_1_scaling(knobs):
        skipped["model.rope_scaling"] = (
            f"factor {knobs['model.rope_scaling.factor']}: MaxText's one rotary scaling is Llama 3.1's "
            "(factor 8, frequency factors 1 and 4, context 8192)"
        )
    if out.get("decoder_block") in FAMILIES:
        window = knobs.get("model.transformer.sliding_window")
        if window is not None:
            skipped["model.transformer.sliding_window"] = (
                f"{window}: MaxText's {out['decoder_block']} block attends to the whole causal prefix"
            )
    return Translation(out, skipped, [])


def markdown_table() -> str:
    """docs/maxtext.md's translation table, from `RULES`."""
    lines = ["| MaxText | equipax | how |", "|---|---|---|"]
    for rule in RULES:
        shown = [
            k for k in rule.maxtext if not k.endswith(tuple(f"_{a}_parallelism" for a in (*OTHER_AXES, "pipeline")))
        ]
        keys = ", ".join(f"`{k}`" for k in shown)
        lines.append(f"| {keys} | {', '.join(f'`{k}`' for k in rule.equipax)} | {rule.how} |")
    lines += [f"| `{k}` | - | not translated: {why} |" for k, why in NOT_TRANSLATED.items()]
    return "\n".join(lines) + "\n"
