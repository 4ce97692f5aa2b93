"""A transformer block with its collectives written out (`jax.shard_map`), Megatron style.

The GSPMD path lets XLA insert collectives from the parameter shardings; this path spells
them out, so what crosses the interconnect is visible in the code:

- FSDP: weights arrive sharded over `fsdp` on their embed dimension; each is all-gathered
  over `fsdp` right before use (its gradient is reduce-scattered by the transpose of the
  all-gather, which AD derives).
- Tensor parallelism: QKV and MLP-up weights are column-split over `tensor` (each device
  holds whole heads / a slice of the hidden units), so attention and the MLP activation need
  no communication; the output and MLP-down projections are row-split, each device produces a
  partial sum, and one `psum` over `tensor` per sub-layer completes it.
- The batch is split over (data, fsdp); activations are replicated over `tensor`.
- Context parallelism: with a `context` axis the sequence is split over it too, each device's
  slots carry their global positions (`sequence_index`), and attention exchanges keys and values
  over `context` inside this shard_map (`equipax.core.nn.context_parallel`).

The sharding rules are the same as the GSPMD path's (`equipax.core.partition`), and the
numbers agree with it (tests/models/test_sharding.py).
"""

from typing import Any

import equinox as eqx
import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from equipax.core.mesh import BATCH_AXES, CONTEXT, FSDP, TENSOR
from equipax.core.nn.context_parallel import slot_index

__all__ = ["shard_map_block"]


def _gather_fsdp(params: Any, specs: Any) -> Any:
    """All-gather every weight dimension sharded over `fsdp` (FSDP's just-in-time gather)."""

    def gather(w, spec):
        if w is None or spec is None:
            return w
        for dim, axis in enumerate(spec):
            if axis == FSDP:
                # all-gather: [.., embed/fsdp, ..] -> [.., embed, ..] on every fsdp peer.
                w = jax.lax.all_gather(w, FSDP, axis=dim, tiled=True)
        return w

    return jax.tree.map(gather, params, specs, is_leaf=lambda x: x is None)


def shard_map_block(
    block: eqx.Module,
    x: Float[Array, "batch seq embed"],
    mesh: Mesh,
    *,
    segment_ids: Int[Array, "batch seq"] | None = None,
    rotary: Any = None,
    sequence_index: Int[Array, "batch seq"] | None = None,
) -> Float[Array, "batch seq embed"]:
    """Apply a pre-norm TransformerBlock with explicit FSDP + tensor-parallel collectives.

    The block's own forward pass runs on each device's heads and hidden units; its `reduce` hook
    all-reduces each sub-layer's partial sum over `tensor` before the residual add.

    Arguments:
        block: a `TransformerBlock` (one layer's parameters, sharded by the partition rules).
        x: activations, batch split over (data, fsdp).
        mesh: the device mesh with axes (data, fsdp, tensor).
        segment_ids: packed sequences (split over the batch like `x`).
        rotary: `(sin, cos)` of each token's position (split over the batch like `x`), or None.
        sequence_index: each slot's index in its unsplit row (a context-parallel layout); with a
            `context` axis None means 0 .. seq-1.

    Returns:
        The block's output, sharded like `x`.
    """
    from equipax.core.partition import param_specs

    params, static = eqx.partition(block, eqx.is_array)
    specs = param_specs(params, mesh)
    batch_axes = tuple(a for a in BATCH_AXES if a in mesh.shape)
    cp = mesh.shape.get(CONTEXT, 1)
    seq = CONTEXT if cp > 1 else None
    x_spec, row_spec = P(batch_axes, seq, None), P(batch_axes, seq)
    tp = mesh.shape.get(TENSOR, 1)
    if tp > 1:
        _check_divisible(block, tp)
    if cp > 1:  # each device's slots need their global positions
        sequence_index = slot_index(x, sequence_index)

    def local(params, x, segment_ids, rotary, sequence_index):
        blk = eqx.combine(_gather_fsdp(params, specs), static)
        # The row-split output and down projections yield partial sums: all-reduce each.
        reduce = (lambda y: jax.lax.psum(y, TENSOR)) if tp > 1 else None
        context = dict(mesh=mesh, sequence_index=sequence_index) if cp > 1 else {}
        y, _, _ = blk(x, segment_ids, rotary=rotary, reduce=reduce, **context)  # pyright: ignore[reportCallIssue]
        return y

    rot_spec = P() if rotary is None else (x_spec, x_spec)
    seg_spec = P() if segment_ids is None else row_spec
    index_spec = P() if sequence_index is None else row_spec
    return jax.shard_map(local, mesh=mesh, in_specs=(specs, x_spec, seg_spec, rot_spec, index_spec), out_specs=x_spec)(
        params, x, segment_ids, rotary, sequence_index
    )


def _check_divisible(block: Any, tp: int) -> None:
    """Raise ValueError for a block whose heads or hidden units do not split over `tensor` (each
    device's partial sum would then repeat whole heads), or that has output biases."""
    attn, ffn = block.attention, block.ffn
    knob = "model.transformer"
    if attn.out_bias is not None or ffn.down.bias is not None:
        raise ValueError(
            "tensor_parallel='shard_map' does not support output biases (each tensor shard "
            f"would add them once); set {knob}.use_bias=False or {knob}.tensor_parallel='gspmd'."
        )
    for name, count in (
        ("num_heads", attn.num_heads),
        ("num_kv_heads", attn.num_kv_heads),
        ("hidden_dims", ffn.down.in_features),
    ):
        if count % tp:
            raise ValueError(
                f"tensor_parallel='shard_map' splits {knob}.{name}={count} over the {tp} devices of the "
                f"`tensor` axis, which does not divide it; use {knob}.tensor_parallel='gspmd' (it "
                "replicates what does not split) or a `tensor` axis that divides it."
            )
