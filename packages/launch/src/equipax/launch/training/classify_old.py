"""The epoch loop for image-classification experiments (`ClassifierExperimentConfig`).

The German tutorial's `train_model`, on equipax's parts: the jitted train and eval steps of
`equipax.core.step` with the model's BatchNorm statistics threaded through as `model_state`,
orbax checkpoints, metrics.jsonl + TensorBoard, the progress bar and graceful stop of the LM loop.
Each epoch prints `Epoch e/N: Loss, Train Acc, Test Acc` as the tutorial does, records them
(split `epoch` in metrics.jsonl) and ends with a full pass over the test images; `plots/history.png`
is the tutorial's two-panel figure.

A checkpoint holds the train state (parameters, optimizer state, BatchNorm statistics), the
training input's position and the running sums of the current epoch, so a run stopped mid-epoch
resumes to the same result as an uninterrupted one.
"""

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from rich.console import Console

from equipax.core.config import ConfigError, format_knobs, to_json
from equipax.core.optim import make_learner, make_schedule
from equipax.core.step import (
    EVAL_SUMS, Metrics, TrainState, init_train_state, make_eval_step, make_train_step, mean_eval_metrics,
)
from equipax.data import ImageClassificationInput, split_digits, synthetic_images
from equipax.launch.training.checkpoints import Checkpointer, tree_digest
from equipax.launch.experiments.classify_config_old import ClassifierExperimentConfig
from equipax.launch.training.plots import plot_classifier_history
from equipax.launch.training.preemption import StopRequest
from equipax.launch.training.progress import ProgressReporter
from equipax.launch.training.loop import Preempted
from equipax.launch.training.summaries import MetricsWriter, read_metrics
from equipax.models import AdvancedCNN, classification_loss



@dataclasses.dataclass
class ClassifierResult:
    """What a finished classification run reports (also written to result.json)."""

    job_dir: Path
    start_step: int
    final_step: int
    num_epochs: int
    final_train_loss: float | None
    final_train_accuracy: float | None
    final_test_loss: float | None
    final_test_accuracy: float | None
    history: dict[str, list[float]]
    state_digest: str


def classifier_numbers(cfg: ClassifierExperimentConfig) -> dict[str, Any]:
    """Numbers computed from the config alone (the model is traced abstractly; no devices)."""
    model, _ = eqx.filter_eval_shape(
        lambda: eqx.nn.make_with_state(AdvancedCNN)(cfg.model, key=jax.random.key(0)))
    params = sum(x.size for x in jax.tree.leaves(model) if isinstance(x, jax.ShapeDtypeStruct))
    return {
        "params_total": int(params),
        "train_images": cfg.data.train_size,
        "steps_per_epoch": cfg.steps_per_epoch,
        "total_steps": cfg.num_steps,
        "global_batch": cfg.data.batch_size,
    }


def build_image_inputs(cfg: ClassifierExperimentConfig) -> tuple[ImageClassificationInput, ImageClassificationInput]:
    """(train, test) inputs of the experiment's images; test makes one padded pass in order."""
    d = cfg.data
    if d.source == "digits":
        (train_x, train_y), (test_x, test_y) = split_digits(d.test_fraction, seed=d.seed)
    else:
        # Separate seeds: the tutorial drew its test set with the training set's key.
        shape = dict(image_size=d.image_size, channels=d.channels, num_classes=d.num_classes)
        train_x, train_y = synthetic_images(d.num_train, seed=d.seed, **shape)
        test_x, test_y = synthetic_images(d.num_test, seed=d.seed + 1, **shape)
    train = ImageClassificationInput(train_x, train_y, batch_size=d.batch_size, seed=d.seed,
                                     shuffle=d.shuffle)
    test = ImageClassificationInput(test_x, test_y, batch_size=d.batch_size, repeat=False, shuffle=False)
    return train, test


def evaluate_classifier(eval_step, state: TrainState, test: ImageClassificationInput) -> dict[str, float]:
    """Loss and accuracy over one full pass of `test` (padding rows carry weight 0)."""
    test.reset()
    m = mean_eval_metrics(jax.device_get(eval_step(state.model, batch, state.model_state)) for batch in test)
    return {"loss": m["loss"], "accuracy": m["accuracy"], "examples": m["weight"]}


def _sums_to_host(sums: Metrics) -> dict[str, float]:
    return {k: float(v) for k, v in jax.device_get(sums).items()}


def run_classifier(
    cfg: ClassifierExperimentConfig,
    *,
    job_dir: Path,
    sources: dict[str, str] | None = None,
    console: Console | None = None,
) -> ClassifierResult:
    """Train `cfg` for its epochs, writing everything to `job_dir`; resume if it holds a checkpoint.

    Arguments:
        cfg: the resolved experiment.
        job_dir: the job directory (created if missing).
        sources: which knobs came from `--set` (for knobs.txt).
        console: where progress goes (default: stdout).

    Returns:
        A ClassifierResult with the per-epoch history and a digest of the final state.
    """
    if jax.process_count() > 1:
        raise ConfigError(f"{cfg.name} is a single-process experiment; run it without "
                          "--coordinator/--num-processes.")
    console = console or Console()
    job_dir = Path(job_dir)
    job_dir.mkdir(parents=True, exist_ok=True)
    train_input, test_input = build_image_inputs(cfg)
    spe, total = cfg.steps_per_epoch, cfg.num_steps

    init_key, step_key = jax.random.split(jax.random.key(cfg.train.seed))
    optimizer = make_learner(cfg.learner)
    model, model_state = eqx.nn.make_with_state(AdvancedCNN)(cfg.model, key=init_key)
    state = init_train_state(model, optimizer, model_state=model_state)
    num_params = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))
    console.print(
        f"[bold]{cfg.name}[/]: {num_params / 1e6:.2f}M params, {cfg.data.source} images "
        f"({cfg.data.train_size} train / {len(test_input.images)} test), {cfg.train.num_epochs} epochs "
        f"x {spe} steps of {cfg.data.batch_size} -> {job_dir}", highlight=False)

    checkpointer = Checkpointer(job_dir / "checkpoints", keep=cfg.train.keep_checkpoints)
    writer = MetricsWriter(job_dir)
    epoch_sums = dict.fromkeys(EVAL_SUMS, 0.0)
    start = checkpointer.latest_step()
    if start is not None:
        state, saved = checkpointer.restore(start, state)
        train_input.set_state(saved["input"])
        epoch_sums = {k: float(saved["epoch_sums"][k]) for k in EVAL_SUMS}
        writer.truncate_after(start)
        console.print(f"Resumed from step {start} (epoch {start // spe + 1}, "
                      f"{job_dir / 'checkpoints'}).", highlight=False)
    start = start or 0
    (job_dir / "config.json").write_text(to_json(cfg) + "\n")
    (job_dir / "knobs.txt").write_text(format_knobs(cfg, sources or {}))

    train_step = make_train_step(classification_loss, optimizer, make_schedule(cfg.learner.schedule))
    eval_step = make_eval_step(classification_loss)
    progress = ProgressReporter(console, total=total, start=start)
    # Epoch sums stay on the device between epochs: no host sync per step.
    sums: Metrics = {k: jnp.asarray(v, jnp.float32) for k, v in epoch_sums.items()}
    pending: tuple[int, Metrics] | None = None
    t_last, s_last = time.monotonic(), start

    def flush_pending() -> None:
        nonlocal pending, t_last, s_last
        if pending is None:
            return
        s, device_metrics = pending
        pending = None
        values = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
        now = time.monotonic()
        step_time = (now - t_last) / max(s - s_last, 1)
        t_last, s_last = now, s
        record = {k: values[k] for k in ("loss", "accuracy", "learning_rate", "grad_norm", "param_norm")}
        record.update(step_time_s=step_time, examples_per_s=cfg.data.batch_size / step_time)
        writer.write(s, "train", record)
        progress.update(s, record)

    step = start
    with StopRequest() as stop:
        for step in range(start + 1, total + 1):
            state, metrics = train_step(state, train_input.get_next(), step_key)
            sums = {k: sums[k] + metrics[k] for k in EVAL_SUMS}
            if step == start + 1:
                jax.block_until_ready(metrics)  # the first step includes compilation
                progress.message(f"Compiled and ran the first step in {time.monotonic() - t_last:.1f} s.")
                t_last, s_last = time.monotonic(), step
            flush_pending()
            if step % cfg.train.log_every == 0 or step == total or stop:
                pending = (step, metrics)
            epoch, epoch_done = divmod(step, spe)
            if epoch_done == 0:
                flush_pending()
                _end_epoch(cfg, epoch, step, _sums_to_host(sums), evaluate_classifier(eval_step, state, test_input),
                           writer, progress)
                sums = {k: jnp.zeros((), jnp.float32) for k in EVAL_SUMS}
                t_last, s_last = time.monotonic(), step
            if (epoch_done == 0 and (epoch % cfg.train.checkpoint_every_epochs == 0 or step == total)) or stop:
                checkpointer.save(step, state, {"input": train_input.get_state(),
                                                "epoch_sums": _sums_to_host(sums)})
            if stop:
                break
        flush_pending()
    progress.close()
    checkpointer.close()
    writer.close()
    if stop:
        console.print(
            f"Stopped by {stop.signal_name} after step {step}; checkpoint saved in "
            f"{job_dir / 'checkpoints'}. Run the same command again to resume.", highlight=False)
        raise Preempted(step)

    epochs = sorted((r for r in read_metrics(writer.path) if r.get("split") == "epoch"),
                    key=lambda r: r["epoch"])
    history = {k: [float(r[k]) for r in epochs]
               for k in ("train_loss", "train_accuracy", "test_loss", "test_accuracy")}
    plot_classifier_history(epochs, job_dir / "plots" / "history.png", title=cfg.name)
    last = epochs[-1] if epochs else {}
    result = ClassifierResult(
        job_dir=job_dir, start_step=start, final_step=total, num_epochs=cfg.train.num_epochs,
        final_train_loss=last.get("train_loss"), final_train_accuracy=last.get("train_accuracy"),
        final_test_loss=last.get("test_loss"), final_test_accuracy=last.get("test_accuracy"),
        history=history, state_digest=tree_digest(state),
    )
    summary = {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(result).items()}
    (job_dir / "result.json").write_text(json.dumps(summary, indent=2) + "\n")
    if result.final_test_accuracy is not None:
        chance = 1.0 / cfg.model.num_classes
        console.print(f"Final test accuracy {result.final_test_accuracy:.4f} (chance: {chance:.4f})",
                      highlight=False)
    return result


def _end_epoch(cfg: ClassifierExperimentConfig, epoch: int, step: int, sums: dict[str, float],
               test: dict[str, float], writer: MetricsWriter, progress: ProgressReporter) -> None:
    weight = max(sums["weight_sum"], 1e-9)
    record: dict[str, Any] = {
        "epoch": epoch,
        "train_loss": sums["loss_sum"] / weight,
        "train_accuracy": sums["correct_sum"] / weight,
        "test_loss": test["loss"],
        "test_accuracy": test["accuracy"],
    }
    writer.write(step, "eval", {"epoch": epoch, **test})
    writer.write(step, "epoch", record)
    progress.message(
        f"Epoch {epoch}/{cfg.train.num_epochs}: Loss: {record['train_loss']:.4f}, "
        f"Train Acc: {record['train_accuracy']:.4f}, Test Acc: {record['test_accuracy']:.4f}")
