"""The step loop of a run: fetch a batch, dispatch the jitted step, write the train record of the
previous logged step (`train_log.py`: read back one step late, so the device never waits for the
host), and call the hooks that are due (`hooks.py`), keeping their time out of the step time.
`equipax.launch.training.loop.run_experiment` sets a run up and drives it.
"""

import dataclasses
import time
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import jax

from equipax.launch.aot.compile_events import CompileEvents
from equipax.launch.cluster.distributed import any_process
from equipax.launch.training import ahead
from equipax.launch.training.hooks import Hook, RunContext, StepContext
from equipax.launch.training.nonfinite import NonFiniteMonitor, poison_batch
from equipax.launch.training.preemption import StopRequest
from equipax.launch.training.progress import ProgressReporter
from equipax.launch.training.startup import mark, phases_line
from equipax.launch.training.train_log import StepTimer, TrainLog, device_peak_tflops

__all__ = ["StepLoop"]


class StepLoop:
    """The loop of one run: its hooks in order, their outputs, the step timer and the train log.

    Arguments:
        run: the run.
        hooks: every hook, in the order they run (`order_hooks`).
        nonfinite: the run's non-finite monitor (fed every step's metrics).
        progress: the progress bar.
        units_per_step: tokens or examples per step.
        flops_per_step: model FLOPs per step (None: no TFLOP/s or MFU).
    """

    def __init__(
        self,
        run: RunContext,
        hooks: list[Hook],
        nonfinite: NonFiniteMonitor,
        progress: ProgressReporter,
        *,
        units_per_step: int,
        flops_per_step: float | None,
    ) -> None:
        self.run: RunContext = run
        self.hooks: list[Hook] = hooks
        self.nonfinite: NonFiniteMonitor = nonfinite
        self.progress: ProgressReporter = progress
        self.outputs: dict[str, Any] = {}
        self.timer: StepTimer = StepTimer(run.start)
        self.train_log: TrainLog = TrainLog(
            run,
            self.timer,
            units_per_step=units_per_step,
            flops_per_step=flops_per_step,
            peak_tflops=device_peak_tflops(run.cfg),
            nonfinite_total=lambda: nonfinite.total,
            progress=progress.update,
        )
        self.stopped_by: str = ""

    def loop_state(self) -> dict[str, Any]:
        state = dict(self.nonfinite.state())
        for hook in self.hooks:
            state |= hook.state()
        return state

    def call(self, hooks: Sequence[Hook], ctx: StepContext) -> None:
        """Run `hooks` at this step, their time kept out of the step time."""
        began = time.monotonic()
        for hook in hooks:
            output = hook.after_step(ctx)
            if output is not None:
                self.outputs[hook.key] = output
        self.timer.exclude(time.monotonic() - began)

    def train(self, state: Any) -> tuple[Any, int]:
        """Fetch, dispatch, train record, hooks: the whole loop."""
        run, training = self.run, self.run.training
        outputs = MappingProxyType(self.outputs)
        step = run.start
        self.timer.restart(run.start)
        with StopRequest() as stop:
            for step in range(run.start + 1, run.total + 1):
                host_batch = run.inputs.train.get_next()
                if step == run.start + 1:
                    ahead.wait_for(run.ahead, ahead.TRAIN_STEP)  # compiled while the state was built
                    hosts = training.infeed.num_infeed_hosts if training.infeed else 1
                    training.task.check_batch(host_batch, run.cfg.global_batch_size // hosts)
                    _log_host_examples(self.progress, host_batch)
                if step in run.cfg.train.debug_nan_steps:  # test knob: a poisoned batch
                    host_batch = poison_batch(host_batch)
                began = time.monotonic()
                for hook in self.hooks:
                    hook.before_step(run, step)
                self.timer.exclude(time.monotonic() - began)
                with CompileEvents() as compiling:
                    state, metrics = training.train_step(state, training.place(host_batch), training.keys.step)
                self.nonfinite.record(step, metrics)
                if step == run.start + 1:
                    jax.block_until_ready(metrics)  # the first step includes compilation
                    self.progress.message(
                        f"Compiled and ran the first step in {time.monotonic() - self.timer.t:.1f} s."
                    )
                    mark("first step")
                    if line := phases_line():
                        self.progress.message(line)
                    self.timer.restart(step)
                stopping = any_process(bool(stop))  # all processes stop at the same step
                ctx = StepContext(
                    run=run,
                    step=step,
                    state=state,
                    metrics=MappingProxyType(metrics),
                    stopping=stopping,
                    outputs=outputs,
                    train=MappingProxyType(self.train_log.latest),
                    compile_seconds=compiling.backend_seconds,
                    loop_state=self.loop_state,
                )
                due = [hook for hook in self.hooks if hook.due(ctx)]
                self.call([h for h in due if h.first], ctx)  # the profile window's step ends here
                self.train_log.after_dispatch(step, metrics, stopping=stopping)
                rest = [h for h in due if not h.first]
                if any(h.waits_for_device for h in rest):
                    self.train_log.flush()  # this step's record, with its own step time
                    jax.block_until_ready(metrics)  # the step's device work counts as the step's
                    ctx = dataclasses.replace(ctx, train=MappingProxyType(self.train_log.latest))
                self.call(rest, ctx)
                if stopping:
                    self.stopped_by = stop.signal_name or "a peer process"
                    break
        return state, step


def _log_host_examples(progress: ProgressReporter, batch: Mapping[str, Any]) -> None:
    """Multi-host: say which examples this host reads first (disjoint across infeed hosts; the
    hosts of one context group read the same)."""
    if jax.process_count() > 1 and "example_id" in batch:
        ids = batch["example_id"]
        progress.message(
            f"host {jax.process_index()}/{jax.process_count()} reads examples "
            f"{ids.tolist() if ids.size <= 16 else f'{ids[0]}..{ids[-1]}'}"
        )
