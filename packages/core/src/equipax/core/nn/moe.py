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
The router (`route`, its losses, `MoEStats`) is `equipax.core.nn.router`, re-exported here.
"""

from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray

from equipax.core.nn.linear import fan_in_init
from equipax.core.nn.mlp import Activation, FeedForward
from equipax.core.nn.router import (
    Collectives,
    MoEStats,
    expert_capacity,
    load_balancing_loss,
    route,
    router_logits,
    router_z_loss,
    shard_stats,
    update_router_bias,
)
from equipax.core.partition import Axes

__all__ = [
    "Collectives",
    "MoEFeedForward",
    "MoEStats",
    "expert_capacity",
    "load_balancing_loss",
    "moe_feed_forward",
    "moe_shard",
    "reference_moe_feed_forward",
    "route",
    "router_z_loss",
    "update_router_bias",
]

_ACTIVATIONS = {"gelu": jax.nn.gelu, "relu": jax.nn.relu, "silu": jax.nn.silu}
Dispatch = Literal["dropless", "capacity"]


def _sort_by_expert(flat: Array, num_experts: int) -> tuple[Array, Array, Array]:
    """`(order, group_sizes, rank)`: a stable sort of the flat assignments by expert, each
    expert's count, and each assignment's rank among those of its expert (token order)."""
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=num_experts)
    starts = jnp.cumsum(sizes) - sizes
    rank = jnp.zeros_like(flat).at[order].set(jnp.arange(flat.shape[0]) - starts[flat[order]])
    return order, sizes, rank


def _dropless(
    x: Array, experts: Array, weights: Array, gate: Array, up: Array, down: Array, act, num_experts: int, first: Array
) -> Array:
    """Grouped matmuls over the assignments sorted by expert; `x` is `[tokens embed]`.

    `gate`, `up`, `down` hold the experts `first ..` (all of them on one device): the rows of
    those experts are rotated to the front, and the rows after their groups (other devices'
    experts) come out of `ragged_dot` as zeros, so the result is this shard's partial sum."""
    tokens, top_k = experts.shape
    order, sizes, _ = _sort_by_expert(experts.reshape(-1), num_experts)
    xs = x[order // top_k]
    local = gate.shape[0]
    shift = jnp.sum(jnp.where(jnp.arange(num_experts) < first, sizes, 0))
    if local < num_experts:
        sizes = jax.lax.dynamic_slice_in_dim(sizes, first, local)
        xs = jnp.roll(xs, -shift, axis=0)
    h = act(jax.lax.ragged_dot(xs, gate.astype(x.dtype), sizes)) * jax.lax.ragged_dot(xs, up.astype(x.dtype), sizes)
    ys = jax.lax.ragged_dot(h, down.astype(x.dtype), sizes)
    if local < num_experts:
        ys = jnp.roll(ys, shift, axis=0)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0]))
    y = ys[inverse].reshape(tokens, top_k, -1)
    return jnp.sum(y * weights.astype(x.dtype)[..., None], axis=1)


def _dispatch(x: Array, experts: Array, num_experts: int, capacity: int) -> tuple[Array, Array]:
    """One sequence's `[experts capacity embed]` buffer and each assignment's slot in it (one past
    the end for an assignment dropped: the scatter skips it, `_combine` reads 0 for it)."""
    top_k = experts.shape[1]
    flat = experts.reshape(-1)
    _, _, rank = _sort_by_expert(flat, num_experts)
    slot = jnp.where(rank < capacity, flat * capacity + rank, num_experts * capacity)
    src = x[jnp.arange(flat.shape[0]) // top_k]
    buf = jnp.zeros((num_experts * capacity, x.shape[-1]), x.dtype).at[slot].set(src, mode="drop")
    return buf.reshape(num_experts, capacity, -1), slot


def _combine(out: Array, slot: Array, weights: Array) -> Array:
    """One sequence's output from the experts' `[experts capacity embed]` buffer."""
    y = jnp.take(out.reshape(-1, out.shape[-1]), slot, axis=0, mode="fill", fill_value=0)
    return jnp.sum(y.reshape(*weights.shape, -1) * weights.astype(out.dtype)[..., None], axis=1)


def _expert_mlp(buf: Array, gate: Array, up: Array, down: Array, act) -> Array:
    """Each expert's gated MLP on its rows of `buf` (`[experts ... embed]`)."""
    dt = buf.dtype
    h = act(jnp.einsum("e...d,edh->e...h", buf, gate.astype(dt))) * jnp.einsum("e...d,edh->e...h", buf, up.astype(dt))
    return jnp.einsum("e...h,ehd->e...d", h, down.astype(dt))


def moe_shard(
    x: Float[Array, "batch seq embed"],
    router: Float[Array, "embed experts"],
    gate: Float[Array, "local_experts embed hidden"],
    up: Float[Array, "local_experts embed hidden"],
    down: Float[Array, "local_experts hidden embed"],
    *,
    top_k: int,
    norm_topk_prob: bool,
    capacity_factor: float | None,
    activation: Activation,
    num_experts: int,
    comm: Collectives,
    router_bias: Float[Array, " experts"] | None = None,
) -> tuple[Float[Array, "batch seq embed"], MoEStats]:
    """The MoE feed-forward of one shard (`moe_feed_forward` on one device, the body of the
    expert-parallel `shard_map` in `equipax.core.nn.moe_parallel`).

    `x` is this shard's `[batch seq embed]`; `gate`, `up`, `down` its `num_experts / ep`
    experts (ep = the size of `comm.expert`). Dropless: every shard gathers the tokens of its
    expert group, runs its own experts and scatters the partial sums back (`psum_scatter`).
    With capacity: each shard fills `[experts capacity]` buffers for its sequences, an all-to-all
    sends each expert's rows to the shard that holds it, and a second one brings the results back.
    Experts whose hidden units are split over a `tensor` axis give a partial sum (the caller adds
    it up)."""
    b, s, d = x.shape
    act = _ACTIVATIONS[activation]
    tokens = x.reshape(b * s, d)
    logits = router_logits(tokens, router)
    weights, experts, probs = route(logits, top_k, norm_topk_prob=norm_topk_prob, bias=router_bias)
    axis = comm.expert
    if capacity_factor is None:
        first = jnp.zeros((), jnp.int32)
        all_tokens, all_experts, all_weights = tokens, experts, weights
        if axis is not None:
            first = jax.lax.axis_index(axis) * gate.shape[0]
            gather = lambda t: jax.lax.all_gather(t, axis, axis=0, tiled=True)  # noqa: E731
            all_tokens, all_experts, all_weights = gather(tokens), gather(experts), gather(weights)
        y = _dropless(all_tokens, all_experts, all_weights, gate, up, down, act, num_experts, first)
        if axis is not None:
            y = jax.lax.psum_scatter(y, axis, scatter_dimension=0, tiled=True)
        dropped = jnp.zeros((), jnp.int32)
    else:
        capacity = expert_capacity(s, num_experts, top_k, capacity_factor)
        experts_bs, weights_bs = experts.reshape(b, s, top_k), weights.reshape(b, s, top_k)
        buf, slot = jax.vmap(lambda xs, es: _dispatch(xs, es, num_experts, capacity))(x, experts_bs)
        buf = jnp.swapaxes(buf, 0, 1)  # [experts batch capacity embed]
        if axis is not None:  # -> [local experts, batch of every shard of the group, capacity, embed]
            buf = jax.lax.all_to_all(buf, axis, split_axis=0, concat_axis=1, tiled=True)
        out = _expert_mlp(buf, gate, up, down, act)
        if axis is not None:
            out = jax.lax.all_to_all(out, axis, split_axis=1, concat_axis=0, tiled=True)
        y = jax.vmap(_combine)(jnp.swapaxes(out, 0, 1), slot, weights_bs)
        dropped = jnp.sum(slot == num_experts * capacity)
    return y.reshape(b, s, d), shard_stats(logits, probs, experts, dropped, comm)


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
    router_bias: Float[Array, " experts"] | None = None,
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
        router_bias: per-expert biases for choosing the experts (`route`), or None.

    Returns:
        `(outputs in x.dtype, MoEStats)`.
    """
    return moe_shard(
        x,
        router,
        gate,
        up,
        down,
        top_k=top_k,
        norm_topk_prob=norm_topk_prob,
        capacity_factor=capacity_factor,
        activation=activation,
        num_experts=gate.shape[0],
        comm=Collectives(),
        router_bias=router_bias,
    )


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
    router_bias: Float[Array, " experts"] | None = None,
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
    # The top-k by a full descending sort (the fast path uses lax.top_k), of the biased scores.
    scores = probs if router_bias is None else probs + router_bias.astype(jnp.float32)[None, None]
    experts = jnp.argsort(-scores, axis=-1)[..., :top_k]
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
    flat_experts = experts.reshape(b * s, -1)
    counts = jnp.stack([jnp.sum(experts == e) for e in range(num_experts)]).astype(jnp.float32)
    stats = MoEStats(
        load_balancing_loss(flat_probs, flat_experts), router_z_loss(flat_logits), counts, dropped.astype(jnp.float32)
    )
    return y.astype(x.dtype), stats


class MoEFeedForward(eqx.Module):
    """A mixture-of-experts feed-forward layer with optional shared (always-on) experts.

    Returns `(outputs, MoEStats)`: the block adds the weighted auxiliary losses to the task loss.
    """

    router: Float[Array, "embed experts"]
    gate: Float[Array, "experts embed hidden"]
    up: Float[Array, "experts embed hidden"]
    down: Float[Array, "experts hidden embed"]
    shared: FeedForward | None
    router_bias: Float[Array, " experts"] | None
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
        router_bias: bool = False,
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
        router_bias: hold per-expert routing biases (zeros; not trained by the gradient: the
            train step sets them from each step's load, `TransformerConfig.router_bias_update_rate`).
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
        self.router_bias = jnp.zeros((num_experts,), jnp.float32) if router_bias else None
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.capacity_factor = capacity_factor
        self.activation = activation

    def logical_axes(self) -> dict[str, Axes]:
        """Experts on the `expert` axis; the experts' MLPs split like the dense MLP's."""
        return {
            "router": ("embed", None),
            "router_bias": (None,),
            "gate": ("expert", "embed", "hidden"),
            "up": ("expert", "embed", "hidden"),
            "down": ("expert", "hidden", "embed"),
        }

    def __call__(self, x: Float[Array, "batch seq embed"]) -> tuple[Float[Array, "batch seq embed"], MoEStats]:
        """Apply the layer on one device (or under GSPMD; `equipax.core.nn.moe_parallel.apply_moe`
        runs it expert-parallel over a mesh's `expert` axis).

        Arguments:
            x: inputs.

        Returns:
            `(outputs of the same shape and dtype, MoEStats)`.
        """
        y, stats = self.routed(x, num_experts=self.gate.shape[0], comm=Collectives())
        return (y if self.shared is None else y + self.shared(x)), stats

    def routed(
        self, x: Float[Array, "batch seq embed"], *, num_experts: int, comm: Collectives
    ) -> tuple[Float[Array, "batch seq embed"], MoEStats]:
        """The routed experts' part of the output (no shared expert): `moe_shard` with this layer's
        weights, which are one shard's `num_experts / ep` experts inside the expert-parallel
        `shard_map` (`comm`), or all `num_experts` on one device (`Collectives()`)."""
        return moe_shard(
            x,
            self.router,
            self.gate,
            self.up,
            self.down,
            top_k=self.top_k,
            norm_topk_prob=self.norm_topk_prob,
            capacity_factor=self.capacity_factor,
            activation=self.activation,
            num_experts=num_experts,
            comm=comm,
            router_bias=self.router_bias,
        )
