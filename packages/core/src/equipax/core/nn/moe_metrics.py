"""What a mixture of experts adds to an LM's training loss and metrics (docs/moe.md): the weighted
router losses and the per-step router metrics, from the stack's per-layer `MoEStats`."""

import jax.numpy as jnp
from jaxtyping import Array, Float

from equipax.core.nn.moe import MoEStats

__all__ = ["moe_loss_and_metrics"]


def moe_loss_and_metrics(
    stats: MoEStats, *, aux_loss_coef: float, z_loss_coef: float
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """The weighted auxiliary terms of the training loss, and the metrics a step reports.

    Arguments:
        stats: the stack's stats, each with a leading layer axis (`TransformerStack.forward`).
        aux_loss_coef: weight of the load-balancing loss (`router_aux_loss_coef`).
        z_loss_coef: weight of the router z-loss (`router_z_loss_coef`).

    Returns:
        `(aux_loss_coef * aux + z_loss_coef * z, metrics)` with aux and z averaged over the
        layers; the metrics are scalars: `moe_aux_loss`, `moe_z_loss` (unweighted layer means),
        `moe_dropped_fraction` (dropped / routed assignments, all layers), `moe_load_max` (the
        busiest expert's assignments over the even share, averaged over layers: 1 = balanced)
        and `moe_expert_<e>_tokens` (assignments routed to expert e, mean over layers).
    """
    aux, z = jnp.mean(stats.aux_loss), jnp.mean(stats.z_loss)
    counts = stats.tokens_per_expert  # [layers experts]
    routed = jnp.sum(counts, axis=-1)
    even = routed / counts.shape[-1]
    metrics = {
        "moe_aux_loss": aux,
        "moe_z_loss": z,
        "moe_dropped_fraction": jnp.sum(stats.dropped) / jnp.maximum(jnp.sum(routed), 1.0),
        "moe_load_max": jnp.mean(jnp.max(counts, axis=-1) / jnp.maximum(even, 1e-9)),
    }
    width = len(str(counts.shape[-1] - 1))
    mean_counts = jnp.mean(counts, axis=0)
    metrics |= {f"moe_expert_{e:0{width}d}_tokens": mean_counts[e] for e in range(counts.shape[-1])}
    return aux_loss_coef * aux + z_loss_coef * z, metrics
