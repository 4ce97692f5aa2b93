"""What the MaxText <-> equipax rules are made of: MaxText's defaults, the values a rule reads
(`Values`) and the converters each way (`*_to_equipax`, `*_to_maxtext`). The rules themselves are
`maxtext_rules.RULES`, the decoder blocks `maxtext_families`; the public functions are in
`maxtext.py`."""

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "activation_to_equipax",
    "activation_to_maxtext",
    "ACTIVATIONS",
    "batch_size",
    "brief",
    "dims_to_equipax",
    "dims_to_maxtext",
    "inverted",
    "logit_cap",
    "MAXTEXT_DEFAULTS",
    "MAXTEXT_MESH_AXES",
    "MESH_AXES",
    "mesh_to_equipax",
    "mesh_to_maxtext",
    "one_of",
    "OTHER_AXES",
    "pipeline_stages",
    "pipeline_to_equipax",
    "pipeline_to_maxtext",
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

# MaxText 0.2.5's base.yml values of the keys a translation reads when a config leaves them out
# (tests/fixtures/maxtext/facts.json records them; a test checks the two agree). A model key left
# out means MaxText's default, so a translated decoder block takes these, never the base
# experiment's values.
MAXTEXT_DEFAULTS: dict[str, Any] = {
    "decoder_block": "llama2",
    "global_parameter_scale": 1,
    "base_num_decoder_layers": 16,
    "base_emb_dim": 2048,
    "base_mlp_dim": 7168,
    "base_num_query_heads": 16,
    "base_num_kv_heads": 16,
    "base_moe_mlp_dim": -1,
    "head_dim": 128,
    "vocab_size": 32_000,
    "mlp_activations": ["silu", "linear"],
    "normalization_layer_epsilon": 1e-5,
    "rope_max_timescale": 10_000,
    "rope_type": "default",
    "rope_use_scale": True,
    "logits_via_embedding": False,
    "normalize_embedding_logits": True,
    "use_qk_norm": False,
    "fused_qkv": False,
    "attn_logits_soft_cap": 0.0,
    "final_logits_soft_cap": 0.0,
    "num_experts": 1,
    "num_experts_per_tok": 1,
    "capacity_factor": -1.0,
    "load_balance_loss_weight": 0.0,
    "shared_experts": 0,
    "steps": 150_001,
    "learning_rate": 3e-5,
    "lr_schedule_type": "cosine",
    "warmup_steps_fraction": 0.1,
    "learning_rate_final_fraction": 0.1,
    "learning_rate_schedule_steps": -1,
    "skip_first_n_steps_for_profiler": 1,
    "profiler_steps": 5,
    "num_slices": -1,
    "model_name": "default",
}
MESH_AXES = ("data", "fsdp", "tensor")  # equipax's default (data, fsdp, tensor) mesh axes
# equipax mesh axis -> MaxText's `{ici,dcn}_X_parallelism` name.
MAXTEXT_MESH_AXES = {"data": "data", "fsdp": "fsdp", "tensor": "tensor", "expert": "expert", "stage": "pipeline"}
OTHER_AXES = (
    "fsdp_transpose",
    "sequence",
    "context",
    "context_usp_ulysses",
    "context_autoregressive",
    "autoregressive",
    "tensor_sequence",
    "diloco",
)
SCALE_RULES = ("doubling", "linear")
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


def brief(value: Any, width: int = 40) -> str:
    """A value as a short text (long lists and dicts cut)."""
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


@dataclasses.dataclass
class Values:
    """The MaxText keys of one translation, with what was used and what was skipped.

    `family` is the translated decoder block (None: a config without `decoder_block` keeps the
    base experiment's block); `axes` the equipax mesh axes the mesh keys fill."""

    given: Mapping[str, Any]
    scale_rule: str = "doubling"
    family: str | None = None
    moe: bool = False
    axes: tuple[str, ...] = MESH_AXES
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
    base, rem = divmod(log2, 3)  # MaxText 0.2.5: doublings rotate over heads+mlp, emb, layers
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
            f"{v.scale_rule!r} rule (--scale-rule: 'doubling' is MaxText 0.2.5's power-of-two rule; 'linear' "
            "multiplies every base_* size, as MaxText's first release and the Pax README do)."
        )
    if "base_num_heads" in v.given and "base_num_query_heads" not in v.given:  # the older key
        v.given = {**v.given, "base_num_query_heads": v.given["base_num_heads"]}
    every = scale or v.family is not None  # a decoder block is defined by all its sizes
    out = {}
    for key, knob, m in (
        ("base_num_decoder_layers", "num_layers", layers),
        ("base_emb_dim", "model_dims", emb),
        ("base_mlp_dim", "hidden_dims", mlp),
        ("base_num_query_heads", "num_heads", heads),
    ):
        if every or v.has(key):
            out[TRANSFORMER + knob] = int(v.get(key)) * m
    if v.family is not None or v.has("base_num_kv_heads"):  # MaxText's first release: one head count
        kv = int(v.get("base_num_kv_heads")) * heads
        q = out.get(TRANSFORMER + "num_heads", kv)
        if v.family is None:  # the Pax GPT: None = one key/value head per query head
            out[TRANSFORMER + "num_kv_heads"] = None if kv == q else kv
        else:
            out[TRANSFORMER + "num_kv_heads"] = kv
        if kv != q:
            out[TRANSFORMER + "fused_qkv"] = False
            v.notes.append(
                f"{kv} key/value heads for {q} query heads (grouped-query attention): also set "
                "model.transformer.fused_qkv=False (separate query and key/value projections)."
            )
    return out


def dims_to_maxtext(k: Mapping[str, Any]) -> dict[str, Any]:
    kv = k[TRANSFORMER + "num_kv_heads"]
    return {
        "global_parameter_scale": 1,
        "base_num_decoder_layers": k[TRANSFORMER + "num_layers"],
        "base_emb_dim": k[TRANSFORMER + "model_dims"],
        "base_mlp_dim": k[TRANSFORMER + "hidden_dims"],
        "base_num_query_heads": k[TRANSFORMER + "num_heads"],
        "base_num_kv_heads": k[TRANSFORMER + "num_heads"] if kv is None else kv,
    }


def _slices(v: Values) -> int:
    n = int(v.get("num_slices"))
    if n < 1:
        v.notes.append("num_slices=-1 (MaxText: the slices present): one slice assumed; give num_slices=N.")
        return 1
    return n


def mesh_to_equipax(v: Values) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for where in ("ici", "dcn"):
        for axis in (*OTHER_AXES, *(a for a in ("expert", "pipeline") if a not in map(MAXTEXT_MESH_AXES.get, v.axes))):
            key = f"{where}_{axis}_parallelism"
            if v.given.get(key, 1) != 1:
                v.skipped[key] = (
                    f"{v.given[key]}: the mesh axes here are {', '.join(v.axes)} (docs/maxtext.md, "
                    f"'Meshes'); no {axis} axis"
                )
    keys = {w: [f"{w}_{MAXTEXT_MESH_AXES[a]}_parallelism" for a in v.axes] for w in ("ici", "dcn")}
    if not v.has(*keys["ici"], *keys["dcn"]):
        return out
    ici_default = {"fsdp": -1}  # base.yml: fsdp takes the devices of a slice, data the slices
    ici = tuple(int(v.given.get(k, ici_default.get(a, 1))) for k, a in zip(keys["ici"], v.axes))
    dcn = [int(v.given.get(k, -1 if a == "data" else 1)) for k, a in zip(keys["dcn"], v.axes)]
    if -1 in dcn:
        rest = math.prod(s for s in dcn if s != -1)
        slices = _slices(v)
        if slices % rest:
            raise ValueError(f"num_slices={slices} is not a multiple of the other DCN axes' {rest}")
        dcn[dcn.index(-1)] = slices // rest
    out["mesh.ici_mesh_shape"] = ici
    out["mesh.dcn_mesh_shape"] = tuple(dcn)
    if v.axes != MESH_AXES:
        out["mesh.axis_names"] = v.axes
    return out


def mesh_to_maxtext(k: Mapping[str, Any]) -> dict[str, Any]:
    axes = k.get("mesh.axis_names", MESH_AXES)
    out: dict[str, Any] = {}
    for where in ("ici", "dcn"):
        sizes = dict(zip(axes, k[f"mesh.{where}_mesh_shape"]))
        for axis, name in MAXTEXT_MESH_AXES.items():
            out[f"{where}_{name}_parallelism"] = sizes.get(axis, 1)
    out["num_slices"] = math.prod(k["mesh.dcn_mesh_shape"])  # MaxText checks the DCN axes against it
    return out


def pipeline_stages(v: Values) -> int:
    """Pipeline stages of a MaxText config: its ICI x DCN `pipeline` parallelism."""
    return int(v.given.get("ici_pipeline_parallelism", 1)) * int(v.given.get("dcn_pipeline_parallelism", 1))


def pipeline_to_equipax(v: Values) -> dict[str, Any]:
    stages = pipeline_stages(v)
    if stages == 1 or "stage" not in v.axes:
        return {}
    layers = int(v.get("base_num_decoder_layers"))
    repeats = int(v.given.get("num_pipeline_repeats", -1))
    if repeats <= 0:  # MaxText: num_layers_per_pipeline_stage (default 1) layers per stage and repeat
        repeats = max(1, layers // (stages * int(v.given.get("num_layers_per_pipeline_stage", 1))))
    micro = int(v.given.get("num_pipeline_microbatches", -1))
    return {
        TRANSFORMER + "pipeline_stages": stages,
        TRANSFORMER + "pipeline_schedule": "circular" if repeats > 1 else "gpipe",
        TRANSFORMER + "pipeline_repeats": repeats,
        TRANSFORMER + "pipeline_microbatches": micro if micro > 0 else stages,  # MaxText: one per stage
        TRANSFORMER + "pipeline_microbatch_size": None,
    }


def pipeline_to_maxtext(k: Mapping[str, Any]) -> dict[str, Any]:
    stages = k[TRANSFORMER + "pipeline_stages"]
    if stages == 1:
        return {}
    repeats = k[TRANSFORMER + "pipeline_repeats"]
    micro = k[TRANSFORMER + "pipeline_microbatches"]
    size = k[TRANSFORMER + "pipeline_microbatch_size"]
    if micro is None and size is not None:  # MaxText counts microbatches: the global batch / size
        per_device = k["data.per_device_batch"]
        devices = math.prod((*k["mesh.ici_mesh_shape"], *k["mesh.dcn_mesh_shape"]))
        micro = (k["data.batch_size"] if per_device is None else per_device * devices) // size
    return {
        "num_pipeline_repeats": repeats,
        "num_layers_per_pipeline_stage": k[TRANSFORMER + "num_layers"] // (stages * repeats),
        "num_pipeline_microbatches": micro,
    }


def schedule_to_equipax(v: Values) -> dict[str, Any]:
    kind = v.get("lr_schedule_type")
    if kind != "cosine":
        raise Skip(f"lr_schedule_type={kind!r}: equipax's warmup_cosine is MaxText's 'cosine'")
    steps = int(v.get("steps"))
    total = int(v.get("learning_rate_schedule_steps"))
    total = steps if total == -1 else total
    warmup = int(float(v.get("warmup_steps_fraction")) * total)  # MaxText rounds down
    if total <= warmup:
        raise Skip(f"a cosine of {total - warmup} steps after {warmup} warmup steps")
    if total < steps:
        v.notes.append(f"MaxText trains at learning rate 0 after step {total}; equipax stays at final_fraction x peak.")
    final = v.given.get("cosine_learning_rate_final_fraction")  # MaxText before 0.2's name
    return {
        "learner.schedule.kind": "warmup_cosine",
        "learner.schedule.peak_learning_rate": float(v.get("learning_rate")),
        "learner.schedule.warmup_steps": warmup,
        "learner.schedule.decay_steps": total - warmup,
        "learner.schedule.final_fraction": float(v.get("learning_rate_final_fraction") if final is None else final),
    }


def schedule_to_maxtext(k: Mapping[str, Any]) -> dict[str, Any]:
    if k["learner.schedule.kind"] != "warmup_cosine":
        raise Skip(f"learner.schedule.kind={k['learner.schedule.kind']!r}: MaxText's schedule is warmup + cosine")
    total = k["learner.schedule.warmup_steps"] + k["learner.schedule.decay_steps"]
    return {
        "learning_rate": k["learner.schedule.peak_learning_rate"],
        "lr_schedule_type": "cosine",
        "learning_rate_schedule_steps": total,
        "warmup_steps_fraction": k["learner.schedule.warmup_steps"] / total,
        "learning_rate_final_fraction": k["learner.schedule.final_fraction"],
    }


def activation_to_equipax(v: Values) -> dict[str, Any]:
    acts = tuple(v.get("mlp_activations"))
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
    if value is None:
        raise Skip("per_device_batch_size=None: give a number of examples per device")
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
