"""Non-finite steps, host side: count the in-graph skips, stop when the policy says so.

The train step (built with `skip_nonfinite=True`) never applies an update whose loss or
gradient norm is not finite and reports `nonfinite` = 1.0 for it, so the state stays finite and
every checkpoint restores to usable parameters. The loop hands each step's metrics to a
`NonFiniteMonitor` (device arrays, no sync) and calls `check` where it reads the device anyway:
when logged metrics are read back and before every checkpoint. `check` raises `NonFiniteError`
when `train.on_nonfinite="abort"` saw one such step, or "skip" saw more than
`train.max_consecutive_nonfinite` in a row.
"""

from collections.abc import Callable
from typing import Any, Literal

import jax
import numpy as np



class NonFiniteError(Exception):
    """The run stopped on non-finite steps; the message names the step, the quantity, the checkpoint."""

    def __init__(self, message: str, *, step: int, last_checkpoint: int | None):
        super().__init__(message)
        self.step = step
        self.last_checkpoint = last_checkpoint


def poison_batch(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """FOR TESTS (`train.debug_nan_steps`): the batch with every floating array set to NaN."""
    return {k: np.full_like(v, np.nan) if np.issubdtype(v.dtype, np.floating) else v
            for k, v in batch.items()}


class NonFiniteMonitor:
    """Counts skipped (non-finite) steps and enforces `train.on_nonfinite`.

    Arguments:
        mode: "skip" or "abort".
        max_consecutive: in "skip" mode, the most consecutive skipped steps tolerated.
        state: `state()` of the run this one resumes (counts carried over), or None.
    """

    def __init__(self, mode: Literal["skip", "abort"], max_consecutive: int,
                 state: dict[str, Any] | None = None):
        self.mode = mode
        self.max_consecutive = max_consecutive
        self.total = int((state or {}).get("nonfinite_total", 0))
        self.consecutive = int((state or {}).get("nonfinite_consecutive", 0))
        self._pending: list[tuple[int, Any]] = []

    def state(self) -> dict[str, int]:
        """The counts, JSON-ready, for the checkpoint."""
        return {"nonfinite_total": self.total, "nonfinite_consecutive": self.consecutive}

    def record(self, step: int, metrics: dict[str, Any]) -> None:
        """Keep step `step`'s device metrics until the next `check` (no device sync)."""
        self._pending.append((step, {k: metrics[k] for k in ("nonfinite", "loss", "grad_norm")}))

    def check(self, upto: int, *, last_checkpoint: Callable[[], int | None], where: str,
              log: Callable[[str], object]) -> None:
        """Read the flags of steps <= `upto`, update the counts, log skips; raise to stop.

        Arguments:
            upto: the newest step whose metrics may be read now.
            last_checkpoint: returns the newest complete checkpoint's step (all saves finished).
            where: the checkpoint directory, for the message.
            log: progress messages (one per skipped step).
        """
        ready = [(s, m) for s, m in self._pending if s <= upto]
        if not ready:
            return
        self._pending = [(s, m) for s, m in self._pending if s > upto]
        values = jax.device_get([m for _, m in ready])
        for (s, _), v in zip(ready, values):
            if float(v["nonfinite"]) == 0.0:
                self.consecutive = 0
                continue
            self.total += 1
            self.consecutive += 1
            loss, grad_norm = float(v["loss"]), float(v["grad_norm"])
            quantity = (f"the loss is {loss}" if not np.isfinite(loss)
                        else f"the gradient norm is {grad_norm} (loss {loss:.4g})")
            if self.mode == "abort" or self.consecutive > self.max_consecutive:
                self._pending.clear()
                raise self._error(s, quantity, last_checkpoint(), where)
            log(f"step {s}: {quantity}; the update was skipped ({self.consecutive} in a row, "
                f"{self.total} in all; train.max_consecutive_nonfinite={self.max_consecutive}).")

    def _error(self, step: int, quantity: str, ckpt: int | None, where: str) -> NonFiniteError:
        if self.mode == "abort":
            why = "train.on_nonfinite='abort' stops at the first non-finite step"
        else:
            why = (f"{self.consecutive} consecutive steps were non-finite, more than "
                   f"train.max_consecutive_nonfinite={self.max_consecutive}")
        saved = (f"The last good checkpoint is step {ckpt} in {where}; rerunning the same command "
                 "resumes from it" if ckpt is not None else
                 "No checkpoint was saved yet; rerunning starts from step 0")
        return NonFiniteError(
            f"Step {step}: {quantity}; {why}. The update was not applied and no checkpoint holds a "
            f"non-finite state. {saved}. Lower learner.schedule.peak_learning_rate or "
            "learner.clip_gradient_norm, check the data near that step, or use --set "
            "train.on_nonfinite=skip (and train.max_consecutive_nonfinite) to step over rare bad batches.",
            step=step, last_checkpoint=ckpt,
        )
