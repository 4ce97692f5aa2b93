"""Non-finite steps, host side: count the in-graph skips, stop when the policy says so.

The train step (built with `skip_nonfinite=True`) never applies an update whose loss or
gradient norm is not finite and reports `nonfinite` = 1.0 for it, so the state stays finite. It
also reports a step whose update overflows (its norm, or without train.check_update_norm an
element of it or of its square, is not finite; the update is applied only where the parameter
stays finite) and a step whose parameters' norm is not finite. An update can still leave
parameters finite but too large for the model (at a learning rate of 1e10 the next loss is NaN):
when the run stops, the step that wrote them is found from the norms around it, and no
checkpoint whose parameters a later step found to have no finite norm is named as good.
The loop hands each step's metrics to a
`NonFiniteMonitor` (device arrays, no sync) and calls `check` where it reads the device anyway:
when logged metrics are read back and before every checkpoint. `check` raises `NonFiniteError`
when `train.on_nonfinite="abort"` saw one such step, or "skip" saw more than
`train.max_consecutive_nonfinite` in a row. Its message names where the run became unstable
(the first skipped step, or an update or gradient blow-up just before it), the likely cause,
and the newest checkpoint saved before that; checkpoints saved since are set aside, so
rerunning (with a fix) resumes from a state training can continue from.
"""

import statistics
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Literal

import jax
import numpy as np

from equipax.launch.failures import NonFiniteError

__all__ = ["GRAD_BLOWUP_FACTOR", "NonFiniteMonitor", "poison_batch", "Rollback"]

# Per-step values the monitor keeps (device arrays until `check` reads them).
_RECORDED = ("nonfinite", "loss", "grad_norm", "update_norm", "param_norm", "learning_rate")
# A step whose gradient norm exceeds this many times the median of the steps before it blew up.
GRAD_BLOWUP_FACTOR = 10.0


def poison_batch(batch: Mapping[str, Any]) -> dict[str, Any]:
    """FOR TESTS (`train.debug_nan_steps`): the batch with every floating array set to NaN."""
    return {k: np.full_like(v, np.nan) if np.issubdtype(v.dtype, np.floating) else v for k, v in batch.items()}


# `rollback(unstable_from) -> (newest checkpoint before that step or None, steps set aside, where to)`.
Rollback = Callable[[int], tuple[int | None, list[int], str]]


class NonFiniteMonitor:
    """Counts skipped (non-finite) steps and enforces `train.on_nonfinite`.

    Arguments:
        mode: "skip" or "abort".
        max_consecutive: in "skip" mode, the most consecutive skipped steps tolerated.
        state: `state()` of the run this one resumes (counts carried over), or None.
    """

    def __init__(
        self, mode: Literal["skip", "abort"], max_consecutive: int, state: dict[str, Any] | None = None
    ) -> None:
        self.mode = mode
        self.max_consecutive = max_consecutive
        self.total: int = int((state or {}).get("nonfinite_total", 0))
        self.consecutive: int = int((state or {}).get("nonfinite_consecutive", 0))
        self.streak_start: int | None = (state or {}).get("nonfinite_streak_start")  # first skipped step in a row
        self._pending: list[tuple[int, Any]] = []
        self._history: deque[tuple[int, dict[str, float]]] = deque(maxlen=256)  # read steps, host floats

    def state(self) -> dict[str, Any]:
        """The counts, JSON-ready, for the checkpoint."""
        return {
            "nonfinite_total": self.total,
            "nonfinite_consecutive": self.consecutive,
            "nonfinite_streak_start": self.streak_start,
        }

    def record(self, step: int, metrics: dict[str, Any]) -> None:
        """Keep step `step`'s device metrics until the next `check` (no device sync)."""
        self._pending.append((step, {k: metrics[k] for k in _RECORDED if k in metrics}))

    def check(self, upto: int, *, rollback: Rollback, where: str, log: Callable[[str], object]) -> None:
        """Read the flags of steps <= `upto`, update the counts, log skips; raise to stop.

        Arguments:
            upto: the newest step whose metrics may be read now.
            rollback: given the step the run became unstable at, sets aside the checkpoints saved
                from then on and returns the newest one left (all saves finished) and those moved.
            where: the checkpoint directory, for the message.
            log: progress messages (one per skipped step).
        """
        ready = [(s, m) for s, m in self._pending if s <= upto]
        if not ready:
            return
        self._pending = [(s, m) for s, m in self._pending if s > upto]
        values = jax.device_get([m for _, m in ready])
        for (s, _), raw in zip(ready, values):
            v = {k: float(x) for k, x in raw.items()}
            self._history.append((s, v))
            if v["nonfinite"] == 0.0:
                self.consecutive, self.streak_start = 0, None
                continue
            self.total += 1
            self.consecutive += 1
            if self.streak_start is None:
                self.streak_start = s
            quantity = _quantity(v)
            if self.mode == "abort" or self.consecutive > self.max_consecutive:
                self._pending.clear()
                raise self._error(s, quantity, rollback, where)
            log(
                f"step {s}: {quantity}; the update was skipped ({self.consecutive} in a row, "
                f"{self.total} in all; train.max_consecutive_nonfinite={self.max_consecutive})."
            )

    def _unstable_from(self) -> tuple[int, str]:
        """The step the run became unstable at, and what likely caused it."""
        start = int(self.streak_start or 0)
        seen = dict(self._history)
        # A blow-up just before the first skipped step (finite, but it wrecked the parameters
        # that the next steps could no longer use) is where the trouble began; so is the step
        # that wrote parameters whose norm the next step found not finite.
        while start > 1 and (_params_overflowed(start, seen) or (start - 1 in seen and _blew_up(start - 1, seen))):
            start -= 1
        first = seen.get(start, {})
        lr = first.get("learning_rate", float("nan"))
        update, params = _update_norm(start, seen), first.get("param_norm", float("nan"))
        before = _median_grad_norm(start, seen)
        loss, grad_norm = first.get("loss", float("nan")), first.get("grad_norm", float("nan"))
        if np.isfinite(loss) and np.isfinite(grad_norm) and (update is None or not update <= params):
            norm = (
                f"update norm {update:.3g}"
                if "update_norm" in first
                else "an update whose square overflows float32"
                if update is None or not np.isfinite(update)
                else f"update norm at least {update:.3g}"
            )
            cause = (
                f"the updates outgrew the parameters ({norm} against parameter norm "
                f"{params:.3g} at learning rate {lr:.3g}): the learning rate is likely too high"
            )
        elif np.isfinite(loss) and before is not None and not grad_norm <= GRAD_BLOWUP_FACTOR * before:
            cause = (
                f"the gradient norm blew up ({first.get('grad_norm'):.3g} against a median of "
                f"{before:.3g} before): lower the learning rate or clip the gradients"
            )
        else:
            cause = (
                "a non-finite loss or gradient with no growth before it: likely a bad batch near "
                "that step, or an overflow inside the model"
            )
        return start, cause

    def _error(self, step: int, quantity: str, rollback: Rollback, where: str) -> NonFiniteError:
        if self.mode == "abort":
            why = "train.on_nonfinite='abort' stops at the first non-finite step"
        else:
            why = (
                f"{self.consecutive} consecutive steps were non-finite, more than "
                f"train.max_consecutive_nonfinite={self.max_consecutive}"
            )
        start, cause = self._unstable_from()
        good, moved, moved_to = rollback(start)
        seen = dict(self._history)
        # Never name a checkpoint whose parameters a later step found to have no finite norm.
        while good is not None and _params_overflowed(good + 1, seen):
            good, more, moved_to = rollback(good)
            moved = sorted({*moved, *more})
        unstable = f"The run became unstable at step {start}; likely cause: {cause}."
        if moved:
            unstable += (
                f" The checkpoint(s) saved since (step {', '.join(map(str, moved))}) were moved to "
                f"{moved_to} (kept, not resumed from)."
            )
        saved = (
            f"The last good checkpoint is step {good} in {where}; rerunning the same command resumes from it"
            if good is not None
            else "No checkpoint from before that step remains; rerunning starts from step 0"
        )
        return NonFiniteError(
            f"Step {step}: {quantity}; {why}. No non-finite update was applied and no checkpoint holds a "
            f"non-finite state. {unstable} {saved}. Lower learner.schedule.peak_learning_rate or "
            "learner.clip_gradient_norm, check the data near that step, or use --set "
            "train.on_nonfinite=skip (and train.max_consecutive_nonfinite) to step over rare bad batches.",
            step=step,
            last_checkpoint=good,
        )


def _quantity(v: dict[str, float]) -> str:
    loss, grad_norm = v["loss"], v["grad_norm"]
    if not np.isfinite(loss):
        return f"the loss is {loss}"
    if not np.isfinite(grad_norm):
        return f"the gradient norm is {grad_norm} (loss {loss:.4g})"
    if not np.isfinite(v.get("param_norm", 0.0)):
        return f"the parameter norm is {v['param_norm']} (loss {loss:.4g}, gradient norm {grad_norm:.4g})"
    norm = (
        f"update norm {v['update_norm']}"
        if "update_norm" in v
        else "an element of it or of its square overflows float32"
    )
    return (
        f"the update is not finite ({norm}, learning rate {v.get('learning_rate', float('nan')):.3g}; "
        f"loss {loss:.4g}, gradient norm {grad_norm:.4g})"
    )


def _params_overflowed(step: int, seen: dict[int, dict[str, float]]) -> bool:
    """Whether step `step` found the parameters it started from (those step `step - 1` wrote, the
    checkpoint of step `step - 1`) to have no finite norm."""
    return step in seen and not np.isfinite(seen[step].get("param_norm", 0.0))


def _update_norm(step: int, seen: dict[int, dict[str, float]]) -> float | None:
    """Step `step`'s update norm: the `update_norm` it logged, or without it
    (train.check_update_norm=false) the least it can be, |next parameter norm - parameter norm|
    (the triangle inequality); None when neither is known."""
    v = seen.get(step, {})
    if "update_norm" in v:
        return v["update_norm"]
    after = seen.get(step + 1, {}).get("param_norm")
    if after is None or "param_norm" not in v:
        return None
    return abs(after - v["param_norm"]) if np.isfinite(after) else float("inf")


def _median_grad_norm(step: int, seen: dict[int, dict[str, float]]) -> float | None:
    """The median gradient norm of up to 20 applied steps before `step` (None with fewer than 3)."""
    norms = [v["grad_norm"] for s, v in sorted(seen.items()) if s < step and v["nonfinite"] == 0.0][-20:]
    return statistics.median(norms) if len(norms) >= 3 else None


def _blew_up(step: int, seen: dict[int, dict[str, float]]) -> bool:
    """An applied step whose update outgrew the parameters, or whose gradient norm jumped."""
    v = seen[step]
    update = _update_norm(step, seen)
    if update is not None and update > v.get("param_norm", np.inf):
        return True
    before = _median_grad_norm(step, seen)
    return before is not None and v["grad_norm"] > GRAD_BLOWUP_FACTOR * before
