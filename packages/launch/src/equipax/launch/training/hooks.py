"""The loop's hooks: logging, evaluation, epoch summaries and checkpoints.

The loop (`loop.py`) calls each hook's `before_step`, dispatches one step, and then calls each
hook's `after_step` in order. Hooks read device values only where the loop syncs anyway (logged steps, eval,
checkpoints), so the device never waits for the host. A hook with state that must survive a
restart (running epoch sums) returns it from `state()` and gets it back through `load()`; the
checkpoint hook saves it with the train state.
"""

import math
import time
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from equipax.core.step import mean_eval_metrics
from equipax.data import BaseInput
from equipax.core.task import EVAL_SUMS
from equipax.launch.cluster.distributed import gather_host_states, to_host
from equipax.launch.jobdir.plots import plot_classifier_history
from equipax.launch.jobdir.summaries import read_metrics

if TYPE_CHECKING:
    from equipax.launch.training.build import Training
    from equipax.launch.training.loop import Run

__all__ = ["CheckpointHook", "EpochHook", "EvalHook", "evaluate", "Hook", "LogHook", "StepTimer"]


class Hook:
    """A step hook; every method is optional."""

    def before_step(self, run: "Run", step: int) -> None:
        """Called just before step `step` is dispatched (its batch is fetched)."""

    def after_step(self, run: "Run", step: int, state: Any, metrics: dict[str, Any]) -> None:
        """Called after step `step` was dispatched (its metrics are still on the device)."""

    def state(self) -> dict[str, Any]:
        """JSON-ready state saved with each checkpoint."""
        return {}

    def load(self, state: dict[str, Any]) -> None:
        """Restore `state()` of the run this one resumes."""

    def close(self, run: "Run") -> None:
        """The loop is over (finished or stopped): flush what is pending."""

    def result(self, run: "Run") -> dict[str, Any]:
        """What this hook adds to result.json of a finished run."""
        return {}


def eval_pass(training: "Training", eval_input: BaseInput, model: Any, model_state: Any, *,
              limit: int) -> dict[str, float]:
    """Weighted mean loss and accuracy of `model` over an eval run of `eval_input` (reset first):
    `limit` batches, or the whole pass when 0. Also `weight` (tokens or examples) and `batches`."""
    eval_input.reset()

    def sums():
        count = 0
        while limit == 0 or count < limit:
            try:
                batch = eval_input.get_next()
            except StopIteration:
                return
            yield to_host(training.eval_step(model, training.place(batch), model_state))
            count += 1

    return mean_eval_metrics(sums())


def evaluate(run: "Run", state: Any) -> dict[str, float]:
    """The run's eval (`train.eval_batches`; 0 = a whole pass): loss, accuracy, tokens/examples, batches."""
    m = eval_pass(run.training, run.inputs.eval, state.model, state.model_state, limit=run.cfg.train.eval_batches)
    return {"loss": m["loss"], "accuracy": m["accuracy"], run.unit: m["weight"], "batches": m["batches"]}


class LogHook(Hook):
    """Writes train metrics every `train.log_every` steps, read back one step late."""

    def __init__(self) -> None:
        self.pending: tuple[int, dict[str, Any]] | None = None

    def after_step(self, run: "Run", step: int, state: Any, metrics: dict[str, Any]) -> None:
        self.flush(run)  # the previous logged step: the device has moved on to this one
        if step % run.cfg.train.log_every == 0 or step == run.total or run.stopping:
            self.pending = (step, metrics)

    def flush(self, run: "Run") -> None:
        if self.pending is None:
            return
        step, device_metrics = self.pending
        self.pending = None
        run.check_nonfinite(step)
        values = {k: float(v) for k, v in to_host(device_metrics).items()}
        step_time = run.timer.lap(step)
        record = {k: values.get(k, math.nan) for k in ("loss", "accuracy", "learning_rate", "grad_norm",
                                                          "param_norm")}
        record |= {"step_time_s": step_time, f"{run.unit}_per_s": run.units_per_step / step_time}
        if run.flops_per_step is not None:
            record["tflops_per_s_per_device"] = run.flops_per_step / step_time / run.training.mesh.size / 1e12
            if run.peak_tflops is not None:
                record["mfu"] = record["tflops_per_s_per_device"] / run.peak_tflops
        record["nonfinite_steps"] = run.nonfinite.total  # skipped updates so far (train.on_nonfinite)
        run.last_train = record
        run.writer.write(step, "train", record)
        run.progress.update(step, record)

    def close(self, run: "Run") -> None:
        self.flush(run)


class EvalHook(Hook):
    """Evaluates every `train.eval_every` steps, at the end, and at each epoch's end."""

    def __init__(self, log: LogHook) -> None:
        self.log = log

    def after_step(self, run: "Run", step: int, state: Any, metrics: dict[str, Any]) -> None:
        if not (step % run.cfg.train.eval_every == 0 or step == run.total or run.epoch_end(step)):
            return
        self.log.flush(run)
        run.last_eval = evaluate(run, state)
        run.last_eval_step = step
        run.writer.write(step, "eval", run.last_eval)
        run.progress.message(f"step {step}: eval loss {run.last_eval['loss']:.4f}, accuracy "
                             f"{run.last_eval['accuracy']:.3f} on {run.last_eval[run.unit]:,.0f} {run.unit}")
        run.timer.restart(step)  # keep eval time out of the next step-time reading


class EpochHook(Hook):
    """`train.num_epochs` runs: the epoch's train loss/accuracy (summed on the device, no sync per
    step) and the eval at its end become an `epoch` record, printed as the tutorial does."""

    def __init__(self) -> None:
        self.sums: dict[str, Any] = {k: jnp.zeros((), jnp.float32) for k in EVAL_SUMS}

    def after_step(self, run: "Run", step: int, state: Any, metrics: dict[str, Any]) -> None:
        self.sums = {k: self.sums[k] + metrics[k] for k in EVAL_SUMS}
        if not run.epoch_end(step):
            return
        host = {k: float(v) for k, v in jax.device_get(self.sums).items()}
        weight = max(host["weight_sum"], 1e-9)
        epoch = step // run.steps_per_epoch
        record = {"epoch": epoch, "train_loss": host["loss_sum"] / weight,
                  "train_accuracy": host["correct_sum"] / weight,
                  "test_loss": run.last_eval["loss"], "test_accuracy": run.last_eval["accuracy"]}
        run.writer.write(step, "epoch", record)
        run.progress.message(
            f"Epoch {epoch}/{run.cfg.train.num_epochs}: Loss: {record['train_loss']:.4f}, "
            f"Train Acc: {record['train_accuracy']:.4f}, Test Acc: {record['test_accuracy']:.4f}")
        self.sums = {k: jnp.zeros((), jnp.float32) for k in EVAL_SUMS}

    def state(self) -> dict[str, Any]:
        return {"epoch_sums": {k: float(v) for k, v in jax.device_get(self.sums).items()}}

    def load(self, state: dict[str, Any]) -> None:
        if "epoch_sums" in state:
            self.sums = {k: jnp.asarray(state["epoch_sums"][k], jnp.float32) for k in EVAL_SUMS}

    def result(self, run: "Run") -> dict[str, Any]:
        epochs = sorted((r for r in read_metrics(run.writer.path) if r.get("split") == "epoch"),
                        key=lambda r: r["epoch"]) if run.writer.path.exists() else []
        history = {k: [float(r[k]) for r in epochs]
                   for k in ("train_loss", "train_accuracy", "test_loss", "test_accuracy")}
        if run.primary:
            plot_classifier_history(epochs, run.job_dir / "plots" / "history.png", title=run.cfg.name)
        last = epochs[-1] if epochs else {}
        return {"num_epochs": run.cfg.train.num_epochs, "history": history,
                **{f"final_{k}": last.get(k) for k in history}}


class CheckpointHook(Hook):
    """Saves every `train.checkpoint_every` steps, at each epoch's end, at the end and on a stop."""

    def __init__(self, hooks: list[Hook]) -> None:
        self.hooks = hooks

    def after_step(self, run: "Run", step: int, state: Any, metrics: dict[str, Any]) -> None:
        if step % run.cfg.train.checkpoint_every and step != run.total and not run.stopping \
                and not run.epoch_end(step):
            return
        run.check_nonfinite(step)  # never save past an unchecked step
        loop_state = dict(run.nonfinite.state())
        for hook in self.hooks:
            loop_state |= hook.state()
        run.checkpointer.save(step, state, gather_host_states(run.inputs.train.get_state()),
                              loop_state=loop_state)


class StepTimer:
    """Seconds per step between two reads (eval and compilation kept out)."""

    def __init__(self, step: int) -> None:
        self.restart(step)

    def restart(self, step: int) -> None:
        self.t: float = time.monotonic()
        self.step: int = step

    def lap(self, step: int) -> float:
        now = time.monotonic()
        per_step = (now - self.t) / max(step - self.step, 1)
        self.t, self.step = now, step
        return per_step
