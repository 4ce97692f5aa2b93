"""Learners: learning-rate schedules and optax optimizer chains built from frozen configs.

Two learners:
- `adamw`: the CNN tutorial's `chain(clip_by_global_norm, adamw(schedule))` (docs/tutorial_cnn.md).
- `pax_adam`: Pax's Adam as used by the 22B experiment: global-norm clip -> Adam moments ->
  per-tensor update-RMS clip -> decoupled weight decay -> learning rate.

Weight decay (both learners) applies only to parameters with `ndim >= 2` (matrices, kernels,
embeddings); biases and norm scales are not decayed.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from equipax.core.configs import LearnerConfig, LearnerKind, ScheduleConfig, ScheduleKind

__all__ = [
    "clip_by_update_rms",
    "decay_mask",
    "Learner",
    "LearnerConfig",
    "LearnerKind",
    "make_learner",
    "make_schedule",
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


class Learner(NamedTuple):
    """An optimizer and the learning-rate schedule it follows (built together, one source)."""

    optimizer: optax.GradientTransformation
    schedule: optax.Schedule


def make_learner(cfg: LearnerConfig) -> Learner:
    """Build the optimizer described by `cfg`, with its schedule.

    Arguments:
        cfg: the learner config.

    Returns:
        `Learner(optimizer, schedule)` (unpacks as a pair). The optimizer is an optax
        transformation whose updates are added to the parameters (`eqx.apply_updates`); pass
        it parameters filtered with `eqx.is_inexact_array`. The schedule is the one the
        optimizer uses, for reporting the learning rate.
    """
    schedule = make_schedule(cfg.schedule)
    parts: list[optax.GradientTransformation] = []
    if cfg.clip_gradient_norm is not None:
        parts.append(optax.clip_by_global_norm(cfg.clip_gradient_norm))
    if cfg.kind == "adamw":
        parts.append(
            optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask)
        )
    else:
        parts.append(optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps))
        if cfg.clip_update_rms is not None:
            parts.append(clip_by_update_rms(cfg.clip_update_rms))
        if cfg.weight_decay > 0:
            parts.append(optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask))
        parts.append(optax.scale_by_learning_rate(schedule))
    return Learner(optax.chain(*parts), schedule)
