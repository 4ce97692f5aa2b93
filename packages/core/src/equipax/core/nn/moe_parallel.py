"""Expert parallelism: a mixture-of-experts layer over the `expert` mesh axis, its collectives
written out in a `jax.shard_map` (docs/moe.md).

The experts are split over `expert` (each device holds `num_experts / ep` of them, by the
`("expert", "expert")` logical-axis rule), and so is the batch (`expert` is one of the batch
axes). Each device routes its own tokens, then (`equipax.core.nn.moe.moe_shard`):

- with a capacity factor, fills `[experts capacity]` buffers for its sequences and exchanges them
  with one all-to-all over `expert` (each device receives its experts' rows from every device of
  its group), runs its experts, and returns the results with a second all-to-all;
- dropless, all-gathers its group's tokens and routing, runs its experts on their rows (grouped
  matmuls) and reduce-scatters the partial sums back to the tokens' devices.

The rest composes as the tensor-parallel block does (`equipax.core.nn.tensor_parallel`): weights
sharded over `fsdp` are all-gathered before use, expert hidden units split over `tensor` give
partial sums that one `psum` over `tensor` completes, and the router's statistics are summed over
the batch axes, so the layer's output, losses and gradients equal one device's (tests/models/
test_moe_parallel.py).
"""

from typing import Any

import equinox as eqx
import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float

from equipax.core.mesh import BATCH_AXES, EXPERT, TENSOR
from equipax.core.nn.moe import Collectives, MoEFeedForward, MoEStats
from equipax.core.nn.tensor_parallel import _gather_fsdp  # pyright: ignore[reportPrivateUsage]

__all__ = ["apply_moe", "expert_parallel_moe"]


def _split_over_tensor(spec: Any) -> bool:
    return spec is not None and TENSOR in tuple(spec)


def apply_moe(
    layer: MoEFeedForward, x: Float[Array, "batch seq embed"], mesh: Mesh | None = None
) -> tuple[Float[Array, "batch seq embed"], MoEStats]:
    """`layer(x)`: expert-parallel (`expert_parallel_moe`) on a mesh whose `expert` axis is > 1, else
    as on one device (GSPMD places any other collectives).

    Arguments:
        layer: the MoE layer.
        x: activations.
        mesh: the device mesh, or None.

    Returns:
        `(outputs, MoEStats)`.
    """
    if mesh is not None and mesh.shape.get(EXPERT, 1) > 1:
        return expert_parallel_moe(layer, x, mesh)
    return layer(x)


def expert_parallel_moe(
    layer: MoEFeedForward, x: Float[Array, "batch seq embed"], mesh: Mesh
) -> tuple[Float[Array, "batch seq embed"], MoEStats]:
    """Apply `layer` with its experts split over `mesh`'s `expert` axis.

    Arguments:
        layer: the MoE layer (one block's parameters, sharded by the partition rules).
        x: activations, batch split over the batch axes (`expert` among them).
        mesh: the device mesh, with an `expert` axis that divides `layer`'s experts.

    Returns:
        `(outputs sharded like x, MoEStats replicated)`: the numbers of `layer(x)` on one device.

    Raises:
        ValueError: the `expert` axis does not divide the number of experts.
    """
    from equipax.core.partition import param_specs

    num_experts, ep = layer.gate.shape[0], mesh.shape[EXPERT]
    if num_experts % ep:
        raise ValueError(
            f"model.transformer.num_experts={num_experts} cannot be split over the {ep} devices of the "
            f"`expert` mesh axis; use an `expert` axis that divides {num_experts}."
        )
    params, static = eqx.partition(layer, eqx.is_array)
    specs = param_specs(params, mesh)
    batch = tuple(a for a in BATCH_AXES if a in mesh.shape)
    x_spec = P(batch, None, None)
    routed_split = _split_over_tensor(specs.down)
    shared_split = layer.shared is not None and _split_over_tensor(specs.shared.down.weight)

    def local(params: MoEFeedForward, x: Array) -> tuple[Array, MoEStats]:
        lyr = eqx.combine(_gather_fsdp(params, specs), static)
        y, stats = lyr.routed(x, num_experts=num_experts, comm=Collectives(expert=EXPERT, batch=batch))
        if routed_split:  # each device's hidden units gave a partial sum
            y = jax.lax.psum(y, TENSOR)
        if lyr.shared is not None:
            shared = lyr.shared(x)
            y = y + (jax.lax.psum(shared, TENSOR) if shared_split else shared)
        return y, stats

    return jax.shard_map(local, mesh=mesh, in_specs=(specs, x_spec), out_specs=(x_spec, P()))(params, x)
