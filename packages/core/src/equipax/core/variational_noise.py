"""Variational noise: Gaussian weight noise in the training forward pass (Praxis' `vn`).

Each training step from `vn_start_step` on computes its loss, and so its gradient, at
`params + noise` for the trained parameters whose path matches `vn_regex`, with the noise drawn
from N(0, vn_scale^2) afresh each step; the optimizer's update is applied to the noise-free
parameters (the gradient of `L(p + e)` with respect to `p` is `L'(p + e)`). Evaluation and
decoding never call this: they see the parameters as trained.

The noise is a pure function of (key, step, leaf): the run's step key (`fold_in(key, step)`, the
key dropout also derives from) or, with `vn_seed` set, that seed folded with the step; each leaf
folds in its index among the parameters. So a resumed run draws exactly the noise the
uninterrupted one did.
"""

import re
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int, PRNGKeyArray

from equipax.core.learner_config import VariationalNoiseConfig
from equipax.core.param_paths import is_param, param_paths, path_string

__all__ = ["VariationalNoiseConfig", "add_variational_noise", "noise_key", "param_paths", "variational_noise"]

_SALT = 0x766E  # "vn": the noise's key is the step key folded with this, apart from dropout's


def noise_key(cfg: VariationalNoiseConfig, step_key: PRNGKeyArray, step: Int[Array, ""] | int) -> PRNGKeyArray:
    """The key of step `step`'s noise: from the step key, or from `cfg.vn_seed` and the step."""
    if cfg.vn_seed is None:
        return jax.random.fold_in(step_key, _SALT)
    return jax.random.fold_in(jax.random.key(cfg.vn_seed), step)


def _draws(params: Any, cfg: VariationalNoiseConfig, key: PRNGKeyArray, step: Int[Array, ""] | int) -> tuple[list, Any]:
    """The flat leaves of `params` with their noise (None: not a matched parameter) and the treedef."""
    pattern = re.compile(cfg.vn_regex)
    scale = jnp.where(step >= cfg.vn_start_step, cfg.vn_scale, 0.0).astype(jnp.float32)
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    pairs, index = [], 0
    for path, leaf in flat:
        draw = None
        if is_param(leaf):
            if pattern.search(path_string(path)):
                normal = jax.random.normal(jax.random.fold_in(key, index), leaf.shape, jnp.float32)
                draw = (scale * normal).astype(leaf.dtype)
            index += 1
        pairs.append((leaf, draw))
    return pairs, treedef


def variational_noise(
    params: Any, cfg: VariationalNoiseConfig, *, key: PRNGKeyArray, step: Int[Array, ""] | int
) -> Any:
    """The noise one step adds: a tree like `params` (non-parameter leaves unchanged), zeros for
    the leaves `vn_regex` does not match and for every leaf before `vn_start_step`.

    Arguments:
        params: the trained parameters (an Equinox module or any pytree; None leaves are skipped).
        cfg: the noise's knobs.
        key: `noise_key(cfg, step_key, step)`.
        step: the step number (the noise starts at `cfg.vn_start_step`).
    """
    pairs, treedef = _draws(params, cfg, key, step)
    zeros = [d if d is not None else jnp.zeros_like(x) if is_param(x) else x for x, d in pairs]
    return jax.tree_util.tree_unflatten(treedef, zeros)


def add_variational_noise(
    params: Any, cfg: VariationalNoiseConfig, *, key: PRNGKeyArray, step: Int[Array, ""] | int
) -> Any:
    """`params` plus `variational_noise(params, cfg, key=key, step=step)` (only the matched leaves change)."""
    pairs, treedef = _draws(params, cfg, key, step)
    return jax.tree_util.tree_unflatten(treedef, [x if d is None else x + d for x, d in pairs])
