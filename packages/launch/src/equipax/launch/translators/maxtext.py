"""MaxText <-> equipax: the config keys of MaxText's `base.yml` as equipax knobs, and back.

Pure functions on plain values (no JAX, no files). `RULES` is the translation table: each rule
reads some MaxText keys and sets some equipax knobs, and says how in one line;
`launch convert maxtext`, `launch show --format maxtext` and docs/maxtext.md (`markdown_table`)
all come from it. Only the keys a config sets are translated: the knobs of the base experiment
stay as they are for the rest (MaxText's own defaults are used only where a derived number
needs them, e.g. `base_emb_dim` when only `global_parameter_scale` is given).
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

from equipax.core.knobs import ConfigError
from equipax.launch.translators.maxtext_converters import MESH_AXES, OTHER_AXES, SCALE_RULES, Skip, Values
from equipax.launch.translators.maxtext_rules import RULES

__all__ = ["NOT_TRANSLATED", "RULES", "SCALE_RULES", "Translation", "markdown_table", "to_equipax", "to_maxtext"]

NOT_TRANSLATED = {
    "run_name": "the job directory is `launch run --job-log-dir`",
    "base_output_directory": "the job directory is `launch run --job-log-dir`",
    "decoder_block": "equipax translates into Pax's GPT decoder (LayerNorm, sinusoidal positions); for Llama blocks "
    "see the llama* experiments",
    "model_name": "MaxText's model presets are not read: give their keys",
    "enable_checkpointing": "equipax always checkpoints (every train.checkpoint_every steps, at the end, on a stop)",
    "log_period": "MaxText flushes TensorBoard every log_period steps; equipax's train.log_every is how often "
    "metrics are read back (a different trade-off)",
    "init_weights_seed": "equipax splits one train.seed into init, data and step keys",
    "data_shuffle_seed": "equipax splits one train.seed into init, data and step keys",
    "tokenizer_path": "the C4 input reads Pax's SentencePiece vocabulary (data knobs)",
    "weight_dtype": "equipax keeps parameters in float32",
    "adam_eps_root": "equipax's Adam has no epsilon inside the square root",
    "hardware": "the platform is JAX's (JAX_PLATFORMS)",
    "dropout_rate": "equipax's Pax LM has no dropout",
}
_QUIET = {
    ("enable_checkpointing", True),
    ("weight_dtype", "float32"),
    ("adam_eps_root", 0),
    ("dropout_rate", 0),
    ("adam_eps_root", 0.0),
    ("dropout_rate", 0.0),
}  # values that already mean what equipax does


@dataclasses.dataclass
class Translation:
    """equipax knobs of a MaxText config, and the keys that had no translation (key -> why)."""

    knobs: dict[str, Any]
    skipped: dict[str, str]
    notes: list[str]


def to_equipax(maxtext: Mapping[str, Any], *, scale_rule: str = "linear") -> Translation:
    """Translate the keys a MaxText config sets into equipax knobs (dotted paths)."""
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {SCALE_RULES}; got {scale_rule!r}.")
    v = Values(dict(maxtext), scale_rule=scale_rule)
    knobs: dict[str, Any] = {}
    used: set[str] = set()
    for rule in RULES:
        if not v.has(*rule.maxtext):
            continue
        used |= set(rule.maxtext)
        try:
            knobs |= rule.forward(v)
        except Skip as e:
            for key in rule.maxtext:
                if key in maxtext:
                    v.skipped.setdefault(key, str(e))
        except (ValueError, TypeError, ArithmeticError) as e:
            given = ", ".join(f"{k}={maxtext[k]!r}" for k in rule.maxtext if k in maxtext)
            raise ConfigError(
                f"The MaxText value(s) {given} do not translate: {e}. Give each key a value of the kind "
                f"MaxText takes (a number for sizes and steps, e.g. steps=1000)."
            ) from None
    for key, value in maxtext.items():
        if key not in used and (key, value) not in _QUIET:
            v.skipped.setdefault(key, NOT_TRANSLATED.get(key, "no equipax knob"))
    return Translation(knobs, v.skipped, v.notes)


def to_maxtext(knobs: Mapping[str, Any]) -> Translation:
    """The MaxText keys of flat equipax knobs (`flatten(cfg)` of an LM experiment); `knobs` of the
    result holds MaxText keys, `skipped` the rules that did not apply (first knob -> why)."""
    out: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for rule in RULES:
        try:
            out |= rule.reverse(knobs)
        except Skip as e:
            skipped[rule.equipax[0]] = str(e)
        except KeyError as e:
            skipped[rule.equipax[0]] = f"this experiment has no knob {e.args[0]}"
    if knobs.get("mesh.axis_names", MESH_AXES) != MESH_AXES:
        skipped["mesh.axis_names"] = f"{knobs['mesh.axis_names']}: MaxText's pipeline axis is not translated"
    return Translation(out, skipped, [])


def markdown_table() -> str:
    """docs/maxtext.md's translation table, from `RULES`."""
    lines = ["| MaxText | equipax | how |", "|---|---|---|"]
    for rule in RULES:
        shown = [k for k in rule.maxtext if not k.endswith(tuple(f"_{a}_parallelism" for a in OTHER_AXES))]
        keys = ", ".join(f"`{k}`" for k in shown)
        lines.append(f"| {keys} | {', '.join(f'`{k}`' for k in rule.equipax)} | {rule.how} |")
    lines += [f"| `{k}` | - | not translated: {why} |" for k, why in NOT_TRANSLATED.items()]
    return "\n".join(lines) + "\n"
