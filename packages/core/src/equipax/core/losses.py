"""Several named, weighted losses in one Task (Pax's loss aggregator).

A Task's `loss` may return, in place of one scalar, a mapping `{name: (value, weight)}`: e.g. a
mixture of experts' `{"cross_entropy": (ce, 1.0), "router_aux": (aux, 0.01), "router_z": (z,
0.001)}`. The steps differentiate their aggregate `sum(weight * value)` (summed in the mapping's
order, so the total is the same number on every call), log each unweighted value as
`loss/<name>` beside the total `loss`, and evaluate each separately: an eval batch contributes
`loss_sum/<name> = value * weight_sum`, so the pass reports `loss/<name>` as the weight-weighted
mean of the per-batch values (for a per-token mean such as the cross-entropy that is exactly the
pass's per-token mean; for a per-batch statistic such as a router loss, its mean over the pass
weighted by each batch's tokens).
"""

import re
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Scalar

__all__ = [
    "aggregate_losses",
    "is_named_losses",
    "LOSS_PREFIX",
    "named_loss_sums",
    "NamedLosses",
    "SUM_PREFIX",
    "check_named_losses",
]

# `{name: (value, weight)}`: each value a scalar array, each weight a number or a scalar array.
NamedLosses = Mapping[str, tuple[Scalar, float | ArrayLike]]

LOSS_PREFIX = "loss/"  # the train and eval metric of one named loss: `loss/<name>`
SUM_PREFIX = "loss_sum/"  # its eval sum: `loss_sum/<name>`, combined by `mean_eval_metrics`

_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]*")


def is_named_losses(loss: Any) -> bool:
    """Whether a loss function returned named losses (a mapping) rather than one scalar."""
    return isinstance(loss, Mapping)


def check_named_losses(losses: Any) -> str | None:
    """What is wrong with `losses` as named losses, in one sentence; None when nothing is."""
    if not isinstance(losses, Mapping) or not losses:
        return "The named losses are empty; return at least one `{name: (value, weight)}`."
    for name, entry in losses.items():
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            return f"The loss name {name!r} is not a name (a letter, then letters, digits, '_', '.' or '-')."
        if not isinstance(entry, tuple) or len(entry) != 2:
            return f"The named loss {name!r} is a {type(entry).__name__}; expected a `(value, weight)` pair."
        value, weight = entry
        if jnp.shape(value) != ():
            return f"The named loss {name!r} has shape {jnp.shape(value)}; expected a scalar."
        if jnp.shape(weight) != ():
            return f"The weight of the named loss {name!r} has shape {jnp.shape(weight)}; expected a number."
    return None


def aggregate_losses(losses: NamedLosses) -> tuple[Float[Array, ""], dict[str, Array]]:
    """The loss the step differentiates and the metric of each part.

    Arguments:
        losses: `{name: (value, weight)}` (checked by `check_named_losses`).

    Returns:
        `(sum of weight * value, in the mapping's order; {"loss/<name>": value})`.
    """
    total: Any = None
    metrics: dict[str, Array] = {}
    for name, (value, weight) in losses.items():
        term = jnp.asarray(weight, jnp.float32) * jnp.asarray(value, jnp.float32)
        total = term if total is None else total + term
        metrics[LOSS_PREFIX + name] = jnp.asarray(value, jnp.float32)
    return total, metrics


def named_loss_sums(metrics: Mapping[str, Array]) -> dict[str, Array]:
    """One eval batch's sums of its named losses, from its metrics (`loss/<name>` each, beside the
    batch's `weight_sum`): `{"loss_sum/<name>": value * weight_sum}`; empty without either."""
    if "weight_sum" not in metrics:
        return {}
    weight = metrics["weight_sum"]
    return {SUM_PREFIX + k[len(LOSS_PREFIX) :]: v * weight for k, v in metrics.items() if k.startswith(LOSS_PREFIX)}
