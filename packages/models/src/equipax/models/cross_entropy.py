"""The softmax cross-entropy of a language model's output head, as few passes over the logits as
XLA can make, and a variant that never holds the `[batch seq vocab]` logits at all.

Both give the same per-token statistics (`HeadStats`), from which `equipax.models.lm.lm_losses`
takes the cross-entropy, the z-loss and the accuracy:

- `head_stats(raw, labels, cap)` reads the logits the head's matmul wrote (in the model's dtype).
  The logit cap, the float32 cast and the softmax are elementwise in the reductions that read
  them, so XLA:TPU fuses them there and writes no float32 `[batch seq vocab]` array: the label's
  logit is gathered from the matmul's output (not from the float32 logits, whose gather made XLA
  write them out in float32), and with a cap the normaliser needs no maximum first (a capped logit
  lies in `[-cap, cap]`, so `exp(logit - cap)` cannot overflow), so XLA:TPU computes every
  reduction in the matmul's own output pass. benchmarks/README.md, "The LM head", has the bytes.
- `chunked_head_stats(h, table, labels, ...)` computes the head's matmul and the statistics one
  chunk of the vocabulary at a time in a scan, keeping only `[batch seq]` statistics; its backward
  pass (a `jax.custom_vjp`) recomputes each chunk's logits. It holds `[batch seq vocab / chunks]`
  logits at a time for one more head matmul per step (`model.num_vocab_tiling`).
"""

import functools
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

from equipax.core.mesh_config import TENSOR
from equipax.core.partition import constrain_batch_and_last

__all__ = ["chunked_head_stats", "HeadStats", "head_stats", "soft_cap"]


class HeadStats(NamedTuple):
    """Per-token statistics of the (capped) float32 logits, each `[*batch]` float32.

    `log_sum - label` is the cross-entropy, `log_sum + ref` the log-normaliser `logsumexp(logits)`.

    Attributes:
        ref: the number subtracted from every logit before the exponential: the row's largest
            logit, or the cap when the logits are capped (no gradient flows to it).
        log_sum: `log(sum(exp(logits - ref)))`.
        label: the label's logit minus `ref`.
        correct: 1.0 where the label's logit is the largest (a tie counts), else 0.0.
    """

    ref: Float[Array, "*batch"]
    log_sum: Float[Array, "*batch"]
    label: Float[Array, "*batch"]
    correct: Float[Array, "*batch"]


def soft_cap(x: Array, cap: float | None) -> Array:
    """`cap * tanh(x / cap)` (Pax's soft-capped logits); `x` itself when `cap` is None."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def pick_label(raw: Float[Array, "*batch vocab"], labels: Int[Array, "*batch"]) -> Float[Array, "*batch"]:
    """`raw[..., labels]` as a sum of `raw` where the vocabulary index equals the label: the same
    numbers as a gather (one term is not zero; adding zeros is exact), but its gradient is a
    select fused into the pass that writes the logits' gradient, where a gather's is a scatter
    into a zeroed `[*batch, vocab]` array that XLA:TPU lays out flat first: two copies of the
    logits (llama3_2_1b at seq 8192: 26 ms of a 703 ms step on the v5e, benchmarks/README.md)."""
    hit = jax.lax.broadcasted_iota(labels.dtype, raw.shape, raw.ndim - 1) == labels[..., None]
    # Summed in float32 (exact: one term), as the head's other sums are, so XLA:TPU computes it in
    # the same pass over the logits as their maximum and sum of exponentials.
    return jnp.sum(jnp.where(hit, raw.astype(jnp.float32), 0.0), axis=-1).astype(raw.dtype)


def head_stats(
    raw: Float[Array, "*batch vocab"], labels: Int[Array, "*batch"], cap: float | None, *, fused: bool = True
) -> HeadStats:
    """`HeadStats` of the logits `soft_cap(raw.astype(float32), cap)`.

    Arguments:
        raw: the head matmul's output, in the model's dtype (the float32 cast and the cap are
            applied here, inside the passes that read it).
        labels: each position's label in `[0, vocab)`.
        cap: the output logit cap, or None.
        fused: the form XLA:TPU fuses: the label's logit picked from `raw` (`pick_label`; a
            gather from the float32 logits makes XLA write them out), and with a cap the sums shifted by the cap,
            so no pass waits for the maximum. False: the label gathered from the float32 logits
            and the sums shifted by the maximum, the numbers the CPU golden tests recorded (the two
            differ in low bits).

    Returns:
        The statistics, float32.
    """
    logits = soft_cap(raw.astype(jnp.float32), cap)
    top = jax.lax.stop_gradient(jnp.max(logits, axis=-1))
    if not fused:
        shifted = logits - top[..., None]
        label = jnp.take_along_axis(shifted, labels[..., None], axis=-1)[..., 0]
        log_sum = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1))
        return HeadStats(top, log_sum, label, (label >= 0).astype(jnp.float32))
    label = soft_cap(pick_label(raw, labels).astype(jnp.float32), cap)
    correct = (label >= top).astype(jnp.float32)
    if cap is not None:  # a capped logit is at most `cap`: exp(logit - cap) <= 1 needs no maximum
        ref = jnp.full_like(top, cap)
        return HeadStats(ref, jnp.log(jnp.sum(jnp.exp(logits - cap), axis=-1)), label - cap, correct)
    return HeadStats(top, jnp.log(jnp.sum(jnp.exp(logits - top[..., None]), axis=-1)), label - top, correct)


def chunked_head_stats(
    h: Float[Array, "batch seq embed"],
    table: Float[Array, "vocab embed"] | Float[Array, "embed vocab"],
    labels: Int[Array, "batch seq"],
    *,
    cap: float | None,
    chunks: int,
    vocab_axis: int,
    mesh: Mesh | None = None,
) -> HeadStats:
    """`head_stats` of the logits `h @ table`, one chunk of the vocabulary at a time.

    Each chunk's logits `[batch seq vocab/chunks]` are computed, folded into running statistics
    (an online logsumexp: running maximum and rescaled sum; with a cap, the sum of
    `exp(logit - cap)`, which needs no maximum) and dropped; the backward pass recomputes them chunk
    by chunk and writes the table's gradient a chunk at a time. On a mesh whose `tensor` axis
    splits the vocabulary, each chunk takes an equal slice of every device's part, so no chunk
    moves between devices.

    Arguments:
        h: final hidden states, in the model's dtype (the matmul's dtype).
        table: the output projection, float32: the tied embedding `[vocab embed]`
            (`vocab_axis=0`) or an untied `[embed vocab]` kernel (`vocab_axis=1`); cast to `h`'s
            dtype a chunk at a time.
        labels: each position's label.
        cap: the output logit cap, or None.
        chunks: how many chunks; with the mesh's `tensor` size, must divide the vocabulary.
        vocab_axis: which axis of `table` is the vocabulary.
        mesh: the device mesh the chunk logits are pinned to (`constrain_batch_and_last`).

    Returns:
        The statistics, float32 `[batch seq]`; the gradient flows to `h` and `table` through
        `log_sum` and `label`.
    """
    vocab = table.shape[vocab_axis]
    groups = _vocab_groups(vocab, chunks, mesh)
    if chunks < 1 or vocab % (chunks * groups):
        raise ValueError(f"{chunks} vocabulary chunks do not divide the vocabulary of {vocab}.")
    stats = cast(tuple[Array, Array, Array, Array], _chunked(h, table, labels, cap, chunks, groups, vocab_axis, mesh))
    return HeadStats(*stats)


def _vocab_groups(vocab: int, chunks: int, mesh: Mesh | None) -> int:
    """The parts the vocabulary is split into over the mesh's `tensor` axis (1: none), as
    `constrain_batch_and_last` splits the logits."""
    tp = 1 if mesh is None else mesh.shape.get(TENSOR, 1)
    return tp if tp > 1 and vocab % (tp * chunks) == 0 else 1


def _split(table: Array, vocab_axis: int, chunks: int, groups: int) -> Array:
    """`table` with its vocabulary axis as `[groups, chunks, vocab / (groups * chunks)]` (a view)."""
    shape = table.shape
    vocab = shape[vocab_axis]
    sub = vocab // (groups * chunks)
    return table.reshape((*shape[:vocab_axis], groups, chunks, sub, *shape[vocab_axis + 1 :]))


def _chunk_table(table: Array, j: Array, vocab_axis: int, chunks: int, groups: int, dtype: Any) -> Array:
    """Chunk `j` of the table, `[vocab/chunks embed]` or `[embed vocab/chunks]`, in `dtype`: the
    `j`-th slice of each group, side by side."""
    split = _split(table, vocab_axis, chunks, groups)
    piece = jax.lax.dynamic_index_in_dim(split, j, axis=vocab_axis + 1, keepdims=False)
    shape = list(table.shape)
    shape[vocab_axis] //= chunks
    return piece.reshape(shape).astype(dtype)


def _label_place(labels: Array, vocab: int, chunks: int, groups: int) -> tuple[Array, Array]:
    """Each label's chunk and its column in that chunk's logits."""
    per, sub = vocab // groups, vocab // (groups * chunks)
    group, rest = labels // per, labels % per
    return rest // sub, group * sub + rest % sub


def _chunk_logits(h, table, j, cap, chunks, groups, vocab_axis, mesh):
    """Chunk `j`'s raw logits (model dtype) and capped float32 logits `[batch seq vocab/chunks]`."""
    w = _chunk_table(table, j, vocab_axis, chunks, groups, h.dtype)
    raw = constrain_batch_and_last(jnp.einsum("bse,ve->bsv" if vocab_axis == 0 else "bse,ev->bsv", h, w), mesh)
    return raw, soft_cap(raw.astype(jnp.float32), cap)


def _forward(h, table, labels, cap, chunks, groups, vocab_axis, mesh):
    label_chunk, label_col = _label_place(labels, table.shape[vocab_axis], chunks, groups)

    def body(carry, j):
        m, s, label, top = carry
        raw, z = _chunk_logits(h, table, j, cap, chunks, groups, vocab_axis, mesh)
        picked = jnp.take_along_axis(raw, label_col[..., None], axis=-1)[..., 0]
        label = jnp.where(label_chunk == j, soft_cap(picked.astype(jnp.float32), cap), label)
        chunk_top = jnp.max(z, axis=-1)
        top = jnp.maximum(top, chunk_top)
        if cap is not None:  # capped logits: exp(z - cap) <= 1, no maximum needed first
            s = s + jnp.sum(jnp.exp(z - cap), axis=-1)
        else:
            new_m = jnp.maximum(m, chunk_top)
            s = s * jnp.exp(m - new_m) + jnp.sum(jnp.exp(z - new_m[..., None]), axis=-1)
            m = new_m
        return (m, s, label, top), None

    zeros, low = jnp.zeros(labels.shape, jnp.float32), jnp.full(labels.shape, -jnp.inf, jnp.float32)
    init = (low if cap is None else jnp.full(labels.shape, cap, jnp.float32), zeros, zeros, low)
    (m, s, label, top), _ = jax.lax.scan(body, init, jnp.arange(chunks))
    return m, jnp.log(s), label - m, (label >= top).astype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _chunked(h, table, labels, cap, chunks, groups, vocab_axis, mesh):
    return _forward(h, table, labels, cap, chunks, groups, vocab_axis, mesh)


def _chunked_fwd(h, table, labels, cap, chunks, groups, vocab_axis, mesh):
    out = _forward(h, table, labels, cap, chunks, groups, vocab_axis, mesh)
    return out, (h, table, labels, out[0] + out[1])


def _chunked_bwd(cap, chunks, groups, vocab_axis, mesh, residuals, cts):
    h, table, labels, lse = residuals
    _, ct_log_sum, ct_label, _ = cts  # `ref` takes no gradient (it is a shift), `correct` has none
    label_chunk, label_col = _label_place(labels, table.shape[vocab_axis], chunks, groups)
    size = table.shape[vocab_axis] // chunks

    def body(dh, j):
        _, z = _chunk_logits(h, table, j, cap, chunks, groups, vocab_axis, mesh)
        cols = jax.lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 1)
        hit = (cols == label_col[..., None]) & (label_chunk == j)[..., None]
        g = ct_log_sum[..., None] * jnp.exp(z - lse[..., None]) + jnp.where(hit, ct_label[..., None], 0.0)
        if cap is not None:  # d(cap * tanh(x / cap)) / dx = 1 - (capped / cap)**2
            g = g * (1.0 - jnp.square(z / cap))
        g = constrain_batch_and_last(g.astype(h.dtype), mesh)
        w = _chunk_table(table, j, vocab_axis, chunks, groups, h.dtype)
        if vocab_axis == 0:
            dh = dh + jnp.einsum("bsv,ve->bse", g, w, preferred_element_type=jnp.float32)
            return dh, jnp.einsum("bsv,bse->ve", g, h).astype(table.dtype)
        dh = dh + jnp.einsum("bsv,ev->bse", g, w, preferred_element_type=jnp.float32)
        return dh, jnp.einsum("bsv,bse->ev", g, h).astype(table.dtype)

    dh, pieces = jax.lax.scan(body, jnp.zeros(h.shape, jnp.float32), jnp.arange(chunks))
    # pieces: [chunks, *pre, groups * sub, *post] -> the table's [*pre, groups, chunks, sub, *post]
    pre, post = table.shape[:vocab_axis], table.shape[vocab_axis + 1 :]
    pieces = pieces.reshape((chunks, *pre, groups, size // groups, *post))
    dtable = jnp.moveaxis(pieces, 0, vocab_axis + 1).reshape(table.shape)
    return dh.astype(h.dtype), dtable, None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)
