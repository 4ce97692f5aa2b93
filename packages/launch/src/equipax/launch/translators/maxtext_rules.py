"""The MaxText <-> equipax translation rules (`RULES`) and the converters they use; the public
functions are in `maxtext.py`."""


import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "ACTIVATIONS",
    "DATASETS",
    "DTYPES",
    "MAXTEXT_DEFAULTS",
    "MESH_AXES",
    "OPTIMIZERS",
    "OTHER_AXES",
    "REMATS",
    "Rule",
    "RULES",
    "SCALE_RULES",
    "Skip",
    "Values",
]

# base.yml values a derived knob needs when a config leaves them out.
MAXTEXT_DEFAULTS: dict[str, Any] = {
    "global_parameter_scale": 1, "base_num_decoder_layers": 16, "base_emb_dim": 2048, "base_mlp_dim": 7168,
    "base_num_query_heads": 16, "steps": 150_001, "learning_rate": 3e-5, "warmup_steps_fraction": 0.1,
    "cosine_learning_rate_final_fraction": 0.1, "learning_rate_schedule_steps": -1,
    "skip_first_n_steps_for_profiler": 1, "profiler_steps": 5,
}
MESH_AXES = ("data", "fsdp", "tensor")  # equipax's (data, fsdp, tensor) mesh axes
OTHER_AXES = ("fsdp_transpose", "sequence", "context", "autoregressive", "expert", "pipeline",
              "tensor_transpose", "tensor_sequence")
SCALE_RULES = ("linear", "doubling")
T = "model.transformer."
REMATS = {"none": "none", "full": "full", "minimal": "dots_saveable"}
ACTIVATIONS: dict[tuple[str, ...], tuple[str, bool]] = {("relu",): ("relu", False), ("gelu",): ("gelu", False), ("silu",): ("silu", False),
               ("silu", "linear"): ("silu", True), ("gelu", "linear"): ("gelu", True),
               ("relu", "linear"): ("relu", True)}


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


@dataclasses.dataclass(frozen=True)
class Rule:
    """MaxText keys -> equipax knobs (`forward`) and back (`reverse`, from flat knobs)."""

    maxtext: tuple[str, ...]
    equipax: tuple[str, ...]
    how: str
    forward: Callable[[Values], dict[str, Any]]
    reverse: Callable[[Mapping[str, Any]], dict[str, Any]]


def _direct(key: str, knob: str, how: str = "same value", to: Callable[[Any], Any] = lambda v: v,
            back: Callable[[Any], Any] = lambda v: v) -> Rule:
    return Rule((key,), (knob,), how, lambda v: {knob: to(v.get(key))}, lambda k: {key: back(k[knob])})


def _scale(scale: int, rule: str) -> tuple[int, int, int, int]:
    """Multipliers of (layers, emb, mlp, heads) for `global_parameter_scale`."""
    if rule == "linear":  # MaxText's first release, as the Pax README's table translates it
        return scale, scale, scale, scale
    log2 = int(math.log2(scale)) if scale > 0 else -1
    if log2 < 0 or 2**log2 != scale:
        raise Skip(f"global_parameter_scale={scale}: the doubling rule needs a power of two")
    base, rem = divmod(log2, 3)  # MaxText today: doublings rotate over heads+mlp, emb, layers
    heads = base + int(rem > 0)
    return 2**base, 2 ** (base + int(rem > 1)), 2**heads, 2**heads


def _dims(v: Values) -> dict[str, Any]:
    scale = v.has("global_parameter_scale")
    try:
        layers, emb, mlp, heads = _scale(int(v.get("global_parameter_scale")), v.scale_rule)
    except Skip as e:
        v.skipped["global_parameter_scale"] = str(e)
        return {}
    if scale and v.get("global_parameter_scale") != 1:
        v.notes.append(f"global_parameter_scale={v.get('global_parameter_scale')} applied with the "
                       f"{v.scale_rule!r} rule (--scale-rule: 'linear' multiplies every base_* size, as MaxText's "
                       "first release and the Pax README do; 'doubling' is MaxText's current power-of-two rule).")
    if "base_num_heads" in v.given and "base_num_query_heads" not in v.given:  # the older key
        v.given = {**v.given, "base_num_query_heads": v.given["base_num_heads"]}
    out = {}
    for key, knob, m in (("base_num_decoder_layers", "num_layers", layers), ("base_emb_dim", "model_dims", emb),
                         ("base_mlp_dim", "hidden_dims", mlp), ("base_num_query_heads", "num_heads", heads)):
        if scale or v.has(key):
            out[T + knob] = int(v.get(key)) * m
    if v.has("base_num_kv_heads"):
        kv = int(v.given["base_num_kv_heads"]) * heads
        if kv != out.get(T + "num_heads", kv):
            v.skipped["base_num_kv_heads"] = (f"{kv} key/value heads for {out[T + 'num_heads']} query heads is "
                                              "grouped-query attention; equipax's Pax LM has one key/value head "
                                              "per query head (the llama experiments have GQA)")
    return out


def _dims_back(k: Mapping[str, Any]) -> dict[str, Any]:
    return {"global_parameter_scale": 1, "base_num_decoder_layers": k[T + "num_layers"],
            "base_emb_dim": k[T + "model_dims"], "base_mlp_dim": k[T + "hidden_dims"],
            "base_num_query_heads": k[T + "num_heads"], "base_num_kv_heads": k[T + "num_heads"]}


def _mesh(v: Values) -> dict[str, Any]:
    out = {}
    for where in ("ici", "dcn"):
        keys = [f"{where}_{a}_parallelism" for a in MESH_AXES]
        for axis in OTHER_AXES:
            size = v.given.get(f"{where}_{axis}_parallelism", 1)
            if size != 1:
                v.skipped[f"{where}_{axis}_parallelism"] = (
                    f"equipax meshes have data, fsdp and tensor axes (and stage for pipelines, docs/pipeline.md); "
                    f"no {axis} axis")
        if not v.has(*keys):
            continue
        default = {"ici": (1, -1, 1), "dcn": (-1, 1, 1)}[where]  # base.yml: fsdp (ICI), data (DCN) take the rest
        shape = tuple(int(v.given.get(k, d)) for k, d in zip(keys, default))
        if where == "dcn" and -1 in shape:
            v.skipped[keys[shape.index(-1)]] = "-1 (all slices) needs the slice count: give the number of slices"
            continue
        out[f"mesh.{where}_mesh_shape"] = shape
    return out


def _mesh_back(k: Mapping[str, Any]) -> dict[str, Any]:
    return {f"{where}_{a}_parallelism": s for where in ("ici", "dcn")
            for a, s in zip(MESH_AXES, k[f"mesh.{where}_mesh_shape"])}


def _schedule(v: Values) -> dict[str, Any]:
    steps = int(v.get("steps"))
    total = int(v.get("learning_rate_schedule_steps"))
    total = steps if total == -1 else total
    warmup = round(float(v.get("warmup_steps_fraction")) * total)
    if total <= warmup:
        raise Skip(f"a cosine of {total - warmup} steps after {warmup} warmup steps")
    if total < steps:
        v.notes.append(f"MaxText trains at learning rate 0 after step {total}; equipax stays at "
                       "final_fraction x peak.")
    return {"learner.schedule.kind": "warmup_cosine", "learner.schedule.peak_learning_rate": float(v.get("learning_rate")),
            "learner.schedule.warmup_steps": warmup, "learner.schedule.decay_steps": total - warmup,
            "learner.schedule.final_fraction": float(v.get("cosine_learning_rate_final_fraction"))}


def _schedule_back(k: Mapping[str, Any]) -> dict[str, Any]:
    if k["learner.schedule.kind"] != "warmup_cosine":
        raise Skip(f"learner.schedule.kind={k['learner.schedule.kind']!r}: MaxText's schedule is warmup + cosine")
    total = k["learner.schedule.warmup_steps"] + k["learner.schedule.decay_steps"]
    return {"learning_rate": k["learner.schedule.peak_learning_rate"], "learning_rate_schedule_steps": total,
            "warmup_steps_fraction": k["learner.schedule.warmup_steps"] / total,
            "cosine_learning_rate_final_fraction": k["learner.schedule.final_fraction"]}


def _activation(v: Values) -> dict[str, Any]:
    acts = tuple(v.given["mlp_activations"])
    if acts not in ACTIVATIONS:
        raise Skip(f"{list(acts)}: equipax has relu/gelu/silu, optionally gated ([act, 'linear'])")
    act, gated = ACTIVATIONS[acts]
    return {T + "activation": act, T + "gated": gated}


def _activation_back(k: Mapping[str, Any]) -> dict[str, Any]:
    return {"mlp_activations": [k[T + "activation"], "linear"] if k[T + "gated"] else [k[T + "activation"]]}


def _profiler(v: Values) -> dict[str, Any]:
    kind = v.given.get("profiler", "xplane" if v.given.get("enable_profiler") else "")
    if kind not in ("", "xplane"):
        raise Skip(f"profiler={kind!r}: equipax traces with jax.profiler (xplane); run nsys around `launch run`")
    out: dict[str, Any] = {"train.profile_steps": int(v.get("profiler_steps")) if kind else 0}
    if kind:
        out["train.profile_start_step"] = int(v.get("skip_first_n_steps_for_profiler")) + 1
        out["train.profile_all_processes"] = bool(v.given.get("upload_all_profiler_results", False))
    return out


def _profiler_back(k: Mapping[str, Any]) -> dict[str, Any]:
    if not k["train.profile_steps"]:
        return {"profiler": ""}
    start = k["train.profile_start_step"] or 2
    return {"profiler": "xplane", "skip_first_n_steps_for_profiler": start - 1,
            "profiler_steps": k["train.profile_steps"], "upload_all_profiler_results": k["train.profile_all_processes"]}


def _steps(v: Values) -> dict[str, Any]:
    steps = int(v.given["steps"])
    steps = steps if steps != -1 else int(v.get("learning_rate_schedule_steps"))
    if steps <= 0:
        raise Skip("steps=-1 needs learning_rate_schedule_steps > 0")
    return {"train.num_steps": steps}


def _cap(v: Any) -> float | None:
    return float(v) if v else None


def _positive(key: str, what: str) -> Callable[[Any], int]:
    def to(value: Any) -> int:
        if int(value) <= 0:
            raise Skip(f"{key}={value}: {what}")
        return int(value)
    return to


def _batch(value: Any) -> int:
    if float(value) != int(float(value)) or float(value) < 1:
        raise Skip(f"per_device_batch_size={value}: equipax needs a whole number of examples per device")
    return int(float(value))


def _choice(key: str, table: Mapping[Any, Any]) -> Callable[[Any], Any]:
    def to(value: Any) -> Any:
        if value not in table:
            raise Skip(f"{key}={value!r}: translated are {', '.join(map(repr, table))}")
        return table[value]
    return to


def _inverse(table: Mapping[Any, Any]) -> dict[Any, Any]:
    return {b: a for a, b in table.items()}


OPTIMIZERS = {"adamw": "adamw", "adam_pax": "pax_adam"}
DTYPES = {"bfloat16": "bfloat16", "float32": "float32"}
DATASETS = {"c4": "c4", "synthetic": "synthetic"}

RULES: tuple[Rule, ...] = (
    Rule(("global_parameter_scale", "base_num_decoder_layers", "base_emb_dim", "base_mlp_dim", "base_num_query_heads",
          "base_num_heads", "base_num_kv_heads"),
         tuple(T + k for k in ("num_layers", "model_dims", "hidden_dims", "num_heads")),
         "base size x scale (see --scale-rule); key/value heads must equal query heads", _dims, _dims_back),
    _direct("head_dim", T + "head_dim"),
    _direct("vocab_size", "model.vocab_size"),
    Rule(("max_target_length",), ("model.max_seq_len", "data.seq_len"), "both",
         lambda v: dict.fromkeys(("model.max_seq_len", "data.seq_len"), int(v.given["max_target_length"])),
         lambda k: {"max_target_length": k["data.seq_len"]}),
    _direct("dtype", "model.dtype", "bfloat16 or float32", _choice("dtype", DTYPES), _choice("model.dtype", DTYPES)),
    _direct("per_device_batch_size", "data.per_device_batch", "whole examples only", _batch),
    Rule(tuple(f"{w}_{a}_parallelism" for w in ("ici", "dcn") for a in (*MESH_AXES, *OTHER_AXES)),
         ("mesh.ici_mesh_shape", "mesh.dcn_mesh_shape"),
         "(data, fsdp, tensor) sizes; other axes only at 1; DCN -1 needs the slice count", _mesh, _mesh_back),
    _direct("scan_layers", T + "scan_layers", to=bool),
    _direct("remat_policy", T + "remat", "none, full; minimal -> dots_saveable (checkpoint dots without batch dims)",
            _choice("remat_policy", REMATS), _choice("model.transformer.remat", _inverse(REMATS))),
    Rule(("mlp_activations",), (T + "activation", T + "gated"), "[act] or gated [act, 'linear']", _activation,
         _activation_back),
    _direct("attn_logits_soft_cap", T + "atten_logit_cap", "0/null = no cap", _cap, lambda c: c or 0.0),
    _direct("final_logits_soft_cap", "model.output_logit_cap", "0/null = no cap", _cap, lambda c: c or 0.0),
    Rule(("learning_rate", "warmup_steps_fraction", "cosine_learning_rate_final_fraction", "learning_rate_schedule_steps"),
         tuple(f"learner.schedule.{k}" for k in ("kind", "peak_learning_rate", "warmup_steps", "decay_steps",
                                                 "final_fraction")),
         "warmup_cosine: warmup = fraction x schedule steps (-1 = steps), cosine for the rest", _schedule,
         _schedule_back),
    _direct("opt_type", "learner.kind", "adamw; adam_pax -> pax_adam", _choice("opt_type", OPTIMIZERS),
            _choice("learner.kind", _inverse(OPTIMIZERS))),
    _direct("adam_b1", "learner.b1", to=float),
    _direct("adam_b2", "learner.b2", to=float),
    _direct("adam_eps", "learner.eps", to=float),
    _direct("adam_weight_decay", "learner.weight_decay", "decoupled, times the learning rate in both", float),
    _direct("gradient_clipping_threshold", "learner.clip_gradient_norm", "0 = no clip", _cap, lambda c: c or 0.0),
    Rule(("steps",), ("train.num_steps",), "-1 = learning_rate_schedule_steps", _steps,
         lambda k: {"steps": k["train.num_steps"]}),
    _direct("checkpoint_period", "train.checkpoint_every", to=_positive("checkpoint_period", "must be > 0")),
    _direct("eval_interval", "train.eval_every", "-1 (no eval) is not translated",
            _positive("eval_interval", "MaxText then never evaluates; equipax evaluates at least at the end")),
    _direct("dataset_type", "data.source", "c4 or synthetic", _choice("dataset_type", DATASETS),
            _choice("data.source", DATASETS)),
    _direct("dataset_path", "data.path", "a directory of c4-train.*/c4-validation.* shards (not TFDS)", str),
    Rule(("profiler", "enable_profiler", "skip_first_n_steps_for_profiler", "profiler_steps",
          "upload_all_profiler_results"), ("train.profile_steps", "train.profile_start_step",
                                           "train.profile_all_processes"),
         "xplane: steps n+1..n+profiler_steps", _profiler, _profiler_back),
)

# Keys known to have no equipax knob, with why (anything else: "no equipax knob").
