"""The router of a mixture-of-experts layer: top-k softmax routing (with DeepSeek-V3's balancing
bias), its auxiliary losses, and the stats a layer reports.

`equipax.core.nn.moe` (the feed-forward that dispatches the routed tokens to the experts) builds on
these and re-exports them; they live here so the dispatch and the routing each read on their own.
`load_balancing_loss` and `router_z_loss` are the plain definitions over one device's tokens;
`shard_stats` computes the same quantities from sums that a `shard_map` adds up over the batch axes
(tests/core/test_moe.py checks them against each other).
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from equipax.core.nn.mixed import einsum_f32

__all__ = [
    "Collectives",
    "MoEStats",
    "expert_capacity",
    "load_balancing_loss",
    "route",
    "router_logits",
    "router_z_loss",
    "shard_stats",
    "update_router_bias",
]


class MoEStats(NamedTuple):
    """What one MoE layer reports besides its output (a pytree: it comes out of a scan).

    aux_loss: the load-balancing loss (`load_balancing_loss`).
    z_loss: the router z-loss (`router_z_loss`).
    tokens_per_expert: assignments routed to each expert, `[experts]` (before any drop).
    dropped: assignments dropped for capacity (0 when dropless).
    """

    aux_loss: Float[Array, ""]
    z_loss: Float[Array, ""]
    tokens_per_expert: Float[Array, " experts"]
    dropped: Float[Array, ""]


def expert_capacity(seq_len: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Assignments each expert takes per sequence: `ceil(capacity_factor * seq * top_k / experts)`.

    Arguments:
        seq_len: tokens per sequence.
        num_experts: experts in the layer.
        top_k: experts per token.
        capacity_factor: 1.0 = an even share of the assignments; more leaves slack.

    Returns:
        The capacity (at least 1).
    """
    return max(1, math.ceil(capacity_factor * seq_len * top_k / num_experts))


def route(
    logits: Float[Array, "tokens experts"],
    top_k: int,
    *,
    norm_topk_prob: bool,
    bias: Float[Array, " experts"] | None = None,
) -> tuple[Float[Array, "tokens top_k"], Int[Array, "tokens top_k"], Float[Array, "tokens experts"]]:
    """Top-k softmax routing.

    Arguments:
        logits: router logits.
        top_k: experts per token.
        norm_topk_prob: renormalise the `top_k` probabilities to sum to 1 (Mixtral, Qwen3-MoE).
        bias: per-expert biases added to the probabilities for choosing the experts only (the
            auxiliary-loss-free balancing of DeepSeek-V3); the combine weights are the unbiased
            probabilities. None: no bias.

    Returns:
        `(weights, experts, probs)`: each token's combine weights and experts, largest first,
        and the softmax over all experts (float32).
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    if bias is None:
        weights, experts = jax.lax.top_k(probs, top_k)
    else:
        _, experts = jax.lax.top_k(probs + jax.lax.stop_gradient(bias).astype(jnp.float32)[None], top_k)
        weights = jnp.take_along_axis(probs, experts, axis=-1)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts, probs


def update_router_bias(
    bias: Float[Array, "*layers experts"], load: Float[Array, "*layers experts"], rate: float
) -> Float[Array, "*layers experts"]:
    """DeepSeek-V3's auxiliary-loss-free balancing step: each expert's routing bias moves by `rate`
    towards balance, `+rate` if it got fewer assignments (`load`, the step's
    `MoEStats.tokens_per_expert`) than the mean of its layer, `-rate` if more, 0 if exactly the mean."""
    mean = jnp.mean(load, axis=-1, keepdims=True)
    return bias + rate * jnp.sign(mean - load).astype(bias.dtype)


def load_balancing_loss(probs: Float[Array, "tokens experts"], experts: Int[Array, "tokens top_k"]) -> Float[Array, ""]:
    """Switch Transformer's load-balancing loss as Mixtral defines it: `E * sum_e f_e * P_e`.

    `f_e` is the number of assignments (over all `top_k` choices) routed to expert `e` divided
    by the number of tokens, `P_e` the mean router probability of `e`. Perfectly even routing
    gives `top_k`.

    Arguments:
        probs: the router's softmax over all experts.
        experts: each token's chosen experts.

    Returns:
        The loss (float32 scalar).
    """
    num_experts = probs.shape[-1]
    f = jnp.mean(jnp.sum(jax.nn.one_hot(experts, num_experts, dtype=jnp.float32), axis=1), axis=0)
    return num_experts * jnp.sum(f * jnp.mean(probs, axis=0))


def router_z_loss(logits: Float[Array, "tokens experts"]) -> Float[Array, ""]:
    """ST-MoE's router z-loss: the mean over tokens of `logsumexp(logits) ** 2`.

    Arguments:
        logits: router logits.

    Returns:
        The loss (float32 scalar).
    """
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)))


def router_logits(
    x: Float[Array, "tokens embed"], router: Float[Array, "embed experts"]
) -> Float[Array, "tokens experts"]:
    """The router's logits in float32 (the matmul in the activations' dtype, accumulated in f32)."""
    return einsum_f32("td,de->te", x, router.astype(x.dtype))


class Collectives(NamedTuple):
    """The collectives of one shard's MoE computation inside a `shard_map` (all None: one device).

    expert: the mesh axis the experts (and the tokens) are split over.
    batch: the mesh axes the tokens are split over (the stats are summed over them).
    """

    expert: str | None = None
    batch: tuple[str, ...] = ()


def shard_stats(logits: Array, probs: Array, experts: Array, dropped: Array, comm: Collectives) -> MoEStats:
    """The stats from sums over this shard's tokens, added up over the batch axes first."""
    counts = jnp.sum(jax.nn.one_hot(experts, probs.shape[-1], dtype=jnp.float32), axis=(0, 1))
    sums = (
        counts,
        jnp.sum(probs, axis=0),
        jnp.sum(jnp.square(jax.nn.logsumexp(logits, axis=-1))),
        jnp.asarray(logits.shape[0], jnp.float32),
        dropped.astype(jnp.float32),
    )
    if comm.batch:
        sums = jax.lax.psum(sums, comm.batch)
    counts, prob_sum, z_sum, tokens, dropped = sums
    aux = probs.shape[-1] * jnp.sum((counts / tokens) * (prob_sum / tokens))
    return MoEStats(aux, z_sum / tokens, counts, dropped)
