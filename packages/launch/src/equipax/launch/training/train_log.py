"""The loop's train records: loss, learning rate, norms, step time, throughput, MFU and the input's counts.

Every `train.log_every` steps (and the run's last step, and the step a stop happens at) the
step's metrics are kept on the device and read back after the next step was dispatched, so the
device never waits for the host. Step time is wall time per step between two reads, less the time
the hooks took (the loop tells the timer) and the first step's compilation.
"""

import math
import time
from collections.abc import Callable
from typing import Any

import jax

from equipax.core.losses import LOSS_PREFIX
from equipax.launch.cluster.distributed import sum_over_processes, to_host
from equipax.launch.configs.experiment import ExperimentConfig
from equipax.launch.hardware.accelerators import peak_tflops_of
from equipax.launch.training.hooks import RunContext

__all__ = ["device_peak_tflops", "StepTimer", "TrainLog"]

_RECORDED = ("loss", "accuracy", "learning_rate", "grad_norm", "param_norm")


def device_peak_tflops(cfg: ExperimentConfig) -> float | None:
    """The per-device peak used for MFU: the config's, else the accelerator table's, else None (CPU)."""
    if cfg.train.peak_tflops_per_device is not None:
        return cfg.train.peak_tflops_per_device
    return peak_tflops_of(jax.devices()[0].device_kind)


class StepTimer:
    """Seconds per step between two reads, less the time excluded in between (hooks, compilation)."""

    def __init__(self, step: int) -> None:
        self.restart(step)

    def restart(self, step: int) -> None:
        self.t: float = time.monotonic()
        self.step: int = step
        self.excluded: float = 0.0

    def exclude(self, seconds: float) -> None:
        """Keep `seconds` (spent outside the steps) out of the next reading."""
        self.excluded += seconds

    def lap(self, step: int) -> float:
        now = time.monotonic()
        per_step = max(now - self.t - self.excluded, 1e-9) / max(step - self.step, 1)
        self.t, self.step, self.excluded = now, step, 0.0
        return per_step


class TrainLog:
    """Writes the train records of a run (see the module docstring); `latest` is the newest one.

    Arguments:
        run: the run.
        timer: the loop's step timer.
        units_per_step: tokens or examples per step (throughput).
        flops_per_step: model FLOPs per step (None: no TFLOP/s or MFU).
        peak_tflops: per-device peak (None: no MFU).
        nonfinite_total: the count of skipped steps so far, for each record.
        progress: the progress bar's update.
    """

    def __init__(
        self,
        run: RunContext,
        timer: StepTimer,
        *,
        units_per_step: int,
        flops_per_step: float | None,
        peak_tflops: float | None,
        nonfinite_total: Callable[[], int],
        progress: Callable[[int, dict[str, float]], None],
    ) -> None:
        self.run: RunContext = run
        self.timer: StepTimer = timer
        self.units_per_step: int = units_per_step
        self.flops_per_step: float | None = flops_per_step
        self.peak_tflops: float | None = peak_tflops
        self.nonfinite_total: Callable[[], int] = nonfinite_total
        self.progress: Callable[[int, dict[str, float]], None] = progress
        self.pending: tuple[int, dict[str, Any], dict[str, int | float]] | None = None
        self.latest: dict[str, float] = {}

    def after_dispatch(self, step: int, metrics: dict[str, Any], *, stopping: bool) -> None:
        """Step `step` was dispatched: write the previous logged step, keep this one if it is logged."""
        self.flush()  # the previous logged step: the device has moved on to this one
        if step % self.run.cfg.train.log_every == 0 or step == self.run.total or stopping:
            # The input's counters now: it has emitted exactly the batches of steps up to `step`.
            train, infeed = self.run.inputs.train, self.run.training.infeed
            # The hosts of one context group read the same rows: the first of them counts them.
            counts = {k: v if infeed is None or infeed.leads_index else 0 for k, v in train.counters().items()}
            self.pending = (step, metrics, train.counter_metrics(sum_over_processes(counts)))

    def flush(self) -> None:
        """Write the pending record now (reading its metrics waits for its step)."""
        if self.pending is None:
            return
        step, device_metrics, data_counts = self.pending
        self.pending = None
        self.run.check_nonfinite(step)
        values = {k: float(v) for k, v in to_host(device_metrics).items()}
        step_time = self.timer.lap(step)
        record = {k: values.get(k, math.nan) for k in _RECORDED}
        # A mixture of experts' router losses, per-expert token counts and dropped share (docs/moe.md).
        record |= {k: v for k, v in values.items() if k.startswith("moe_")}
        # Each named loss of a Task that returns several (equipax.core.losses, docs/extending.md).
        record |= {k: v for k, v in values.items() if k.startswith(LOSS_PREFIX)}
        # Each parameter group's learning rate (learner.groups, docs/extending.md).
        record |= {k: v for k, v in values.items() if k.startswith("learning_rate/")}
        # The input's running counts over every host (a chat input's truncated and dropped
        # conversations and packing efficiency, docs/finetuning.md).
        record |= data_counts
        record |= {"step_time_s": step_time, f"{self.run.unit}_per_s": self.units_per_step / step_time}
        if self.flops_per_step is not None:
            tflops = self.flops_per_step / step_time / self.run.training.mesh.size / 1e12
            record["tflops_per_s_per_device"] = tflops
            if self.peak_tflops is not None:
                record["mfu"] = tflops / self.peak_tflops
        record["nonfinite_steps"] = self.nonfinite_total()  # skipped updates so far (train.on_nonfinite)
        self.latest = record
        self.run.writer.write(step, "train", record)
        self.progress(step, record)
