"""A plain-JAX reference LM train step: what a user would write by hand, no Equinox, no equipax.

The same math as equipax's `TransformerLM` + `lm_loss` + AdamW learner, for two families:
`family="gpt"` (pre-LN, fused QKV, GELU MLP, tied embedding scaled by sqrt(d), sinusoidal
positions, optional tanh logit caps) and `family="llama"` (RMSNorm, separate query and key/value
projections with grouped key/value heads repeated for their query heads, rotary positions, SwiGLU,
untied output projection); both with global-norm clipping and decoupled weight decay on matrices,
written the obvious way: parameters in a dict of arrays, one `jax.jit` with the parameters and
optimizer state donated, and the loss as the only metric. `benchmarks/train_step.py --compare` times
it against the equipax step, in one process, interleaved, on the same batch.

For accelerators (benchmarks/README.md, "equipax vs plain JAX on a TPU"), the step can also scan
over stacked layers (`scan_layers`), rematerialise each block (`remat`: "none", "full",
"dots_saveable" with equipax's policy of that name, or "dots_all_saveable", JAX's own
`dots_saveable`), compute in bfloat16 from float32 master weights (`dtype`: weights cast at use,
norm statistics, the softmax and the loss in float32, as equipax's `model.dtype`) and run the
attention as plain jnp softmax ("xla") or the Pallas TPU splash kernel ("splash", TPU only).
The defaults (unrolled, no remat, float32, "xla") are the CPU comparison it was written for.

This module imports only jax, numpy and optax, so the comparison cannot borrow anything from
equipax by accident.
"""

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class BaselineConfig:
    """The model, the optimizer and the batch of one reference step."""

    vocab_size: int
    num_layers: int
    model_dims: int
    num_heads: int
    head_dim: int
    hidden_dims: int
    seq_len: int
    batch_size: int
    atten_logit_cap: float | None = None
    output_logit_cap: float | None = None
    clip_gradient_norm: float | None = None
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    layernorm_eps: float = 1e-6
    family: str = "gpt"
    num_kv_heads: int | None = None  # llama: key/value heads (None = num_heads)
    rope_theta: float = 10_000.0
    # Llama 3.1's frequency rescaling: (factor, low_freq_factor, high_freq_factor, original_max_seq_len).
    rope_scaling: tuple[float, float, float, int] | None = None
    tie_embeddings: bool | None = None  # None: the family's (gpt tied, llama untied)
    scan_layers: bool = False  # params["layers"] is one dict of arrays stacked on a layer axis
    remat: str = "none"  # "none", "full", "dots_saveable", "dots_all_saveable"
    dtype: str = "float32"  # compute dtype; parameters stay float32
    attention_impl: str = "xla"  # "xla" (jnp softmax) or "splash" (Pallas, TPU)
    # "xla": the q.k logits out of the matmul in float32 (as equipax's XLA path and the splash
    # kernel keep them) instead of rounded to the compute dtype before the float32 softmax.
    float32_logits: bool = False
    splash_interpret: bool = False  # run splash in the Pallas interpreter (any platform; tests)

    @property
    def tied(self) -> bool:
        return self.family != "llama" if self.tie_embeddings is None else self.tie_embeddings


def init_params(cfg: BaselineConfig, key: jax.Array) -> Params:
    """Random parameters: `embed [vocab d]`, per layer `ln1, qkv [d 3 h hd], out [h hd d], ln2,
    up [d ff], down [ff d]`, and `final_ln` (llama: `q [d h hd]`, `kv [d 2 kv hd]`, `gate`, and
    `unembed [d vocab]`)."""
    d, h, hd, ff = cfg.model_dims, cfg.num_heads, cfg.head_dim, cfg.hidden_dims
    keys = iter(jax.random.split(key, 2 + 6 * cfg.num_layers))

    def dense(shape: tuple[int, ...], fan_in: int) -> jax.Array:
        return jax.random.normal(next(keys), shape, jnp.float32) / math.sqrt(fan_in)

    if cfg.family == "llama":
        kv = cfg.num_kv_heads or h
        blocks = [
            {
                "ln1": jnp.ones((d,)),
                "q": dense((d, h, hd), d),
                "kv": dense((d, 2, kv, hd), d),
                "out": dense((h, hd, d), h * hd),
                "ln2": jnp.ones((d,)),
                "gate": dense((d, ff), d),
                "up": dense((d, ff), d),
                "down": dense((ff, d), ff),
            }
            for _ in range(cfg.num_layers)
        ]
        params = {"embed": jax.random.normal(next(keys), (cfg.vocab_size, d)), "final_ln": jnp.ones((d,))}
        if not cfg.tied:
            params["unembed"] = dense((d, cfg.vocab_size), d)
        return params | {"layers": stack_layers(blocks) if cfg.scan_layers else blocks}
    layers = [
        {
            "ln1": jnp.ones((d,)),
            "qkv": dense((d, 3, h, hd), d),
            "out": dense((h, hd, d), h * hd),
            "ln2": jnp.ones((d,)),
            "up": dense((d, ff), d),
            "down": dense((ff, d), ff),
        }
        for _ in range(cfg.num_layers)
    ]
    params = {"embed": dense((cfg.vocab_size, d), d), "final_ln": jnp.ones((d,))}
    if not cfg.tied:
        params["unembed"] = dense((d, cfg.vocab_size), d)
    return params | {"layers": stack_layers(layers) if cfg.scan_layers else layers}


def _layernorm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    # square(x) before mean(x): the other order (or a centred two-pass variance) makes XLA:CPU
    # duplicate the backward fusions across deep stacks (benchmarks/README.md, "The LayerNorm
    # trap"); a baseline slowed by that trap would flatter equipax. Statistics in float32.
    xf = x.astype(jnp.float32)
    mean_sq = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = mean_sq - jnp.square(mean)
    return ((xf - mean) * jax.lax.rsqrt(var + eps) * scale[None, None]).astype(x.dtype)


def _cap(x: jax.Array, cap: float | None) -> jax.Array:
    return x if cap is None else cap * jnp.tanh(x / cap)


def _positions(seq_len: int, dims: int) -> jax.Array:
    half = dims // 2
    inv = jnp.exp(jnp.arange(half, dtype=jnp.float32) * -(math.log(1.0e4) / max(half - 1, 1)))
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv[None, :]
    return jnp.pad(jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], 1), ((0, 0), (0, dims % 2)))


def _rmsnorm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps) * scale[None, None]
    return y.astype(x.dtype)


def _llama3_scaled(inv: jax.Array, scaling: tuple[float, float, float, int]) -> jax.Array:
    """Llama 3.1's rule: keep high frequencies, divide low ones by `factor`, interpolate between."""
    factor, low, high, original = scaling
    wavelen = 2 * math.pi / inv
    scaled = jnp.where(wavelen > original / low, inv / factor, inv)
    smooth = (original / wavelen - low) / (high - low)
    between = (1 - smooth) * scaled / factor + smooth * scaled
    return jnp.where((wavelen >= original / high) & (wavelen <= original / low), between, scaled)


def _rope(x: jax.Array, theta: float, scaling: tuple[float, float, float, int] | None = None) -> jax.Array:
    """Rotate each head's halves by position x frequency (the "rotate half" layout), in float32."""
    seq, half = x.shape[1], x.shape[-1] // 2
    inv = theta ** -(jnp.arange(half, dtype=jnp.float32) * 2 / x.shape[-1])
    if scaling is not None:
        inv = _llama3_scaled(inv, scaling)
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * inv[None, :]
    sin, cos = jnp.sin(angles)[None, :, None], jnp.cos(angles)[None, :, None]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def stack_layers(layers: list[Params]) -> Params:
    """Per-layer parameter dicts -> one dict of arrays with a leading layer axis (for `scan_layers`)."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *layers)


def _xla_attention(cfg: BaselineConfig, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal softmax attention, plain jnp: logits and softmax in float32, matmuls in the compute
    dtype; query heads grouped over their key/value head (no repeated keys)."""
    b, s, h, hd = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, s, kv, h // kv, hd)
    if cfg.float32_logits:
        logits = jnp.einsum("bqngk,bsnk->bngqs", qg, k, preferred_element_type=jnp.float32) / math.sqrt(hd)
    else:
        logits = jnp.einsum("bqngk,bsnk->bngqs", qg, k).astype(jnp.float32) / math.sqrt(hd)
    causal = jnp.tril(jnp.ones((s, s), bool))[None, None, None]
    logits = jnp.where(causal, _cap(logits, cfg.atten_logit_cap), -1e30)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bngqs,bsnk->bqngk", probs, v).reshape(b, s, h, hd)


def _splash_attention(cfg: BaselineConfig, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal attention with the Pallas TPU splash kernel, as a hand-writer calls it: one kernel
    for all heads (grouped key/value heads are its own), vmapped over the batch, no segment ids.
    The block sizes are equipax's (the largest of 512/256/128 dividing the sequence), so the
    two sides run the same kernel configuration."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    s, h = q.shape[1], q.shape[2]
    block = next((n for n in (512, 256, 128) if s % n == 0), None)
    if block is None:
        raise ValueError(f"splash attention needs a sequence length divisible by 128, got {s}")
    sizes = sa.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    mask = sa.MultiHeadMask([sa.CausalMask((s, s))] * h)
    kernel = sa.make_splash_mha(
        mask,
        block_sizes=sizes,
        head_shards=1,
        q_seq_shards=1,
        attn_logits_soft_cap=cfg.atten_logit_cap,
        interpret=cfg.splash_interpret,
    )
    heads_first = lambda t: jnp.swapaxes(t, 1, 2)  # noqa: E731  [b s h d] <-> [b h s d]
    q = q * jnp.asarray(1.0 / math.sqrt(q.shape[-1]), q.dtype)
    return heads_first(jax.vmap(kernel)(heads_first(q), heads_first(k), heads_first(v)))


_REMAT_POLICIES = {
    "full": None,
    # equipax's `model.transformer.remat="dots_saveable"` (equipax.core.nn.remat): matmuls without
    # batch dimensions are saved (the projections and the MLP), the attention einsums recomputed.
    "dots_saveable": "dots_with_no_batch_dims_saveable",
    # JAX's `dots_saveable`: every matmul's output is saved, the attention's too.
    "dots_all_saveable": "dots_saveable",
}


def _block(cfg: BaselineConfig, layer: Params, x: jax.Array) -> jax.Array:
    """One pre-norm block of the family, computing in `x.dtype` (weights cast at use)."""
    dt = x.dtype
    w = {k: v.astype(dt) for k, v in layer.items() if not k.startswith("ln")}
    attention = _splash_attention if cfg.attention_impl == "splash" else _xla_attention
    if cfg.family == "llama":
        h = _rmsnorm(x, layer["ln1"], cfg.layernorm_eps)
        q = _rope(jnp.einsum("bsd,dhk->bshk", h, w["q"]), cfg.rope_theta, cfg.rope_scaling)
        kv = jnp.einsum("bsd,dtnk->bstnk", h, w["kv"])
        k, v = _rope(kv[:, :, 0], cfg.rope_theta, cfg.rope_scaling), kv[:, :, 1]
        x = x + jnp.einsum("bqhk,hkd->bqd", attention(cfg, q, k, v), w["out"])
        h = _rmsnorm(x, layer["ln2"], cfg.layernorm_eps)
        return x + (jax.nn.silu(h @ w["gate"]) * (h @ w["up"])) @ w["down"]
    h = _layernorm(x, layer["ln1"], cfg.layernorm_eps)
    qkv = jnp.einsum("bsd,dthk->bsthk", h, w["qkv"])
    x = x + jnp.einsum("bqhk,hkd->bqd", attention(cfg, qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]), w["out"])
    h = _layernorm(x, layer["ln2"], cfg.layernorm_eps)
    return x + jax.nn.gelu(h @ w["up"]) @ w["down"]


def forward(cfg: BaselineConfig, params: Params, ids: jax.Array) -> jax.Array:
    """Float32 logits `[batch seq vocab]` of the token ids `[batch seq]`.

    The embedding (and sinusoidal positions) are added in float32 and cast to the compute dtype;
    the output logits come out of a matmul in the compute dtype and are cast to float32 (both as
    equipax's `TransformerLM`).
    """
    dt = jnp.dtype(cfg.dtype)
    x = params["embed"][ids]
    if cfg.family != "llama":
        x = x * math.sqrt(cfg.model_dims) + _positions(ids.shape[1], cfg.model_dims)[None]
    x = x.astype(dt)
    block = lambda layer, x: _block(cfg, layer, x)  # noqa: E731
    if cfg.remat != "none":
        if cfg.remat not in _REMAT_POLICIES:
            raise ValueError(f"remat must be 'none' or one of {sorted(_REMAT_POLICIES)}, got {cfg.remat!r}")
        name = _REMAT_POLICIES[cfg.remat]
        block = jax.checkpoint(block, policy=None if name is None else getattr(jax.checkpoint_policies, name))
    if cfg.scan_layers:
        x, _ = jax.lax.scan(lambda x, layer: (block(layer, x), None), x, params["layers"])
    else:
        for layer in params["layers"]:
            x = block(layer, x)
    norm = _rmsnorm if cfg.family == "llama" else _layernorm
    x = norm(x, params["final_ln"], cfg.layernorm_eps)
    logits = x @ params["embed"].astype(dt).T if cfg.tied else x @ params["unembed"].astype(dt)
    return _cap(logits.astype(jnp.float32), cfg.output_logit_cap)


def loss_fn(cfg: BaselineConfig, params: Params, batch: dict[str, jax.Array]) -> jax.Array:
    """Weighted mean next-token cross-entropy (float32)."""
    log_probs = jax.nn.log_softmax(forward(cfg, params, batch["ids"]), axis=-1)
    nll = -jnp.take_along_axis(log_probs, batch["labels"][..., None], axis=-1)[..., 0]
    return jnp.sum(nll * batch["weights"]) / jnp.maximum(jnp.sum(batch["weights"]), 1e-8)


def make_optimizer(cfg: BaselineConfig, learning_rate: float | Callable[[Any], Any]) -> optax.GradientTransformation:
    """Global-norm clip (if set), then AdamW with decay on parameters of two or more dims
    (stacked layers: of three or more, the leading axis being the layer's)."""
    matrix = 3 if cfg.scan_layers else 2

    def mask(params: Params) -> Any:
        decay = jax.tree.map(lambda x: x.ndim >= 2, params)
        if cfg.scan_layers:
            decay["layers"] = jax.tree.map(lambda x: x.ndim >= matrix, params["layers"])
        return decay

    adamw = optax.adamw(learning_rate, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=mask)
    if cfg.clip_gradient_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(cfg.clip_gradient_norm), adamw)


def make_step(cfg: BaselineConfig, optimizer: optax.GradientTransformation) -> Callable[..., Any]:
    """`step(params, opt_state, batch) -> (params, opt_state, loss)`, jitted, params and state donated."""

    def step(params: Params, opt_state: Any, batch: dict[str, jax.Array]):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(cfg, p, batch))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


# ---------------------------------------------------------------------------------------------
# Greedy decoding with a KV cache, written by hand: the reference `benchmarks/decode_reference.py`
# times `launch decode` against. One jit: prefill the right-padded prompts in one pass (each row's
# keys and values at its own positions), then one token per row per step in a `lax.fori_loop`.
# Slot p of the cache holds position p; a query at position p attends to slots <= p, so the pad
# slots past a row's prompt are overwritten by its generated tokens before any query reads them.


def _sinusoid_at(positions: jax.Array, dims: int) -> jax.Array:
    """`_positions` at arbitrary positions `[batch seq]` -> `[batch seq dims]`."""
    half = dims // 2
    inv = jnp.exp(jnp.arange(half, dtype=jnp.float32) * -(math.log(1.0e4) / max(half - 1, 1)))
    angles = positions.astype(jnp.float32)[..., None] * inv[None, None, :]
    return jnp.pad(jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], -1), ((0, 0), (0, 0), (0, dims % 2)))


def _rope_at(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """`_rope` at arbitrary positions: x `[batch seq heads dim]`, positions `[batch seq]`."""
    half = x.shape[-1] // 2
    inv = theta ** -(jnp.arange(half, dtype=jnp.float32) * 2 / x.shape[-1])
    angles = positions.astype(jnp.float32)[..., None] * inv[None, None, :]
    sin, cos = jnp.sin(angles)[:, :, None], jnp.cos(angles)[:, :, None]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _cached_forward(
    cfg: BaselineConfig, params: Params, ids: jax.Array, positions: jax.Array, cache: list[tuple[jax.Array, ...]]
) -> tuple[jax.Array, list[tuple[jax.Array, ...]]]:
    """Logits `[batch seq vocab]` of `ids` at `positions`, reading and writing the per-layer
    `(keys, values)` caches `[batch slots kv_heads hd]`."""
    llama = cfg.family == "llama"
    rows = jnp.arange(ids.shape[0])[:, None]
    slots = cache[0][0].shape[1]
    visible = jnp.arange(slots)[None, None, None, :] <= positions[:, None, :, None]  # [b 1 q slots]
    if llama:
        x = params["embed"][ids]
    else:
        x = params["embed"][ids] * math.sqrt(cfg.model_dims) + _sinusoid_at(positions, cfg.model_dims)
    group = cfg.num_heads // (cfg.num_kv_heads or cfg.num_heads)
    new_cache = []
    for layer, (keys, values) in zip(params["layers"], cache):
        if llama:
            h = _rmsnorm(x, layer["ln1"], cfg.layernorm_eps)
            q = _rope_at(jnp.einsum("bsd,dhk->bshk", h, layer["q"]), positions, cfg.rope_theta)
            kv = jnp.einsum("bsd,dtnk->bstnk", h, layer["kv"])
            k, v = _rope_at(kv[:, :, 0], positions, cfg.rope_theta), kv[:, :, 1]
        else:
            h = _layernorm(x, layer["ln1"], cfg.layernorm_eps)
            qkv = jnp.einsum("bsd,dthk->bsthk", h, layer["qkv"])
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        keys, values = keys.at[rows, positions].set(k), values.at[rows, positions].set(v)
        new_cache.append((keys, values))
        # Query heads in groups over their shared key/value head: the cache is read once per group.
        b, s = q.shape[:2]
        qg = q.reshape(b, s, keys.shape[2], group, cfg.head_dim)
        logits = jnp.einsum("bqngk,bsnk->bngqs", qg, keys) / math.sqrt(cfg.head_dim)
        logits = _cap(logits, cfg.atten_logit_cap)
        probs = jax.nn.softmax(jnp.where(visible[:, :, None], logits, -1e30), axis=-1)
        attn = jnp.einsum("bngqs,bsnk->bqngk", probs, values).reshape(b, s, cfg.num_heads, cfg.head_dim)
        x = x + jnp.einsum("bqhk,hkd->bqd", attn, layer["out"])
        if llama:
            h = _rmsnorm(x, layer["ln2"], cfg.layernorm_eps)
            x = x + (jax.nn.silu(h @ layer["gate"]) * (h @ layer["up"])) @ layer["down"]
        else:
            h = _layernorm(x, layer["ln2"], cfg.layernorm_eps)
            x = x + jax.nn.gelu(h @ layer["up"]) @ layer["down"]
    if llama:
        return _rmsnorm(x, params["final_ln"], cfg.layernorm_eps) @ params["unembed"], new_cache
    x = _layernorm(x, params["final_ln"], cfg.layernorm_eps)
    return _cap(x @ params["embed"].T, cfg.output_logit_cap), new_cache


def make_greedy_decode(cfg: BaselineConfig, max_new_tokens: int) -> Callable[..., jax.Array]:
    """`decode(params, prompts [batch seq], lengths [batch]) -> tokens [batch max_new_tokens]`, jitted:
    greedy, a fixed number of steps (no end-of-sequence stop)."""

    def decode(params: Params, prompts: jax.Array, lengths: jax.Array) -> jax.Array:
        batch, seq = prompts.shape
        kv = cfg.num_kv_heads or cfg.num_heads
        shape = (batch, seq + max_new_tokens, kv, cfg.head_dim)
        cache = [(jnp.zeros(shape), jnp.zeros(shape)) for _ in params["layers"]]
        positions = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
        logits, cache = _cached_forward(cfg, params, prompts, positions, cache)
        last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
        token = jnp.argmax(last, axis=-1).astype(jnp.int32)
        out = jnp.zeros((batch, max_new_tokens), jnp.int32).at[:, 0].set(token)

        def step(i, carry):
            token, out, cache = carry
            logits, cache = _cached_forward(cfg, params, token[:, None], (lengths + i - 1)[:, None], cache)
            token = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
            return token, out.at[:, i].set(token), cache

        _, out, _ = jax.lax.fori_loop(1, max_new_tokens, step, (token, out, cache))
        return out

    return jax.jit(decode)
