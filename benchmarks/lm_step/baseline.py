"""The plain-JAX side of a comparison: a preset as `benchmarks/baseline_lm.py`'s config (the same
math, or an error naming what the hand-written step does not implement) and the equipax model's
parameters in its dict layout, so both sides start from the same numbers."""

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from benchmarks import baseline_lm
from benchmarks.lm_step.presets import Preset, resolve_attention


def baseline_for(preset: Preset, *, remat: str | None = None) -> baseline_lm.BaselineConfig:
    """The plain-JAX `BaselineConfig` of the same math as `preset` (caps, clip, decay, scan, remat,
    dtype and attention kernel included); `remat` overrides the plain side's policy only.
    Attention "auto" (the default) is resolved for this platform first (`resolve_attention`)."""
    preset = resolve_attention(preset)
    m, t, lr = preset.model, preset.model.transformer, preset.learner
    llama = m.position == "rope"
    shared = {
        "use_bias": (t.use_bias, False),
        "attention": (t.attention, "softmax"),
        "learner.kind": (lr.kind, "adamw"),
        "learner.clip_update_rms": (lr.clip_update_rms, None),
        "qk_norm": (t.qk_norm, False),
        "sliding_window": (t.sliding_window, None),
        "z_loss_coef": (m.z_loss_coef, 0.0),
        "pipeline_stages": (t.pipeline_stages, 1),
        "num_experts": (t.num_experts, 0),
    }
    family = {  # the block each family's baseline writes out
        "norm": (t.norm, "rmsnorm" if llama else "layernorm"),
        "activation": (t.activation, "silu" if llama else "gelu"),
        "gated": (t.gated, llama),
        "fused_qkv": (t.fused_qkv, not llama),
        "rope_scaling": (m.rope_scaling if not llama else None, None),  # Llama's "llama3" rule is written out
        "embedding_multiplier": (m.embedding_multiplier, None if llama else "sqrt_model_dims"),
        "position": (m.position, "rope" if llama else "sinusoidal"),
    } | (
        {"atten_logit_cap": (t.atten_logit_cap, None), "output_logit_cap": (m.output_logit_cap, None)} if llama else {}
    )
    bad = {k: found for k, (found, want) in (shared | family).items() if found != want}
    if t.remat not in ("none", "full", "dots_saveable"):
        bad["remat"] = t.remat
    if t.attention_impl not in ("xla", "splash"):
        bad["attention_impl"] = t.attention_impl
    if bad:
        raise SystemExit(
            f"--compare: preset {preset.name!r} has {bad}; the plain-JAX baseline implements the presets' "
            "pre-LN GELU GPT and Llama-block LM with AdamW, remat none/full/dots_saveable and attention "
            "xla/splash only (--attention auto is resolved first). Pick other overrides or another preset."
        )
    return baseline_lm.BaselineConfig(
        vocab_size=m.vocab_size,
        num_layers=t.num_layers,
        model_dims=t.model_dims,
        num_heads=t.num_heads,
        head_dim=t.head_dim,
        hidden_dims=t.hidden_dims,
        seq_len=preset.seq_len,
        batch_size=preset.batch_size,
        atten_logit_cap=t.atten_logit_cap,
        output_logit_cap=m.output_logit_cap,
        clip_gradient_norm=lr.clip_gradient_norm,
        weight_decay=lr.weight_decay,
        b1=lr.b1,
        b2=lr.b2,
        eps=lr.eps,
        layernorm_eps=t.norm_eps,
        family="llama" if llama else "gpt",
        num_kv_heads=t.num_kv_heads,
        rope_theta=m.rope_theta,
        rope_scaling=None
        if m.rope_scaling is None
        else (
            m.rope_scaling.factor,
            m.rope_scaling.low_freq_factor,
            m.rope_scaling.high_freq_factor,
            m.rope_scaling.original_max_seq_len,
        ),
        tie_embeddings=m.tie_embeddings,
        scan_layers=t.scan_layers,
        remat=remat or t.remat,
        dtype=m.dtype,
        attention_impl=t.attention_impl,
        float32_logits=preset.plain_float32_logits,
    )


def _block_params(b: Any, copy: Callable[[Any], Any]) -> dict[str, Any]:
    """One equipax block's (or a stacked block's) arrays in the baseline's names."""
    if b.attention.qkv is None:  # the Llama block
        return {
            "ln1": copy(b.atten_norm.scale),
            "q": copy(b.attention.q),
            "kv": copy(b.attention.kv),
            "out": copy(b.attention.out),
            "ln2": copy(b.ffn_norm.scale),
            "gate": copy(b.ffn.gate.weight),
            "up": copy(b.ffn.up.weight),
            "down": copy(b.ffn.down.weight),
        }
    return {
        "ln1": copy(b.atten_norm.scale),
        "qkv": copy(b.attention.qkv),
        "out": copy(b.attention.out),
        "ln2": copy(b.ffn_norm.scale),
        "up": copy(b.ffn.up.weight),
        "down": copy(b.ffn.down.weight),
    }


def baseline_params(model: Any) -> dict[str, Any]:
    """The equipax `TransformerLM`'s parameters in the baseline's dict layout (copies): a list of
    layer dicts (unrolled) or one dict of stacked arrays (scanned), and `unembed` when untied."""
    copy = lambda x: jnp.array(x, copy=True)  # noqa: E731 (both steps donate their inputs)
    layers = model.stack.layers
    params: dict[str, Any] = {"embed": copy(model.embedding.weight), "final_ln": copy(model.final_norm.scale)}
    if isinstance(layers, tuple):
        params["layers"] = [_block_params(b, copy) for b in layers]
    else:  # scanned: one block whose arrays carry a leading layer axis
        params["layers"] = _block_params(layers, copy)
    if model.unembed is not None:
        params["unembed"] = copy(model.unembed.weight)
    return params
