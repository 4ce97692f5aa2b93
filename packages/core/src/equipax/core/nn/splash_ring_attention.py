"""Ring attention with the splash kernel per block (TPU): `attention_impl='splash'` with
`context_parallel='ring'`. The rotation, the block ids and the backward's shape are ring
attention's (`equipax.core.nn.ring_attention`); what differs is each block's attention, run by the
Pallas kernel and merged by the log-sum-exp it returns.
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array

from equipax.core.nn.remat import ATTENTION_OUT
from equipax.core.nn.ring_attention import (  # pyright: ignore[reportPrivateUsage]
    RingConfig,
    _guard,
    _rotate,
    _source_ids,
    _tied,
    _varying_like,
)

__all__ = ["SplashRingConfig", "splash_ring_attention_shard"]

# The splash kernel per block (TPU): `attention_impl='splash'` with `context_parallel='ring'`.
#
# The XLA ring merges half-blocks of einsums. With splash, each device runs the Pallas kernel
# on every (query chunk, key chunk) pair it meets as the blocks rotate, and merges the pairs by the
# log-sum-exp the kernel returns beside its output (`save_residuals=True`). A splash mask is static,
# and a pair's mask depends only on how far its query chunk starts after its key chunk (in chunks,
# `delta`): the pair's kernel is picked by a `lax.switch` over the few kernels that can occur
# (`SplashRingConfig.kinds`). The backward is ring attention's (the keys and values rotate again,
# their gradients travel with them), each pair's gradients computed by splash's own backward kernels
# from the *merged* output and log-sum-exp of its queries: those kernels take the probabilities as
# `exp(logits - lse)` and the softmax correction as `rowsum(dO * O)`, so given the whole row's
# `lse` and `O` they give this pair's exact share of the row's gradient. Splash exposes that
# backward only as the private `_splash_attention_bwd` of jax 0.11 (`_splash_pair_grads`), which
# the parity test (tests/core/test_context_parallel_splash.py) checks against dense attention.

# A row whose keys in a pair are all masked gets splash's mask value (-0.7 x float32 max) as its
# log-sum-exp: anything below this is "no valid key here" and merges with weight 0.
_NO_KEY_LSE = -1e30


@dataclasses.dataclass(frozen=True)
class SplashRingConfig:
    """The static part of one splash ring call (hashable: `custom_vjp`'s non-differentiable
    argument)."""

    axis: str | None  # the context mesh axis; None = one device (no collectives)
    size: int  # devices on the axis
    zigzag: bool  # device i holds chunks i and 2N-1-i of 2N (else chunk i of N)
    chunk: int  # positions per chunk (a multiple of 128, the kernel's block)
    heads: int  # query heads
    causal: bool
    window: int | None
    logit_cap: float | None
    interpret: bool  # the Pallas interpreter (any platform; for tests)

    @property
    def ring(self) -> RingConfig:
        return RingConfig(self.axis, self.size, self.causal, self.window, self.logit_cap)

    def held(self, device: Array | int) -> list[Array | int]:
        """The chunk numbers (in the unsplit sequence) of `device`'s positions, in its order."""
        return [device, 2 * self.size - 1 - device] if self.zigzag else [device]

    def kinds(self) -> list[int | None]:
        """The pairs' possible masks: None = nothing visible (skipped), else `delta`, the query
        chunk's start after the key chunk's, in chunks. Without a mask every pair is full (one
        kind); causal: a later key chunk is skipped, the same chunk is causal, every earlier one
        is full (`delta=1` stands for all); a window also skips key chunks it cannot reach."""
        if not self.causal:
            return [0]
        if self.window is None:
            return [None, 0, 1]
        reach = (self.chunk + self.window - 2) // self.chunk  # the farthest chunk a window touches
        return [None, *range(reach + 1)]

    def kind_index(self, delta: Array) -> Array:
        """The index into `kinds()` of a pair whose query chunk starts `delta` chunks after its keys'."""
        kinds = self.kinds()
        if len(kinds) == 1:
            return jnp.zeros((), jnp.int32)
        last = kinds[-1]
        assert last is not None
        if self.window is None:
            return jnp.where(delta < 0, 0, jnp.where(delta == 0, 1, 2))
        return jnp.where((delta < 0) | (delta > last), 0, delta + 1)


def _heads_first(x: Array) -> Array:
    """`[b s h d]` <-> `[b h s d]`."""
    return jnp.swapaxes(x, 1, 2)


def _row_scale(w: Array) -> Array:
    """`[b h s]` -> `[b s h 1]`, to scale `[b s h d]` outputs per row."""
    return jnp.moveaxis(w, -1, 1)[..., None]


def _splash_kernel_of(cfg: SplashRingConfig, delta: int, *, save_residuals: bool) -> Any:
    from equipax.core.nn.fused_attention import _splash_kernel  # pyright: ignore[reportPrivateUsage]

    return _splash_kernel(
        cfg.heads,
        cfg.chunk,
        cfg.chunk,
        offset=delta * cfg.chunk,
        causal=cfg.causal,
        window=cfg.window,
        logit_cap=cfg.logit_cap,
        interpret=cfg.interpret,
        save_residuals=save_residuals,
    )


def _splash_pair(cfg: SplashRingConfig, kind: int | None, q, k, v, qseg, kseg) -> tuple[Array, Array]:
    """One pair's normalised output `[b C h d]` and log-sum-exp `[b h C]` (float32); rows with no
    valid key: output 0, log-sum-exp -inf."""
    b, c, h, d = q.shape
    if kind is None:
        return (
            _varying_like(jnp.zeros((b, c, h, d), jnp.float32), q),
            _varying_like(jnp.full((b, h, c), -jnp.inf, jnp.float32), q),
        )
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    kernel = _splash_kernel_of(cfg, kind, save_residuals=True)
    out, (lse,) = jax.vmap(kernel)(
        _heads_first(q), _heads_first(k), _heads_first(v), segment_ids=sa.SegmentIds(q=qseg, kv=kseg)
    )
    valid = lse > _NO_KEY_LSE
    out = jnp.where(_row_scale(valid), _heads_first(out).astype(jnp.float32), 0.0)
    return out, jnp.where(valid, lse.astype(jnp.float32), -jnp.inf)


def _merge_pair(state: tuple[Array, Array], out: Array, lse: Array) -> tuple[Array, Array]:
    """A pair's normalised output into its queries' running `(output, log-sum-exp)`."""
    acc, acc_lse = state
    new = jnp.logaddexp(acc_lse, lse)
    safe = _guard(new)  # rows with no valid key yet: both weights exp(-inf) = 0
    return acc * _row_scale(jnp.exp(acc_lse - safe)) + out * _row_scale(jnp.exp(lse - safe)), new


def _splash_pair_grads(kernel: Any, q, k, v, segments, out, lse, do) -> tuple[Array, Array, Array]:
    """`(dq, dk, dv)` of one example's pair (heads first) from its rows' merged `out` and `lse`:
    splash's backward kernels (`_splash_attention_bwd`, private in jax 0.11: the public kernel's
    VJP recomputes the pair's own, unmerged residuals). Its mask infos are passed as its public
    call passes them (`_splash_attention` flattens the partial mask blocks first)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sak

    def flat(info):
        if info is None or info.partial_mask_blocks is None:
            return info
        blocks = info.partial_mask_blocks
        return info._replace(partial_mask_blocks=blocks.reshape(-1, *blocks.shape[-2:]))

    kw = kernel.kwargs
    res = (q, k, v, segments, None, out, lse, flat(kernel.dq_mask_info), flat(kernel.dkv_mask_info))
    grads = sak._splash_attention_bwd(  # pyright: ignore[reportPrivateUsage]
        False,
        kw["mask_value"],
        kw["is_mqa"],
        kw["block_sizes"],
        None,
        kw["mask_function"],
        kw["attn_logits_soft_cap"],
        kw["interpret"],
        res,
        do,
    )
    return grads[3], grads[4], grads[5]


def _splash_pair_bwd(cfg: SplashRingConfig, kind: int | None, q, k, v, qseg, kseg, out, lse, do):
    """One pair's float32 `(dq, dk, dv)`, `[b C h d]`, `[b C kv_heads d]` x 2."""
    if kind is None:
        zeros = lambda x: _varying_like(jnp.zeros(x.shape, jnp.float32), x)  # noqa: E731
        return zeros(q), zeros(k), zeros(v)
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    kernel = _splash_kernel_of(cfg, kind, save_residuals=False)

    def one(q, k, v, qseg, kseg, out, lse, do):
        return _splash_pair_grads(kernel, q, k, v, sa.SegmentIds(q=qseg, kv=kseg), out, lse, do)

    hf = _heads_first
    dq, dk, dv = jax.vmap(one)(hf(q), hf(k), hf(v), qseg, kseg, hf(out), lse, hf(do).astype(v.dtype))
    return hf(dq).astype(jnp.float32), hf(dk).astype(jnp.float32), hf(dv).astype(jnp.float32)


def _chunks(cfg: SplashRingConfig, x: Array | None) -> list:
    """`x`'s (`[b S/N ...]`) chunks along the sequence, in the device's order."""
    n = 2 if cfg.zigzag else 1
    return [None if x is None else x[:, j * cfg.chunk : (j + 1) * cfg.chunk] for j in range(n)]


def _device(cfg: SplashRingConfig) -> Array | int:
    return 0 if cfg.axis is None else jax.lax.axis_index(cfg.axis)


def _splash_forward(cfg: SplashRingConfig, q, k, v, qseg, kseg_all):
    b, sq, h, d = q.shape
    me = _device(cfg)
    mine, qs, qsegs = cfg.held(me), _chunks(cfg, q), _chunks(cfg, qseg)
    states = [
        (
            _varying_like(jnp.zeros((b, cfg.chunk, h, d), jnp.float32), q),
            _varying_like(jnp.full((b, h, cfg.chunk), -jnp.inf, jnp.float32), q),
        )
        for _ in qs
    ]
    kv = jnp.stack([k, v], axis=2)  # [b S/N 2 kv_heads d]: one permute per step
    pairs = [functools.partial(_splash_pair, cfg, kind) for kind in cfg.kinds()]

    def step(t: Array | int, carry):
        kv, states = carry
        upcoming = kv if cfg.axis is None else _rotate(cfg.ring, kv)  # issued before the compute
        kseg = _source_ids(cfg.ring, kseg_all, t, sq)
        kv, kseg, _ = _tied(kv, kseg, None)
        theirs, kvs, ksegs = cfg.held((me - t) % cfg.size), _chunks(cfg, kv), _chunks(cfg, kseg)
        states = list(states)
        for i, a in enumerate(mine):
            for j, c in enumerate(theirs):
                args = (qs[i], kvs[j][:, :, 0], kvs[j][:, :, 1], qsegs[i], ksegs[j])
                index = cfg.kind_index(jnp.asarray(a - c))
                out, lse = pairs[0](*args) if len(pairs) == 1 else jax.lax.switch(index, pairs, *args)
                states[i] = _merge_pair(states[i], out, lse)
        return upcoming, states

    _, states = step(0, (kv, states)) if cfg.axis is None else jax.lax.fori_loop(0, cfg.size, step, (kv, states))
    out = jnp.concatenate([s[0] for s in states], axis=1)
    lse = jnp.concatenate([s[1] for s in states], axis=-1)
    return out.astype(v.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _splash_ring(cfg: SplashRingConfig, q, k, v, qseg, kseg_all):
    return _splash_forward(cfg, q, k, v, qseg, kseg_all)[0]


def _splash_ring_fwd(cfg: SplashRingConfig, q, k, v, qseg, kseg_all):
    out, lse = _splash_forward(cfg, q, k, v, qseg, kseg_all)
    # Named as the splash kernel names its own (`equipax.core.nn.remat`): a remat policy that
    # keeps the attention's context keeps these, and the backward pass runs no forward ring.
    out, lse = checkpoint_name(out, ATTENTION_OUT), checkpoint_name(lse, ATTENTION_OUT)
    return out, (q, k, v, out, lse, qseg, kseg_all)


def _splash_ring_bwd(cfg: SplashRingConfig, res, g):
    q, k, v, out, lse, qseg, kseg_all = res
    sq = q.shape[1]
    me = _device(cfg)
    mine, qs, qsegs = cfg.held(me), _chunks(cfg, q), _chunks(cfg, qseg)
    outs, dos = _chunks(cfg, out.astype(jnp.float32)), _chunks(cfg, g)
    lses = [lse[..., j * cfg.chunk : (j + 1) * cfg.chunk] for j in range(len(qs))]
    dq = [_varying_like(jnp.zeros(x.shape, jnp.float32), q) for x in qs]
    kv = jnp.stack([k, v], axis=2)
    dkv = _varying_like(jnp.zeros(kv.shape, jnp.float32), kv)  # travels with its block
    pairs = [functools.partial(_splash_pair_bwd, cfg, kind) for kind in cfg.kinds()]

    def step(t: Array | int, carry):
        kv, dkv, dq = carry
        upcoming = kv if cfg.axis is None else _rotate(cfg.ring, kv)
        kseg = _source_ids(cfg.ring, kseg_all, t, sq)
        kv, kseg, _ = _tied(kv, kseg, None)
        theirs, kvs, ksegs = cfg.held((me - t) % cfg.size), _chunks(cfg, kv), _chunks(cfg, kseg)
        dq, parts = list(dq), []
        for j, c in enumerate(theirs):
            part = _varying_like(jnp.zeros(kvs[j].shape, jnp.float32), kv)
            for i, a in enumerate(mine):
                args = (qs[i], kvs[j][:, :, 0], kvs[j][:, :, 1], qsegs[i], ksegs[j], outs[i], lses[i], dos[i])
                index = cfg.kind_index(jnp.asarray(a - c))
                gq, gk, gv = pairs[0](*args) if len(pairs) == 1 else jax.lax.switch(index, pairs, *args)
                dq[i] = dq[i] + gq
                part = part + jnp.stack([gk, gv], axis=2)
            parts.append(part)
        dkv = dkv + jnp.concatenate(parts, axis=1)
        # The gradient follows its block; the N-th rotation brings it home.
        return upcoming, dkv if cfg.axis is None else _rotate(cfg.ring, dkv), dq

    carry = (kv, dkv, dq)
    _, dkv, dq = step(0, carry) if cfg.axis is None else jax.lax.fori_loop(0, cfg.size, step, carry)
    dq_full = jnp.concatenate(dq, axis=1).astype(q.dtype)
    return dq_full, dkv[:, :, 0].astype(k.dtype), dkv[:, :, 1].astype(v.dtype), None, None


_splash_ring.defvjp(_splash_ring_fwd, _splash_ring_bwd)


def splash_ring_attention_shard(
    cfg: SplashRingConfig, q: Array, k: Array, v: Array, segment_ids: Array, all_segment_ids: Array
) -> Array:
    """One device's ring attention with the splash kernel per block pair (inside `jax.shard_map`
    over `cfg.axis`, or alone when None).

    Arguments:
        cfg: the axis, the layout, the chunk and the mask.
        q: this device's `[b S/N heads d]` queries, already scaled by 1/sqrt(d) (as splash takes them).
        k, v: this device's `[b S/N kv_heads d]` keys and values.
        segment_ids: this device's `[b S/N]` int32 segments; all_segment_ids: every device's,
            `[b S]` in device order.

    Returns:
        This device's attention outputs, `[b S/N heads d]` in `v.dtype`.
    """
    return _splash_ring(cfg, q, k, v, segment_ids, all_segment_ids)
