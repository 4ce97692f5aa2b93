"""Ring attention: each device's queries meet every device's keys and values as the blocks rotate
around the `context` mesh axis (`jax.lax.ppermute`), merged by an online softmax.

Per attention layer and device (N devices on the axis, S/N positions each):

- forward: N steps of one loop (`lax.fori_loop`); at step t the device holds the key/value block
  of device `i - t`. The rotation to the next device is issued at the top of the step, before this
  block's compute, which it does not depend on (so the transfer can overlap it): N
  collective-permutes per layer of one array (keys and values stacked), the last bringing each
  block back to its device. The loop carries one block, so at most two are alive.
- each block is cut into halves of queries and keys; a half-pair that the causal, window or
  segment mask leaves empty is skipped (`lax.cond`). With the zigzag layout
  (`equipax.core.nn.context_parallel.zigzag_permutation`) every device then does the same causal
  work, half of the dense product.
- the merge is in float32: running max `m`, denominator and unnormalised output per query.
  A row with no valid key yet (a later document, a future block) keeps `m = -inf`; its exponents
  are taken against 0 instead of `m` so that no `-inf - -inf` makes a NaN (the guard).
- grouped-query attention rotates the `kv_heads` key/value heads, never the repeated ones.
- backward (`jax.custom_vjp`): the saved log-sum-exp per row lets each block's probabilities be
  recomputed; keys and values rotate again (N permutes) and their float32 gradient accumulators
  travel with them (N permutes: after the last, each block's gradient is home). Per device, the
  keys and values stay O(S/N) (no more than two blocks alive) and the logits are those of one
  half-block pair at a time, `(S/2N)^2` per head, never `[S/N S]` (benchmarks/README.md,
  "Context parallelism": measured per-device memory).

The positions and segment ids of every key (int32 `[batch S]`, small next to the keys) are
all-gathered once per layer, so a block's mask is computed from its source device's slice.
`ring_attention` equals `equipax.core.nn.attention.reference_attention` on the unpermuted sequence
(tests/core/test_context_parallel.py). The splash kernel per block (TPU) is
`equipax.core.nn.splash_ring_attention`.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array

from equipax.core.nn.attention_masks import attention_mask

__all__ = ["RingConfig", "ring_attention_shard"]


@dataclasses.dataclass(frozen=True)
class RingConfig:
    """The static part of one ring attention call (hashable: `custom_vjp`'s non-differentiable
    argument)."""

    axis: str | None  # the context mesh axis; None = one device (no collectives)
    size: int  # devices on the axis
    causal: bool
    window: int | None
    logit_cap: float | None


def _halves(n: int) -> list[slice]:
    """Two halves of `n` positions (one slice when `n` is odd): the unit of block skipping."""
    if n % 2:
        return [slice(0, n)]
    return [slice(0, n // 2), slice(n // 2, n)]


def _mask(cfg: RingConfig, qpos: Array, qseg: Array | None, kpos: Array, kseg: Array | None) -> Array:
    mask = attention_mask(qpos, kpos, causal=cfg.causal, window=cfg.window, query_segments=qseg, key_segments=kseg)
    return jnp.ones((qpos.shape[0], qpos.shape[1], kpos.shape[1]), bool) if mask is None else mask


def _logits(cfg: RingConfig, qs: Array, k: Array) -> Array:
    """Capped float32 logits `[b n g q k]` of pre-scaled queries `[b q n g d]` and keys `[b k n d]`."""
    s = jnp.einsum("bqngd,bknd->bngqk", qs, k, preferred_element_type=jnp.float32)
    return s if cfg.logit_cap is None else cfg.logit_cap * jnp.tanh(s / cfg.logit_cap)


def _merge(cfg: RingConfig, qs: Array, k: Array, v: Array, mask: Array, state: tuple[Array, Array, Array]):
    """One block into the online softmax `(max, denominator, output)` of its queries (float32)."""
    m, denom, acc = state
    s = jnp.where(mask[:, None, None], _logits(cfg, qs, k), -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    safe = _guard(m_new)
    p = jnp.exp(s - safe[..., None])
    alpha = jnp.exp(m - safe)
    pv = jnp.einsum("bngqk,bknd->bqngd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m_new, alpha * denom + jnp.sum(p, axis=-1), acc * _per_query(alpha) + pv


def _guard(m: Array) -> Array:
    """The max to subtract: 0 for rows that have seen no valid key (`m = -inf`), else `m`."""
    return jnp.where(jnp.isneginf(m), 0.0, m)


def _per_query(x: Array) -> Array:
    """`[b n g q]` -> `[b q n g 1]`, to scale `[b q n g d]` outputs per row."""
    return jnp.moveaxis(x, -1, 1)[..., None]


def _rotate(cfg: RingConfig, x: Array) -> Array:
    assert cfg.axis is not None
    return jax.lax.ppermute(x, cfg.axis, [(j, (j + 1) % cfg.size) for j in range(cfg.size)])


def _source_ids(cfg: RingConfig, ids: Array | None, step: Array | int, block: int) -> Array | None:
    """The slice of all-gathered `[b S]` ids of the block held at `step` (from device `i - step`)."""
    if ids is None or cfg.axis is None:
        return ids
    src = (jax.lax.axis_index(cfg.axis) - step) % cfg.size
    return jax.lax.dynamic_slice_in_dim(ids, src * block, block, axis=1)


def _sub(ids: Array | None, sl: slice) -> Array | None:
    return None if ids is None else ids[:, sl]


def _tied(kv: Array, kpos: Array | None, kseg: Array | None) -> tuple[Array, Array | None, Array | None]:
    """The block's positions tied to its keys and values (an `optimization_barrier`), so that
    JAX's partial evaluation sees the masks as depending on the rotating data.

    Without it, under a scan over layers (`scan_layers=True`), the masks and everything the
    skipped-block `cond`s derive from them depend on the positions alone, which are the same for
    every layer: JAX hoists them out of the layer loop and keeps them for every ring step at
    once, stacked (160 GiB per chip for the 128k experiment; docs/long_context.md).
    `tests/core/test_context_parallel.py::test_ring_gradient_under_a_layer_scan_saves_no_per_step_blocks`
    checks the traced program."""
    return jax.lax.optimization_barrier((kv, kpos, kseg))


def _varying_like(x: Array, ref: Array) -> Array:
    """`x` made to vary over the manual mesh axes `ref` varies over: a freshly built accumulator
    (zeros, -inf) is "unvarying", and a `lax.cond` that returns it unchanged in one branch and
    merged with a device's block in the other needs the two to agree, where JAX checks it (a
    pipeline stage's shard_map, manual over `stage` and `context`). A no-op elsewhere."""
    axes = tuple(sorted(_varying_axes(ref) - _varying_axes(x)))
    return jax.lax.pcast(x, axes, to="varying") if axes else x


def _varying_axes(x: Array) -> frozenset:
    """The manual mesh axes `x` varies over (JAX 0.11 keeps them in its type's `mat.varying`)."""
    mat = getattr(jax.typeof(x), "mat", None)
    return frozenset(getattr(mat, "varying", ()) or ())


def _forward(cfg: RingConfig, q: Array, k: Array, v: Array, qpos, qseg, kpos_all, kseg_all):
    b, sq, heads, d = q.shape
    sk, kv_heads = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    qs = (q * jnp.asarray(1.0 / math.sqrt(d), q.dtype)).reshape(b, sq, kv_heads, groups, d)
    qh, kh = _halves(sq), _halves(sk)
    states = [
        (
            jnp.full((b, kv_heads, groups, h.stop - h.start), -jnp.inf, jnp.float32),
            jnp.zeros((b, kv_heads, groups, h.stop - h.start), jnp.float32),
            jnp.zeros((b, h.stop - h.start, kv_heads, groups, d), jnp.float32),
        )
        for h in qh
    ]
    states = [tuple(_varying_like(x, q) for x in state) for state in states]
    kv = jnp.stack([k, v], axis=2)  # [b sk 2 kv_heads d]: one permute per step

    def step(t: Array | int, carry):
        kv, states = carry
        # Issued first: the transfer does not depend on this block's compute and can overlap it.
        upcoming = kv if cfg.axis is None else _rotate(cfg, kv)
        kpos, kseg = _source_ids(cfg, kpos_all, t, sk), _source_ids(cfg, kseg_all, t, sk)
        kv, kpos, kseg = _tied(kv, kpos, kseg)
        states = list(states)
        for i, qsl in enumerate(qh):
            for ksl in kh:
                mask = _mask(cfg, qpos[:, qsl], _sub(qseg, qsl), kpos[:, ksl], _sub(kseg, ksl))  # pyright: ignore[reportOptionalSubscript]
                states[i] = jax.lax.cond(
                    jnp.any(mask),
                    functools.partial(_merge, cfg),
                    lambda qs, k, v, mask, state: state,
                    qs[:, qsl],
                    kv[:, ksl, 0],
                    kv[:, ksl, 1],
                    mask,
                    states[i],
                )
        return upcoming, states

    _, states = step(0, (kv, states)) if cfg.axis is None else jax.lax.fori_loop(0, cfg.size, step, (kv, states))
    m = jnp.concatenate([s[0] for s in states], axis=-1)
    denom = jnp.concatenate([s[1] for s in states], axis=-1)
    acc = jnp.concatenate([s[2] for s in states], axis=1)
    # Every causal self-attention row sees at least itself; the guard keeps any other row finite.
    denom = jnp.where(denom > 0, denom, 1.0)
    out = acc / _per_query(denom)
    lse = _guard(m) + jnp.log(denom)
    return out.reshape(b, sq, heads, d).astype(v.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(cfg: RingConfig, q, k, v, qpos, qseg, kpos_all, kseg_all):
    return _forward(cfg, q, k, v, qpos, qseg, kpos_all, kseg_all)[0]


def _ring_fwd(cfg: RingConfig, q, k, v, qpos, qseg, kpos_all, kseg_all):
    out, lse = _forward(cfg, q, k, v, qpos, qseg, kpos_all, kseg_all)
    return out, (q, k, v, out, lse, qpos, qseg, kpos_all, kseg_all)


def _block_grads(cfg: RingConfig, qs, k, v, do, lse, delta, mask):
    """One block's `(dq_scaled, dk, dv)` (float32) from the saved log-sum-exp."""
    t = _logits(cfg, qs, k)
    p = jnp.where(mask[:, None, None], jnp.exp(t - lse[..., None]), 0.0)
    dv = jnp.einsum("bngqk,bqngd->bknd", p, do, preferred_element_type=jnp.float32)
    dp = jnp.einsum("bqngd,bknd->bngqk", do, v, preferred_element_type=jnp.float32)
    ds = p * (dp - delta[..., None])
    if cfg.logit_cap is not None:
        ds = ds * (1.0 - jnp.square(t / cfg.logit_cap))
    dq = jnp.einsum("bngqk,bknd->bqngd", ds, k, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bngqk,bqngd->bknd", ds, qs, preferred_element_type=jnp.float32)
    return dq, dk, dv


def _ring_bwd(cfg: RingConfig, res, g):
    q, k, v, out, lse, qpos, qseg, kpos_all, kseg_all = res
    b, sq, heads, d = q.shape
    sk, kv_heads = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    scale = 1.0 / math.sqrt(d)
    qs = (q * jnp.asarray(scale, q.dtype)).reshape(b, sq, kv_heads, groups, d)
    do = g.reshape(b, sq, kv_heads, groups, d)
    # delta = rowsum(dO * O): the softmax Jacobian's correction term, [b n g q].
    delta = jnp.moveaxis(jnp.sum(do.astype(jnp.float32) * out.reshape(do.shape).astype(jnp.float32), -1), 1, -1)
    do = do.astype(v.dtype)
    qh, kh = _halves(sq), _halves(sk)
    dq = [_varying_like(jnp.zeros((b, h.stop - h.start, kv_heads, groups, d), jnp.float32), q) for h in qh]
    kv = jnp.stack([k, v], axis=2)
    dkv = _varying_like(jnp.zeros(kv.shape, jnp.float32), kv)  # travels with its block

    def step(t: Array | int, carry):
        kv, dkv, dq = carry
        upcoming = kv if cfg.axis is None else _rotate(cfg, kv)
        kpos, kseg = _source_ids(cfg, kpos_all, t, sk), _source_ids(cfg, kseg_all, t, sk)
        kv, kpos, kseg = _tied(kv, kpos, kseg)
        dq, dk_parts = list(dq), []
        for ksl in kh:
            dk_h = _varying_like(jnp.zeros((b, ksl.stop - ksl.start, 2, kv_heads, d), jnp.float32), kv)
            for i, qsl in enumerate(qh):
                mask = _mask(cfg, qpos[:, qsl], _sub(qseg, qsl), kpos[:, ksl], _sub(kseg, ksl))  # pyright: ignore[reportOptionalSubscript]

                def add(qs, k, v, do, lse, delta, mask, dq_i, dk_h):
                    gq, gk, gv = _block_grads(cfg, qs, k, v, do, lse, delta, mask)
                    return dq_i + gq, dk_h + jnp.stack([gk, gv], axis=2)

                dq[i], dk_h = jax.lax.cond(
                    jnp.any(mask),
                    add,
                    lambda *args: (args[-2], args[-1]),
                    qs[:, qsl],
                    kv[:, ksl, 0],
                    kv[:, ksl, 1],
                    do[:, qsl],
                    lse[..., qsl],
                    delta[..., qsl],
                    mask,
                    dq[i],
                    dk_h,
                )
            dk_parts.append(dk_h)
        dkv = dkv + jnp.concatenate(dk_parts, axis=1)
        # The gradient follows its block; the N-th rotation brings it home.
        return upcoming, dkv if cfg.axis is None else _rotate(cfg, dkv), dq

    carry = (kv, dkv, dq)
    _, dkv, dq = step(0, carry) if cfg.axis is None else jax.lax.fori_loop(0, cfg.size, step, carry)
    dq_full = (jnp.concatenate(dq, axis=1) * scale).reshape(q.shape).astype(q.dtype)
    return dq_full, dkv[:, :, 0].astype(k.dtype), dkv[:, :, 1].astype(v.dtype), None, None, None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention_shard(
    cfg: RingConfig,
    q: Array,
    k: Array,
    v: Array,
    positions: Array,
    segment_ids: Array | None,
    all_positions: Array,
    all_segment_ids: Array | None,
) -> Array:
    """One device's ring attention (inside `jax.shard_map` over `cfg.axis`, or alone when None).

    Arguments:
        cfg: the axis, its size and the mask.
        q, k, v: this device's `[b S/N heads d]` queries and `[b S/N kv_heads d]` keys and values.
        positions, segment_ids: this device's `[b S/N]` global positions and segments.
        all_positions, all_segment_ids: every device's, `[b S]` in device order.

    Returns:
        This device's attention outputs, `[b S/N heads d]` in `v.dtype`.
    """
    return _ring(cfg, q, k, v, positions, segment_ids, all_positions, all_segment_ids)
