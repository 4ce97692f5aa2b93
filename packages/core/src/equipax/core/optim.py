"""Learners: learning-rate schedules and optax optimizer chains built from frozen configs.

Two learners:
- `adamw`: the German tutorial's `chain(clip_by_global_norm, adamw(schedule))`.
- `pax_adam`: Pax's Adam as used by the 22B experiment: global-norm clip -> Adam moments ->
  per-tensor update-RMS clip -> decoupled weight decay -> learning rate.

Weight decay (both learners) applies only to parameters with `ndim >= 2` (matrices, kernels,
embeddings); biases and norm scales are not decayed.
"""

import dataclasses
import math
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax
from equipax.core.config import ConfigError

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

ScheduleKind = Literal["constant", "warmup_cosine", "linear_rampup_exponential_decay"]
LearnerKind = Literal["adamw", "pax_adam"]

_SCHEDULE_KINDS = ("constant", "warmup_cosine", "linear_rampup_exponential_decay")
_LEARNER_KINDS = ("adamw", "pax_adam")


def _bad(field: str, expected: str, found: Any, fix: str = "") -> ConfigError:
    msg = f"{field}: expected {expected}, found {found!r}."
    return ConfigError(f"{msg} {fix}".strip())


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """A learning-rate schedule.

    Arguments:
        kind: `constant` (always `peak_learning_rate`); `warmup_cosine` (linear 0 -> peak over
            `warmup_steps`, then cosine decay over `decay_steps` to `final_fraction * peak`);
            `linear_rampup_exponential_decay` (Pax's LinearRampupExponentialDecay: linear
            0 -> peak over `warmup_steps`, constant until `decay_start`, exponential decay to
            `final_fraction * peak` at step `decay_steps`, constant after).
        peak_learning_rate: the largest learning rate.
        warmup_steps: length of the linear warmup from 0.
        decay_steps: `warmup_cosine`: steps of the cosine after warmup; exponential decay: the
            step at which the decay ends (Pax's `decay_end`).
        final_fraction: the floor as a fraction of the peak (cosine `alpha`, Pax's `min_ratio`).
        decay_start: exponential decay only: the step at which the decay starts (Pax's
            `decay_start`); 0 means "at the end of warmup".
    """

    kind: ScheduleKind = "constant"
    peak_learning_rate: float = 1e-3
    warmup_steps: int = 0
    decay_steps: int = 0
    final_fraction: float = 0.1
    decay_start: int = 0

    def __post_init__(self) -> None:
        if self.kind not in _SCHEDULE_KINDS:
            raise _bad("schedule.kind", f"one of {_SCHEDULE_KINDS}", self.kind)
        if not 0 < self.peak_learning_rate < math.inf:  # refuses nan and inf alike
            raise _bad("schedule.peak_learning_rate", "a finite number > 0", self.peak_learning_rate)
        for name in ("warmup_steps", "decay_steps", "decay_start"):
            value = getattr(self, name)
            if value < 0:
                raise _bad(f"schedule.{name}", "an integer >= 0", value)
        if self.kind == "warmup_cosine":
            if self.decay_steps <= 0:
                raise _bad(
                    "schedule.decay_steps",
                    "> 0 for kind='warmup_cosine' (the length of the cosine after warmup)",
                    self.decay_steps,
                )
            if not 0 <= self.final_fraction <= 1:
                raise _bad("schedule.final_fraction", "a number in [0, 1]", self.final_fraction)
        if self.kind == "linear_rampup_exponential_decay":
            if not 0 < self.final_fraction <= 1:
                raise _bad(
                    "schedule.final_fraction",
                    "a number in (0, 1] for an exponential decay",
                    self.final_fraction,
                )
            if self.decay_start and self.decay_start < self.warmup_steps:
                raise _bad(
                    "schedule.decay_start",
                    f"0 or >= warmup_steps ({self.warmup_steps})",
                    self.decay_start,
                )
            if self.decay_steps <= self.effective_decay_start:
                raise _bad(
                    "schedule.decay_steps",
                    f"the step the decay ends, > decay start ({self.effective_decay_start})",
                    self.decay_steps,
                )

    @property
    def effective_decay_start(self) -> int:
        """The step where the exponential decay begins (`decay_start`, or the warmup's end)."""
        return self.decay_start or self.warmup_steps


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class LearnerConfig:
    """An optimizer: schedule, Adam hyperparameters, clipping and weight decay.

    Arguments:
        kind: `adamw` (optax AdamW after a global-norm clip) or `pax_adam` (Pax's Adam: global-norm
            clip, Adam, per-tensor update-RMS clip, decoupled weight decay, learning rate).
        schedule: the learning-rate schedule.
        b1, b2, eps: Adam's moment decays and denominator epsilon.
        weight_decay: decoupled weight decay (multiplied by the learning rate), on `ndim >= 2`
            parameters only.
        clip_gradient_norm: clip the global gradient norm to this value; None for no clip.
        clip_update_rms: `pax_adam` only: scale each tensor's Adam update so its RMS is at most
            this value; None for no clip.
    """

    kind: LearnerKind = "adamw"
    schedule: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip_gradient_norm: float | None = 1.0
    clip_update_rms: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in _LEARNER_KINDS:
            raise _bad("learner.kind", f"one of {_LEARNER_KINDS}", self.kind)
        for name in ("b1", "b2"):
            value = getattr(self, name)
            if not 0 <= value < 1:
                raise _bad(f"learner.{name}", "a number in [0, 1)", value)
        if not 0 <= self.eps < math.inf:
            raise _bad("learner.eps", "a finite number >= 0", self.eps)
        if not 0 <= self.weight_decay < math.inf:
            raise _bad("learner.weight_decay", "a finite number >= 0", self.weight_decay)
        if self.clip_gradient_norm is not None and not self.clip_gradient_norm > 0:
            raise _bad(
                "learner.clip_gradient_norm", "a number > 0, or None for no clip",
                self.clip_gradient_norm,
            )
        if self.clip_update_rms is not None:
            if not self.clip_update_rms > 0:
                raise _bad(
                    "learner.clip_update_rms", "a number > 0, or None for no clip",
                    self.clip_update_rms,
                )
            if self.kind != "pax_adam":
                raise _bad(
                    "learner.clip_update_rms",
                    "None unless kind='pax_adam'",
                    self.clip_update_rms,
                    "Set learner.kind='pax_adam' or learner.clip_update_rms=None.",
                )


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
            optax.adamw(
                schedule,
                b1=cfg.b1,
                b2=cfg.b2,
                eps=cfg.eps,
                weight_decay=cfg.weight_decay,
                mask=decay_mask,
            )
        )
    else:
        parts.append(optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps))
        if cfg.clip_update_rms is not None:
            parts.append(clip_by_update_rms(cfg.clip_update_rms))
        if cfg.weight_decay > 0:
            parts.append(optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask))
        parts.append(optax.scale_by_learning_rate(schedule))
    return Learner(optax.chain(*parts), schedule)
