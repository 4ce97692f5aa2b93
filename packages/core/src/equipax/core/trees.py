"""A pytree's arrays as one flat `{key path: array}` dict, and back.

The keys are `jax.tree_util.keystr` of each leaf's path (`.model.layers[0].weight`): the names a
checkpoint saves its arrays under, and the names Hugging Face conversions map tensors onto. Only
the array leaves travel (a `jax.ShapeDtypeStruct` counts as one: an abstract state is a restore's
template); the rest of the tree (static fields, callables) comes back from the template.
"""

from typing import Any

import equinox as eqx
import jax

__all__ = ["flat_arrays", "unflatten_into"]


def _is_array_or_abstract(x: Any) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def flat_arrays(tree: Any) -> dict[str, Any]:
    """The array leaves of `tree` by key path (`.model.layers[0].weight`): what a checkpoint saves.
    `jax.ShapeDtypeStruct` leaves count as arrays (an abstract state is a restore's template)."""
    arrays = eqx.filter(tree, _is_array_or_abstract)
    flat, _ = jax.tree_util.tree_flatten_with_path(arrays)
    return {jax.tree_util.keystr(path): leaf for path, leaf in flat}


def unflatten_into(template: Any, flat: dict[str, Any]) -> Any:
    """`template` with its array leaves (or `ShapeDtypeStruct`s) taken from `flat` (`flat_arrays`'s
    `{path: array}`)."""
    arrays, static = eqx.partition(template, _is_array_or_abstract)
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(arrays)
    leaves = [flat[jax.tree_util.keystr(p)] for p, _ in leaves_with_path]
    return eqx.combine(jax.tree_util.tree_unflatten(treedef, leaves), static)
