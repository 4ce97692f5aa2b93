"""Sharding rules, all in one place: parameters, optimizer state and batches.

Each parameter is matched by its path to *logical* axes (embed, vocab, heads, hidden, ...);
`LOGICAL_TO_MESH` maps logical axes to mesh axes:

- FSDP: every large weight is sharded over `fsdp` on its `embed` dimension (ZeRO-3 style;
  XLA all-gathers it for the matmul and reduce-scatters its gradient);
- Megatron tensor parallelism over `tensor`: QKV and MLP up/gate projections are split by
  columns (heads / hidden), the attention output and MLP down projections by rows, so each
  device holds whole heads and a slice of the MLP;
- everything else (norm scales, small biases) is replicated.

A dimension whose size is not divisible by its mesh axis is replicated instead (tiny models on
big meshes still run). Scanned stacks carry a leading layer axis, which is never sharded.
"""

import re
from typing import Any

import equinox as eqx
import jax
import optax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P

from equipax.core.mesh import BATCH_AXES, FSDP, TENSOR

PyTree = Any

# Logical axis -> mesh axis (None = replicated).
LOGICAL_TO_MESH: dict[str, str | None] = {
    "embed": FSDP,
    "vocab": TENSOR,
    "heads": TENSOR,
    "hidden": TENSOR,
    "head_dim": None,
    "qkv": None,
    "layers": None,
}

# Parameter path (jax keystr) pattern -> logical axes of its dimensions (unstacked).
PARAM_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (r"\.embedding\.weight$", ("vocab", "embed")),
    (r"\.attention\.qkv$", ("embed", "qkv", "heads", "head_dim")),
    (r"\.attention\.qkv_bias$", ("qkv", "heads", "head_dim")),
    (r"\.attention\.out$", ("heads", "head_dim", "embed")),
    (r"\.(up|gate)\.weight$", ("embed", "hidden")),
    (r"\.(up|gate)\.bias$", ("hidden",)),
    (r"\.down\.weight$", ("hidden", "embed")),
)


def logical_axes(path: str, ndim: int) -> tuple[str | None, ...]:
    """The logical axes of the parameter at `path` (None entries are replicated)."""
    for pattern, axes in PARAM_RULES:
        if re.search(pattern, path):
            if ndim == len(axes) + 1:  # stacked by scan over layers
                return ("layers", *axes)
            if ndim == len(axes):
                return axes
    return (None,) * ndim


def spec_for(path: str, shape: tuple[int, ...], mesh: Mesh | AbstractMesh) -> P:
    """The PartitionSpec of a parameter of `shape` at `path` on `mesh`."""
    axes = logical_axes(path, len(shape))
    entries: list[str | None] = []
    used: set[str] = set()
    for dim, logical in zip(shape, axes):
        mesh_axis = LOGICAL_TO_MESH.get(logical) if logical else None
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


def param_specs(params: PyTree, mesh: Mesh | AbstractMesh) -> PyTree:
    """PartitionSpecs for every array leaf of `params` (same structure; None elsewhere)."""

    def one(path, leaf):
        if not eqx.is_array(leaf) and not isinstance(leaf, jax.ShapeDtypeStruct):
            return None
        return spec_for(jax.tree_util.keystr(path), tuple(leaf.shape), mesh)

    return jax.tree_util.tree_map_with_path(one, params)


def named(specs: PyTree, mesh: Mesh) -> PyTree:
    """PartitionSpecs -> NamedShardings on `mesh` (None stays None)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def _is_array(x: Any) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _is_param(x: Any) -> bool:
    return _is_array(x) and jax.numpy.issubdtype(x.dtype, jax.numpy.inexact)


def train_state_shardings(state: PyTree, optimizer: optax.GradientTransformation, mesh: Mesh) -> PyTree:
    """NamedShardings for a TrainState, concrete or abstract (`eqx.filter_eval_shape`).

    Parameters follow the rules; the optimizer state follows the parameters it belongs to
    (optax `tree_map_params`); everything else (step, counts) is replicated.

    Arguments:
        state: an `equipax.core.step.TrainState`.
        optimizer: the optimizer that built `state.opt_state`.
        mesh: the device mesh.

    Returns:
        The structure of `eqx.filter(state, is_array)` with a NamedSharding per array.
    """
    model_specs = param_specs(eqx.filter(state.model, _is_array), mesh)
    opt_specs = optax.tree_map_params(
        optimizer,
        lambda _, spec: spec,
        state.opt_state,
        param_specs(eqx.filter(state.model, _is_param), mesh),
        transform_non_params=lambda x: P() if _is_array(x) else None,
        is_leaf=lambda x: isinstance(x, P),
    )
    specs = eqx.tree_at(
        lambda s: (s.model, s.opt_state),
        eqx.filter(state, _is_array),
        (model_specs, opt_specs),
        is_leaf=lambda x: x is None,
    )
    specs = jax.tree.map(lambda x: x if isinstance(x, P) else P(), specs,
                         is_leaf=lambda x: isinstance(x, P))
    return named(specs, mesh)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batches split on their leading (example) dimension over (data, fsdp)."""
    axes = tuple(a for a in BATCH_AXES if a in mesh.shape)
    return NamedSharding(mesh, P(axes))


def constrain_batch(x: jax.Array, mesh: Mesh | None) -> jax.Array:
    """Pin an activation's leading (batch) dimension to (data, fsdp); others replicated.

    Without this, GSPMD may follow the FSDP weights and split activations on `embed`
    instead, replicating the batch on every device (orders of magnitude more memory).
    A no-op without a mesh.
    """
    if mesh is None or mesh.size == 1:
        return x
    axes = tuple(a for a in BATCH_AXES if a in mesh.shape)
    spec = P(axes, *([None] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
