"""Sharding rules, all in one place: parameters, optimizer state and batches.

Each layer declares the *logical* axes of its own weights (embed, vocab, heads, hidden, ...)
in a `logical_axes` method next to the weights; the mesh config's `logical_axis_rules` map
logical axes to mesh axes (`LOGICAL_TO_MESH` is their default, `DEFAULT_LOGICAL_AXIS_RULES`):

- FSDP: every large weight is sharded over `fsdp` on its `embed` dimension (ZeRO-3 style;
  XLA all-gathers it for the matmul and reduce-scatters its gradient);
- Megatron tensor parallelism over `tensor`: QKV and MLP up/gate projections are split by
  columns (heads / hidden), the attention output and MLP down projections by rows, so each
  device holds whole heads and a slice of the MLP;
- pipeline parallelism: a pipelined stack's weights carry a leading `stage` axis, split over
  the `stage` mesh axis, so each stage's devices hold only their own layers
  (equipax.core.nn.pipeline);
- context parallelism: no weight is split over `context`; batches and activations split their
  sequence dimension over it (`batch_sharding`, `constrain_batch`; docs/long_context.md);
- everything else (norm scales, the CNN's small weights) is replicated.

The contract a layer follows::

    class Linear(eqx.Module):
        weight: Float[Array, "in out"]
        bias: Float[Array, " out"] | None
        axes: tuple[str | None, str | None] = eqx.field(static=True)

        def logical_axes(self) -> dict[str, Axes]:
            return {"weight": self.axes, "bias": self.axes[1:]}

`logical_axes()` maps a field name to the logical axes of that field's array, one name per
dimension (`None` = replicated). It must read only static fields: it is also called on
filtered and abstract copies of the model. Mapping a field that holds a *module* gives a
prefix prepended to every axis beneath it: a scanned `TransformerStack` declares
`{"layers": ("layers",)}` for its one stacked block.

An inexact parameter with two or more dimensions (besides such prefixes) and no declared axes
is an error naming its path: nothing large is silently replicated. Undeclared vectors (and
integer arrays) are replicated. A dimension whose size is not divisible by its mesh axis is
replicated instead (tiny models on big meshes still run).
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.tree_util import DictKey, GetAttrKey, SequenceKey

from equipax.core.mesh import BATCH_AXES, CONTEXT, TENSOR
from equipax.core.mesh_config import DEFAULT_LOGICAL_AXIS_RULES
from equipax.core.task import trainable

__all__ = [
    "Axes",
    "batch_sharding",
    "constrain_batch",
    "constrain_batch_and_last",
    "declared_axes",
    "leaf_axes",
    "LOGICAL_TO_MESH",
    "model_shardings",
    "named",
    "param_specs",
    "Rules",
    "spec_for",
    "train_state_shardings",
]

PyTree = Any

Axes = tuple[str | None, ...]
"""The logical axis of each dimension of an array, in order; `None` = replicated."""

# The default logical axis -> mesh axis rules (None = replicated), as a mapping.
LOGICAL_TO_MESH: Mapping[str, str | None] = dict(DEFAULT_LOGICAL_AXIS_RULES)
Rules = Mapping[str, str | None]


def declared_axes(module: Any) -> Mapping[str, Axes]:
    """The logical axes `module` declares for its own fields (empty if it declares none)."""
    method: Callable[[], Mapping[str, Axes]] | None = getattr(module, "logical_axes", None)
    if isinstance(module, eqx.Module) and method is not None:
        return method()
    return {}


def _child(node: Any, key: Any) -> Any:
    if isinstance(key, GetAttrKey):
        return getattr(node, key.name)
    if isinstance(key, SequenceKey):
        return node[key.idx]
    if isinstance(key, DictKey):
        return node[key.key]
    raise LookupError(key)


def _lookup(root: PyTree, path: Sequence[Any]) -> tuple[Axes, Axes | None, Any]:
    """Follow `path` from `root`: (prefix from stacked modules, the leaf's axes or None, owner)."""
    node, prefix = root, ()
    for i, key in enumerate(path):
        if isinstance(key, GetAttrKey):
            axes = declared_axes(node).get(key.name)
            if axes is not None:
                if i == len(path) - 1:
                    return prefix, tuple(axes), node
                prefix += tuple(axes)
        try:
            parent, node = node, _child(node, key)
        except (LookupError, AttributeError, TypeError):
            return prefix, None, None
        if i == len(path) - 1:
            return prefix, None, parent
    return prefix, None, None


def _is_array(x: Any) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _is_param(x: Any) -> bool:
    return _is_array(x) and jnp.issubdtype(x.dtype, jnp.inexact)


def leaf_axes(root: PyTree, path: Sequence[Any], leaf: Any, rules: Rules | None = None) -> Axes:
    """The logical axes of the array `leaf` found at `path` in `root`.

    Arguments:
        root: the model (or a filtered / abstract copy of it).
        path: the leaf's key path, as `jax.tree_util.tree_map_with_path` gives it.
        leaf: the array (or `jax.ShapeDtypeStruct`) at `path`.
        rules: logical axis -> mesh axis (default `LOGICAL_TO_MESH`): the axes it knows.

    Returns:
        One logical axis name (or None) per dimension of `leaf`.

    Raises:
        ValueError: a parameter of two or more dimensions declares no axes, declares the
            wrong number of them, or names an axis `rules` does not map.
    """
    rules = LOGICAL_TO_MESH if rules is None else rules
    name, shape = jax.tree_util.keystr(tuple(path)), tuple(leaf.shape)
    prefix, axes, owner = _lookup(root, path)
    if axes is None:
        own = len(shape) - len(prefix)
        if own >= 2 and _is_param(leaf):
            where = type(owner).__name__ if owner is not None else "the module that holds it"
            field = path[-1].name if isinstance(path[-1], GetAttrKey) else "<field>"
            how = (
                f"add {field!r} to {where}.logical_axes() (a Linear takes them from its owner: "
                f"Linear(..., axes=(in, out)))"
                if callable(getattr(owner, "logical_axes", None))
                else f"give {where} a method `def logical_axes(self): return {{{field!r}: (...)}}`"
            )
            raise ValueError(
                f"Parameter {name} of shape {shape} has no logical axes, so it cannot be "
                f"sharded. Declare its logical axes in the layer that owns it: {how}, with one "
                f"name from {sorted(rules)} (or None) per dimension "
                f"(docs/sharding.md)."
            )
        axes = (None,) * own
    axes = prefix + axes
    if len(axes) != len(shape):
        raise ValueError(
            f"Parameter {name} of shape {shape} has {len(shape)} dimensions but its layers "
            f"declare {len(axes)} logical axes {axes}; declare one per dimension (a stacked "
            f"or vmapped sub-layer needs its owner to declare the leading axis, e.g. "
            f"{{'layers': ('layers',)}})."
        )
    unknown = [a for a in axes if a is not None and a not in rules]
    if unknown:
        raise ValueError(
            f"Parameter {name} declares unknown logical axes {unknown} (the mesh's rules do not map them); "
            f"use names from {sorted(rules)}, or add a rule for each to the mesh.logical_axis_rules knob "
            f'(e.g. --set "mesh.logical_axis_rules=(..., ({unknown[0]!r}, None))" to replicate it).'
        )
    return axes


def spec_for(axes: Axes, shape: tuple[int, ...], mesh: Mesh | AbstractMesh, rules: Rules | None = None) -> P:
    """The PartitionSpec of an array of `shape` with logical `axes` on `mesh`.

    Each mesh axis shards at most one dimension; a dimension not divisible by its mesh axis
    (or whose mesh axis is absent or of size 1) is replicated.

    Arguments:
        axes: one logical axis name (or None) per dimension.
        shape: the array's shape.
        mesh: the device mesh (an `AbstractMesh` needs no devices).
        rules: logical axis -> mesh axis (default `LOGICAL_TO_MESH`).

    Returns:
        One mesh axis (or None) per dimension.
    """
    rules = LOGICAL_TO_MESH if rules is None else rules
    entries: list[str | None] = []
    used: set[str] = set()
    for dim, logical in zip(shape, axes, strict=True):
        mesh_axis = rules[logical] if logical is not None else None
        if mesh_axis is None or mesh_axis not in mesh.shape or mesh_axis in used:
            entries.append(None)
            continue
        size = mesh.shape[mesh_axis]
        if size == 1 or dim % size:
            entries.append(None)
        else:
            entries.append(mesh_axis)
            used.add(mesh_axis)
    return P(*entries)


def param_specs(params: PyTree, mesh: Mesh | AbstractMesh, rules: Rules | None = None) -> PyTree:
    """PartitionSpecs for every array leaf of `params` from its layers' logical axes.

    Arguments:
        params: a model or a filtered copy of it (`eqx.filter(model, eqx.is_array)`), with
            concrete arrays or `jax.ShapeDtypeStruct` leaves (`eqx.filter_eval_shape`).
        mesh: the device mesh.
        rules: logical axis -> mesh axis (default `LOGICAL_TO_MESH`; an experiment's are
            `dict(cfg.mesh.logical_axis_rules)`).

    Returns:
        The same structure with a PartitionSpec per array leaf (None elsewhere).

    Raises:
        ValueError: a parameter of two or more dimensions has no logical axes (the message
            names its path), or its declared axes do not fit it.
    """

    def one(path, leaf):
        if not _is_array(leaf):
            return None
        return spec_for(leaf_axes(params, path, leaf, rules), tuple(leaf.shape), mesh, rules)

    return jax.tree_util.tree_map_with_path(one, params)


def named(specs: PyTree, mesh: Mesh) -> PyTree:
    """PartitionSpecs -> NamedShardings on `mesh` (None stays None)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def model_shardings(model: PyTree, mesh: Mesh, rules: Rules | None = None) -> PyTree:
    """NamedShardings of a model's arrays (concrete or `jax.ShapeDtypeStruct`s) from its layers'
    logical axes: the structure of `eqx.filter(model, eqx.is_array)` (the model part of
    `train_state_shardings`).

    Arguments:
        model: the model.
        mesh: the device mesh.
        rules: logical axis -> mesh axis (default `LOGICAL_TO_MESH`).
    """
    return named(param_specs(eqx.filter(model, _is_array), mesh, rules), mesh)


def train_state_shardings(
    state: PyTree, optimizer: optax.GradientTransformation, mesh: Mesh, rules: Rules | None = None
) -> PyTree:
    """NamedShardings for a TrainState, concrete or abstract (`eqx.filter_eval_shape`).

    Parameters follow their layers' logical axes; the optimizer state follows the parameters it belongs to
    (optax `tree_map_params`); everything else (step, counts) is replicated.

    Arguments:
        state: an `equipax.core.step.TrainState`.
        optimizer: the optimizer that built `state.opt_state`.
        mesh: the device mesh.
        rules: logical axis -> mesh axis (default `LOGICAL_TO_MESH`).

    Returns:
        The structure of `eqx.filter(state, is_array)` with a NamedSharding per array.
    """
    model_specs = param_specs(eqx.filter(state.model, _is_array), mesh, rules)
    # The optimizer state holds the trainable parameters' moments only (`trainable`: a LoRA model's
    # adapters, not its frozen base).
    trained = eqx.filter(eqx.filter(state.model, trainable(state.model)), _is_param)
    if _has_multi_transform(state.opt_state):  # several learners: optax.tree_map_params cannot see them
        opt_specs = _specs_by_path(state.opt_state, trained, param_specs(trained, mesh, rules))
    else:
        # Traced, not run: optax's `init` (which `tree_map_params` calls) makes its step counts with
        # `jnp.zeros`, on a TPU the process's first compile (0.5 s on the v5e's host, before the
        # train step's tracing could start; benchmarks/README.md, "ninth session").
        opt_specs = eqx.filter_eval_shape(
            lambda: optax.tree_map_params(
                optimizer,
                lambda _, spec: spec,
                state.opt_state,
                param_specs(trained, mesh, rules),
                transform_non_params=lambda x: P() if _is_array(x) else None,
                is_leaf=lambda x: isinstance(x, P),
            )
        )
    specs = eqx.tree_at(
        lambda s: (s.model, s.opt_state),
        eqx.filter(state, _is_array),
        (model_specs, opt_specs),
        is_leaf=lambda x: x is None,
    )
    specs = jax.tree.map(lambda x: x if isinstance(x, P) else P(), specs, is_leaf=lambda x: isinstance(x, P))
    return named(specs, mesh)


def _has_multi_transform(opt_state: PyTree) -> bool:
    found = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.MultiTransformState))
    return any(isinstance(x, optax.MultiTransformState) for x in found)


def _specs_by_path(opt_state: PyTree, params: PyTree, specs: PyTree) -> PyTree:
    """The optimizer state's specs for an `optax.multi_transform` (`LearnerConfig.groups`): a
    state leaf whose key path ends with a parameter's path and has its shape (a moment of that
    parameter, in its group's inner state) gets the parameter's spec; the rest (counts, masked
    placeholders) are replicated or dropped. `optax.tree_map_params` re-initialises the optimizer
    on a placeholder, which cannot be labelled by group, so it cannot find these."""
    by_path = {}
    param_leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    for (path, leaf), spec in zip(param_leaves, spec_leaves, strict=True):
        by_path[jax.tree_util.keystr(tuple(path))] = (tuple(leaf.shape), spec)

    def spec_of(path: Any, leaf: Any) -> Any:
        if not _is_array(leaf):
            return None
        text = jax.tree_util.keystr(tuple(path))
        for suffix, (shape, spec) in by_path.items():
            if text.endswith(suffix) and tuple(leaf.shape) == shape:
                return spec
        return P()

    return jax.tree_util.tree_map_with_path(spec_of, opt_state)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batches split on their leading (example) dimension over the batch axes, and on their second
    (the sequence) over `context` when the mesh has one (`[batch seq]` token batches)."""
    axes = tuple(a for a in BATCH_AXES if a in mesh.shape)
    return NamedSharding(mesh, P(axes, CONTEXT) if mesh.shape.get(CONTEXT, 1) > 1 else P(axes))


def _seq_axis(x: jax.Array, mesh: Mesh, manual: frozenset[str]) -> str | None:
    """`context` for the sequence dimension of a `[batch seq ...]` activation, when it splits it."""
    cp = mesh.shape.get(CONTEXT, 1)
    return CONTEXT if cp > 1 and CONTEXT not in manual and x.ndim >= 3 and x.shape[1] % cp == 0 else None


def constrain_batch(x: jax.Array, mesh: Mesh | None) -> jax.Array:
    """Pin an activation's leading (batch) dimension to the batch axes (and a `[batch seq ...]`
    activation's sequence to `context`, if the mesh has one); others replicated.

    Without this, GSPMD may follow the FSDP weights and split activations on `embed`
    instead, replicating the batch on every device (orders of magnitude more memory).
    A no-op without a mesh. Inside a `shard_map` that is manual over some axes (a pipeline
    stage is manual over `stage`), only the remaining automatic batch axes are pinned.
    """
    if mesh is None or mesh.size == 1:
        return x
    manual = _manual_axes()
    axes = tuple(a for a in BATCH_AXES if a in mesh.shape and a not in manual)
    spec = P(axes, *([None] * (x.ndim - 1)))
    if seq := _seq_axis(x, mesh, manual):
        spec = P(axes, seq, *([None] * (x.ndim - 2)))
    # In a manual region the sharding refers to the context mesh (its axis types differ).
    return jax.lax.with_sharding_constraint(x, spec if manual else NamedSharding(mesh, spec))


def constrain_batch_and_last(x: jax.Array, mesh: Mesh | None) -> jax.Array:
    """Pin an activation's batch dimension to the batch axes and its last dimension to `tensor`
    (and the sequence of a `[batch seq ... last]` activation to `context`, if the mesh has one).

    For the residual stream between blocks (`[batch seq embed]`) and the logits (`[batch seq
    vocab]`): without it each tensor-parallel device holds the whole width, and under remat the
    saved layer inputs are the largest activations of a step (c4_16b on a v4-64: 34 GiB per
    chip instead of 31.7; docs/compile.md). The last dimension stays whole when `tensor` is
    absent, manual, of size 1 or does not divide it. A no-op without a mesh.
    """
    if mesh is None or mesh.size == 1:
        return x
    manual = _manual_axes()
    axes = tuple(a for a in BATCH_AXES if a in mesh.shape and a not in manual)
    tp = mesh.shape.get(TENSOR, 1)
    last = TENSOR if tp > 1 and TENSOR not in manual and x.shape[-1] % tp == 0 else None
    spec = P(axes, _seq_axis(x, mesh, manual), *([None] * (x.ndim - 3)), last) if x.ndim >= 3 else P(axes, last)
    return jax.lax.with_sharding_constraint(x, spec if manual else NamedSharding(mesh, spec))


def _manual_axes() -> frozenset[str]:
    """Mesh axes the code being traced is manual over (inside `jax.shard_map`)."""
    from jax.sharding import AxisType

    abstract = jax.sharding.get_abstract_mesh()
    if abstract.empty:
        return frozenset()
    return frozenset(n for n, t in zip(abstract.axis_names, abstract.axis_types) if t == AxisType.Manual)
