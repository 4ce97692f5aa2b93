"""Parameter paths as knobs name them: the parts of a leaf's pytree path joined by `/`.

`embedding/weight`, `stack/layers/0/attention/qkv`: Pax's spelling of variable paths, which its
regex knobs (`vn_regex`, a learner's variables) are written against. `train.vn.vn_regex` and
`learner.groups[].regex` are searched in these (`equipax.core.variational_noise`,
`equipax.core.optim`).
"""

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["is_param", "param_paths", "path_string"]


def path_string(path: tuple[Any, ...]) -> str:
    """`a/b/0/c` for a pytree key path (attribute names, dict keys and sequence indices)."""
    parts = []
    for entry in path:
        for attr in ("name", "key", "idx"):
            if hasattr(entry, attr):
                parts.append(str(getattr(entry, attr)))
                break
        else:
            parts.append(str(entry))
    return "/".join(parts)


def is_param(leaf: Any) -> bool:
    """A floating-point array (or its abstract shape): what a learner trains."""
    return isinstance(leaf, jax.Array | jax.ShapeDtypeStruct) and jnp.issubdtype(leaf.dtype, jnp.inexact)


def param_paths(tree: Any) -> list[str]:
    """The path of every parameter (`is_param`) of `tree`, in its flattening order."""
    return [path_string(path) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0] if is_param(leaf)]
