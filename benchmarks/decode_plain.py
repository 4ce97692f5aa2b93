"""A plain-JAX greedy KV-cache decode of `baseline_lm.py`'s models, in their compute dtype, with
scanned (stacked) or unrolled layers: the loop `decode_reference.py` times `launch decode` against.

`baseline_lm.make_greedy_decode` runs in the parameters' dtype (float32 on equipax's weights) and
over a list of layers; a model that trains in bfloat16 with `scan_layers` (c4_1b, the Llama
presets) decodes here as its training forward computes (`baseline_lm.forward`): float32
parameters cast to the compute dtype at use, the embedding (and sinusoidal positions) added in
float32 and cast, norms and softmax in float32, the keys and values cached in the compute dtype,
float32 logits; rotary positions with Llama 3.1's frequency rescaling where the config has it.
No Equinox, no equipax: parameters in `baseline_lm`'s dict layout
(`benchmarks.lm_step.baseline.baseline_params`).

One jit: prefill the right-padded prompts in one pass (each row's keys and values at its own
positions), then one token per row per step in a `lax.fori_loop`, a fixed number of steps (no
end-of-sequence stop). Slot p of the cache holds position p; a query at position p attends to
slots <= p, so the pad slots past a row's prompt are overwritten by its generated tokens before
any query reads them. Scanned layers run under `lax.scan` with the cache stacked on a layer
axis, as equipax's scanned stack decodes.
"""

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks import baseline_lm

__all__ = ["make_greedy_decode", "make_prefill"]

Params = dict[str, Any]


def _rope_at(x: jax.Array, positions: jax.Array, cfg: Any) -> jax.Array:
    """Rotary positions of `x` `[batch seq heads dim]` at `positions` `[batch seq]`, in float32
    (the "rotate half" layout of `baseline_lm._rope`, its frequency rescaling included)."""
    half = x.shape[-1] // 2
    inv = cfg.rope_theta ** -(jnp.arange(half, dtype=jnp.float32) * 2 / x.shape[-1])
    if cfg.rope_scaling is not None:
        inv = baseline_lm._llama3_scaled(inv, cfg.rope_scaling)
    angles = positions.astype(jnp.float32)[..., None] * inv[None, None, :]
    sin, cos = jnp.sin(angles)[:, :, None], jnp.cos(angles)[:, :, None]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _layer(
    cfg: Any, layer: Params, x: jax.Array, positions: jax.Array, keys: jax.Array, values: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One pre-norm block over the cache of its layer (`[batch slots kv_heads hd]` each): the new
    tokens' keys and values written to their slots first, then attention over the visible slots."""
    dt = x.dtype
    w = {k: v.astype(dt) for k, v in layer.items() if not k.startswith("ln")}
    llama = cfg.family == "llama"
    if llama:
        h = baseline_lm._rmsnorm(x, layer["ln1"], cfg.layernorm_eps)
        q = _rope_at(jnp.einsum("bsd,dhk->bshk", h, w["q"]), positions, cfg)
        kv = jnp.einsum("bsd,dtnk->bstnk", h, w["kv"])
        k, v = _rope_at(kv[:, :, 0], positions, cfg), kv[:, :, 1]
    else:
        h = baseline_lm._layernorm(x, layer["ln1"], cfg.layernorm_eps)
        qkv = jnp.einsum("bsd,dthk->bsthk", h, w["qkv"])
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    rows = jnp.arange(x.shape[0])[:, None]
    keys = keys.at[rows, positions].set(k.astype(keys.dtype))
    values = values.at[rows, positions].set(v.astype(values.dtype))
    b, s = q.shape[:2]
    kv_heads = keys.shape[2]
    # Query heads in groups over their shared key/value head: the cache is read once per group.
    qg = q.reshape(b, s, kv_heads, cfg.num_heads // kv_heads, cfg.head_dim)
    logits = jnp.einsum("bqngk,bsnk->bngqs", qg, keys, preferred_element_type=jnp.float32)
    logits = baseline_lm._cap(logits / math.sqrt(cfg.head_dim), cfg.atten_logit_cap)
    visible = jnp.arange(keys.shape[1])[None, None, None, None, :] <= positions[:, None, None, :, None]
    probs = jax.nn.softmax(jnp.where(visible, logits, -1e30), axis=-1).astype(dt)
    attn = jnp.einsum("bngqs,bsnk->bqngk", probs, values).reshape(b, s, cfg.num_heads, cfg.head_dim)
    x = x + jnp.einsum("bqhk,hkd->bqd", attn, w["out"])
    if llama:
        h = baseline_lm._rmsnorm(x, layer["ln2"], cfg.layernorm_eps)
        return x + (jax.nn.silu(h @ w["gate"]) * (h @ w["up"])) @ w["down"], keys, values
    h = baseline_lm._layernorm(x, layer["ln2"], cfg.layernorm_eps)
    return x + jax.nn.gelu(h @ w["up"]) @ w["down"], keys, values


def _hidden(
    cfg: Any, params: Params, ids: jax.Array, positions: jax.Array, cache: tuple[Any, Any]
) -> tuple[jax.Array, tuple[Any, Any]]:
    """Final-norm hidden states `[batch seq d]` of `ids` at `positions`, and the updated cache
    (`(keys, values)`: stacked `[layers batch slots kv_heads hd]` for scanned layers, else lists)."""
    dt = jnp.dtype(cfg.dtype)
    x = params["embed"][ids]
    if cfg.family != "llama":
        x = x * math.sqrt(cfg.model_dims) + baseline_lm._sinusoid_at(positions, cfg.model_dims)
    x = x.astype(dt)
    keys, values = cache
    if isinstance(params["layers"], dict):  # scanned: one dict of arrays stacked on the layer axis

        def body(x: jax.Array, layer_cache: tuple[Params, jax.Array, jax.Array]) -> tuple[jax.Array, Any]:
            layer, k, v = layer_cache
            x, k, v = _layer(cfg, layer, x, positions, k, v)
            return x, (k, v)

        x, (keys, values) = jax.lax.scan(body, x, (params["layers"], keys, values))
    else:
        keys, values = list(keys), list(values)
        for i, layer in enumerate(params["layers"]):
            x, keys[i], values[i] = _layer(cfg, layer, x, positions, keys[i], values[i])
    norm = baseline_lm._rmsnorm if cfg.family == "llama" else baseline_lm._layernorm
    return norm(x, params["final_ln"], cfg.layernorm_eps), (keys, values)


def _logits(cfg: Any, params: Params, h: jax.Array) -> jax.Array:
    """Float32 next-token logits of final hidden states (a matmul in the compute dtype, as training)."""
    dt = h.dtype
    out = h @ params["embed"].astype(dt).T if cfg.tied else h @ params["unembed"].astype(dt)
    return baseline_lm._cap(out.astype(jnp.float32), cfg.output_logit_cap)


def _empty_cache(cfg: Any, params: Params, batch: int, slots: int) -> tuple[Any, Any]:
    """Zero keys and values for `batch` rows of `slots` slots, stacked or one per layer."""
    dt = jnp.dtype(cfg.dtype)
    shape = (batch, slots, cfg.num_kv_heads or cfg.num_heads, cfg.head_dim)
    if isinstance(params["layers"], dict):
        stacked = (cfg.num_layers, *shape)
        return jnp.zeros(stacked, dt), jnp.zeros(stacked, dt)
    return [jnp.zeros(shape, dt)] * cfg.num_layers, [jnp.zeros(shape, dt)] * cfg.num_layers


def _prefill(cfg: Any, params: Params, prompts: jax.Array, lengths: jax.Array, slots: int) -> tuple[jax.Array, Any]:
    """Float32 logits after each row's last prompt token, and the cache of `slots` slots filled."""
    batch, seq = prompts.shape
    positions = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
    h, cache = _hidden(cfg, params, prompts, positions, _empty_cache(cfg, params, batch, slots))
    last = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)
    return _logits(cfg, params, last[:, 0]), cache


def make_prefill(cfg: Any) -> Callable[..., jax.Array]:
    """`prefill(params, prompts [batch seq], lengths [batch]) -> logits [batch vocab]`, jitted: the
    prompts in one pass, their keys and values written to a cache of `seq` slots (the prefill of
    `make_greedy_decode`, alone)."""
    return jax.jit(lambda params, prompts, lengths: _prefill(cfg, params, prompts, lengths, prompts.shape[1])[0])


def make_greedy_decode(cfg: Any, max_new_tokens: int) -> Callable[..., jax.Array]:
    """`decode(params, prompts [batch seq], lengths [batch]) -> tokens [batch max_new_tokens]`,
    jitted: greedy, a fixed number of steps (no end-of-sequence stop), in `cfg.dtype`.

    Arguments:
        cfg: a `baseline_lm.BaselineConfig` (`benchmarks.lm_step.baseline.baseline_for` of the equipax model).
        max_new_tokens: tokens generated per row.
    """

    def decode(params: Params, prompts: jax.Array, lengths: jax.Array) -> jax.Array:
        batch, seq = prompts.shape
        logits, cache = _prefill(cfg, params, prompts, lengths, seq + max_new_tokens)
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        out = jnp.zeros((batch, max_new_tokens), jnp.int32).at[:, 0].set(token)

        def step(i: jax.Array, carry: tuple[jax.Array, jax.Array, Any]) -> tuple[jax.Array, jax.Array, Any]:
            token, out, cache = carry
            h, cache = _hidden(cfg, params, token[:, None], (lengths + i - 1)[:, None], cache)
            token = jnp.argmax(_logits(cfg, params, h[:, 0]), axis=-1).astype(jnp.int32)
            return token, out.at[:, i].set(token), cache

        _, out, _ = jax.lax.fori_loop(1, max_new_tokens, step, (token, out, cache))
        return out

    return jax.jit(decode)
