"""Mixture-of-experts feed-forward: a top-k softmax router, SwiGLU experts, dropless (grouped
matmuls) or capacity-factor dispatch, and the router's auxiliary losses.

Each token goes to the `top_k` experts with the largest router probabilities; its output is the
sum of those experts' outputs weighted by their probabilities, renormalised over the `top_k`
(`norm_topk_prob`, as Mixtral and Qwen3-MoE do). Two dispatches compute it:

- `"dropless"`: the token-expert assignments are sorted by expert and every expert multiplies its
  contiguous rows (`jax.lax.ragged_dot`, a grouped matmul); no token is dropped.
- `"capacity"` (`capacity_factor` set): each expert takes at most
  `ceil(capacity_factor * seq * top_k / num_experts)` assignments per sequence, in token order
  (earlier tokens first, a token's choices in rank order); the rest are dropped (they add nothing
  to the token's output, which keeps its residual) and counted. The experts then run as one
  batched matmul over an `[experts, capacity]` buffer (static shapes, what expert parallelism
  exchanges). Capacity is counted per sequence, so which tokens drop does not depend on the mesh.

`moe_feed_forward` is the fast kernel; `reference_moe_feed_forward` (same signature) loops over the
experts, runs every token through each and keeps the routed ones: the slow, obvious definition
both dispatches are tested against (forward and gradients, every expert checked on its own).
"""

import math
from typing import Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, Int, PRNGKeyArray

from equipax.core.nn.linear import fan_in_init
from equipax.core.nn.mixed import einsum_f32
from equipax.core.nn.mlp import Activation, FeedForward
from equipax.core.partition import Axes

__all__ = [
    "MoEFeedForward",
    "MoEStats",
    "expert_capacity",
    "load_balancing_loss",
    "moe_feed_forward",
    "reference_moe_feed_forward",
    "route",
    "router_z_loss",
]

_ACTIVATIONS = {"gelu": jax.nn.gelu, "relu": jax.nn.relu, "silu": jax.nn.silu}
Dispatch = Literal["dropless", "capacity"]


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
    logits: Float[Array, "tokens experts"], top_k: int, *, norm_topk_prob: bool
) -> tuple[Float[Array, "tokens top_k"], Int[Array, "tokens top_k"], Float[Array, "tokens experts"]]:
    """Top-k softmax routing.

    Arguments:
        logits: router logits.
        top_k: experts per token.
        norm_topk_prob: renormalise the `top_k` probabilities to sum to 1 (Mixtral, Qwen3-MoE).

    Returns:
        `(weights, experts, probs)`: each token's combine weights and experts, largest first,
        and the softmax over all experts (float32).
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts, probs


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


def _router_logits(x: Array, router: Array) -> Array:
    return einsum_f32("td,de->te", x, router.astype(x.dtype))


def _stats(logits: Array, probs: Array, experts: Array, dropped: Array) -> MoEStats:
    counts = jnp.sum(jax.nn.one_hot(experts, probs.shape[-1], dtype=jnp.float32), axis=(0, 1))
    return MoEStats(load_balancing_loss(probs, experts), router_z_loss(logits), counts, dropped.astype(jnp.float32))


def _sort_by_expert(flat: Array, num_experts: int) -> tuple[Array, Array, Array]:
    """`(order, group_sizes, rank)`: a stable sort of the flat assignments by expert, each
    expert's count, and each assignment's rank among those of its expert (token order)."""
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=num_experts)
    starts = jnp.cumsum(sizes) - sizes
    rank = jnp.zeros_like(flat).at[order].set(jnp.arange(flat.shape[0]) - starts[flat[order]])
    return order, sizes, rank


def _dropless(x: Array, experts: Array, weights: Array, gate: Array, up: Array, down: Array, act) -> Array:
    """Grouped-matmul experts over the assignments sorted by expert; `x` is `[tokens embed]`."""
    tokens, top_k = experts.shape
    flat = experts.reshape(-1)
    order, sizes, _ = _sort_by_expert(flat, gate.shape[0])
    xs = x[order // top_k]
    h = act(jax.lax.ragged_dot(xs, gate.astype(x.dtype), sizes)) * jax.lax.ragged_dot(xs, up.astype(x.dtype), sizes)
    ys = jax.lax.ragged_dot(h, down.astype(x.dtype), sizes)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0]))
    y = ys[inverse].reshape(tokens, top_k, -1)
    return jnp.sum(y * weights.astype(x.dtype)[..., None], axis=1)


def _with_capacity(
    x: Array, experts: Array, weights: Array, gate: Array, up: Array, down: Array, act, capacity: int
) -> tuple[Array, Array]:
    """One sequence through `[experts, capacity]` buffers; returns `(output, assignments dropped)`."""
    tokens, top_k = experts.shape
    num_experts = gate.shape[0]
    flat = experts.reshape(-1)
    _, _, rank = _sort_by_expert(flat, num_experts)
    keep = rank < capacity
    # Dropped assignments point one past the buffer: the scatter skips them, the gather fills 0.
    slot = jnp.where(keep, flat * capacity + rank, num_experts * capacity)
    src = x[jnp.arange(flat.shape[0]) // top_k]
    buf = jnp.zeros((num_experts * capacity, x.shape[-1]), x.dtype).at[slot].set(src, mode="drop")
    buf = buf.reshape(num_experts, capacity, -1)
    h = act(jnp.einsum("ecd,edh->ech", buf, gate.astype(x.dtype))) * jnp.einsum("ecd,edh->ech", buf, up.astype(x.dtype))
    out = jnp.einsum("ech,ehd->ecd", h, down.astype(x.dtype)).reshape(num_experts * capacity, -1)
    y = jnp.take(out, slot, axis=0, mode="fill", fill_value=0).reshape(tokens, top_k, -1)
    return jnp.sum(y * weights.astype(x.dtype)[..., None], axis=1), jnp.sum(~keep)


def moe_feed_forward(
    x: Float[Array, "batch seq embed"],
    router: Float[Array, "embed experts"],
    gate: Float[Array, "experts embed hidden"],
    up: Float[Array, "experts embed hidden"],
    down: Float[Array, "experts hidden embed"],
    *,
    top_k: int,
    norm_topk_prob: bool = True,
    capacity_factor: float | None = None,
    activation: Activation = "silu",
) -> tuple[Float[Array, "batch seq embed"], MoEStats]:
    """The MoE feed-forward, fast path: `sum_k w_k * down_e(act(gate_e x) * up_e x)` over each
    token's top-k experts `e`.

    Arguments:
        x: inputs.
        router: the router's kernel (logits = `x @ router`, computed in float32).
        gate, up, down: the experts' gated-MLP kernels.
        top_k: experts per token.
        norm_topk_prob: renormalise each token's top-k probabilities to sum to 1.
        capacity_factor: None = dropless (grouped matmuls); else each expert takes at most
            `expert_capacity(seq, experts, top_k, capacity_factor)` assignments per sequence.
        activation: the experts' nonlinearity (SwiGLU: "silu").

    Returns:
        `(outputs in x.dtype, MoEStats)`.
    """
    b, s, d = x.shape
    act = _ACTIVATIONS[activation]
    tokens = x.reshape(b * s, d)
    logits = _router_logits(tokens, router)
    weights, experts, probs = route(logits, top_k, norm_topk_prob=norm_topk_prob)
    if capacity_factor is None:
        y = _dropless(tokens, experts, weights, gate, up, down, act)
        dropped = jnp.zeros((), jnp.int32)
    else:
        capacity = expert_capacity(s, gate.shape[0], top_k, capacity_factor)
        per_seq = jax.vmap(lambda xs, es, ws: _with_capacity(xs, es, ws, gate, up, down, act, capacity))
        y, dropped_per_seq = per_seq(x, experts.reshape(b, s, top_k), weights.reshape(b, s, top_k))
        dropped = jnp.sum(dropped_per_seq)
    return y.reshape(b, s, d), _stats(logits, probs, experts, dropped)


def reference_moe_feed_forward(
    x: Float[Array, "batch seq embed"],
    router: Float[Array, "embed experts"],
    gate: Float[Array, "experts embed hidden"],
    up: Float[Array, "experts embed hidden"],
    down: Float[Array, "experts hidden embed"],
    *,
    top_k: int,
    norm_topk_prob: bool = True,
    capacity_factor: float | None = None,
    activation: Activation = "silu",
) -> tuple[Float[Array, "batch seq embed"], MoEStats]:
    """Slow, obvious MoE feed-forward (same arguments as `moe_feed_forward`): a loop over the
    experts runs every token through each one, weighted by the token's routing weight for it
    (0 if not routed there, or dropped for capacity: the first `capacity` assignments of each
    sequence in token order are kept, counted with a cumulative sum)."""
    b, s, d = x.shape
    act = _ACTIVATIONS[activation]
    num_experts = gate.shape[0]
    logits = jnp.einsum("bsd,de->bse", x.astype(jnp.float32), router.astype(jnp.float32))
    probs = jax.nn.softmax(logits, axis=-1)
    # The top-k by a full descending sort (the fast path uses lax.top_k).
    experts = jnp.argsort(-probs, axis=-1)[..., :top_k]
    weights = jnp.take_along_axis(probs, experts, axis=-1)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    y = jnp.zeros((b, s, d), jnp.float32)
    dropped = jnp.zeros((), jnp.int32)
    for e in range(num_experts):
        chosen = experts == e  # [b s k]
        if capacity_factor is not None:
            capacity = expert_capacity(s, num_experts, top_k, capacity_factor)
            position = jnp.cumsum(chosen.reshape(b, s * top_k), axis=1).reshape(b, s, top_k) - 1
            kept = chosen & (position < capacity)
            dropped = dropped + jnp.sum(chosen & ~kept)
            chosen = kept
        w = jnp.sum(jnp.where(chosen, weights, 0.0), axis=-1)  # [b s]
        xf = x.astype(jnp.float32)
        h = act(xf @ gate[e].astype(jnp.float32)) * (xf @ up[e].astype(jnp.float32))
        y = y + w[..., None] * (h @ down[e].astype(jnp.float32))
    flat_logits, flat_probs = logits.reshape(b * s, -1), probs.reshape(b * s, -1)
    return y.astype(x.dtype), _stats(flat_logits, flat_probs, experts.reshape(b * s, top_k), dropped)


class MoEFeedForward(eqx.Module):
    """A mixture-of-experts feed-forward layer with optional shared (always-on) experts.

    Returns `(outputs, MoEStats)`: the block adds the weighted auxiliary losses to the task loss.
    """

    router: Float[Array, "embed experts"]
    gate: Float[Array, "experts embed hidden"]
    up: Float[Array, "experts embed hidden"]
    down: Float[Array, "experts hidden embed"]
    shared: FeedForward | None
    top_k: int = eqx.field(static=True)
    norm_topk_prob: bool = eqx.field(static=True)
    capacity_factor: float | None = eqx.field(static=True)
    activation: Activation = eqx.field(static=True)

    def __init__(
        self,
        model_dims: int,
        hidden_dims: int,
        num_experts: int,
        top_k: int,
        *,
        norm_topk_prob: bool = True,
        capacity_factor: float | None = None,
        shared_hidden_dims: int = 0,
        activation: Activation = "silu",
        key: PRNGKeyArray,
    ) -> None:
        """Arguments:
        model_dims: input and output width.
        hidden_dims: each expert's hidden width (Hugging Face's `moe_intermediate_size`).
        num_experts: routed experts.
        top_k: experts per token (`num_experts_per_tok`), at most `num_experts`.
        norm_topk_prob: renormalise each token's top-k probabilities.
        capacity_factor: None = dropless; else the per-sequence capacity factor (> 0).
        shared_hidden_dims: hidden width of a shared gated MLP every token also goes through
            (DeepSeek's shared experts); 0 = none.
        activation: the experts' nonlinearity.
        key: PRNG key.
        """
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be None (dropless) or > 0, got {capacity_factor}")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
        k_router, k_gate, k_up, k_down, k_shared = jr.split(key, 5)
        self.router = fan_in_init(k_router, (model_dims, num_experts), in_axes=(0,))
        self.gate = fan_in_init(k_gate, (num_experts, model_dims, hidden_dims), in_axes=(1,))
        self.up = fan_in_init(k_up, (num_experts, model_dims, hidden_dims), in_axes=(1,))
        self.down = fan_in_init(k_down, (num_experts, hidden_dims, model_dims), in_axes=(1,))
        self.shared = (
            FeedForward(model_dims, shared_hidden_dims, activation=activation, gated=True, key=k_shared)
            if shared_hidden_dims
            else None
        )
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.capacity_factor = capacity_factor
        self.activation = activation

    def logical_axes(self) -> dict[str, Axes]:
        """Experts on the `expert` axis; the experts' MLPs split like the dense MLP's."""
        return {
            "router": ("embed", None),
            "gate": ("expert", "embed", "hidden"),
            "up": ("expert", "embed", "hidden"),
            "down": ("expert", "hidden", "embed"),
        }

    def __call__(self, x: Float[Array, "batch seq embed"]) -> tuple[Float[Array, "batch seq embed"], MoEStats]:
        """Apply the layer.

        Arguments:
            x: inputs.

        Returns:
            `(outputs of the same shape and dtype, MoEStats)`.
        """
        y, stats = moe_feed_forward(
            x,
            self.router,
            self.gate,
            self.up,
            self.down,
            top_k=self.top_k,
            norm_topk_prob=self.norm_topk_prob,
            capacity_factor=self.capacity_factor,
            activation=self.activation,
        )
        return (y if self.shared is None else y + self.shared(x)), stats
