"""The training loop: config -> (model, optimizer, inputs) -> step -> loop -> job directory.

The host loop stays small: fetch a batch, dispatch the jitted step, and read the metrics of
a logged step back only after the next step has been dispatched, so the device never waits
for the host. Evaluation, checkpoints and summaries happen every N steps.
"""

import dataclasses
import functools
import json
import math
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from rich.console import Console

from equipax.core.config import ConfigError, flatten, format_knobs, from_json, to_json
from equipax.core.flops import lm_param_counts, transformer_lm_flops_per_token
from equipax.core.optim import make_learner, make_schedule
from equipax.core.mesh import build_mesh, check_device_count
from equipax.core.partition import batch_sharding
from equipax.core.step import (
    TrainState, init_sharded_train_state, make_eval_step, make_train_step, mean_eval_metrics,
)
from equipax.data import BaseInput
from equipax.launch.training.checkpoints import Checkpointer, tree_digest
from equipax.launch.training.jobdir import prepare_job_dir, write_text_atomic
from equipax.launch.training.nonfinite import NonFiniteMonitor, poison_batch
from equipax.launch.cluster.distributed import any_process, barrier, gather_host_states, host_state, is_primary, to_host
from equipax.launch.experiments.config import ExperimentConfig
from equipax.launch.training.lm_inputs import build_lm_inputs, build_tokenizer
from equipax.launch.training.plots import plot_loss
from equipax.launch.training.preemption import StopRequest
from equipax.launch.training.progress import ProgressReporter
from equipax.launch.training.summaries import MetricsWriter, read_metrics
from equipax.models.lm import TransformerLM, generate, lm_loss

# Batch fields the model reads (segment_ids/positions only in packed batches).
MODEL_KEYS = ("ids", "labels", "weights", "segment_ids", "positions")

# bf16 dense peak per chip, TFLOP/s, by `device_kind` substring (for MFU).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "TPU v4": 275.0, "TPU v5 lite": 197.0,
               "TPU v5e": 197.0, "TPU v5p": 459.0, "TPU v5": 459.0, "TPU v6": 918.0}


class Preempted(Exception):
    """The run stopped on SIGTERM/SIGINT after checkpointing `step`."""

    def __init__(self, step: int):
        super().__init__(f"stopped after step {step}")
        self.step = step


@dataclasses.dataclass
class RunResult:
    """What a finished (or stopped) run reports."""

    job_dir: Path
    start_step: int
    final_step: int
    final_train_loss: float | None
    final_eval_loss: float | None
    unigram_entropy: float | None
    state_digest: str
    sample: str | None


def device_peak_tflops(cfg: ExperimentConfig) -> float | None:
    """The per-device peak used for MFU: the config's, else a table lookup, else None (CPU)."""
    if cfg.train.peak_tflops_per_device is not None:
        return cfg.train.peak_tflops_per_device
    kind = jax.devices()[0].device_kind
    for name, peak in PEAK_TFLOPS.items():
        if name.lower() in kind.lower():
            return peak
    return None


def derived_numbers(cfg: ExperimentConfig) -> dict[str, Any]:
    """Numbers computed from the config alone (no devices touched)."""
    params = lm_param_counts(cfg.model.transformer, cfg.model.vocab_size)
    flops = transformer_lm_flops_per_token(
        cfg.model.transformer, vocab_size=cfg.model.vocab_size, seq_len=cfg.data.seq_len
    )
    tokens_per_step = cfg.global_batch_size * cfg.data.seq_len
    return {
        "params_total": params["total"],
        "params_embedding": params["embedding"],
        "params_per_layer": params["per_layer"],
        "global_batch": cfg.global_batch_size,
        "tokens_per_step": tokens_per_step,
        "total_tokens": tokens_per_step * cfg.train.num_steps,
        "model_flops_per_token": flops["training"],
        "model_flops_per_step": flops["training"] * tokens_per_step,
        "devices_required": cfg.mesh.num_devices,
        "mesh_shape": list(cfg.mesh.shape),
    }


def _write_job_files(cfg: ExperimentConfig, sources: dict[str, str], job_dir: Path) -> None:
    job_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(job_dir / "config.json", to_json(cfg) + "\n")
    write_text_atomic(job_dir / "knobs.txt", format_knobs(cfg, sources))


def _knob_changes(cfg: ExperimentConfig, job_dir: Path) -> str:
    """The knobs that differ from the job's recorded config.json, as text (or "")."""
    path = job_dir / "config.json"
    if not path.exists():
        return ""
    try:
        old = flatten(from_json(ExperimentConfig, path.read_text()))
    except (ConfigError, ValueError):
        return ""
    new = flatten(cfg)
    diffs = [f"  {k}: {old.get(k)!r} -> {v!r}" for k, v in new.items() if old.get(k) != v]
    return "\nKnobs that differ from the job's config.json:\n" + "\n".join(diffs) if diffs else ""


def _to_device(batch: dict[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
    """This host's rows -> global arrays split over (data, fsdp) across all hosts."""
    return {k: jax.make_array_from_process_local_data(sharding, batch[k]) for k in MODEL_KEYS if k in batch}


def build_run_mesh(cfg: ExperimentConfig) -> Mesh:
    """The experiment's mesh on this job's devices, or a ConfigError saying what to do instead."""
    available = jax.device_count()
    if cfg.mesh.num_devices != available:
        check_device_count(
            cfg.mesh, available,
            hint=(f". To check this experiment without the hardware, run `launch compile --exp "
                  f"{cfg.name}`; to run its code path on this machine, try `launch run --exp "
                  f"{cfg.name}_smoke --cpu-devices 8` where a _smoke variant exists"),
        )
    return build_mesh(cfg.mesh)


def evaluate(eval_step, model, eval_input: BaseInput, num_batches: int,
             sharding: NamedSharding) -> dict[str, float]:
    """Weighted mean loss and accuracy over an eval pass (`num_batches`=0: the whole pass)."""
    eval_input.reset()

    def batches():
        count = 0
        while num_batches == 0 or count < num_batches:
            try:
                batch = eval_input.get_next()
            except StopIteration:
                return
            yield to_host(eval_step(model, _to_device(batch, sharding)))
            count += 1

    m = mean_eval_metrics(batches())
    return {"loss": m["loss"], "accuracy": m["accuracy"], "tokens": m["weight"], "batches": m["batches"]}


def run_experiment(
    cfg: ExperimentConfig,
    *,
    job_dir: Path,
    sources: dict[str, str] | None = None,
    console: Console | None = None,
) -> RunResult:
    """Train `cfg`, writing everything to `job_dir`; resume if it holds a checkpoint.

    Arguments:
        cfg: the resolved experiment.
        job_dir: the job directory (created if missing).
        sources: which knobs came from `--set` (for knobs.txt).
        console: where progress goes (default: stdout).

    Returns:
        A RunResult with the final losses and a digest of the final state.
    """
    console = console or Console()
    job_dir = Path(job_dir)
    mesh = build_run_mesh(cfg)  # fails in seconds when the devices are not there
    prepare_job_dir(job_dir, cfg.name)  # writable, and not another experiment's
    numbers = derived_numbers(cfg)
    console.print(
        f"[bold]{cfg.name}[/]: {numbers['params_total'] / 1e6:.2f}M params, "
        f"{numbers['tokens_per_step']:,} tokens/step, {cfg.train.num_steps} steps -> {job_dir}",
        highlight=False,
    )

    # Process 0 trains (or finds) the job's tokenizer; the others load it once it is written.
    tokenizer = None
    if is_primary():
        tokenizer = build_tokenizer(cfg, job_dir, log=lambda m: console.print(m, highlight=False))
    barrier("tokenizer")
    tokenizer = tokenizer or build_tokenizer(cfg, job_dir)
    inputs = build_lm_inputs(cfg, tokenizer, num_infeed_hosts=jax.process_count(),
                             infeed_host_index=jax.process_index())

    root = jax.random.key(cfg.train.seed)
    init_key, step_key, sample_key = jax.random.split(root, 3)
    optimizer = make_learner(cfg.learner)
    schedule = make_schedule(cfg.learner.schedule)
    state: TrainState
    state, state_sharding = init_sharded_train_state(
        lambda k: TransformerLM(cfg.model, key=k), optimizer, mesh, init_key
    )
    data_sharding = batch_sharding(mesh)

    checkpointer = Checkpointer(job_dir / "checkpoints", keep=cfg.train.keep_checkpoints)
    writer = MetricsWriter(job_dir, enabled=is_primary())
    start, loop_state = None, None
    try:  # the newest checkpoint that restores; damaged ones are set aside with a message
        restored = checkpointer.restore_latest(state, log=lambda m: console.print(m, highlight=False))
    except ConfigError as e:
        raise ConfigError(f"{e}{_knob_changes(cfg, job_dir)}") from None
    if restored is not None:
        start, state, data_state, loop_state = restored
        inputs.train.set_state(host_state(data_state))
        writer.truncate_after(start)
        console.print(f"Resumed from step {start} ({job_dir / 'checkpoints'}).", highlight=False)
    start = start or 0
    if restored is None:
        writer.truncate_after(0)  # records of a run killed before its first checkpoint
    nonfinite = NonFiniteMonitor(cfg.train.on_nonfinite, cfg.train.max_consecutive_nonfinite, loop_state)

    def check_nonfinite(upto: int) -> None:
        nonfinite.check(upto, where=str(job_dir / "checkpoints"),
                        last_checkpoint=lambda: (checkpointer.wait(), checkpointer.latest_step())[1],
                        log=lambda m: progress.message(m))
    if is_primary():
        _write_job_files(cfg, sources or {}, job_dir)

    loss_fn = functools.partial(lm_loss, mesh=mesh)
    train_step = make_train_step(loss_fn, optimizer, schedule, state_sharding=state_sharding,
                                 batch_sharding=data_sharding, skip_nonfinite=True)
    eval_step = make_eval_step(loss_fn)
    flops_per_step = numbers["model_flops_per_step"]
    peak = device_peak_tflops(cfg)
    num_devices = mesh.size
    total = cfg.train.num_steps
    progress = ProgressReporter(console, total=total, start=start)

    last_train: dict[str, float] = {}
    last_eval: dict[str, float] = {}
    pending: tuple[int, dict[str, Any]] | None = None
    t_last, s_last = time.monotonic(), start

    def flush_pending() -> None:
        nonlocal pending, t_last, s_last, last_train
        if pending is None:
            return
        s, device_metrics = pending
        pending = None
        check_nonfinite(s)
        values = {k: float(v) for k, v in to_host(device_metrics).items()}
        now = time.monotonic()
        step_time = (now - t_last) / max(s - s_last, 1)
        t_last, s_last = now, s
        record = {
            "loss": values["loss"],
            "accuracy": values.get("accuracy", math.nan),
            "learning_rate": values["learning_rate"],
            "grad_norm": values["grad_norm"],
            "param_norm": values["param_norm"],
            "step_time_s": step_time,
            "tokens_per_s": numbers["tokens_per_step"] / step_time,
            "tflops_per_s_per_device": flops_per_step / step_time / num_devices / 1e12,
            "nonfinite_steps": nonfinite.total,  # skipped updates so far (train.on_nonfinite)
        }
        if peak is not None:
            record["mfu"] = record["tflops_per_s_per_device"] / peak
        last_train = record
        writer.write(s, "train", record)
        progress.update(s, record)

    step, stopping = start, False
    with StopRequest() as stop:
        for step in range(start + 1, total + 1):
            host_batch = inputs.train.get_next()
            if step == start + 1 and jax.process_count() > 1 and "example_id" in host_batch:
                ids = host_batch["example_id"]
                progress.message(f"host {jax.process_index()}/{jax.process_count()} reads examples "
                                 f"{ids.tolist() if ids.size <= 16 else f'{ids[0]}..{ids[-1]}'}")
            if step in cfg.train.debug_nan_steps:  # test knob: a poisoned batch
                host_batch = poison_batch(host_batch)
            batch = _to_device(host_batch, data_sharding)
            state, metrics = train_step(state, batch, step_key)
            nonfinite.record(step, metrics)
            if step == start + 1:
                jax.block_until_ready(metrics)  # the first step includes compilation
                progress.message(f"Compiled and ran the first step in {time.monotonic() - t_last:.1f} s.")
                t_last, s_last = time.monotonic(), step
            flush_pending()
            stopping = any_process(bool(stop))  # all processes stop at the same step
            if step % cfg.train.log_every == 0 or step == total or stopping:
                pending = (step, metrics)
            if step % cfg.train.eval_every == 0 or step == total:
                flush_pending()
                last_eval = evaluate(eval_step, state.model, inputs.eval, cfg.train.eval_batches,
                                     data_sharding)
                writer.write(step, "eval", last_eval)
                progress.message(
                    f"step {step}: eval loss {last_eval['loss']:.4f}, "
                    f"accuracy {last_eval['accuracy']:.3f} on {last_eval['tokens']:,.0f} tokens"
                )
                # Eval synchronised the device: restart the step timer here, keeping eval
                # time out of the next step-time reading.
                t_last, s_last = time.monotonic(), step
            if step % cfg.train.checkpoint_every == 0 or step == total or stopping:
                check_nonfinite(step)  # never save past an unchecked step
                checkpointer.save(step, state, gather_host_states(inputs.train.get_state()),
                                  loop_state=nonfinite.state())
            if stopping:
                break
        flush_pending()
    if stopping:
        progress.close()
        checkpointer.close()
        writer.close()
        console.print(
            f"Stopped by {stop.signal_name or 'a peer process'} after step {step}; checkpoint saved in "
            f"{job_dir / 'checkpoints'}. Run the same command again to resume.", highlight=False)
        raise Preempted(step)
    progress.close()
    checkpointer.close()
    writer.flush()
    if start == total:
        # Resumed from the final checkpoint (killed after it): report what the finished run did.
        last_train = next((r for r in reversed(read_metrics(writer.path)) if r["split"] == "train"), {}) \
            if writer.path.exists() else {}
        last_eval = evaluate(eval_step, state.model, inputs.eval, cfg.train.eval_batches, data_sharding)

    sample = None
    if cfg.train.sample_tokens > 0 and jax.process_count() == 1:
        prompt = np.asarray(tokenizer.encode(cfg.train.sample_prompt) or [tokenizer.bos_id], np.int32)
        assert isinstance(state.model, TransformerLM)
        out = generate(state.model, jax.numpy.asarray(prompt), cfg.train.sample_tokens,
                       temperature=cfg.train.sample_temperature, key=sample_key)
        sample = tokenizer.decode(np.asarray(out).tolist())
        writer.add_text("eval", "sample", sample, total)
        console.print("[bold]Sample:[/]", highlight=False)
        console.print(sample, highlight=False, markup=False)
    writer.close()

    result = RunResult(
        job_dir=job_dir, start_step=start, final_step=total,
        final_train_loss=last_train.get("loss"), final_eval_loss=last_eval.get("loss"),
        unigram_entropy=inputs.unigram_entropy, state_digest=tree_digest(state), sample=sample,
    )
    if is_primary():
        plot_loss(read_metrics(writer.path), job_dir / "plots" / "loss.png", title=cfg.name)
        summary = {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(result).items()}
        (job_dir / "result.json").write_text(json.dumps(summary, indent=2) + "\n")
    if result.final_eval_loss is not None:
        line = f"Final eval loss {result.final_eval_loss:.4f} nats/token"
        if result.unigram_entropy is not None:
            line += f" (unigram entropy of the training tokens: {result.unigram_entropy:.4f})"
        console.print(line, highlight=False)
    return result
