"""KV-cache decoding for every LM family, through the model's own modules.

The cache holds every layer's keys and values, preallocated to a maximum length (`KVCache`, made
by `TransformerLM.init_cache`); slot `j` of a row holds the token at position `j`. `prefill` runs
the (right-padded) prompts through the model in one pass and fills the cache; `decode_step` feeds
one new token per row, each at its own position, and attends over the slots up to it. Both call
`TransformerLM.cached`: the same embedding, attention modules (with their positions, QK-norm and
sliding window) and output projection as training. `decode` runs prefill and the token loop
(`jax.lax.while_loop`, stopping at EOS in every row or at `max_new_tokens`) inside one jitted
function. Each row's room is its own: `min(max_new_tokens, max_seq_len - its prompt length)`,
whatever the batch's widest prompt. `equipax.models.lm.generate` (no cache) is the reference that
greedy decoding must reproduce token for token.

On a TPU the loop is compiled with `TPU_DECODE_COMPILER_OPTIONS`: XLA:TPU's memory-space
assignment otherwise may keep a stacked weight (read-only, carried through the loop) in on-chip
memory and copy it out and back in every layer of every token, which made c4_1b at 6 layers
decode a batch of 8 at 0.61x a plain-JAX loop on a v5e (benchmarks/README.md, "Decode on the
chip").
"""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from equipax.core.nn.linear import Linear
from equipax.core.nn.quantization import quantize_weights
from equipax.core.nn.self_attention import Attention, AttentionCache
from equipax.core.nn.transformer import StackCache
from equipax.models.lm import DTYPES, TransformerLM
from equipax.models.lora import LoRALM

__all__ = [
    "AttentionCache",
    "decode",
    "decode_program",
    "decode_step",
    "for_decoding",
    "init_cache",
    "KVCache",
    "prefill",
    "sample_logits",
    "TPU_DECODE_COMPILER_OPTIONS",
]

# XLA:TPU's memory-space assignment keeps an allocation in on-chip memory only where its uses read
# at least as many bytes as its copies move. Without it, libtpu 0.0.42.1 and 0.0.48.1 placed the
# [layers heads head_dim embed] output projection of c4_1b at 6 layers (79 MB) in on-chip memory
# across the token loop at batch 8 and moved all of it out and back once per layer: ~0.9 GB of
# copies per token (tests/launch/test_decode_tpu.py checks the compiled program).
TPU_DECODE_COMPILER_OPTIONS = {"xla_tpu_msa_inefficient_use_to_copy_ratio": 1.0}

KVCache = StackCache
"""A model's KV cache: one `AttentionCache` (`keys`, `values` `[layers batch slots kv_heads
head_dim]`) for scanned layers, or one per layer."""


def init_cache(model: TransformerLM, batch_size: int, max_len: int) -> KVCache:
    """An empty (zero) cache for `batch_size` rows of up to `max_len` tokens.

    Arguments:
        model: the language model; the cache takes its compute dtype.
        batch_size: number of rows.
        max_len: slots per row: prompt plus generated tokens; at most `model.cfg.max_seq_len`.

    Returns:
        A zero cache; with grouped-query attention it holds `num_kv_heads` heads.
    """
    return model.init_cache(batch_size, max_len)


def prefill(
    model: TransformerLM, prompts: Int[Array, "batch seq"], lengths: Int[Array, " batch"], cache: KVCache
) -> tuple[Float[Array, "batch vocab"], KVCache]:
    """Run the prompts through the model in one pass, filling slots `0 .. seq-1` of the cache.

    Arguments:
        prompts: token ids, right-padded: row `b` is `prompts[b, :lengths[b]]` (the padding is
            written to the cache but masked, and overwritten as tokens are generated).
        lengths: prompt length of each row, in `[1, seq]`.
        cache: a cache of at least `seq` slots (`init_cache`).

    Returns:
        `(logits, cache)`: float32 next-token logits after each row's last prompt token, and
        the filled cache.
    """
    batch, seq = prompts.shape
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    h, cache = model.cached(prompts, positions, cache)
    last = jnp.take_along_axis(h, (lengths - 1)[:, None, None].astype(jnp.int32), axis=1)
    return model.logits(last[:, 0]), cache


def decode_step(
    model: TransformerLM, tokens: Int[Array, " batch"], positions: Int[Array, " batch"], cache: KVCache
) -> tuple[Float[Array, "batch vocab"], KVCache]:
    """Feed one token per row at its own position; it attends to the row's slots up to it.

    Arguments:
        tokens: the newest token of each row.
        positions: the position of each row's token (its prompt length plus the number of
            tokens generated before it).
        cache: the cache after prefill and the previous steps.

    Returns:
        `(logits, cache)`: float32 logits for the token after each row's, and the cache with
        this token's keys and values written.
    """
    h, cache = model.cached(tokens[:, None], positions[:, None].astype(jnp.int32), cache)
    return model.logits(h[:, 0]), cache


def sample_logits(
    logits: Float[Array, "batch vocab"],
    key: PRNGKeyArray | None,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> Int[Array, " batch"]:
    """Pick the next token of each row: greedy, or sampled with temperature, top-k and top-p.

    Arguments:
        logits: next-token logits.
        key: PRNG key; unused (may be `None`) when `temperature == 0`.
        temperature: 0 for greedy (argmax); > 0 samples from `softmax(logits / temperature)`.
        top_k: sample only among the `top_k` most likely tokens (`None` = all).
        top_p: nucleus sampling: only among the most likely tokens whose probabilities sum to
            at least `top_p` (the smallest such set; `None` = all).

    Returns:
        int32 token ids.
    """
    if temperature == 0.0 or key is None:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None and top_p < 1.0:
        ordered = jnp.flip(jnp.sort(logits, axis=-1), axis=-1)
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
        keep = jnp.sum(before < top_p, axis=-1, keepdims=True)  # >= 1: the first is kept
        threshold = jnp.take_along_axis(ordered, keep - 1, axis=-1)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return jr.categorical(key, logits, axis=-1).astype(jnp.int32)


def _decode_loop(
    model: TransformerLM,
    prompts: Array,
    lengths: Array,
    key: PRNGKeyArray | None,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    eos_id: Array,
    pad_id: Array,
) -> tuple[Array, Array]:
    # eos_id (-1: none) and pad_id are traced: other values reuse the compiled program. The
    # lengths were checked on the host (`_check_lengths`): no host callback in the program.
    batch, seq = prompts.shape
    lengths = lengths.astype(jnp.int32)
    slots = min(seq + max_new_tokens, model.cfg.max_seq_len)
    cache = init_cache(model, batch, slots)
    logits, cache = prefill(model, prompts.astype(jnp.int32), lengths, cache)
    # Each row's own room (>= 1: lengths <= seq < max_seq_len): prompt + generated fit max_seq_len.
    room = jnp.minimum(max_new_tokens, model.cfg.max_seq_len - lengths)

    def pick(logits: Array, key: PRNGKeyArray | None) -> tuple[Array, PRNGKeyArray | None]:
        # The key schedule of `generate`: split once per token, sample with the second half.
        if key is None:
            return sample_logits(logits, None), None
        key, sub = jr.split(key)
        return sample_logits(logits, sub, temperature=temperature, top_k=top_k, top_p=top_p), key

    def stopped(tokens: Array, num: Array) -> Array:
        return (tokens == eos_id) | (num >= room)

    token, key = pick(logits, key)
    out = jnp.full((batch, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(token)
    num = jnp.ones((batch,), jnp.int32)
    state = (jnp.int32(1), token, out, num, stopped(token, num), cache, key)

    def cond(state):
        step, _, _, _, done, _, _ = state
        return (step < max_new_tokens) & ~jnp.all(done)

    def body(state):
        step, token, out, num, done, cache, key = state
        # A finished row's position may pass its room: clamped into the cache (its token is padding).
        logits, cache = decode_step(model, token, jnp.minimum(lengths + step - 1, slots - 1), cache)
        token, key = pick(logits, key)
        token = jnp.where(done, pad_id, token)
        out = jax.lax.dynamic_update_slice(out, token[:, None], (0, step))
        num = num + (~done).astype(jnp.int32)
        return step + 1, token, out, num, done | stopped(token, num), cache, key

    _, _, out, num, _, _, _ = jax.lax.while_loop(cond, body, state)
    return out, num


# (filter_jit passes jax.jit's keywords on; its type stubs do not list them.)
_DECODE = {"tpu": eqx.filter_jit(_decode_loop, compiler_options=TPU_DECODE_COMPILER_OPTIONS)}  # pyright: ignore[reportCallIssue]
_DECODE_DEFAULT = eqx.filter_jit(_decode_loop)


def _check_lengths(lengths: Array | np.ndarray, width: int) -> None:
    """Every prompt length in `[1, width]`, read on the host (each process its own rows), before
    the call: a check inside the loop's program (`eqx.error_if`) is a host callback there, and a
    TPU program holding one paid for it on every call (benchmarks/README.md, "sixth session")."""
    try:
        shards = [s.data for s in lengths.addressable_shards] if isinstance(lengths, jax.Array) else [lengths]
        parts = [np.asarray(part) for part in shards]
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError, AttributeError):
        return  # decoding inside a trace: the values are not known here
    for values in parts:
        if values.size and (values.min() < 1 or values.max() > width):
            raise ValueError(
                f"decode: every prompt length must be in [1, {width}] (the prompts' width); got lengths from "
                f"{values.min()} to {values.max()}."
            )


def decode_program(model: TransformerLM) -> Callable[..., tuple[Array, Array]]:
    """The jitted decode loop for the platform that holds `model`'s weights (TPU: compiled with
    `TPU_DECODE_COMPILER_OPTIONS`); its arguments are those of the internal `_decode_loop`."""
    leaves = [x for x in jax.tree.leaves(model) if isinstance(x, jax.Array)]
    platform = next(iter(leaves[0].devices())).platform if leaves else jax.default_backend()
    return _DECODE.get(platform, _DECODE_DEFAULT)


def _served(model: TransformerLM | LoRALM) -> TransformerLM:
    """A `LoRALM`'s merge, and with `model.quantization` set, its projections' int8 copies
    (`quantize_weights`; a model that holds them already is kept as is)."""
    if isinstance(model, LoRALM):
        model = model.merged()
    return quantize_weights(model) if model.cfg.quantization != "none" else model


# The projection weights `equipax.core.nn.quantization.project` reads, by module: in the forward
# pass `decode` runs, each is read there only, cast to the activations' dtype (the model's compute
# dtype). (An untied output projection is also read by the training loss's vocabulary chunks,
# `TransformerLM.head_stats`, which a model made for decoding does not run.)
_PROJECTIONS = {Linear: ("weight",), Attention: ("qkv", "q", "kv", "out")}


def _projections_in_compute_dtype(model: TransformerLM) -> TransformerLM:
    """`model` with its projections' float weights (the blocks' attention and MLP matrices, an
    untied output projection) held in its compute dtype: the numbers of their cast at use. Float32
    weights are otherwise converted inside every `decode` call, before the token loop (c4_1b at 6
    layers: 2.8 GB of HBM traffic, ~3.5 ms of a v5e per call). Norm scales, biases, the embedding
    (looked up in float32) and int8 `QuantizedWeight`s are kept."""
    dtype = jnp.dtype(DTYPES[model.cfg.dtype])

    def held_otherwise(w: object) -> bool:  # a float array not yet in the compute dtype
        return isinstance(w, jax.Array | np.ndarray) and jnp.issubdtype(w.dtype, jnp.floating) and w.dtype != dtype

    def cast(m: eqx.Module) -> eqx.Module:
        names = [n for n in _PROJECTIONS[type(m)] if held_otherwise(getattr(m, n))]
        if not names:
            return m
        return eqx.tree_at(lambda x: [getattr(x, n) for n in names], m, [getattr(m, n).astype(dtype) for n in names])

    is_projection = lambda x: type(x) in _PROJECTIONS  # noqa: E731
    return jax.tree.map(lambda x: cast(x) if is_projection(x) else x, model, is_leaf=is_projection)


def for_decoding(model: TransformerLM | LoRALM) -> TransformerLM:
    """The model `decode` computes with, made once where a model is loaded for decoding: a
    `LoRALM`'s merge, with `model.quantization` set its projections' int8 copies
    (`quantize_weights`), and its other projection weights in the compute dtype (a bfloat16
    model's float32 matrices cast as each matmul casts them: the same tokens). It spares each
    `decode` call the copies (XLA otherwise converts the float32 weights in every call)."""
    return _projections_in_compute_dtype(_served(model))


def decode(
    model: TransformerLM | LoRALM,
    prompts: Int[Array | np.ndarray, "batch seq"],
    lengths: Int[Array | np.ndarray, " batch"],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    pad_id: int = 0,
    key: PRNGKeyArray | None = None,
) -> tuple[Int[Array, "batch new_tokens"], Int[Array, " batch"]]:
    """Generate up to `max_new_tokens` tokens per prompt with a KV cache, in one jitted call.

    Prefill fills the cache from the prompts in one pass; then one token per row per step
    (`jax.lax.while_loop`) until every row has produced `eos_id` or its room's worth of tokens:
    `min(max_new_tokens, max_seq_len - lengths[b])` for row `b` (the model reads at most
    `max_seq_len` tokens; a row's room does not depend on the other rows' prompts).
    Greedy decoding gives the tokens of `generate` (which recomputes the whole prefix).

    Arguments:
        model: the language model (softmax attention: any family); a `LoRALM` decodes as its merge.
            A model with a `quantization` computes from its int8 weights (made here unless the
            model already holds them; `launch decode` makes them once at load with `for_decoding`,
            which also holds the other projection weights in the compute dtype).
        prompts: right-padded prompts (pad with anything): row `b` is `prompts[b, :lengths[b]]`.
            On the host (numpy) or the device.
        lengths: prompt length of each row, in `[1, seq]`; on the host, or the device (each
            process then reads its own rows back to check them).
        max_new_tokens: the most tokens to generate per row (>= 1); a row whose prompt leaves
            less room in the model's `max_seq_len` stops there (`num_tokens` says where).
        temperature: 0 for greedy, > 0 to sample from `softmax(logits / temperature)`.
        top_k: when sampling, only among the `top_k` most likely tokens.
        top_p: when sampling, only among the smallest set of most likely tokens whose
            probability reaches `top_p` (nucleus sampling).
        eos_id: a row stops after generating this token (it is kept in the output).
        pad_id: fills each row after its last generated token.
        key: PRNG key, required when `temperature > 0`; the same key gives the same samples.

    Returns:
        `(tokens, num_tokens)`: int32 generated tokens (prompts excluded), shape
        `[batch, max_new_tokens]`, padded with `pad_id` after each row's end, and how many tokens
        each row generated (including its EOS).

    Raises:
        ValueError: a bad argument (a prompt length outside `[1, seq]` too), or prompts as wide
            as `max_seq_len` (no room for a token).
    """
    model = _served(model)
    vocab = model.cfg.vocab_size
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}.")
    if prompts.ndim != 2 or lengths.shape != (prompts.shape[0],):
        raise ValueError(
            f"decode takes prompts [batch seq] and lengths [batch]; got shapes {prompts.shape} and {lengths.shape}."
        )
    if prompts.shape[1] >= model.cfg.max_seq_len:
        raise ValueError(
            f"prompts {prompts.shape[1]} tokens wide leave no room for a new token in the model's "
            f"max_seq_len={model.cfg.max_seq_len}; pass prompts at most {model.cfg.max_seq_len - 1} tokens wide."
        )
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}.")
    if temperature > 0 and key is None:
        raise ValueError("sampling with temperature > 0 needs a PRNG key: pass key=...")
    if top_k is not None and not 1 <= top_k <= vocab:
        raise ValueError(f"top_k must be in [1, vocab_size={vocab}] or None, got {top_k}.")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p}.")
    for name, value in (("eos_id", eos_id), ("pad_id", pad_id)):
        if value is not None and not 0 <= value < vocab:
            raise ValueError(f"{name} must be a token id in [0, {vocab}), got {value}.")
    _check_lengths(lengths, prompts.shape[1])
    return decode_program(model)(
        model,
        prompts,
        lengths,
        key if temperature > 0 else None,
        int(max_new_tokens),
        float(temperature),
        top_k,
        top_p,
        jnp.int32(-1 if eos_id is None else eos_id),
        jnp.int32(pad_id),
    )
