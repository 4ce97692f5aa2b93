"""A slow, obvious numpy forward pass of Hugging Face Llama / Mistral / Qwen3 / Mixtral / Qwen3-MoE
checkpoints.

Written from the transformers definitions (`LlamaForCausalLM`, `MistralForCausalLM`,
`Qwen3ForCausalLM`, `MixtralForCausalLM`, `Qwen3MoeForCausalLM`, eager attention) and nothing of
equipax's model: it reads the directory's
`config.json` itself, the way transformers 5 does (v4 `rope_theta` / `rope_scaling` and v5
`rope_parameters`; each model type's class defaults for keys left out), and the weights by their
Hugging Face names, one layer at a time, in float64. So a wrong config mapping, a permuted
projection or a mis-grouped key/value head on the equipax side shows up as a difference from it:
the import and export parity gate (`logit_kl`) and the parity tests compare against it. A mixture
of experts runs token by token: the router's softmax over the experts, the top `num_experts_per_tok`
(renormalised: Mixtral always, Qwen3-MoE with `norm_topk_prob`), each chosen expert's SwiGLU MLP
from its own tensors, weighted.
"""

import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from equipax.models.hf.config import read_hf_config
from equipax.models.hf.safetensors import HFCheckpoint

__all__ = ["logit_kl", "reference_logits"]

# transformers' config-class defaults for the keys this forward pass reads.
_CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 2048},
    "mistral": {
        "rms_norm_eps": 1e-6,
        "num_key_value_heads": 8,
        "sliding_window": 4096,
        "max_position_embeddings": 131072,
    },
    "qwen3": {
        "rms_norm_eps": 1e-6,
        "head_dim": 128,
        "num_key_value_heads": 32,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
        "max_position_embeddings": 32768,
    },
    "mixtral": {
        "rms_norm_eps": 1e-5,
        "num_key_value_heads": 8,
        "sliding_window": None,
        "max_position_embeddings": 131072,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    },
    "qwen3_moe": {
        "rms_norm_eps": 1e-6,
        "num_key_value_heads": 4,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_position_embeddings": 32768,
        "num_local_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
    },
}


def _key(hf: Mapping[str, Any], name: str, default: Any = None) -> Any:
    return hf[name] if name in hf else _CLASS_DEFAULTS[hf["model_type"]].get(name, default)


def _inv_freq(hf: Mapping[str, Any], head_dim: int) -> np.ndarray:
    """`rope_init_fn` of transformers: default or llama3 inverse frequencies, float64."""
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})  # config_utils' precedence
    params.setdefault("rope_theta", hf.get("rope_theta", 10_000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    base = float(params["rope_theta"])
    inv = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float64) / head_dim)
    if rope_type == "default":
        return inv
    if rope_type != "llama3":
        raise ValueError(f"the reference implements rope types default and llama3, not {rope_type!r}")
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old = params.get("original_max_position_embeddings") or _key(hf, "max_position_embeddings")
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv
    llama = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * llama / factor + smooth * llama
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, llama)


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    variance = np.mean(x * x, axis=-1, keepdims=True)
    return weight * (x / np.sqrt(variance + eps))


def _rotate_half(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _windows(hf: Mapping[str, Any], num_layers: int) -> list[int | None]:
    """Each layer's sliding window (None: full causal attention), as each model class decides."""
    kind = hf["model_type"]
    if kind in ("mistral", "mixtral"):
        return [_key(hf, "sliding_window")] * num_layers
    if kind == "qwen3_moe":  # every layer, when on
        return [_key(hf, "sliding_window") if _key(hf, "use_sliding_window") else None] * num_layers
    if kind == "qwen3":
        window = _key(hf, "sliding_window") if _key(hf, "use_sliding_window") else None
        types = hf.get("layer_types") or [
            "sliding_attention" if window is not None and i >= _key(hf, "max_window_layers") else "full_attention"
            for i in range(num_layers)
        ]
        return [window if t == "sliding_attention" else None for t in types]
    return [None] * num_layers


def _swiglu(h: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """`down(silu(gate(h)) * up(h))` with `[out, in]` weights."""
    g = h @ gate.T
    return (g / (1 + np.exp(-g)) * (h @ up.T)) @ down.T


def _moe(hf: Mapping[str, Any], h: np.ndarray, w: Any, p: str) -> np.ndarray:
    """A Mixtral / Qwen3-MoE sparse block on `h` `[batch seq embed]`, one token at a time."""
    if hf["model_type"] == "mixtral":
        prefix, names, renormalise = p + "block_sparse_moe.", ("w1", "w3", "w2"), True
    else:
        prefix, names = p + "mlp.", ("gate_proj", "up_proj", "down_proj")
        renormalise = bool(_key(hf, "norm_topk_prob"))
    top_k = _key(hf, "num_experts_per_tok")
    router = w(prefix + "gate.weight")  # [experts, embed]
    experts: dict[int, list[np.ndarray]] = {}  # each expert's weights, read once
    out = np.zeros_like(h)
    for b, t in np.ndindex(h.shape[:2]):
        logits = router @ h[b, t]
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        chosen = np.argsort(-probs, kind="stable")[:top_k]
        weights = probs[chosen] / (probs[chosen].sum() if renormalise else 1.0)
        for e, weight in zip(chosen.tolist(), weights, strict=True):
            if e not in experts:
                experts[e] = [w(f"{prefix}experts.{e}.{n}.weight") for n in names]
            out[b, t] += weight * _swiglu(h[b, t], *experts[e])
    return out


def reference_logits(directory: str | os.PathLike[str], ids: np.ndarray) -> np.ndarray:
    """Next-token logits of the Hugging Face model in `directory` for `ids`, in float64.

    Arguments:
        directory: config.json + safetensors weights (one file or an index and shards).
        ids: int token ids `[batch, seq]` (positions 0 .. seq-1, no padding).

    Returns:
        `[batch, seq, vocab]` float64 logits.
    """
    hf = read_hf_config(directory)
    ckpt = HFCheckpoint(directory)

    def w(name: str) -> np.ndarray:
        return ckpt.read(name).astype(np.float64)

    ids = np.asarray(ids)
    batch, seq = ids.shape
    heads = hf["num_attention_heads"]
    kv_heads = _key(hf, "num_key_value_heads") or heads
    head_dim = _key(hf, "head_dim") or hf["hidden_size"] // heads
    eps = _key(hf, "rms_norm_eps")
    num_layers = hf["num_hidden_layers"]
    embed = w("model.embed_tokens.weight")
    x = embed[ids]
    freqs = np.arange(seq, dtype=np.float64)[:, None] * _inv_freq(hf, head_dim)[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb)[None, None], np.sin(emb)[None, None]  # [1 1 seq head_dim]
    q_pos, k_pos = np.arange(seq)[:, None], np.arange(seq)[None, :]
    for i, window in enumerate(_windows(hf, num_layers)):
        p = f"model.layers.{i}."
        h = _rms_norm(x, w(p + "input_layernorm.weight"), eps)
        # [batch seq heads*hd] -> view [batch seq heads hd] -> transpose(1, 2): [batch heads seq hd]
        q = (h @ w(p + "self_attn.q_proj.weight").T).reshape(batch, seq, heads, head_dim)
        k = (h @ w(p + "self_attn.k_proj.weight").T).reshape(batch, seq, kv_heads, head_dim)
        v = (h @ w(p + "self_attn.v_proj.weight").T).reshape(batch, seq, kv_heads, head_dim)
        if hf["model_type"] in ("qwen3", "qwen3_moe"):
            q = _rms_norm(q, w(p + "self_attn.q_norm.weight"), eps)
            k = _rms_norm(k, w(p + "self_attn.k_norm.weight"), eps)
        q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        group = heads // kv_heads
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # repeat_kv
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(head_dim)
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= k_pos > q_pos - window
        scores = np.where(allowed, scores, -np.inf)
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        attn = (scores / scores.sum(-1, keepdims=True)) @ v  # [batch heads seq hd]
        attn = attn.transpose(0, 2, 1, 3).reshape(batch, seq, heads * head_dim)
        x = x + attn @ w(p + "self_attn.o_proj.weight").T
        h = _rms_norm(x, w(p + "post_attention_layernorm.weight"), eps)
        if hf["model_type"] in ("mixtral", "qwen3_moe"):
            x = x + _moe(hf, h, w, p)
        else:
            x = x + _swiglu(h, *(w(p + f"mlp.{n}_proj.weight") for n in ("gate", "up", "down")))
    x = _rms_norm(x, w("model.norm.weight"), eps)
    tied = _key(hf, "tie_word_embeddings", False)  # tied: the output is the input table (any lm_head unused)
    return x @ (embed if tied else w("lm_head.weight")).T


def logit_kl(reference: np.ndarray, logits: np.ndarray) -> float:
    """Mean over positions of KL(softmax(reference) || softmax(logits)), in nats (float64).

    Arguments:
        reference: `[..., vocab]` logits of the reference.
        logits: the same positions' logits of the model checked.
    """
    a = np.asarray(reference, np.float64)
    b = np.asarray(logits, np.float64)
    la = a - a.max(-1, keepdims=True)
    la -= np.log(np.exp(la).sum(-1, keepdims=True))
    lb = b - b.max(-1, keepdims=True)
    lb -= np.log(np.exp(lb).sum(-1, keepdims=True))
    return float(np.mean(np.sum(np.exp(la) * (la - lb), axis=-1)))
