"""Random Hugging Face model directories (config.json + safetensors) for the conversion tests.

Weights have standard deviation 1/sqrt(fan_in) (norm scales 1 + N(0, 0.1)), so every projection
moves the logits and a wrong layout shows. `schema="v4"` writes `rope_theta`/`rope_scaling` at the
top level as transformers 4.x does, `"v5"` one `rope_parameters` dict as transformers 5 does.
"""

import json
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from equipax.models.hf.safetensors import write_safetensors

# One tiny config per family and option (MHA/GQA/MQA, head_dim != hidden/heads, tied and untied,
# llama3 rope scaling whose band falls inside the tested positions, a window below them).
FAMILIES: dict[str, dict[str, Any]] = {
    "llama2_mha": {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 4, "rope_theta": 1e4},
    "llama3_gqa": {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 5e5},
    "llama3_2_tied_scaled": {
        "model_type": "llama",
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 12,
        "tie_word_embeddings": True,
        "rope_theta": 5e5,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    },
    "qwen3_tied": {
        "model_type": "qwen3",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "tie_word_embeddings": True,
        "rope_theta": 1e6,
    },
    # Mixtures of experts: 8 experts top-2 (Mixtral renormalises), 6 top-3 with QK-norm and
    # each expert narrower than intermediate_size (Qwen3-MoE, with and without norm_topk_prob).
    "mixtral_experts": {
        "model_type": "mixtral",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "rope_theta": 1e6,
    },
    "qwen3_moe_unnormalised": {
        "model_type": "qwen3_moe",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 6,
        "num_experts_per_tok": 3,
        "moe_intermediate_size": 24,
        "norm_topk_prob": False,
        "rope_theta": 1e6,
    },
    "mistral_window": {
        "model_type": "mistral",
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "sliding_window": 24,
        "rope_theta": 1e4,
    },
}

BASE = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
}

NUMPY_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def hf_config(family: str, *, schema: str = "v5", **extra: Any) -> dict[str, Any]:
    """The config.json of `family` in the v4 or v5 rotary schema."""
    cfg = {**BASE, **FAMILIES[family], **extra}
    if schema == "v5":
        theta = cfg.pop("rope_theta")
        scaling = cfg.pop("rope_scaling", None)
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": theta} | (scaling or {})
    return cfg


def random_tensors(cfg: dict[str, Any], *, seed: int = 0, dtype: str = "float32") -> dict[str, np.ndarray]:
    """Hugging Face tensors for `cfg`, std 1/sqrt(fan_in), in export order."""
    rng = np.random.default_rng(seed)
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    h = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or h
    hd = cfg.get("head_dim") or d // h
    out: dict[str, np.ndarray] = {}

    def dense(name: str, rows: int, cols: int) -> None:
        out[name] = rng.normal(0, 1 / np.sqrt(cols), (rows, cols))

    def norm(name: str, n: int) -> None:
        out[name] = 1 + 0.1 * rng.normal(size=n)

    out["model.embed_tokens.weight"] = rng.normal(0, 1, (v, d))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        norm(p + "input_layernorm.weight", d)
        dense(p + "self_attn.q_proj.weight", h * hd, d)
        dense(p + "self_attn.k_proj.weight", kv * hd, d)
        dense(p + "self_attn.v_proj.weight", kv * hd, d)
        dense(p + "self_attn.o_proj.weight", d, h * hd)
        if cfg["model_type"] in ("qwen3", "qwen3_moe"):
            norm(p + "self_attn.q_norm.weight", hd)
            norm(p + "self_attn.k_norm.weight", hd)
        norm(p + "post_attention_layernorm.weight", d)
        if cfg["model_type"] == "mixtral":
            dense(p + "block_sparse_moe.gate.weight", cfg["num_local_experts"], d)
            for e in range(cfg["num_local_experts"]):
                dense(p + f"block_sparse_moe.experts.{e}.w1.weight", f, d)
                dense(p + f"block_sparse_moe.experts.{e}.w2.weight", d, f)
                dense(p + f"block_sparse_moe.experts.{e}.w3.weight", f, d)
        elif cfg["model_type"] == "qwen3_moe":
            g = cfg["moe_intermediate_size"]
            dense(p + "mlp.gate.weight", cfg["num_experts"], d)
            for e in range(cfg["num_experts"]):
                dense(p + f"mlp.experts.{e}.gate_proj.weight", g, d)
                dense(p + f"mlp.experts.{e}.up_proj.weight", g, d)
                dense(p + f"mlp.experts.{e}.down_proj.weight", d, g)
        else:
            dense(p + "mlp.gate_proj.weight", f, d)
            dense(p + "mlp.up_proj.weight", f, d)
            dense(p + "mlp.down_proj.weight", d, f)
    norm("model.norm.weight", d)
    if not cfg.get("tie_word_embeddings", False):
        dense("lm_head.weight", v, d)
    return {k: a.astype(NUMPY_DTYPES[dtype]) for k, a in out.items()}


def write_hf_dir(
    path: Path, family: str, *, schema: str = "v5", seed: int = 0, dtype: str = "float32", **extra: Any
) -> Path:
    """A Hugging Face model directory of `family` with random weights, in one safetensors file."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(family, schema=schema, **extra)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    write_safetensors(path / "model.safetensors", random_tensors(cfg, seed=seed, dtype=dtype), {"format": "pt"})
    return path
