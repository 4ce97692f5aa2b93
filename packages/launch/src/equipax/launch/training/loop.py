"""The training loop, one for every experiment: config -> `build_training` -> step -> hooks -> job dir.

The host loop stays small: fetch a batch, dispatch the jitted step, and let the hooks
(`hooks.py`: logging, eval, epoch summaries, checkpoints) act on it; metrics of a logged step
are read back only after the next step was dispatched, so the device never waits for the host.
"""

import contextlib
import dataclasses
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from rich.console import Console

from equipax.core.knobs import ConfigError, flatten, format_knobs, from_json, to_json
from equipax.core.mesh import build_mesh, check_device_count
from equipax.launch.cluster.distributed import any_process, host_state, is_primary
from equipax.launch.errors import Preempted
from equipax.launch.configs.experiment import ExperimentConfig
from equipax.launch.tasks import Inputs, family
from equipax.launch.training.build import Training, build_training
from equipax.launch.jobdir.checkpoints import Checkpointer
from equipax.launch.training.decode_hook import DecodeHook
from equipax.launch.training.finish import RunResult, finish
from equipax.launch.training.hooks import CheckpointHook, EpochHook, EvalHook, Hook, LogHook, StepTimer
from equipax.launch.jobdir.ownership import JobLock, prepare_job_dir, write_text_atomic
from equipax.launch.training.nonfinite import NonFiniteMonitor, poison_batch
from equipax.launch.training.preemption import StopRequest
from equipax.launch.training.progress import ProgressReporter
from equipax.launch.training.profiling import profiling_hooks
from equipax.launch.jobdir.resume import check_resume, resume_meta
from equipax.launch.jobdir.summaries import MetricsWriter

__all__ = [
    "build_run_mesh",
    "device_peak_tflops",
    "PEAK_TFLOPS",
    "Run",
    "run_experiment",
    "RunResult",
]

# bf16 dense peak per chip, TFLOP/s, by `device_kind` substring (for MFU).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "TPU v4": 275.0, "TPU v5 lite": 197.0,
               "TPU v5e": 197.0, "TPU v5p": 459.0, "TPU v5": 459.0, "TPU v6": 918.0}


def device_peak_tflops(cfg: ExperimentConfig) -> float | None:
    """The per-device peak used for MFU: the config's, else a table lookup, else None (CPU)."""
    if cfg.train.peak_tflops_per_device is not None:
        return cfg.train.peak_tflops_per_device
    kind = jax.devices()[0].device_kind
    return next((peak for name, peak in PEAK_TFLOPS.items() if name.lower() in kind.lower()), None)


def build_run_mesh(cfg: ExperimentConfig) -> jax.sharding.Mesh:
    """The experiment's mesh on this job's devices, or a ConfigError saying what to do instead."""
    if cfg.mesh.num_devices != jax.device_count():
        check_device_count(cfg.mesh, jax.device_count(), hint=_mesh_hint(cfg))
    return build_mesh(cfg.mesh)


def _mesh_hint(cfg: ExperimentConfig) -> str:
    """What to run instead, naming only experiments that exist."""
    from equipax.launch.experiments import registry

    names = {e.name for e in registry.entries()}
    base = cfg.name.removesuffix("_smoke")
    hint = f". To check this experiment without the hardware, run `launch compile --exp {cfg.name}`"
    smoke = f"{base}_smoke"
    if cfg.name.endswith("_smoke") or smoke not in names:
        return hint + (f"; to simulate its {cfg.mesh.num_devices} devices on this CPU, add `--cpu-devices "
                       f"{cfg.mesh.num_devices}`" if cfg.mesh.num_devices <= 64 else "")
    devices = registry.get_experiment(smoke).mesh.num_devices  # pyright: ignore[reportAttributeAccessIssue]
    return hint + (f"; to run its code path on this CPU, try `launch run --exp {smoke} --cpu-devices "
                   f"{devices}`")


def _knob_changes(cfg: ExperimentConfig, job_dir: Path) -> str:
    """The knobs that differ from the job's recorded config.json, as text (or "")."""
    try:
        old = flatten(from_json(ExperimentConfig, (job_dir / "config.json").read_text()))
    except (OSError, ConfigError, ValueError):
        return ""
    diffs = [f"  {k}: {old.get(k)!r} -> {v!r}" for k, v in flatten(cfg).items() if old.get(k) != v]
    return "\nKnobs that differ from the job's config.json:\n" + "\n".join(diffs) if diffs else ""


@dataclasses.dataclass
class Run:
    """One run's moving parts, shared by the loop and its hooks."""

    cfg: ExperimentConfig
    job_dir: Path
    training: Training
    inputs: Inputs
    writer: MetricsWriter
    checkpointer: Checkpointer
    progress: ProgressReporter
    nonfinite: NonFiniteMonitor
    timer: StepTimer
    start: int
    unit: str
    units_per_step: int
    flops_per_step: float | None
    peak_tflops: float | None
    primary: bool
    stopping: bool = False
    last_train: dict[str, float] = dataclasses.field(default_factory=dict)
    last_eval: dict[str, float] = dataclasses.field(default_factory=dict)
    last_eval_step: int = -1
    stopped_by: str = ""

    @property
    def total(self) -> int:
        return self.cfg.num_steps

    @property
    def steps_per_epoch(self) -> int:
        return self.cfg.steps_per_epoch or 0

    def epoch_end(self, step: int) -> bool:
        """True after the last step of an epoch of a `train.num_epochs` run."""
        return self.cfg.train.num_epochs is not None and step % self.steps_per_epoch == 0

    def check_nonfinite(self, upto: int) -> None:
        """Apply `train.on_nonfinite` to the steps up to `upto` (raises NonFiniteError to stop)."""
        self.nonfinite.check(upto, where=str(self.job_dir / "checkpoints"),
                             rollback=self.checkpointer.set_aside_from, log=self.progress.message)


def run_experiment(cfg: ExperimentConfig, *, job_dir: Path, sources: dict[str, str] | None = None,
                   console: Console | None = None) -> RunResult:
    """Train `cfg`, writing everything to `job_dir`; resume if it holds a checkpoint.

    Arguments:
        cfg: the resolved experiment.
        job_dir: the job directory (created if missing).
        sources: which knobs came from `--set` (for knobs.txt).
        console: where progress goes (default: stdout).

    Returns:
        A RunResult with the final losses and a digest of the final state.

    Raises:
        Preempted: stopped by SIGTERM/SIGINT after saving a checkpoint.
    """
    console = console or Console()
    job_dir = Path(job_dir)
    try:
        cfg = cfg.for_devices(jax.device_count())  # a -1 mesh axis takes the devices present
    except ValueError as e:
        raise ConfigError(str(e)) from None
    mesh = build_run_mesh(cfg)  # fails in seconds when the devices are not there
    created = not job_dir.exists()
    prepare_job_dir(job_dir, cfg.name)  # writable, and not another experiment's
    try:
        with JobLock(job_dir, log=lambda m: console.print(m, highlight=False)):
            return _train(cfg, job_dir, mesh, sources or {}, console)
    except BaseException:
        if created and is_primary() and not any(p.name != ".lock" for p in job_dir.iterdir()):
            shutil.rmtree(job_dir, ignore_errors=True)  # stopped before writing anything: leave no trace
        raise


def _train(cfg: ExperimentConfig, job_dir: Path, mesh: jax.sharding.Mesh, sources: dict[str, str],
           console: Console) -> RunResult:
    fam = family(cfg)
    numbers = fam.numbers(cfg)
    log = lambda m: console.print(m, highlight=False)  # noqa: E731
    log(f"[bold]{cfg.name}[/]: {numbers['params_total'] / 1e6:.2f}M params, {cfg.global_batch_size:,} "
        f"examples/step, {cfg.num_steps} steps -> {job_dir}")
    inputs = fam.build_inputs(cfg, job_dir, log=log)
    training = build_training(cfg, mesh)
    state = training.init_state()
    meta = resume_meta(cfg, job_dir, hosts=jax.process_count())
    checkpointer = Checkpointer(job_dir / "checkpoints", keep=cfg.train.keep_checkpoints, meta=meta)
    writer = MetricsWriter(job_dir, enabled=is_primary(), log=log)

    def check_meta(saved: dict[str, Any], step: int) -> None:
        for note in check_resume(saved, meta, step=step, where=job_dir / "checkpoints"):
            log(f"note: {note}")

    try:  # the newest checkpoint that restores and verifies; damaged ones are set aside with a message
        restored = checkpointer.restore_latest(state, log=log, check_meta=check_meta)
    except ConfigError as e:
        checkpointer.close()
        raise ConfigError(f"{e}{_knob_changes(cfg, job_dir)}") from None
    start, loop_state = 0, {}
    if restored is not None:
        start, state, data_state, loop_state = restored
        if start > cfg.num_steps:  # before anything (result.json, config.json) is rewritten
            checkpointer.close()
            raise ConfigError(
                f"The job in {job_dir} already trained to step {start} (its newest checkpoint), past "
                f"train.num_steps={cfg.num_steps}; its result.json is kept as it is. Raise train.num_steps "
                f"to at least {start} to continue it, or point --job-log-dir at a new directory for a "
                "shorter run."
            )
        inputs.train.set_state(host_state(data_state))
        log(f"Resumed from step {start} ({job_dir / 'checkpoints'}).")
    writer.truncate_after(start)  # records written after the checkpoint resumed from
    if is_primary():
        write_text_atomic(job_dir / "config.json", to_json(cfg) + "\n")
        write_text_atomic(job_dir / "knobs.txt", format_knobs(cfg, sources))

    run = Run(cfg=cfg, job_dir=job_dir, training=training, inputs=inputs, writer=writer,
              checkpointer=checkpointer, progress=ProgressReporter(console, total=cfg.num_steps, start=start),
              nonfinite=NonFiniteMonitor(cfg.train.on_nonfinite, cfg.train.max_consecutive_nonfinite, loop_state),
              timer=StepTimer(start), start=start, unit=fam.UNIT,
              units_per_step=cfg.global_batch_size * fam.units_per_example(cfg),
              flops_per_step=numbers.get("model_flops_per_step"), peak_tflops=device_peak_tflops(cfg),
              primary=is_primary())
    log_hook = LogHook()
    hooks: list[Hook] = [log_hook, EvalHook(log_hook), DecodeHook(run, log_hook)]
    if cfg.train.num_epochs is not None:
        hooks.append(EpochHook())
    hooks.append(CheckpointHook(hooks[:]))
    for hook in hooks:
        hook.load(loop_state)

    hooks[:0] = profiling_hooks(run)  # first: they bracket the step's dispatch (profile window, PGLE)
    try:
        state, step = _loop(run, hooks, state)
    except BaseException:
        for hook in hooks:  # stop a profile trace, restore settings; the original error is the one raised
            with contextlib.suppress(Exception):
                hook.close(run)
        raise
    for hook in hooks:
        hook.close(run)
    run.progress.close()
    checkpointer.close()
    if run.stopping:
        writer.close()
        log(f"Stopped by {run.stopped_by} after step {step}; checkpoint saved in {job_dir / 'checkpoints'}. "
            "Run the same command again to resume.")
        raise Preempted(step)
    return finish(run, hooks, state, fam, log)


def _loop(run: Run, hooks: list[Hook], state: Any) -> tuple[Any, int]:
    """Fetch, dispatch, hooks: the whole loop."""
    cfg, training = run.cfg, run.training
    step = run.start
    with StopRequest() as stop:
        for step in range(run.start + 1, run.total + 1):
            host_batch = run.inputs.train.get_next()
            if step == run.start + 1:
                training.task.check_batch(host_batch, cfg.global_batch_size // jax.process_count())
                _log_host_examples(run, host_batch)
            if step in cfg.train.debug_nan_steps:  # test knob: a poisoned batch
                host_batch = poison_batch(host_batch)
            for hook in hooks:
                hook.before_step(run, step)
            state, metrics = training.train_step(state, training.place(host_batch), training.keys.step)
            run.nonfinite.record(step, metrics)
            if step == run.start + 1:
                jax.block_until_ready(metrics)  # the first step includes compilation
                run.progress.message(f"Compiled and ran the first step in {time.monotonic() - run.timer.t:.1f} s.")
                run.timer.restart(step)
            run.stopping = any_process(bool(stop))  # all processes stop at the same step
            for hook in hooks:
                hook.after_step(run, step, state, metrics)
            if run.stopping:
                run.stopped_by = stop.signal_name or "a peer process"
                break
    return state, step


def _log_host_examples(run: Run, batch: Mapping[str, Any]) -> None:
    """Multi-host: say which examples this host reads first (disjoint across hosts)."""
    if jax.process_count() > 1 and "example_id" in batch:
        ids = batch["example_id"]
        run.progress.message(f"host {jax.process_index()}/{jax.process_count()} reads examples "
                             f"{ids.tolist() if ids.size <= 16 else f'{ids[0]}..{ids[-1]}'}")
