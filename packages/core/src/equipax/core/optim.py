"""Learners: learning-rate schedules and optax optimizer chains built from frozen configs.

Two learners:
- `adamw`: the CNN tutorial's `chain(clip_by_global_norm, adamw(schedule))` (docs/tutorial_cnn.md).
- `pax_adam`: Pax's Adam as used by the 22B experiment: global-norm clip -> Adam moments ->
  per-tensor update-RMS clip -> decoupled weight decay -> learning rate.

Weight decay (both learners) applies only to parameters with `ndim >= 2` (matrices, kernels,
embeddings); biases and norm scales are not decayed.

`pax_adam`'s Adam (`scale_by_adam_of_kept_moments`) is optax's, computing its update from the
moments the train step's non-finite guard keeps, so that XLA applies the update-RMS clip in the
passes the moments already take (the same numbers as the plain optax chain, bit for bit).

Several learners (Pax's): `LearnerConfig.groups` names parameter groups by a regex on their paths
(`equipax.core.param_paths`), each with its own learner or frozen; `make_learner` then builds one
`optax.multi_transform` over them, the parameters no group matches under the "default" learner
(the config's own knobs). Each learner runs on its own group alone (its gradient clip is over
the group's gradients), exactly as if it trained those parameters by itself.
"""

import re
from collections.abc import Sequence
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from equipax.core.knobs import ConfigError
from equipax.core.learner_config import LearnerConfig, LearnerKind, ParamGroupConfig, ScheduleConfig, ScheduleKind
from equipax.core.param_paths import param_paths, path_string

__all__ = [
    "clip_by_update_rms",
    "decay_mask",
    "group_labels",
    "group_schedules",
    "Learner",
    "LearnerConfig",
    "LearnerKind",
    "make_learner",
    "make_schedule",
    "ParamGroupConfig",
    "scale_by_adam_of_kept_moments",
    "ScheduleConfig",
    "ScheduleKind",
]


def make_schedule(cfg: ScheduleConfig) -> optax.Schedule:
    """Build the learning-rate schedule described by `cfg`.

    Arguments:
        cfg: the schedule config.

    Returns:
        A function from the step (0 for the first update) to the learning rate.
    """
    peak = cfg.peak_learning_rate
    if cfg.kind == "constant":
        return optax.constant_schedule(peak)
    if cfg.kind == "warmup_cosine":
        cosine = optax.cosine_decay_schedule(peak, cfg.decay_steps, alpha=cfg.final_fraction)
        if cfg.warmup_steps == 0:
            return cosine
        warmup = optax.linear_schedule(0.0, peak, cfg.warmup_steps)
        return optax.join_schedules([warmup, cosine], [cfg.warmup_steps])
    return _linear_rampup_exponential_decay(
        peak=peak,
        warmup_steps=cfg.warmup_steps,
        decay_start=cfg.effective_decay_start,
        decay_end=cfg.decay_steps,
        final_fraction=cfg.final_fraction,
    )


def _linear_rampup_exponential_decay(
    *, peak: float, warmup_steps: int, decay_start: int, decay_end: int, final_fraction: float
) -> optax.Schedule:
    def schedule(step):
        s = jnp.asarray(step, jnp.float32)
        ramp = peak * s / warmup_steps if warmup_steps > 0 else jnp.asarray(peak, jnp.float32)
        progress = jnp.clip((s - decay_start) / (decay_end - decay_start), 0.0, 1.0)
        decayed = peak * jnp.power(jnp.float32(final_fraction), progress)
        return jnp.where(s < warmup_steps, ramp, decayed)

    return schedule


def decay_mask(params: Any) -> Any:
    """Weight-decay mask: True for parameters with `ndim >= 2` (None leaves stay None)."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def clip_by_update_rms(max_rms: float) -> optax.GradientTransformation:
    """Scale each tensor of the update so that its root-mean-square is at most `max_rms`.

    This is Pax's per-tensor update clip (`clip_threshold` of its Adam): each leaf is divided by
    `max(1, rms(leaf) / max_rms)`.

    Arguments:
        max_rms: the largest allowed RMS of any one tensor's update.

    Returns:
        A stateless optax transformation.
    """

    def init_fn(params):
        del params
        return optax.EmptyState()

    def clip(u):
        rms = jnp.sqrt(jnp.mean(jnp.square(u.astype(jnp.float32))))
        return (u / jnp.maximum(1.0, rms / max_rms)).astype(u.dtype)

    def update_fn(updates, state, params=None):
        del params
        return jax.tree.map(clip, updates), state

    return optax.GradientTransformation(init_fn, update_fn)


def scale_by_adam_of_kept_moments(
    *, b1: float, b2: float, eps: float, mu_dtype: Any = None
) -> optax.GradientTransformationExtraArgs:
    """`optax.scale_by_adam` whose update is computed from the moments the train step keeps.

    With the extra argument `grads_finite` (a scalar bool the train step passes under
    `skip_nonfinite`: False when it discards the step and keeps the old optimizer state), the
    update is computed from the moments the step keeps: the new ones where `grads_finite`, else
    the old ones. Where the step applies it, the update is `optax.scale_by_adam`'s, bit for bit;
    where it does not, the step discards it. The state returned is always optax's new state (the
    step selects it against the old one).

    Why: Pax's per-tensor update-RMS clip (`clip_by_update_rms`) needs each tensor's whole update
    before any of it is applied, so XLA applies the update in a second pass, which recomputes it
    from the moments the first pass wrote. It can do that only from the moments the step stores:
    computed from the moments before the guard's select, the update made XLA write the unselected
    first moment and the update's denominator as well and read them back, 14 arrays of a weight's
    size moved per weight and step instead of 10 (AdamW's one pass: 8; benchmarks/README.md, "Pax's
    learner"; tests/launch/test_compile_tpu.py).

    Without `grads_finite`, or where the first moment is stored in a narrower dtype than the
    update is computed in (`mu_dtype='bfloat16'`, whose rounding the update must not see), the
    update is `optax.scale_by_adam`'s own.
    """
    adam = optax.scale_by_adam(b1=b1, b2=b2, eps=eps, mu_dtype=mu_dtype)

    def update_fn(updates, state, params=None, *, grads_finite=None, **extra_args):
        del extra_args
        new_updates, new_state = adam.update(updates, state, params)
        if grads_finite is None:
            return new_updates, new_state
        new, old = cast(optax.ScaleByAdamState, new_state), cast(optax.ScaleByAdamState, state)

        def kept(moment: Any, before: Any, decay: float) -> Any:
            # The step's own select of the state, written the same way: XLA computes it once.
            moment = jax.tree.map(lambda m, b: jnp.where(grads_finite, m, b), moment, before)
            return optax.tree.bias_correction(moment, decay, new.count)

        def direction(u, m, v):
            if u is None or m.dtype != u.dtype:
                return u
            return m / (jnp.sqrt(v) + eps)

        mu_hat, nu_hat = kept(new.mu, old.mu, b1), kept(new.nu, old.nu, b2)
        return jax.tree.map(direction, new_updates, mu_hat, nu_hat, is_leaf=lambda x: x is None), new_state

    return optax.GradientTransformationExtraArgs(adam.init, update_fn)


class Learner(NamedTuple):
    """An optimizer and the learning-rate schedule it follows (built together, one source)."""

    optimizer: optax.GradientTransformation
    schedule: optax.Schedule


def make_learner(cfg: LearnerConfig) -> Learner:
    """Build the optimizer described by `cfg`, with its schedule.

    Arguments:
        cfg: the learner config; with `cfg.groups`, several learners (the module docstring).

    Returns:
        `Learner(optimizer, schedule)` (unpacks as a pair). The optimizer is an optax
        transformation whose updates are added to the parameters (`eqx.apply_updates`); pass
        it parameters filtered with `eqx.is_inexact_array`. The schedule is the one the
        optimizer uses (the default group's, with groups), for reporting the learning rate;
        `group_schedules(cfg)` has the groups'.
    """
    default = _make_one(cfg)
    if not cfg.groups:
        return default
    transforms: dict[Any, optax.GradientTransformation] = {"default": default.optimizer}
    for g in cfg.groups:
        transforms[g.name] = optax.set_to_zero() if g.learner is None else _make_one(g.learner).optimizer
    return Learner(optax.multi_transform(transforms, lambda tree: group_labels(tree, cfg.groups)), default.schedule)


def group_schedules(cfg: LearnerConfig) -> dict[str, optax.Schedule]:
    """The learning-rate schedule of each (not frozen) group of `cfg.groups`, by name."""
    return {g.name: make_schedule(g.learner.schedule) for g in cfg.groups if g.learner is not None}


def group_labels(tree: Any, groups: Sequence[ParamGroupConfig]) -> Any:
    """The name of the group that trains each parameter of `tree` ("default" where none matches).

    Raises:
        ConfigError: a group matches no parameter, or two groups match one (naming them and the
            paths, so the regex can be fixed).
    """
    patterns = [(g.name, re.compile(g.regex)) for g in groups]
    used: set[str] = set()

    def label(path: tuple[Any, ...], leaf: Any) -> Any:
        # By path alone: optax also labels trees shaped like the parameters whose leaves are not
        # arrays (`optax.tree_map_params` with PartitionSpecs), and they must get the same labels.
        name = path_string(path)
        hits = [g for g, pattern in patterns if pattern.search(name)]
        if len(hits) > 1:
            raise ConfigError(
                f"learner.groups: the parameter {name!r} matches the regexes of groups {hits}; each parameter "
                "belongs to one group. Make the regexes exclusive (e.g. anchor them: '^embedding/')."
            )
        used.update(hits)
        return hits[0] if hits else "default"

    labels = jax.tree_util.tree_map_with_path(label, tree, is_leaf=lambda x: isinstance(x, PartitionSpec))
    paths = param_paths(tree)
    unused = [g.name for g in groups if g.name not in used]
    if unused and paths:  # (optax also labels trees without parameters, e.g. empty states)
        shown = ", ".join(paths[:8]) + (f", ... ({len(paths)} in all)" if len(paths) > 8 else "")
        raise ConfigError(
            f"learner.groups {unused} match no trained parameter, so their learners would train nothing. "
            f"The paths their regexes are searched in: {shown}. Fix the regex, or drop the group."
        )
    return labels


def _make_one(cfg: LearnerConfig) -> Learner:
    """One learner: `cfg`'s optimizer chain and schedule (its groups aside)."""
    schedule = make_schedule(cfg.schedule)
    parts: list[optax.GradientTransformation] = []
    if cfg.clip_gradient_norm is not None:
        parts.append(optax.clip_by_global_norm(cfg.clip_gradient_norm))
    if cfg.kind == "adamw":
        parts.append(
            optax.adamw(
                schedule,
                b1=cfg.b1,
                b2=cfg.b2,
                eps=cfg.eps,
                weight_decay=cfg.weight_decay,
                mask=decay_mask,
                mu_dtype=cfg.mu_dtype,
            )
        )
    else:
        parts.append(scale_by_adam_of_kept_moments(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, mu_dtype=cfg.mu_dtype))
        if cfg.clip_update_rms is not None:
            parts.append(clip_by_update_rms(cfg.clip_update_rms))
        if cfg.weight_decay > 0:
            parts.append(optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask))
        parts.append(optax.scale_by_learning_rate(schedule))
    return Learner(optax.chain(*parts), schedule)
