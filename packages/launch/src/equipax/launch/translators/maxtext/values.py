"""What the MaxText <-> equipax rules read and how they convert: MaxText's defaults, the values of
one translation (`Values`), the mesh axes, and the converters each way that are not a block's, the
mesh's or training's (`*_to_equipax`, `*_to_maxtext`, and the small ones rules share: `one_of`,
`positive_int`, ...). The table itself is `rules.RULES`; the decoder blocks are `blocks.py`, the mesh
`mesh.py`, the optimizer, schedule and data `training.py`; the entry points are in `translate.py`."""

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "activation_to_equipax",
    "activation_to_maxtext",
    "ACTIVATIONS",
    "batch_size",
    "BLOCK_KNOBS",
    "brief",
    "dims_to_equipax",
    "dims_to_maxtext",
    "inverted",
    "logit_cap",
    "MAXTEXT_DEFAULTS",
    "MAXTEXT_MESH_AXES",
    "MESH_AXES",
    "MOE_KNOBS",
    "one_of",
    "OTHER_AXES",
    "positive_int",
    "scale_multipliers",
    "SCALE_RULES",
    "Skip",
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
    "remat_policy": "full",
}
MESH_AXES = ("data", "fsdp", "tensor")  # equipax's default (data, fsdp, tensor) mesh axes
# equipax mesh axis -> MaxText's `{ici,dcn}_X_parallelism` name.
MAXTEXT_MESH_AXES = {
    "data": "data",
    "fsdp": "fsdp",
    "tensor": "tensor",
    "expert": "expert",
    "stage": "pipeline",
    "context": "context",
}
OTHER_AXES = (
    "fsdp_transpose",
    "sequence",
    "context_usp_ulysses",
    "context_autoregressive",
    "autoregressive",
    "tensor_sequence",
    "diloco",
)
SCALE_RULES = ("doubling", "linear")
TRANSFORMER = "model.transformer."
# the knobs a translated block sets (`block_to_equipax`, `moe_to_equipax`)
BLOCK_KNOBS = tuple(
    TRANSFORMER + k for k in ("norm", "norm_eps", "use_bias", "fused_qkv", "qk_norm", "sliding_window", "attention")
) + tuple(
    f"model.{k}"
    for k in ("position", "rope_theta", "rope_scaling", "tie_embeddings", "embedding_multiplier", "embedding_init_std")
)
MOE_KNOBS = tuple(
    TRANSFORMER + k
    for k in (
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
        "capacity_factor",
        "shared_expert_intermediate_size",
        "router_aux_loss_coef",
    )
)

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
