"""The learner's and the train step's configs: `ScheduleConfig`, `LearnerConfig` (with its
parameter groups, `ParamGroupConfig`) and `VariationalNoiseConfig`.

Re-exported by `equipax.core.optim`, which builds the learner. No JAX, numpy or equinox here, so
the CLI's `list`, `show` and knob errors stay fast.
"""

import dataclasses
import math
import re
from typing import Any, Literal

from equipax.core.knobs import ConfigError
from equipax.core.seeds import check_seed

__all__ = [
    "LearnerConfig",
    "LearnerKind",
    "ParamGroupConfig",
    "ScheduleConfig",
    "ScheduleKind",
    "VariationalNoiseConfig",
]

ScheduleKind = Literal["constant", "warmup_cosine", "linear_rampup_exponential_decay"]
LearnerKind = Literal["adamw", "pax_adam"]

_SCHEDULE_KINDS = ("constant", "warmup_cosine", "linear_rampup_exponential_decay")
_LEARNER_KINDS = ("adamw", "pax_adam")
_MU_DTYPES = ("float32", "bfloat16")


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
                    "schedule.final_fraction", "a number in (0, 1] for an exponential decay", self.final_fraction
                )
            if self.decay_start and self.decay_start < self.warmup_steps:
                raise _bad("schedule.decay_start", f"0 or >= warmup_steps ({self.warmup_steps})", self.decay_start)
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
        mu_dtype: the dtype Adam's first moment is stored in (optax's and MaxText's `mu_dtype`):
            None = the parameters' dtype (float32); "bfloat16" halves its memory and the bytes
            the update's pass moves for it. The second moment stays in the parameters' dtype.
        groups: parameter groups with their own learner (Pax's several learners;
            `ParamGroupConfig`): each parameter whose path a group's `regex` matches is updated by
            that group's learner (or not at all: a frozen group); the rest by this one.
    """

    kind: LearnerKind = "adamw"
    schedule: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip_gradient_norm: float | None = 1.0
    clip_update_rms: float | None = None
    mu_dtype: Literal["float32", "bfloat16"] | None = None
    groups: tuple["ParamGroupConfig", ...] = ()

    def __post_init__(self) -> None:
        names = [g.name for g in self.groups]
        for g in self.groups:
            if g.learner is not None and g.learner.groups:
                raise _bad(f"learner.groups[{g.name!r}].learner.groups", "() (groups do not nest)", g.learner.groups)
            if g.name == "default" or names.count(g.name) > 1:
                raise _bad(
                    "learner.groups",
                    "groups with distinct names other than 'default' (the parameters no group matches)",
                    names,
                )
        if self.kind not in _LEARNER_KINDS:
            raise _bad("learner.kind", f"one of {_LEARNER_KINDS}", self.kind)
        if self.mu_dtype not in (None, *_MU_DTYPES):
            raise _bad("learner.mu_dtype", f"one of {_MU_DTYPES}, or None (the parameters' dtype)", self.mu_dtype)
        for name in ("b1", "b2"):
            value = getattr(self, name)
            if not 0 <= value < 1:
                raise _bad(f"learner.{name}", "a number in [0, 1)", value)
        if not 0 <= self.eps < math.inf:
            raise _bad("learner.eps", "a finite number >= 0", self.eps)
        if not 0 <= self.weight_decay < math.inf:
            raise _bad("learner.weight_decay", "a finite number >= 0", self.weight_decay)
        if self.clip_gradient_norm is not None and not self.clip_gradient_norm > 0:
            raise _bad("learner.clip_gradient_norm", "a number > 0, or None for no clip", self.clip_gradient_norm)
        if self.clip_update_rms is not None:
            if not self.clip_update_rms > 0:
                raise _bad("learner.clip_update_rms", "a number > 0, or None for no clip", self.clip_update_rms)
            if self.kind != "pax_adam":
                raise _bad(
                    "learner.clip_update_rms",
                    "None unless kind='pax_adam'",
                    self.clip_update_rms,
                    "Set learner.kind='pax_adam' or learner.clip_update_rms=None.",
                )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParamGroupConfig:
    """A group of parameters with its own learner (`learner.groups`; Pax's several learners).

    Arguments:
        name: the group's name (its learning rate is logged as `learning_rate/<name>`).
        regex: `re.search`ed in each trained parameter's path, written with `/` between its parts
            (`embedding/weight`, `stack/layers/0/attention/qkv`; `equipax.core.param_paths`). A
            group that matches no parameter, or a parameter two groups match, is a ConfigError.
        learner: the group's optimizer and schedule (its own clipping: the global-norm clip is
            over the group's gradients); None = frozen (never updated).
    """

    name: str
    regex: str
    learner: LearnerConfig | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise _bad("learner.groups[].name", "a non-empty name", self.name)
        try:
            re.compile(self.regex)
        except re.error as e:
            raise _bad(
                f"learner.groups[{self.name!r}].regex", "a valid regular expression", self.regex, f"({e})."
            ) from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class VariationalNoiseConfig:
    """Gaussian weight noise in the training forward pass (Praxis' `vn`; `train.vn.*`).

    From step `vn_start_step` on, every trained parameter whose path matches `vn_regex` gets noise
    drawn from N(0, vn_scale^2) added for the loss and its gradient; the update is applied to the
    noise-free parameters, and evaluation and decoding never see noise
    (`equipax.core.variational_noise`).

    vn_scale: the noise's standard deviation; 0 = off (Pax's default).
    vn_regex: `re.search`ed in each parameter's path with `/` between its parts (Pax's spelling,
        e.g. `blocks/attention|embed`); "" = every trained parameter.
    vn_start_step: the first step that gets noise.
    vn_seed: None = the noise comes from the run's step key (`train.seed`, new each step);
        an int in `[0, 2**63)` = from this seed folded with the step, so the noise does not change with `train.seed`.
    """

    vn_scale: float = 0.0
    vn_regex: str = ""
    vn_start_step: int = 0
    vn_seed: int | None = None

    def __post_init__(self) -> None:
        scale = self.vn_scale
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not 0 <= scale < math.inf:
            raise _bad("train.vn.vn_scale", "a finite number >= 0 (0 = no noise)", scale)
        if not isinstance(self.vn_regex, str):
            raise _bad("train.vn.vn_regex", "a regular expression (a string)", self.vn_regex)
        try:
            re.compile(self.vn_regex)
        except re.error as e:
            raise _bad("train.vn.vn_regex", "a valid regular expression", self.vn_regex, f"({e}).") from None
        if isinstance(self.vn_start_step, bool) or not isinstance(self.vn_start_step, int) or self.vn_start_step < 0:
            raise _bad("train.vn.vn_start_step", "an int >= 0", self.vn_start_step)
        if self.vn_seed is not None:
            check_seed(self.vn_seed, "train.vn.vn_seed")

    @property
    def enabled(self) -> bool:
        return self.vn_scale > 0
