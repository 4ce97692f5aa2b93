"""What the MaxText <-> equipax rules are made of: MaxText's defaults, the values a rule reads
(`Values`) and the converters each way (`*_to_equipax`, `*_to_maxtext`). The rules themselves are
`maxtext_rules.RULES`; the public functions are in `maxtext.py`."""

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "activation_to_equipax",
    "activation_to_maxtext",
    "ACTIVATIONS",
    "batch_size",
    "dims_to_equipax",
    "dims_to_maxtext",
    "inverted",
    "logit_cap",
    "MAXTEXT_DEFAULTS",
    "MESH_AXES",
    "mesh_to_equipax",
    "mesh_to_maxtext",
    "one_of",
    "OTHER_AXES",
    "positive_int",
    "profiler_to_equipax",
    "profiler_to_maxtext",
    "scale_multipliers",
    "SCALE_RULES",
    "schedule_to_equipax",
    "schedule_to_maxtext",
    "Skip",
    "steps_to_equipax",
    "TRANSFORMER",
    "Values",
]

# base.yml values a derived knob needs when a config leaves them out.
MAXTEXT_DEFAULTS: dict[str, Any] = {
    "global_parameter_scale": 1,
    "base_num_decoder_layers": 16,
    "base_emb_dim": 2048,
    "base_mlp_dim": 7168,
    "base_num_query_heads": 16,
    "steps": 150_001,
    "learning_rate": 3e-5,
    "warmup_steps_fraction": 0.1,
    "cosine_learning_rate_final_fraction": 0.1,
    "learning_rate_schedule_steps": -1,
    "skip_first_n_steps_for_profiler": 1,
    "profiler_steps": 5,
}
MESH_AXES = ("data", "fsdp", "tensor")  # equipax's (data, fsdp, tensor) mesh axes
OTHER_AXES = (
    "fsdp_transpose",
    "sequence",
    "context",
    "autoregressive",
    "expert",
    "pipeline",
    "tensor_transpose",
    "tensor_sequence",
)
SCALE_RULES = ("linear", "doubling")
TRANSFORMER = "model.transformer."
ACTIVATIONS: dict[tuple[str, ...], tuple[str, bool]] = {
    ("relu",): ("relu", False),
    ("gelu",): ("gelu", False),
    ("silu",): ("silu", False),
    ("silu", "linear"): ("silu", True),
    ("gelu", "linear"): ("gelu", True),
    ("relu", "linear"): ("relu", True),
}


class Skip(Exception):
    """A key (or knob) that cannot be translated; the message says why."""


@dataclasses.dataclass
class Values:
    """The MaxText keys of one translation, with what was used and what was skipped."""

    given: Mapping[str, Any]
    scale_rule: str = "linear"
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)

    def has(self, *keys: str) -> bool:
        return any(k in self.given for k in keys)

    def get(self, key: str) -> Any:
        return self.given[key] if key in self.given else MAXTEXT_DEFAULTS[key]


def scale_multipliers(scale: int, rule: str) -> tuple[int, int, int, int]:
    """Multipliers of (layers, emb, mlp, heads) for `global_parameter_scale`."""
    if rule == "linear":  # MaxText's first release, as the Pax README's table translates it
        return scale, scale, scale, scale
    log2 = int(math.log2(scale)) if scale > 0 else -1
    if log2 < 0 or 2**log2 != scale:
        raise Skip(f"global_parameter_scale={scale}: the doubling rule needs a power of two")
    base, rem = divmod(log2, 3)  # MaxText today: doublings rotate over heads+mlp, emb, layers
    heads = base + int(rem > 0)
    return 2**base, 2 ** (base + int(rem > 1)), 2**heads, 2**heads


def dims_to_equipax(v: Values) -> dict[str, Any]:
    scale = v.has("global_parameter_scale")
    try:
        layers, emb, mlp, heads = scale_multipliers(int(v.get("global_parameter_scale")), v.scale_rule)
    except Skip as e:
        v.skipped["global_parameter_scale"] = str(e)
        return {}
    if scale and v.get("global_parameter_scale") != 1:
        v.notes.append(
            f"global_parameter_scale={v.get('global_parameter_scale')} applied with the "
            f"{v.scale_rule!r} rule (--scale-rule: 'linear' multiplies every base_* size, as MaxText's "
            "first release and the Pax README do; 'doubling' is MaxText's current power-of-two rule)."
        )
    if "base_num_heads" in v.given and "base_num_query_heads" not in v.given:  # the older key
        v.given = {**v.given, "base_num_query_heads": v.given["base_num_heads"]}
    out = {}
    for key, knob, m in (
        ("base_num_decoder_layers", "num_layers", layers),
        ("base_emb_dim", "model_dims", emb),
        ("base_mlp_dim", "hidden_dims", mlp),
        ("base_num_query_heads", "num_heads", heads),
    ):
        if scale or v.has(key):
            out[TRANSFORMER + knob] = int(v.get(key)) * m
    if v.has("base_num_kv_heads"):
        kv = int(v.given["base_num_kv_heads"]) * heads
        if kv != out.get(TRANSFORMER + "num_heads", kv):
            v.skipped["base_num_kv_heads"] = (
                f"{kv} key/value heads for {out[TRANSFORMER + 'num_heads']} query heads is "
                "grouped-query attention; equipax's Pax LM has one key/value head "
                "per query head (the llama experiments have GQA)"
            )
    return out


def dims_to_maxtext(k: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "global_parameter_scale": 1,
        "base_num_decoder_layers": k[TRANSFORMER + "num_layers"],
        "base_emb_dim": k[TRANSFORMER + "model_dims"],
        "base_mlp_dim": k[TRANSFORMER + "hidden_dims"],
        "base_num_query_heads": k[TRANSFORMER + "num_heads"],
        "base_num_kv_heads": k[TRANSFORMER + "num_heads"],
    }


def mesh_to_equipax(v: Values) -> dict[str, Any]:
    out = {}
    for where in ("ici", "dcn"):
        keys = [f"{where}_{a}_parallelism" for a in MESH_AXES]
        for axis in OTHER_AXES:
            size = v.given.get(f"{where}_{axis}_parallelism", 1)
            if size != 1:
                v.skipped[f"{where}_{axis}_parallelism"] = (
                    f"equipax meshes have data, fsdp and tensor axes (and stage for pipelines, docs/pipeline.md); "
                    f"no {axis} axis"
                )
        if not v.has(*keys):
            continue
        default = {"ici": (1, -1, 1), "dcn": (-1, 1, 1)}[where]  # base.yml: fsdp (ICI), data (DCN) take the rest
        shape = tuple(int(v.given.get(k, d)) for k, d in zip(keys, default))
        if where == "dcn" and -1 in shape:
            v.skipped[keys[shape.index(-1)]] = "-1 (all slices) needs the slice count: give the number of slices"
            continue
        out[f"mesh.{where}_mesh_shape"] = shape
    return out


def mesh_to_maxtext(k: Mapping[str, Any]) -> dict[str, Any]:
    return {
        f"{where}_{a}_parallelism": s
        for where in ("ici", "dcn")
        for a, s in zip(MESH_AXES, k[f"mesh.{where}_mesh_shape"])
    }


def schedule_to_equipax(v: Values) -> dict[str, Any]:
    steps = int(v.get("steps"))
    total = int(v.get("learning_rate_schedule_steps"))
    total = steps if total == -1 else total
    warmup = round(float(v.get("warmup_steps_fraction")) * total)
    if total <= warmup:
        raise Skip(f"a cosine of {total - warmup} steps after {warmup} warmup steps")
    if total < steps:
        v.notes.append(f"MaxText trains at learning rate 0 after step {total}; equipax stays at final_fraction x peak.")
    return {
        "learner.schedule.kind": "warmup_cosine",
        "learner.schedule.peak_learning_rate": float(v.get("learning_rate")),
        "learner.schedule.warmup_steps": warmup,
        "learner.schedule.decay_steps": total - warmup,
        "learner.schedule.final_fraction": float(v.get("cosine_learning_rate_final_fraction")),
    }


def schedule_to_maxtext(k: Mapping[str, Any]) -> dict[str, Any]:
    if k["learner.schedule.kind"] != "warmup_cosine":
        raise Skip(f"learner.schedule.kind={k['learner.schedule.kind']!r}: MaxText's schedule is warmup + cosine")
    total = k["learner.schedule.warmup_steps"] + k["learner.schedule.decay_steps"]
    return {
        "learning_rate": k["learner.schedule.peak_learning_rate"],
        "learning_rate_schedule_steps": total,
        "warmup_steps_fraction": k["learner.schedule.warmup_steps"] / total,
        "cosine_learning_rate_final_fraction": k["learner.schedule.final_fraction"],
    }


def activation_to_equipax(v: Values) -> dict[str, Any]:
    acts = tuple(v.given["mlp_activations"])
    if acts not in ACTIVATIONS:
        raise Skip(f"{list(acts)}: equipax has relu/gelu/silu, optionally gated ([act, 'linear'])")
    act, gated = ACTIVATIONS[acts]
    return {TRANSFORMER + "activation": act, TRANSFORMER + "gated": gated}


def activation_to_maxtext(k: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "mlp_activations": [k[TRANSFORMER + "activation"], "linear"]
        if k[TRANSFORMER + "gated"]
        else [k[TRANSFORMER + "activation"]]
    }


def profiler_to_equipax(v: Values) -> dict[str, Any]:
    kind = v.given.get("profiler", "xplane" if v.given.get("enable_profiler") else "")
    if kind not in ("", "xplane"):
        raise Skip(f"profiler={kind!r}: equipax traces with jax.profiler (xplane); run nsys around `launch run`")
    out: dict[str, Any] = {"train.profile.steps": int(v.get("profiler_steps")) if kind else 0}
    if kind:
        out["train.profile.start_step"] = int(v.get("skip_first_n_steps_for_profiler")) + 1
        out["train.profile.all_processes"] = bool(v.given.get("upload_all_profiler_results", False))
    return out


def profiler_to_maxtext(k: Mapping[str, Any]) -> dict[str, Any]:
    if not k["train.profile.steps"]:
        return {"profiler": ""}
    start = k["train.profile.start_step"] or 2
    return {
        "profiler": "xplane",
        "skip_first_n_steps_for_profiler": start - 1,
        "profiler_steps": k["train.profile.steps"],
        "upload_all_profiler_results": k["train.profile.all_processes"],
    }


def steps_to_equipax(v: Values) -> dict[str, Any]:
    steps = int(v.given["steps"])
    steps = steps if steps != -1 else int(v.get("learning_rate_schedule_steps"))
    if steps <= 0:
        raise Skip("steps=-1 needs learning_rate_schedule_steps > 0")
    return {"train.num_steps": steps}


def logit_cap(v: Any) -> float | None:
    return float(v) if v else None


def positive_int(key: str, what: str) -> Callable[[Any], int]:
    def to(value: Any) -> int:
        if int(value) <= 0:
            raise Skip(f"{key}={value}: {what}")
        return int(value)

    return to


def batch_size(value: Any) -> int:
    if float(value) != int(float(value)) or float(value) < 1:
        raise Skip(f"per_device_batch_size={value}: equipax needs a whole number of examples per device")
    return int(float(value))


def one_of(key: str, table: Mapping[Any, Any]) -> Callable[[Any], Any]:
    def to(value: Any) -> Any:
        if value not in table:
            raise Skip(f"{key}={value!r}: translated are {', '.join(map(repr, table))}")
        return table[value]

    return to


def inverted(table: Mapping[Any, Any]) -> dict[Any, Any]:
    return {b: a for a, b in table.items()}
