"""The training program, one for every experiment: config -> `build_training` -> resume -> steps
and hooks -> result, all in the job directory.

`run_experiment` checks the devices and the job directory, builds the program and the inputs,
resumes from the newest checkpoint that verifies, and runs the step loop (`step_loop.py`) with
the run's own hooks (`builtin_hooks.py`) and the caller's (`hooks.py` is their protocol).
"""

import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import jax
from rich.console import Console

from equipax.core.knobs import EXPERIMENT, ConfigError, format_knobs, to_json
from equipax.core.mesh import build_mesh, check_device_count
from equipax.core.step import TrainState
from equipax.launch.aot.remat import is_auto
from equipax.launch.cluster.distributed import is_primary
from equipax.launch.configs.experiment import ExperimentConfig
from equipax.launch.failures import Preempted
from equipax.launch.jobdir.checkpoints import Checkpointer
from equipax.launch.jobdir.ownership import JobLock, prepare_job_dir, write_text_atomic
from equipax.launch.jobdir.summaries import MetricsWriter
from equipax.launch.program.attention import ATTENTION_KNOB, attention_record
from equipax.launch.program.program import check_host_rows
from equipax.launch.program.training import Training, build_training
from equipax.launch.store.storage import AnyPath, job_path, rmtree
from equipax.launch.tasks import Family, Inputs, family
from equipax.launch.training.ahead import CompileAhead
from equipax.launch.training.builtin_hooks import builtin_hooks
from equipax.launch.training.finish import RunResult, finish
from equipax.launch.training.hooks import Hook, RunContext, order_hooks
from equipax.launch.training.nonfinite import NonFiniteMonitor
from equipax.launch.training.progress import ProgressReporter
from equipax.launch.training.resume_checks import resume_meta
from equipax.launch.training.start import Start, resume_or_start
from equipax.launch.training.startup import compile_cache, mark
from equipax.launch.training.step_loop import StepLoop

__all__ = ["build_run_mesh", "remat_target", "run_experiment", "RunResult"]


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
        return hint + (
            f"; to simulate its {cfg.mesh.num_devices} devices on this CPU, add `--cpu-devices {cfg.mesh.num_devices}`"
            if cfg.mesh.num_devices <= 64
            else ""
        )
    devices = registry.get_experiment(smoke).mesh.num_devices  # pyright: ignore[reportAttributeAccessIssue]
    return hint + (f"; to run its code path on this CPU, try `launch run --exp {smoke} --cpu-devices {devices}`")


def run_experiment(
    cfg: ExperimentConfig,
    *,
    job_dir: AnyPath,
    sources: dict[str, str] | None = None,
    console: Console | None = None,
    hooks: Sequence[Hook] = (),
    allow_new_data_order: bool = False,
) -> RunResult:
    """Train `cfg`, writing everything to `job_dir`; resume if it holds a checkpoint.

    Arguments:
        cfg: the resolved experiment.
        job_dir: the job directory (created if missing): local, or `gs://`/`s3://` (`store/storage.py`).
        sources: which knobs came from `--set` (for knobs.txt).
        console: where progress goes (default: stdout).
        hooks: the caller's hooks (`equipax.launch.training.hooks.Hook`), run with the run's own
            (evaluation, sampling, profiling, checkpoints) in the order their constraints give.
        allow_new_data_order: resume even where the data knobs changed (another global batch,
            dataset or tokenizer): the model and optimizer state are restored, the data starts a
            new order (`launch run --allow-new-data-order`).

    Returns:
        A RunResult with the final losses and a digest of the final state.

    Raises:
        Preempted: stopped by SIGTERM/SIGINT after saving a checkpoint.
    """
    console = console or Console()
    job_dir = job_path(job_dir)
    try:
        cfg = cfg.for_devices(jax.device_count())  # a -1 mesh axis takes the devices present
    except ValueError as e:
        raise ConfigError(str(e)) from None
    mesh = build_run_mesh(cfg)  # fails in seconds when the devices are not there
    mark("devices")
    created = not job_dir.exists()
    prepare_job_dir(job_dir, cfg.name)  # writable, and not another experiment's
    try:
        with JobLock(job_dir, log=lambda m: console.print(m, highlight=False)):
            # JAX's automatic PGLE recompiles after profiling: its programs stay out of the cache.
            cache_dir = cfg.train.compiler.cache_dir if cfg.train.pgle.mode != "auto" else ""
            # The background compiles (`ahead.py`) end before the cache's settings are restored.
            with compile_cache(cache_dir, job_dir), contextlib.ExitStack() as cleanup:
                return _train(cfg, job_dir, mesh, sources or {}, console, hooks, cleanup, allow_new_data_order)
    except BaseException:
        # Stopped before writing anything (the compilation cache is no record of the job): leave no trace.
        kept = {".lock", *Path(cfg.train.compiler.cache_dir).parts[:1]}
        if created and is_primary() and not any(p.name not in kept for p in job_dir.iterdir()):
            rmtree(job_dir)
        raise


def local_device_memory_gib() -> float:
    """Memory per local device: the allocator's limit of an accelerator, or a CPU host's memory
    shared by its (simulated) devices."""
    import os

    device = jax.local_devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and stats.get("bytes_limit"):
        return stats["bytes_limit"] / 2**30
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 / jax.local_device_count()


def _compile_ahead(cfg: ExperimentConfig, training: Training, inputs: Inputs) -> CompileAhead | None:
    """The run's train step, eval step and checksum program compiled on a background thread
    (`ahead.py`); None with JAX's automatic PGLE, which profiles the step's own calls."""
    if cfg.train.pgle.mode == "auto":
        return None
    # The eval step is compiled for batches of the train batches' shape.
    return CompileAhead(training, eval_step=getattr(inputs.eval, "batch_size", None) == inputs.train.batch_size)


def remat_target(cfg: ExperimentConfig, device: Any) -> tuple[float, Any, dict[str, Any]]:
    """What `remat="auto"` is chosen against on `device` in a run: the budget in GiB
    (`train.hbm_gib_per_device`, else the device's own memory, `local_device_memory_gib`), the
    roofline of its kind (`train.peak_tflops_per_device` for the peak) and the target recorded."""
    from equipax.launch.aot.hlo_cost import NOMINAL_HOST, Roofline
    from equipax.launch.hardware.accelerators import accelerator_of

    budget = cfg.train.hbm_gib_per_device or local_device_memory_gib()
    accelerator = accelerator_of(device.device_kind)
    roofline = Roofline.of(accelerator, cfg.train.peak_tflops_per_device) if accelerator else NOMINAL_HOST
    return budget, roofline, {"name": device.device_kind, "platform": device.platform, "budget_gib": budget}


def _choose_remat(
    cfg: ExperimentConfig,
    mesh: jax.sharding.Mesh,
    job_dir: AnyPath,
    sources: dict[str, str],
    log: Any,
    cleanup: contextlib.ExitStack,
) -> tuple[ExperimentConfig, dict[str, str], Training | None]:
    """`model.transformer.remat="auto"` resolved on this job's devices (`equipax.launch.aot.remat`),
    with the chosen candidate's program where it was compiled here (its first step compiles nothing,
    whether or not JAX's persistent compilation cache is on)."""
    from equipax.launch.aot.remat import CACHE_FILE, KNOB, choose_remat, format_remat_table

    budget, roofline, target = remat_target(cfg, mesh.devices.flat[0])
    choice = choose_remat(
        cfg,
        mesh,
        budget_gib=budget,
        margin=cfg.train.hbm_margin,
        roofline=roofline,
        target=target,
        cache=job_dir / CACHE_FILE,
        log=log,
        feeds_batches=True,
        beside=_compile_init(cfg, mesh),
    )
    if choice.beside is not None:  # done before JAX's compilation cache settings are restored
        cleanup.callback(choice.beside.join)
    if choice.cached is None:
        log(f"{KNOB}='auto' -> {choice.policy!r} ({choice.reason}; {choice.search_s:.1f} s):")
        log(format_remat_table(choice.table, choice.budget_bytes, choice.policy, choice.own))
    how = f"auto, chosen by compiling: {choice.reason}" if choice.reason else "auto, chosen by compiling"
    training = choice.compiled.training if choice.compiled is not None else None
    return choice.cfg, {**sources, KNOB: f"{how} ({CACHE_FILE})"}, training


def _compile_init(cfg: ExperimentConfig, mesh: jax.sharding.Mesh) -> Callable[[], object] | None:
    """The state's initialisation compiled into JAX's persistent compilation cache, for `build` to
    load (None where the cache is off: `build` compiles it); remat="auto" runs it beside its
    candidates' compiles (the program is the same under every policy)."""
    if not jax.config.jax_compilation_cache_dir:
        return None
    return lambda: build_training(cfg, mesh, feeds_batches=False).compile_init()


def _with_attention_note(cfg: ExperimentConfig, mesh: jax.sharding.Mesh, sources: dict[str, str]) -> dict[str, str]:
    """`sources`, with what `attention_impl="auto"` runs as on this mesh noted beside the knob (its
    value stays "auto" in config.json: another platform resolves it again)."""
    record = attention_record(cfg, mesh)
    if record is None or record["value"] != "auto":
        return sources
    where = f"on this mesh ({record['platform']}, seq {record['seq_len']}, {record['dtype']})"
    return {
        **sources,
        ATTENTION_KNOB: f"{sources.get(ATTENTION_KNOB, EXPERIMENT)}; auto -> {record['kernel']!r} {where}",
    }


def _train(
    cfg: ExperimentConfig,
    job_dir: AnyPath,
    mesh: jax.sharding.Mesh,
    sources: dict[str, str],
    console: Console,
    extra_hooks: Sequence[Hook],
    cleanup: contextlib.ExitStack,
    allow_new_data_order: bool = False,
) -> RunResult:
    log = lambda m: console.print(m, highlight=False)  # noqa: E731
    chosen = None
    if is_auto(cfg):  # before anything reads the model: the rest of the run sees the chosen policy
        cfg, sources, chosen = _choose_remat(cfg, mesh, job_dir, sources, log, cleanup)
        mark("remat auto")
    fam = family(cfg)
    numbers = fam.numbers(cfg)
    log(
        f"[bold]{cfg.name}[/]: {numbers['params_total'] / 1e6:.2f}M params, {cfg.global_batch_size:,} "
        f"examples/step, {cfg.num_steps} steps -> {job_dir}"
    )
    inputs = fam.build_inputs(cfg, job_dir, mesh=mesh, log=log)
    mark("inputs")
    training = chosen if chosen is not None else build_training(cfg, mesh)
    check_host_rows(training, inputs.train)
    checkpointer = _checkpointer(training, fam, inputs, job_dir)
    writer = MetricsWriter(job_dir, enabled=is_primary(), log=log)
    ahead = _compile_ahead(cfg, training, inputs)
    if ahead is not None:
        cleanup.callback(ahead.close)
    start = resume_or_start(
        training, fam, inputs.train, checkpointer, job_dir=job_dir, ahead=ahead,
        allow_new_data_order=allow_new_data_order, log=log,
    )  # fmt: skip
    mark("build")
    writer.truncate_after(start.step)  # records written after the checkpoint resumed from
    _write_config(cfg, job_dir, mesh, sources)
    progress = ProgressReporter(console, total=cfg.num_steps, start=start.step)
    nonfinite = NonFiniteMonitor(cfg.train.on_nonfinite, cfg.train.max_consecutive_nonfinite, start.loop_state)
    run = RunContext(
        cfg=cfg, job_dir=job_dir, training=training, inputs=inputs, start=start.step, total=cfg.num_steps,
        unit=fam.UNIT, primary=is_primary(), writer=writer, checkpointer=checkpointer, log=progress.message,
        check_nonfinite=lambda upto: nonfinite.check(
            upto, where=str(job_dir / "checkpoints"), rollback=checkpointer.set_aside_from, log=progress.message
        ),
        ahead=ahead,
    )  # fmt: skip
    loop = StepLoop(
        run,
        order_hooks([*builtin_hooks(run), *extra_hooks]),
        nonfinite,
        progress,
        units_per_step=cfg.global_batch_size * fam.units_per_example(cfg),
        flops_per_step=numbers.get("model_flops_per_step"),
    )
    state, step = _steps_with_hooks(loop, run, start)
    progress.close()
    cleanup.callback(checkpointer.close)  # `finish` closes it (waits for the final save) before result.json
    if loop.stopped_by:
        _preempted(loop.stopped_by, step, checkpointer, writer, job_dir, log)
    return finish(run, loop.hooks, state, fam, last_train=loop.train_log.latest, outputs=loop.outputs, console=console)


def _checkpointer(training: Training, fam: Family, inputs: Inputs, job_dir: AnyPath) -> Checkpointer:
    """The run's checkpointer, each save recording what its state means (`resume_meta`) and where
    the run is (the processes, devices and mesh)."""
    cfg, mesh = training.cfg, training.mesh
    layout = {"processes": jax.process_count(), "devices": int(mesh.devices.size), "mesh": dict(mesh.shape)}
    meta = resume_meta(
        cfg,
        fam.data_fingerprint(cfg, job_dir),
        hosts=jax.process_count(),
        global_state=inputs.train.global_state,
        layout=layout,
    )
    return Checkpointer(job_dir / "checkpoints", keep=cfg.train.keep_checkpoints, meta=meta)


def _write_config(cfg: ExperimentConfig, job_dir: AnyPath, mesh: jax.sharding.Mesh, sources: dict[str, str]) -> None:
    """config.json (the experiment as run) and knobs.txt (every knob, where it came from), by the primary."""
    if is_primary():
        write_text_atomic(job_dir / "config.json", to_json(cfg) + "\n")
        write_text_atomic(job_dir / "knobs.txt", format_knobs(cfg, _with_attention_note(cfg, mesh, sources)))


def _steps_with_hooks(loop: StepLoop, run: RunContext, start: Start) -> tuple[TrainState[Any], int]:
    """The step loop from `start`, the hooks loaded with their saved state, started before the
    first step and closed after the last; on an error each is closed (its own error suppressed)
    and the error raised."""
    for hook in loop.hooks:
        hook.load(start.loop_state)
    try:
        for hook in loop.hooks:
            hook.start(run)
        state, step = loop.train(start.state)
    except BaseException:
        for close in (loop.train_log.flush, *(lambda h=h: h.close(run) for h in loop.hooks)):
            with contextlib.suppress(Exception):  # stop a profile trace, restore settings; the error is raised
                close()
        raise
    loop.train_log.flush()
    for hook in loop.hooks:
        hook.close(run)
    return state, step


def _preempted(
    by: str,
    step: int,
    checkpointer: Checkpointer,
    writer: MetricsWriter,
    job_dir: AnyPath,
    log: Callable[[str], object],
) -> NoReturn:
    """Stopped by a signal after saving step `step`: close the checkpointer and the writer, say how
    to resume, raise Preempted."""
    checkpointer.close()
    writer.close()
    log(
        f"Stopped by {by} after step {step}; checkpoint saved in {job_dir / 'checkpoints'}. "
        "Run the same command again to resume."
    )
    raise Preempted(step)
