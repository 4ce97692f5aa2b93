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

The sharding rules are the same as the GSPMD path's (`equipax.core.partition`), and the
numbers agree with it (tests/models/test_sharding.py).
"""

from typing import Any

import equinox as eqx
import jax
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import Array, Float

from equipax.core.mesh import BATCH_AXES, FSDP, TENSOR

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


def shard_map_block(block: eqx.Module, x: Float[Array, "batch seq embed"], mesh: Mesh) -> Float[Array, "batch seq embed"]:
    """Apply a pre-LN TransformerBlock with explicit FSDP + tensor-parallel collectives.

    Arguments:
        block: a `TransformerBlock` (one layer's parameters, sharded by the partition rules).
        x: activations, batch split over (data, fsdp).
        mesh: the device mesh with axes (data, fsdp, tensor).

    Returns:
        The block's output, sharded like `x`.
    """
    from equipax.core.partition import param_specs

    params, static = eqx.partition(block, eqx.is_array)
    specs = param_specs(params, mesh)
    batch_axes = tuple(a for a in BATCH_AXES if a in mesh.shape)
    x_spec = P(batch_axes, None, None)
    has_tensor = TENSOR in mesh.shape and mesh.shape[TENSOR] > 1

    def local(params, x):
        blk = eqx.combine(_gather_fsdp(params, specs), static)
        attn, ffn = blk.attention, blk.ffn  # pyright: ignore[reportAttributeAccessIssue]
        if has_tensor and (attn.out_bias is not None or ffn.down.bias is not None):
            raise ValueError(
                "tensor_parallel='shard_map' does not support output biases (each tensor shard "
                "would add them once); set use_bias=False or use tensor_parallel='gspmd'."
            )
        # Attention over this device's heads; the output projection yields a partial sum.
        y = attn(blk.atten_norm(x))  # pyright: ignore[reportAttributeAccessIssue]
        if has_tensor:
            y = jax.lax.psum(y, TENSOR)  # all-reduce of the row-split output projection
        x = x + y
        # MLP over this device's hidden units; the down projection yields a partial sum.
        y = ffn(blk.ffn_norm(x))  # pyright: ignore[reportAttributeAccessIssue]
        if has_tensor:
            y = jax.lax.psum(y, TENSOR)  # all-reduce of the row-split down projection
        return x + y

    return jax.shard_map(local, mesh=mesh, in_specs=(specs, x_spec), out_specs=x_spec)(params, x)
