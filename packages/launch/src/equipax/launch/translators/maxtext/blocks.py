"""MaxText's decoder blocks (`decoder_block`) as equipax families: which blocks the one decoder
stack has (`FAMILIES`, each onto a base experiment of its family), which it lacks and why
(`MISSING_BLOCKS`), the architecture keys whose other values it cannot represent
(`ARCHITECTURE_CHECKS`), and the converters of the block's knobs each way. Facts about MaxText
0.2.5's blocks that these rely on are listed in docs/maxtext.md, "Decoder blocks"."""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from equipax.launch.translators.maxtext.values import TRANSFORMER, Skip, Values

__all__ = [
    "ARCHITECTURE_CHECKS",
    "architecture_problems",
    "representable",
    "base_experiment",
    "block_to_equipax",
    "block_to_maxtext",
    "Family",
    "FAMILIES",
    "LLAMA3_1_SCALING",
    "llama3_1_scaling",
    "MISSING_BLOCKS",
    "moe_to_equipax",
    "moe_to_maxtext",
]


@dataclasses.dataclass(frozen=True)
class Family:
    """A MaxText decoder block equipax has: Llama's block (RMSNorm, rotary positions, no biases,
    untied unless `logits_via_embedding`), dense or a mixture of experts."""

    moe: bool
    experiment: str  # the base experiment of the family (`--exp` when none is given)


FAMILIES: dict[str, Family] = {
    "llama2": Family(moe=False, experiment="llama2_7b"),  # and Llama 3 / 3.1 (`base_experiment`)
    "mistral": Family(moe=False, experiment="mistral_7b"),
    "qwen3": Family(moe=False, experiment="qwen3_8b"),
    "mixtral": Family(moe=True, experiment="mixtral_8x7b"),
    "qwen3_moe": Family(moe=True, experiment="qwen3_30b_a3b"),
}
_MLA = "multi-head latent attention (MLA: low-rank compressed keys and values)"
MISSING_BLOCKS: dict[str, str] = {
    "default": "MaxText's default test block",
    "simple": "MaxText's test block",
    "simple_mlp": "MaxText's test block",
    "deepseek": _MLA + " and dense first layers",
    "deepseek4": _MLA + " with compressed attention",
    "gemma": "Gemma's block (embeddings x sqrt(emb_dim), (1 + w) RMSNorm, tied logits / sqrt(emb_dim)); equipax "
    "has no Gemma family",
    "gemma2": "post-attention and post-feed-forward norms, alternating local/global attention",
    "gemma3": "post-attention and post-feed-forward norms, alternating local/global attention",
    "gemma4": "per-layer inputs, alternating local/global attention",
    "gemma4_small": "per-layer inputs, alternating local/global attention",
    "qwen2": "biases on the query/key/value projections only (equipax's use_bias also biases the others)",
    "qwen3_custom_moe": "MaxText's custom Qwen3 MoE block",
    "qwen3_next": "gated delta-net linear-attention layers",
    "qwen3_5": "gated delta-net linear-attention layers",
    "gpt3": "biases in every projection and LayerNorm, learned position embeddings (equipax's Pax GPT, the c4_* "
    "experiments, has neither: translate a config without decoder_block onto it)",
    "gpt_oss": "attention sinks, alternating sliding-window layers, biased experts",
    "llama4": "interleaved dense and MoE layers, chunked attention, layers without rotary positions",
    "olmo3": "norms after attention and the feed-forward (not before), alternating sliding-window layers",
    "envy": "MaxText's envy block",
}
# Llama 3.1's rotary scaling as MaxText applies it (a `model_name` starting with "llama3.1", or
# `rope_type: llama3.1`, with `rope_use_scale`): factor 8, frequency factors 1 and 4, context 8192.
LLAMA3_1_SCALING: dict[str, Any] = {
    "kind": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_seq_len": 8192,
}


def _off(*ok: Any) -> Callable[[Any], bool]:
    return lambda value: value in ok


# key -> (the values that mean what equipax's block does, what another value needs). A key that
# is absent means MaxText's default, which is one of the values here.
ARCHITECTURE_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "attention_bias": (_off(False), "biases on the query/key/value projections"),
    "mlp_bias": (_off(False), "biases in the feed-forward"),
    "use_post_attn_norm": (_off(False), "a norm after attention"),
    "use_post_ffw_norm": (_off(False), "a norm after the feed-forward"),
    "inhomogeneous_layer_cycle_interval": (_off(1), "layers that differ in a cycle"),
    "first_num_dense_layers": (_off(0), "dense layers before the MoE layers"),
    "interleave_moe_layer_step": (_off(1), "MoE layers interleaved with dense ones"),
    "mtp_num_layers": (_off(0), "multi-token prediction layers"),
    "trainable_position_size": (lambda v: int(v) <= 0, "learned position embeddings"),
    "use_untrainable_positional_embedding": (_off(False), "sinusoidal positions added to rotary ones"),
    "rope_type": (_off("default", "llama3.1"), "this rotary scaling (equipax has Llama 3.1's)"),
    "partial_rotary_factor": (_off(1, 1.0), "rotary positions on part of each head"),
    "use_mrope": (_off(False), "multimodal rotary positions"),
    "use_multimodal": (_off(False), "a vision encoder"),
    "vision_encoder_block": (_off("none", None), "a vision encoder"),
    "routed_score_func": (_off("", "softmax"), "this router score function"),
    "routed_scaling_factor": (_off(1, 1.0), "scaled expert weights"),
    "routed_bias": (_off(False), "router biases"),
    "n_routing_groups": (_off(-1), "grouped routing"),
    "mlp_activations_limit": (lambda v: float(v) <= 0, "clamped activations"),
    "attention_sink": (_off(False), "attention sinks"),
    "share_kv_projections": (_off(False), "shared key/value projections"),
    "global_head_dim": (_off(0), "another head size in global layers"),
    "global_num_kv_heads": (_off(0), "other key/value heads in global layers"),
    "attention_output_dim": (_off(-1), "an attention output width other than heads x head_dim"),
    "qk_norm_with_scale": (_off(True), "QK-norm without a learned scale"),
}


def representable(key: str, value: Any) -> bool:
    """Whether `value` of an `ARCHITECTURE_CHECKS` key means what equipax's block does (a value
    of the wrong kind does not)."""
    try:
        return bool(ARCHITECTURE_CHECKS[key][0](value))
    except (TypeError, ValueError):
        return False


def architecture_problems(v: Values) -> list[str]:
    """What of this config's architecture equipax's stack lacks (empty: it has all of it)."""
    block = v.get("decoder_block")
    if not isinstance(block, str):
        return [f"decoder_block={block!r} is not a decoder block's name"]
    if block in MISSING_BLOCKS:
        return [f"decoder_block={block!r}: {MISSING_BLOCKS[block]}"]
    if block not in FAMILIES:
        return [f"decoder_block={block!r} is not a MaxText 0.2.5 decoder block"]
    problems = [
        f"{key}={v.given[key]!r}: {what}"
        for key, (_, what) in ARCHITECTURE_CHECKS.items()
        if key in v.given and not representable(key, v.given[key])
    ]
    if v.get("logits_via_embedding") and v.get("normalize_embedding_logits"):
        problems.append(
            "normalize_embedding_logits=True with logits_via_embedding=True: tied logits divided by "
            "sqrt(emb_dim) (set normalize_embedding_logits=false)"
        )
    return problems


def _rope_scaling(v: Values) -> dict[str, Any] | None:
    named = str(v.get("model_name")).startswith("llama3.1") or v.get("rope_type") == "llama3.1"
    return dict(LLAMA3_1_SCALING) if named and v.get("rope_use_scale") else None


def base_experiment(v: Values) -> str:
    """The base experiment of a translated block's family (Llama 2, 3 or 3.1 by the rotary knobs)."""
    block = v.get("decoder_block")
    if block != "llama2":
        return FAMILIES[block].experiment
    if _rope_scaling(v) is not None:
        return "llama3_1_8b"
    return "llama3_8b" if float(v.get("rope_max_timescale")) == 500_000 else "llama2_7b"


def block_to_equipax(v: Values) -> dict[str, Any]:
    """The block's knobs: Llama's choices, and what the config sets of rope, norms, tying, QK-norm."""
    tied = bool(v.get("logits_via_embedding"))
    if v.family is None:  # no decoder_block: only the keys given, on the base experiment's block
        out: dict[str, Any] = {}
        if v.has("normalization_layer_epsilon"):
            out[TRANSFORMER + "norm_eps"] = float(v.given["normalization_layer_epsilon"])
        if v.has("use_qk_norm"):
            out[TRANSFORMER + "qk_norm"] = bool(v.given["use_qk_norm"])
        if v.has("logits_via_embedding"):
            out["model.tie_embeddings"] = tied
        if v.has("rope_max_timescale"):
            out["model.rope_theta"] = float(v.given["rope_max_timescale"])
        return out
    for key in ("sliding_window_size", "attention_type"):
        if key in v.given and v.given[key] not in (0, "global", "full"):
            v.skipped[key] = (
                f"{v.given[key]!r}: MaxText's {v.family} block does not read it (every layer attends to the "
                "whole causal prefix)"
            )
    if v.has("fused_qkv") and v.given["fused_qkv"]:
        v.skipped["fused_qkv"] = f"MaxText's {v.family} block has separate projections"
    out = {
        TRANSFORMER + "norm": "rmsnorm",
        TRANSFORMER + "norm_eps": float(v.get("normalization_layer_epsilon")),
        TRANSFORMER + "use_bias": False,
        TRANSFORMER + "fused_qkv": False,
        TRANSFORMER + "qk_norm": bool(v.get("use_qk_norm")) if v.family.startswith("qwen3") else False,
        TRANSFORMER + "sliding_window": None,
        TRANSFORMER + "attention": "softmax",
        "model.position": "rope",
        "model.rope_theta": float(v.get("rope_max_timescale")),
        "model.rope_scaling": _rope_scaling(v),
        "model.tie_embeddings": tied,
        "model.embedding_multiplier": None,
        # as the family presets (decoder_presets.decoder_lm): N(0, 1) untied, N(0, 1/d) tied
        "model.embedding_init_std": None if tied else 1.0,
    }
    if v.has("use_qk_norm") and v.given["use_qk_norm"] and not v.family.startswith("qwen3"):
        v.skipped["use_qk_norm"] = f"MaxText's {v.family} block has no QK-norm"
    return out


def block_to_maxtext(k: Mapping[str, Any]) -> dict[str, Any]:
    """The MaxText block of flat equipax knobs (Skip: the Pax GPT, which MaxText has no block of)."""
    t = TRANSFORMER
    llama = (
        k["model.position"] == "rope"
        and k[t + "norm"] == "rmsnorm"
        and not k[t + "use_bias"]
        and k["model.embedding_multiplier"] is None
        and k[t + "attention"] == "softmax"
    )
    if not llama:
        raise Skip(
            f"model.position={k['model.position']!r}, model.transformer.norm={k[t + 'norm']!r}: MaxText has no "
            "block of Pax's GPT (its gpt3 block has biases and learned positions); MaxText builds its llama2 block"
        )
    moe = k[t + "num_experts"] > 0
    block = ("qwen3_moe" if moe else "qwen3") if k[t + "qk_norm"] else ("mixtral" if moe else "llama2")
    if not moe and block == "llama2" and k[t + "sliding_window"] is not None:
        block = "mistral"
    scaling = llama3_1_scaling(k)
    out = {
        "decoder_block": block,
        "normalization_layer_epsilon": k[t + "norm_eps"],
        "rope_max_timescale": k["model.rope_theta"],
        "rope_type": "llama3.1" if scaling else "default",
        "rope_use_scale": True,
        "logits_via_embedding": k["model.tie_embeddings"],
        "normalize_embedding_logits": False,
        "use_qk_norm": k[t + "qk_norm"],
        "fused_qkv": False,
        "attention_type": "global",
        "sliding_window_size": 0,
    }
    return out


def llama3_1_scaling(k: Mapping[str, Any]) -> bool:
    """Whether flat knobs have MaxText's one rotary scaling (Llama 3.1's)."""
    return k.get("model.rope_scaling.kind") is not None and all(
        k[f"model.rope_scaling.{f}"] == v for f, v in LLAMA3_1_SCALING.items()
    )


def moe_to_equipax(v: Values) -> dict[str, Any]:
    if v.family is None:
        if v.has("num_experts") and int(v.given["num_experts"]) > 1:
            v.skipped["num_experts"] = "no decoder_block: the base experiment's feed-forward is kept"
        return {}
    experts = int(v.get("num_experts"))
    if not v.moe:
        if experts > 1:
            v.skipped["num_experts"] = f"{experts}: MaxText's {v.family} block has a dense feed-forward"
        return {TRANSFORMER + "num_experts": 0}
    if experts < 2:
        raise ValueError(f"decoder_block={v.family!r} is a mixture of experts; num_experts must be > 1")
    mlp = int(v.get("base_moe_mlp_dim"))
    dense = int(v.get("base_mlp_dim"))
    capacity = float(v.get("capacity_factor"))
    shared = int(v.get("shared_experts"))
    return {
        TRANSFORMER + "num_experts": experts,
        TRANSFORMER + "num_experts_per_tok": int(v.get("num_experts_per_tok")),
        TRANSFORMER + "moe_intermediate_size": None if mlp <= 0 or mlp == dense else mlp,
        # MaxText's mixtral and qwen3_moe blocks take a softmax over each token's top-k logits
        TRANSFORMER + "norm_topk_prob": True,
        TRANSFORMER + "capacity_factor": None if capacity <= 0 else capacity,
        TRANSFORMER + "shared_expert_intermediate_size": shared * (mlp if mlp > 0 else dense),
        TRANSFORMER + "router_aux_loss_coef": float(v.get("load_balance_loss_weight")),
    }


def moe_to_maxtext(k: Mapping[str, Any]) -> dict[str, Any]:
    t = TRANSFORMER
    experts = k[t + "num_experts"]
    if experts == 0:
        return {"num_experts": 1, "num_experts_per_tok": 1}
    if not k[t + "norm_topk_prob"]:
        raise Skip("norm_topk_prob=False: MaxText's MoE blocks renormalise each token's top-k weights")
    mlp = k[t + "moe_intermediate_size"] or k[t + "hidden_dims"]
    shared = k[t + "shared_expert_intermediate_size"]
    if shared % mlp:
        raise Skip(f"shared_expert_intermediate_size={shared}: MaxText's shared experts are {mlp} wide each")
    return {
        "num_experts": experts,
        "num_experts_per_tok": k[t + "num_experts_per_tok"],
        "base_moe_mlp_dim": mlp,
        "norm_topk_prob": True,
        "capacity_factor": k[t + "capacity_factor"] or -1.0,
        "shared_experts": shared // mlp,
        "load_balance_loss_weight": k[t + "router_aux_loss_coef"],
    }
