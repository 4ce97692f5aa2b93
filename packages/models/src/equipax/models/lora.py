"""LoRA: low-rank adapters on the projections of the one decoder stack, over a frozen base model.

`LoRALM(base, config, key=...)` holds the base `TransformerLM` unchanged and, for each adapted
projection W (attention q, k, v, o; feed-forward gate, up, down), a pair A `[*stack, in..., r]`
(uniform in +-1/sqrt(fan_in), as PEFT initialises it) and B `[*stack, r, out...]` (zeros). The model
it computes with is `merged()`: the base with every W replaced by `W + (alpha / r) * A @ B`, so
the adapter model and its merge are one function (`tests/models/test_lora.py` checks the merge
against numpy). Its `trainable_spec()` marks only A and B trainable (`equipax.core.task.trainable`):
the base gets no gradient, no optimizer state and no update.

The projections are found by their place in the stack (`attention.q`, `attention.kv` (k and v
fused), `attention.qkv` (Pax's fused q, k, v), `attention.out`, `ffn.{gate,up,down}.weight`), with
any leading stacked-layer axes (scanned or pipelined stacks); the adapters declare the logical axes
of the weights they adapt, so they shard as those weights do.
"""

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.tree_util import GetAttrKey
from jaxtyping import Array, Float, PRNGKeyArray

from equipax.core.nn.moe import MoEStats
from equipax.core.partition import leaf_axes
from equipax.models.configs import LORA_TARGETS, LoRAConfig
from equipax.models.cross_entropy import HeadStats
from equipax.models.lm import TransformerLM

__all__ = ["LoRAAdapter", "LoRALM", "lora_slots"]

# Where each target lives: (the weight's path suffix, index along its fused axis or None, the
# weight's own rank (without stacked-layer axes), how many of those dimensions are inputs).
_SLOTS: dict[str, tuple[tuple[tuple[str, ...], int | None, int, int], ...]] = {
    "q": ((("attention", "q"), None, 3, 1), (("attention", "qkv"), 0, 4, 1)),
    "k": ((("attention", "kv"), 0, 4, 1), (("attention", "qkv"), 1, 4, 1)),
    "v": ((("attention", "kv"), 1, 4, 1), (("attention", "qkv"), 2, 4, 1)),
    "o": ((("attention", "out"), None, 3, 2),),
    "gate": ((("ffn", "gate", "weight"), None, 2, 1),),
    "up": ((("ffn", "up", "weight"), None, 2, 1),),
    "down": ((("ffn", "down", "weight"), None, 2, 1),),
}
assert set(_SLOTS) == set(LORA_TARGETS)


class LoRAAdapter(eqx.Module):
    """One adapted projection: `delta = scale * A @ B` over its stacked-layer axes.

    Attributes:
        a: `[*stack, in..., rank]`.
        b: `[*stack, rank, out...]` (zeros at initialisation).
        axes: logical axes of `a` and `b` (the adapted weight's, the rank axis replicated).
    """

    a: Float[Array, "..."]
    b: Float[Array, "..."]
    stack: int = eqx.field(static=True)
    inputs: int = eqx.field(static=True)
    axes: tuple[tuple[str | None, ...], tuple[str | None, ...]] = eqx.field(static=True)

    def logical_axes(self) -> dict[str, tuple[str | None, ...]]:
        return {"a": self.axes[0], "b": self.axes[1]}

    def delta(self, scale: float) -> Float[Array, "..."]:
        """`scale * A @ B` in the shape `[*stack, in..., out...]` of the adapted weight, float32."""
        lead = self.a.shape[: self.stack]
        ins = self.a.shape[self.stack : -1]
        outs = self.b.shape[self.stack + 1 :]
        a = self.a.reshape(*lead, math.prod(ins), self.a.shape[-1]).astype(jnp.float32)
        b = self.b.reshape(*lead, self.b.shape[self.stack], math.prod(outs)).astype(jnp.float32)
        return (scale * jnp.matmul(a, b)).reshape(*lead, *ins, *outs)


def _suffix(path: tuple[Any, ...], n: int) -> tuple[str, ...] | None:
    tail = path[-n:]
    if len(tail) < n or not all(isinstance(k, GetAttrKey) for k in tail):
        return None
    return tuple(k.name for k in tail)


def lora_slots(base: TransformerLM, targets: tuple[str, ...]) -> list[tuple[str, str, int | None, Any, int, int]]:
    """The adapted weights of `base`: `(name, weight path, fused index, weight, stack dims, input dims)`.

    Raises:
        ValueError: a target that names no projection of this model (listing those it has).
    """
    leaves = jax.tree_util.tree_flatten_with_path(base)[0]
    found, present = [], set()
    for target, slots in _SLOTS.items():
        for suffix, index, rank, inputs in slots:
            for path, leaf in leaves:
                if _suffix(path, len(suffix)) != suffix:
                    continue
                present.add(target)
                if target in targets:
                    owner = jax.tree_util.keystr(path[: len(path) - len(suffix) + 1])  # ...attention, ...ffn
                    name = f"{owner}.{target}".lstrip(".")
                    found.append((name, jax.tree_util.keystr(path), index, leaf, leaf.ndim - rank, inputs))
    missing = [t for t in targets if t not in present]
    if missing:
        raise ValueError(
            f"model.lora.targets names {', '.join(map(repr, missing))}, which this model does not have; its "
            f"projections are {', '.join(t for t in LORA_TARGETS if t in present)}."
        )
    return found


class LoRALM(eqx.Module):
    """A frozen `TransformerLM` with low-rank adapters; called like the model it wraps.

    Attributes:
        base: the frozen model (bit-identical after training).
        adapters: one `LoRAAdapter` per adapted projection, by its path in the stack (e.g.
            `stack.layers.attention.q`).
        config: rank, alpha and targets.
    """

    base: TransformerLM
    adapters: dict[str, LoRAAdapter]
    config: LoRAConfig = eqx.field(static=True)
    where: tuple[tuple[str, str, int | None], ...] = eqx.field(static=True)

    def __init__(self, base: TransformerLM, config: LoRAConfig, *, key: PRNGKeyArray) -> None:
        """Arguments:
        base: the model to adapt (kept as given: it is frozen).
        config: the adapters' rank, alpha and targets.
        key: initialises the A matrices.
        """
        self.base = base
        self.config = config
        slots = lora_slots(base, config.targets)
        adapters, where = {}, []
        for (name, path, index, weight, stack, inputs), k in zip(slots, jax.random.split(key, len(slots))):
            shape = (
                weight.shape if index is None else weight.shape[: stack + inputs] + weight.shape[stack + inputs + 1 :]
            )
            axes = leaf_axes(base, _path_of(base, path), weight)
            if index is not None:
                axes = axes[: stack + inputs] + axes[stack + inputs + 1 :]
            lead, ins, outs = shape[:stack], shape[stack : stack + inputs], shape[stack + inputs :]
            bound = 1.0 / math.sqrt(math.prod(ins))
            a = jax.random.uniform(k, (*lead, *ins, config.rank), jnp.float32, -bound, bound)
            b = jnp.zeros((*lead, config.rank, *outs), jnp.float32)
            a_axes = (*axes[: stack + inputs], None)
            b_axes = (*axes[:stack], None, *axes[stack + inputs :])
            adapters[name] = LoRAAdapter(a, b, stack=stack, inputs=inputs, axes=(a_axes, b_axes))
            where.append((name, path, index))
        self.adapters = adapters
        self.where = tuple(where)

    @property
    def cfg(self) -> Any:
        """The base model's `LMConfig`."""
        return self.base.cfg

    def trainable_spec(self) -> "LoRALM":
        """True on the adapters' arrays, False everywhere else (`equipax.core.task.trainable`)."""
        spec = jax.tree.map(lambda _: False, self)
        return eqx.tree_at(lambda m: m.adapters, spec, replace=jax.tree.map(lambda _: True, self.adapters))

    def deltas(self) -> dict[str, list[tuple[int | None, Array]]]:
        """`{weight path: [(fused index, scale * A @ B), ...]}`."""
        out: dict[str, list[tuple[int | None, Array]]] = {}
        for name, path, index in self.where:
            out.setdefault(path, []).append((index, self.adapters[name].delta(self.config.scale)))
        return out

    def merged(self) -> TransformerLM:
        """The base model with every adapted weight W replaced by `W + scale * A @ B` (float32)."""
        deltas = self.deltas()
        stacks = {path: self.adapters[name].stack for name, path, _ in self.where}
        inputs = {path: self.adapters[name].inputs for name, path, _ in self.where}

        def merge(path: Any, leaf: Any) -> Any:
            where = jax.tree_util.keystr(path)
            if where not in deltas:
                return leaf
            w = leaf.astype(jnp.promote_types(leaf.dtype, jnp.float32))
            for index, delta in deltas[where]:
                if index is None:
                    w = w + delta
                else:
                    at = (slice(None),) * (stacks[where] + inputs[where]) + (index,)
                    w = w.at[at].add(delta)
            return w

        return jax.tree_util.tree_map_with_path(merge, self.base)

    def __call__(self, ids: Any, **kwargs: Any) -> Float[Array, "batch seq vocab"]:
        """The merged model's logits (`TransformerLM.__call__`'s arguments)."""
        return self.merged()(ids, **kwargs)

    def forward(self, ids: Any, **kwargs: Any) -> tuple[Float[Array, "batch seq vocab"], MoEStats | None]:
        """The merged model's logits and mixture-of-experts stats (`TransformerLM.forward`)."""
        return self.merged().forward(ids, **kwargs)

    def hidden(self, ids: Any, **kwargs: Any) -> tuple[Float[Array, "batch seq embed"], MoEStats | None]:
        """The merged model's final hidden states and mixture-of-experts stats (`TransformerLM.hidden`)."""
        return self.merged().hidden(ids, **kwargs)

    def head_stats(self, h: Any, labels: Any, mesh: Any = None) -> HeadStats:
        """The base model's `head_stats` (no adapter touches the output head)."""
        return self.base.head_stats(h, labels, mesh)


def _path_of(tree: Any, where: str) -> tuple[Any, ...]:
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if jax.tree_util.keystr(path) == where:
            return path
    raise KeyError(where)
