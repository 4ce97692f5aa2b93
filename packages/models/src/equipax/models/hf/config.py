"""Hugging Face `config.json` <-> `LMConfig`, for the Llama, Mistral, Qwen3, Mixtral and Qwen3-MoE
model types.

Reading takes both schemas of the rotary knobs: transformers 4.x writes `rope_theta` and
`rope_scaling` at the top level, transformers 5 one `rope_parameters` dict (`rope_type`,
`rope_theta`, the scaling factors). A config that has `rope_parameters` is read by it; a reader
that ignored it would fall back to theta 1e4 and produce a model that runs with wrong numbers.
Writing emits both, with the same values, so that either version reads the same model.

What `LMConfig` cannot represent is refused with a `ConfigError` naming the key, its value and
why (an unknown `model_type`, a rope type other than "default"/"llama3", biases, another
activation, per-layer sliding windows, Qwen3-MoE's dense layers among sparse ones): never a model
that loads and computes something else. The mixtures of experts read as equipax's dropless MoE
feed-forward (`model.transformer.num_experts`, docs/moe.md), which routes as these classes do: a
softmax over the experts, the top `num_experts_per_tok`, renormalised (Mixtral always, Qwen3-MoE
with `norm_topk_prob`).
No JAX here: it runs while a command resolves its config.
"""

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from equipax.core.configs import RopeScalingConfig, TransformerConfig
from equipax.core.knobs import ConfigError
from equipax.models.configs import LMConfig

__all__ = [
    "CONFIG_FILE",
    "export_type_of",
    "hf_config_from_lm",
    "lm_config_from_hf",
    "MODEL_TYPES",
    "MOE_TYPES",
    "model_type_of",
    "read_hf_config",
]

CONFIG_FILE = "config.json"
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
MOE_TYPES = ("mixtral", "qwen3_moe")
_ROPE_TYPES = ("default", "llama3")


def read_hf_config(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The `config.json` of a Hugging Face model directory, as a dict.

    Raises:
        ConfigError: the directory or its config.json is missing or is not a JSON object.
    """
    directory = Path(directory)
    path = directory / CONFIG_FILE
    if not directory.is_dir():
        raise ConfigError(
            f"{directory} is not a directory; point at a Hugging Face model directory (config.json + *.safetensors)."
        )
    if not path.is_file():
        raise ConfigError(
            f"{directory} has no {CONFIG_FILE}: it is not a Hugging Face model directory (config.json + "
            "*.safetensors, as `save_pretrained` writes)."
        )
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} does not read as JSON ({e}).") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a JSON object.")
    return data


def _need(hf: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in hf or hf[key] is None:
        raise ConfigError(f"{where} has no {key!r}; every {hf.get('model_type')} config.json has one.")
    return hf[key]


def _rope(hf: Mapping[str, Any], where: str) -> tuple[float, RopeScalingConfig | None]:
    """`(rope_theta, rope_scaling)` from the v5 `rope_parameters` or the v4 top-level keys."""
    if isinstance(hf.get("rope_parameters"), Mapping):
        params: Mapping[str, Any] = hf["rope_parameters"]
        if any(isinstance(v, Mapping) for v in params.values()):
            raise ConfigError(
                f"{where}: rope_parameters is nested per layer type ({', '.join(params)}); equipax models "
                "one rotary embedding for all layers."
            )
        theta, scaling = params.get("rope_theta", hf.get("rope_theta", 10_000.0)), params
        key = "rope_parameters"
    else:
        theta, scaling = hf.get("rope_theta", 10_000.0), hf.get("rope_scaling") or {}
        key = "rope_scaling"
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind not in _ROPE_TYPES:
        raise ConfigError(
            f"{where}: {key}.rope_type={kind!r} is not supported; equipax computes the rotary frequencies of "
            f"rope types {', '.join(map(repr, _ROPE_TYPES))} only (others would load and compute other numbers)."
        )
    partial = (scaling or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ConfigError(f"{where}: partial_rotary_factor={partial!r}; equipax rotates whole heads (1.0) only.")
    if kind == "default":
        return float(theta), None
    try:
        rope = RopeScalingConfig(
            kind="llama3",
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_seq_len=int(
                scaling.get("original_max_position_embeddings") or _get(hf, "max_position_embeddings")
            ),
        )
    except (KeyError, TypeError) as e:
        raise ConfigError(f"{where}: {key} of rope type 'llama3' lacks {e}.") from None
    except ValueError as e:
        raise ConfigError(f"{where}: {key}: {e}") from None
    return float(theta), rope


# What each model type's transformers config class assumes for a key config.json leaves out.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "tie_word_embeddings": False},
    "mistral": {"num_key_value_heads": 8, "sliding_window": 4096, "max_position_embeddings": 131072},
    "qwen3": {"head_dim": 128, "num_key_value_heads": 32, "max_position_embeddings": 32768, "max_window_layers": 28},
    "mixtral": {
        "num_key_value_heads": 8,
        "sliding_window": None,
        "max_position_embeddings": 131072,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.001,
    },
    "qwen3_moe": {
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
        "num_local_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 0.001,
    },
}


def _get(hf: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """`hf[key]`, or the model type's class default when config.json leaves it out."""
    if key in hf:
        return hf[key]
    return _DEFAULTS.get(str(hf.get("model_type")), {}).get(key, default)


def _window(hf: Mapping[str, Any], model_type: str, layers: int, where: str) -> int | None:
    """The sliding window every layer has, or None; windows in some layers only are refused."""
    if model_type in ("mistral", "mixtral"):  # every layer; these config classes ignore layer_types
        window = _get(hf, "sliding_window")
    elif model_type == "qwen3_moe":  # every layer when use_sliding_window (no max_window_layers)
        window = _get(hf, "sliding_window") if hf.get("use_sliding_window") else None
    else:
        window = _get(hf, "sliding_window") if (model_type == "qwen3" and hf.get("use_sliding_window")) else None
        kinds = hf.get("layer_types")
        if kinds is None:  # Qwen3: the layers from max_window_layers on slide when the window is on
            first = int(_get(hf, "max_window_layers", 0))
            kinds = [
                "sliding_attention" if window is not None and i >= first else "full_attention" for i in range(layers)
            ]
        if set(kinds) == {"full_attention"}:
            window = None
        elif set(kinds) != {"sliding_attention"} or window is None:
            raise ConfigError(
                f"{where}: layer_types {sorted(set(kinds))} (sliding_window={window!r}) give the layers different "
                "attention; equipax has the same attention in every layer."
            )
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ConfigError(f"{where}: sliding_window={window!r}; expected a positive int or null.")
    return window


def _experts(hf: Mapping[str, Any], model_type: str, where: str) -> dict[str, Any]:
    """The `TransformerConfig` knobs of a Mixtral / Qwen3-MoE config's experts ({} for dense types)."""
    if model_type not in MOE_TYPES:
        return {}
    # transformers 5 writes num_local_experts for both; Qwen3-MoE's hub configs say num_experts.
    experts = hf.get("num_local_experts", hf.get("num_experts", _get(hf, "num_local_experts")))
    out = {
        "num_experts": int(experts),
        "num_experts_per_tok": int(_get(hf, "num_experts_per_tok")),
        "norm_topk_prob": True if model_type == "mixtral" else bool(_get(hf, "norm_topk_prob")),
        "router_aux_loss_coef": float(_get(hf, "router_aux_loss_coef")),
        "capacity_factor": None,
    }
    if model_type == "qwen3_moe":
        step, dense = _get(hf, "decoder_sparse_step"), list(_get(hf, "mlp_only_layers") or [])
        if step != 1 or dense:
            raise ConfigError(
                f"{where}: decoder_sparse_step={step!r}, mlp_only_layers={dense!r} make some layers dense "
                "feed-forwards; equipax has the same feed-forward (every layer a mixture of experts) in every layer."
            )
        out["moe_intermediate_size"] = int(_get(hf, "moe_intermediate_size"))
    return out


def lm_config_from_hf(hf: Mapping[str, Any], *, where: str = CONFIG_FILE, **overrides: Any) -> LMConfig:
    """The `LMConfig` of a Hugging Face Llama / Mistral / Qwen3 / Mixtral / Qwen3-MoE config.

    Arguments:
        hf: the parsed config.json.
        where: the file it came from, for messages.
        overrides: `LMConfig` fields to set on top (e.g. `dtype`), none of which change the numbers
            a model with these weights computes in float32.

    Returns:
        The model config (float32, scanned layers, no remat).

    Raises:
        ConfigError: a model type or option equipax cannot represent, named with the reason.
    """
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConfigError(
            f"{where}: model_type={model_type!r} is not one equipax converts; it reads "
            f"{', '.join(sorted(MODEL_TYPES))} (Llama 2/3/3.1/3.2, Mistral, Qwen3, Mixtral, Qwen3-MoE)."
        )
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{where}: hidden_act={act!r}; these families' feed-forward is SwiGLU (hidden_act 'silu').")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ConfigError(f"{where}: {key}=true; equipax's Llama-style block has no projection biases.")
    heads = int(_need(hf, "num_attention_heads", where))
    dims = int(_need(hf, "hidden_size", where))
    layers = int(_need(hf, "num_hidden_layers", where))
    head_dim = _get(hf, "head_dim") or dims // heads
    theta, scaling = _rope(hf, where)
    try:
        transformer = TransformerConfig(
            num_layers=layers,
            model_dims=dims,
            num_heads=heads,
            num_kv_heads=int(_get(hf, "num_key_value_heads") or heads),
            head_dim=int(head_dim),
            hidden_dims=int(_need(hf, "intermediate_size", where)),
            activation="silu",
            gated=True,
            norm="rmsnorm",
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            use_bias=False,
            fused_qkv=False,
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            sliding_window=_window(hf, model_type, layers, where),
            atten_logit_cap=None,
            scan_layers=True,
            remat="none",
            attention_impl="xla",
            **_experts(hf, model_type, where),
        )
        return LMConfig(
            vocab_size=int(_need(hf, "vocab_size", where)),
            max_seq_len=int(_get(hf, "max_position_embeddings") or 2048),
            transformer=transformer,
            output_logit_cap=None,
            position="rope",
            rope_theta=theta,
            rope_scaling=scaling,
            tie_embeddings=bool(_get(hf, "tie_word_embeddings", False)),
            embedding_multiplier=None,
            dtype="float32",
            **overrides,
        )
    except ValueError as e:  # ConfigError included: the numbers do not make a valid model
        raise ConfigError(f"{where} does not describe a model equipax can build: {e}") from None


def model_type_of(cfg: LMConfig) -> str:
    """The Hugging Face model type an `LMConfig` is exported as (QK-norm: qwen3; a window: mistral;
    with experts, QK-norm: qwen3_moe, else mixtral).

    Raises:
        ConfigError: the model is not Llama-style (Pax's GPT block, caps, biases...), naming the knob.
    """
    t = cfg.transformer
    wanted = [
        ("model.position", cfg.position, "rope"),
        ("model.transformer.norm", t.norm, "rmsnorm"),
        ("model.transformer.activation", t.activation, "silu"),
        ("model.transformer.gated", t.gated, True),
        ("model.transformer.use_bias", t.use_bias, False),
        ("model.transformer.attention", t.attention, "softmax"),
        ("model.transformer.atten_logit_cap", t.atten_logit_cap, None),
        ("model.output_logit_cap", cfg.output_logit_cap, None),
        ("model.embedding_multiplier", cfg.embedding_multiplier, None),
    ]
    for knob, found, expected in wanted:
        if found != expected:
            raise ConfigError(
                f"{knob}={found!r}: a Hugging Face Llama / Mistral / Qwen3 model has {knob}={expected!r}, so this "
                "model has no Hugging Face equivalent to export to (Pax's GPT block is not one of those families)."
            )
    if t.num_hidden_groups is not None:
        raise ConfigError(
            f"model.transformer.num_hidden_groups={t.num_hidden_groups}: a Hugging Face Llama / Mistral / Qwen3 "
            "model has its own weights in every layer, so shared layers have no equivalent to export to (set "
            "num_hidden_groups=None)."
        )
    if t.qk_norm and t.sliding_window is not None:
        raise ConfigError(
            "model.transformer.qk_norm=True with sliding_window set: Hugging Face's Qwen3 has QK-norm and "
            "Mistral the window, no exported family both in every layer."
        )
    if t.num_experts:
        if t.shared_expert_intermediate_size:
            raise ConfigError(
                f"model.transformer.shared_expert_intermediate_size={t.shared_expert_intermediate_size}: Hugging "
                "Face's Mixtral and Qwen3-MoE have no shared expert, so this model has no equivalent to export to."
            )
        if not t.qk_norm and not t.norm_topk_prob:
            raise ConfigError(
                "model.transformer.norm_topk_prob=False without qk_norm: Hugging Face's Mixtral always "
                "renormalises the top-k router probabilities, so this model has no equivalent to export to."
            )
        return "qwen3_moe" if t.qk_norm else "mixtral"
    return "qwen3" if t.qk_norm else "mistral" if t.sliding_window is not None else "llama"


def export_type_of(cfg: LMConfig) -> str:
    """`model_type_of`, refusing also what reads in but cannot be written back: routing biases
    (auxiliary-loss-free balancing; an import starts them at 0).

    Raises:
        ConfigError: naming the knob.
    """
    model_type = model_type_of(cfg)
    rate = cfg.transformer.router_bias_update_rate
    if rate:
        raise ConfigError(
            f"model.transformer.router_bias_update_rate={rate}: Hugging Face's Mixtral and Qwen3-MoE have no "
            "routing biases, so the exported model would choose other experts than the trained one; export a "
            "model trained with router_bias_update_rate=0."
        )
    return model_type


def hf_config_from_lm(
    cfg: LMConfig, *, bos_token_id: int | None = None, eos_token_id: int | None = None, dtype: str = "float32"
) -> dict[str, Any]:
    """The Hugging Face config.json of `cfg`, with both rotary schemas (module docstring).

    Arguments:
        cfg: the model (Llama-style: `model_type_of` says which type).
        bos_token_id, eos_token_id: the tokenizer's, or None.
        dtype: the dtype the weights are written in ("float32", "bfloat16", "float16").

    Returns:
        The JSON-ready dict.
    """
    model_type = export_type_of(cfg)
    t = cfg.transformer
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    rope_scaling: dict[str, Any] | None = None
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope_scaling = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_seq_len,
        }
        rope_parameters = {**rope_scaling, "rope_theta": cfg.rope_theta}
    out: dict[str, Any] = {
        "architectures": [MODEL_TYPES[model_type]],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": t.model_dims,
        "intermediate_size": t.hidden_dims,
        "num_hidden_layers": t.num_layers,
        "num_attention_heads": t.num_heads,
        "num_key_value_heads": t.kv_heads,
        "head_dim": t.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": t.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": rope_parameters,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": dtype,
        "dtype": dtype,
        "use_cache": True,
    }
    if model_type == "llama":
        out |= {"mlp_bias": False, "pretraining_tp": 1}
    elif model_type in ("mistral", "mixtral"):
        out["sliding_window"] = t.sliding_window
    else:
        out |= {"use_sliding_window": False, "sliding_window": None, "max_window_layers": t.num_layers}
    if model_type in MOE_TYPES:
        # A model trained with capacity dispatch computes dropless in transformers (docs/moe.md).
        out |= {
            "num_local_experts": t.num_experts,
            "num_experts_per_tok": t.num_experts_per_tok,
            "router_aux_loss_coef": t.router_aux_loss_coef,
            "output_router_logits": False,
        }
        if model_type == "mixtral":
            out |= {"intermediate_size": t.expert_hidden_dims, "router_jitter_noise": 0.0}
        else:
            out |= {
                "num_experts": t.num_experts,
                "moe_intermediate_size": t.expert_hidden_dims,
                "norm_topk_prob": t.norm_topk_prob,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
            }
            out.pop("max_window_layers")
    return out
