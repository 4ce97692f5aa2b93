"""The hooks every run has: evaluation, epoch summaries, sampling, profiling, checkpoints.

`builtin_hooks(run)` lists them for a run; the loop adds the caller's hooks and orders them all
(`equipax.launch.training.hooks.order_hooks`). The eval hook's output (its metrics) is what the
epoch hook reads at an epoch's end and what result.json reports as the final eval.
"""

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from equipax.core.losses import LOSS_PREFIX
from equipax.core.step import mean_eval_metrics
from equipax.core.task import EVAL_SUMS
from equipax.launch.cluster.distributed import gather_host_states, to_host
from equipax.launch.jobdir.plots import NO_MATPLOTLIB, plot_classifier_history
from equipax.launch.jobdir.summaries import read_metrics
from equipax.launch.training import ahead
from equipax.launch.training.hooks import ALL, Hook, RunContext, StepContext

if TYPE_CHECKING:
    from equipax.data import BaseInput
    from equipax.launch.program.program import Program

__all__ = ["builtin_hooks", "CheckpointHook", "EpochHook", "eval_pass", "eval_record", "evaluate", "EvalHook"]


def builtin_hooks(run: RunContext) -> list[Hook]:
    """The run's own hooks, in their order: profiling (first), eval, sampling, epochs, checkpoints (last)."""
    from equipax.launch.training.decode_hook import DecodeHook
    from equipax.launch.training.profiling import profiling_hooks

    hooks = [*profiling_hooks(run), EvalHook(run.cfg.train.eval_every), DecodeHook(run.cfg.train.decode.every)]
    if run.cfg.train.num_epochs is not None:
        hooks.append(EpochHook())
    return [*hooks, CheckpointHook(run.cfg.train.checkpoint_every)]


def eval_pass(
    program: "Program", eval_input: "BaseInput", model: Any, model_state: Any, *, limit: int
) -> dict[str, float]:
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
            yield to_host(program.eval_step(model, program.place(batch), model_state))
            count += 1

    return mean_eval_metrics(sums())


def eval_record(m: Mapping[str, float], unit: str) -> dict[str, float]:
    """An eval pass's record: loss, accuracy, tokens/examples (`unit`), batches, and `loss/<name>`
    of each named loss (`equipax.core.losses`)."""
    named = {k: v for k, v in m.items() if k.startswith(LOSS_PREFIX)}
    return {"loss": m["loss"], "accuracy": m["accuracy"], unit: m["weight"], "batches": m["batches"], **named}


def evaluate(run: RunContext, state: Any) -> dict[str, float]:
    """The run's eval (`train.eval_batches`; 0 = a whole pass): `eval_record`."""
    ahead.wait_for(run.ahead, ahead.EVAL_STEP)
    m = eval_pass(run.training, run.inputs.eval, state.model, state.model_state, limit=run.cfg.train.eval_batches)
    return eval_record(m, run.unit)


class EvalHook(Hook):
    """Evaluates every `train.eval_every` steps, at the end, and at each epoch's end; its output is
    the eval's metrics."""

    name: str = "eval"
    waits_for_device: bool = True

    def __init__(self, every: int) -> None:
        self.every = every

    def due(self, ctx: StepContext) -> bool:
        return super().due(ctx) or ctx.final or ctx.epoch_end

    def after_step(self, ctx: StepContext) -> dict[str, float]:
        run = ctx.run
        metrics = evaluate(run, ctx.state)
        run.writer.write(ctx.step, "eval", metrics)
        run.log(
            f"step {ctx.step}: eval loss {metrics['loss']:.4f}, accuracy {metrics['accuracy']:.3f} on "
            f"{metrics[run.unit]:,.0f} {run.unit}"
        )
        return metrics


class EpochHook(Hook):
    """`train.num_epochs` runs: the epoch's train loss/accuracy (summed on the device, no sync per
    step) and the eval at its end become an `epoch` record, printed as the CNN tutorial does."""

    name: str = "epoch"
    after: tuple[str, ...] = ("eval",)  # reads the eval of the epoch's last step

    def __init__(self) -> None:
        self.sums: dict[str, Any] = {k: jnp.zeros((), jnp.float32) for k in EVAL_SUMS}

    def after_step(self, ctx: StepContext) -> dict[str, Any] | None:
        self.sums = {k: self.sums[k] + ctx.metrics[k] for k in EVAL_SUMS}
        if not ctx.epoch_end:
            return None
        run = ctx.run
        host = {k: float(v) for k, v in jax.device_get(self.sums).items()}
        weight = max(host["weight_sum"], 1e-9)
        epoch = ctx.step // run.steps_per_epoch
        evaluated = ctx.outputs["eval"]
        record = {
            "epoch": epoch,
            "train_loss": host["loss_sum"] / weight,
            "train_accuracy": host["correct_sum"] / weight,
            "test_loss": evaluated["loss"],
            "test_accuracy": evaluated["accuracy"],
        }
        run.writer.write(ctx.step, "epoch", record)
        run.log(
            f"Epoch {epoch}/{run.cfg.train.num_epochs}: Loss: {record['train_loss']:.4f}, "
            f"Train Acc: {record['train_accuracy']:.4f}, Test Acc: {record['test_accuracy']:.4f}"
        )
        self.sums = {k: jnp.zeros((), jnp.float32) for k in EVAL_SUMS}
        return record

    def state(self) -> dict[str, Any]:
        return {"epoch_sums": {k: float(v) for k, v in jax.device_get(self.sums).items()}}

    def load(self, state: dict[str, Any]) -> None:
        if "epoch_sums" in state:
            self.sums = {k: jnp.asarray(state["epoch_sums"][k], jnp.float32) for k in EVAL_SUMS}

    def result(self, run: RunContext, outputs: Mapping[str, Any]) -> dict[str, Any]:
        epochs = (
            sorted((r for r in read_metrics(run.writer.path) if r.get("split") == "epoch"), key=lambda r: r["epoch"])
            if run.writer.path.exists()
            else []
        )
        history = {
            k: [float(r[k]) for r in epochs] for k in ("train_loss", "train_accuracy", "test_loss", "test_accuracy")
        }
        plot = run.job_dir / "plots" / "history.png"
        if run.primary and plot_classifier_history(epochs, plot, title=run.cfg.name) is None:
            run.log(f"note: plots/history.png not written: {NO_MATPLOTLIB}")
        last = epochs[-1] if epochs else {}
        return {
            "num_epochs": run.cfg.train.num_epochs,
            "history": history,
            **{f"final_{k}": last.get(k) for k in history},
        }


class CheckpointHook(Hook):
    """Saves every `train.checkpoint_every` steps, at each epoch's end, at the end and on a stop,
    after every other hook (their state, saved with the checkpoint, is final for the step)."""

    name: str = "checkpoint"
    waits_for_device: bool = True
    after: tuple[str, ...] = (ALL,)

    def __init__(self, every: int) -> None:
        self.every = every

    def due(self, ctx: StepContext) -> bool:
        return super().due(ctx) or ctx.final or ctx.stopping or ctx.epoch_end

    def after_step(self, ctx: StepContext) -> None:
        run = ctx.run
        run.check_nonfinite(ctx.step)  # never save past an unchecked step
        ahead.wait_for(run.ahead, ahead.CHECKSUMS)
        run.checkpointer.save(
            ctx.step,
            ctx.state,
            gather_host_states(run.inputs.train.get_state(), global_state=run.inputs.train.global_state),
            loop_state=ctx.loop_state(),
        )
