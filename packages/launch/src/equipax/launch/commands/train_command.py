"""`launch list`, `launch show` and `launch run`: the registry and the one training program."""

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from equipax.core.knobs import ConfigError, flatten, format_knobs, to_dict
from equipax.launch.commands.common import (
    DEFAULT_EXPERIMENT,
    CpuDevicesOption,
    ExpOption,
    JobLogDirOption,
    SetOption,
    err,
    fail,
    out,
    resolve,
    resolve_job,
)
from equipax.launch.experiments import registry
from equipax.launch.store.storage import job_path

__all__ = ["list_cmd", "profile_overrides", "run", "show"]


def _count(n: int | float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(int(n))


def list_cmd() -> None:
    """List registered experiments."""
    from equipax.launch.tasks import derived_numbers

    table = Table(title="Registered experiments")
    for col in ("name", "params", "mesh", "data", "steps"):
        table.add_column(col, no_wrap=True)
    for entry in registry.entries():
        cfg = entry.fn()
        if entry.kind == "benchmark":
            table.add_row(entry.name, "-", "1", "random q/k/v", "-")
            continue
        mesh = "x".join(str(s) for s in cfg.mesh.shape) if cfg.mesh.num_devices > 1 else "1"
        data = cfg.data.source + (" images" if cfg.kind == "image_classification" else "")
        table.add_row(entry.name, _count(derived_numbers(cfg)["params_total"]), mesh, data, _count(cfg.num_steps))
    out.print(table)
    out.print("mesh = data x fsdp x tensor devices; `launch show --exp NAME` for everything else.", highlight=False)
    aliases = [(alias, entry.name) for entry in registry.entries() for alias in entry.aliases]
    if aliases:
        out.print("\nPax names (`--exp` takes the whole path or its class name):", highlight=False)
        width = max(len(a) for a, _ in aliases)
        for alias, name in sorted(aliases):
            out.print(f"  {alias:<{width}}  = {name}", highlight=False)


def show(
    exp: ExpOption = DEFAULT_EXPERIMENT,
    set_: SetOption = None,
    format: Annotated[str, typer.Option("--format", help="text, json, or maxtext (a MaxText config).")] = "text",
    cpu_devices: CpuDevicesOption = None,
) -> None:
    """Print the resolved config and derived numbers without touching any device."""
    from equipax.launch.tasks import derived_numbers

    entry, cfg, sources = resolve(exp, set_)
    numbers = derived_numbers(cfg) if entry.kind == "train" else {}
    if "devices_required" in numbers and cpu_devices is not None and cpu_devices != numbers["devices_required"]:
        err.print(
            f"note: the mesh needs {numbers['devices_required']} devices; --cpu-devices {cpu_devices} "
            "would not run it.",
            highlight=False,
        )
    if format == "json":
        doc = {"config": to_dict(cfg), "derived": numbers, "sources": sources, "aliases": list(entry.aliases)}
        print(json.dumps(doc, indent=2))
    elif format == "text":
        out.print(f"[bold]# {cfg.name}[/]: {cfg.description}", highlight=False)
        if entry.aliases:
            out.print(f"# also --exp {' or '.join(entry.aliases)}", highlight=False)
        out.print(format_knobs(cfg, sources), highlight=False, markup=False, end="")
        out.print("[bold]# derived[/]", highlight=False)
        for k, v in numbers.items():
            text = f"{v:,}" if isinstance(v, int) else f"{v:.4g}" if isinstance(v, float) else str(v)
            out.print(f"{k} = {text}", highlight=False)
    elif format == "maxtext":
        from equipax.launch.commands.convert_command import print_maxtext

        print_maxtext(cfg)
    else:
        fail(f"--format must be 'text', 'json' or 'maxtext'; got {format!r}.")


def profile_overrides(text: str) -> list[str]:
    """`--profile START:COUNT` as the knobs it sets (train.profile.start_step, train.profile.steps)."""
    start, sep, count = text.partition(":")
    if not sep or not count.strip().isdigit() or not (start.strip().isdigit() or not start.strip()):
        fail(
            f"--profile takes START:COUNT (e.g. 5:3 traces steps 5, 6 and 7; :3 starts at the run's second "
            f"step); got {text!r}."
        )
    return [f"train.profile.start_step={start.strip() or None}", f"train.profile.steps={count.strip()}"]


def run(
    exp: Annotated[
        str | None,
        typer.Option(
            "--exp",
            "-e",
            help="Experiment: short name or dotted path (default: the --job-log-dir's own, else shakespeare_tiny).",
        ),
    ] = None,
    set_: SetOption = None,
    job_log_dir: JobLogDirOption = None,
    cpu_devices: CpuDevicesOption = None,
    coordinator: Annotated[
        str | None, typer.Option("--coordinator", help="Multi-process: HOST:PORT of process 0.")
    ] = None,
    num_processes: Annotated[int | None, typer.Option("--num-processes", help="Multi-process: N.")] = None,
    process_id: Annotated[int | None, typer.Option("--process-id", help="Multi-process: this process, 0..N-1.")] = None,
    distributed_auto: Annotated[
        bool,
        typer.Option(
            "--distributed-auto",
            help="Join a multi-host job detected from the environment (Cloud TPU, SLURM, Open MPI).",
        ),
    ] = False,
    coordinator_timeout: Annotated[
        float,
        typer.Option(
            "--coordinator-timeout",
            min=1,
            help="Multi-process: seconds to wait for the coordinator and the other processes.",
        ),
    ] = 300.0,
    profile: Annotated[
        str | None,
        typer.Option(
            "--profile",
            help="START:COUNT: trace COUNT steps from step START into <job>/profile (':COUNT' = from the second step).",
        ),
    ] = None,
    allow_new_data_order: Annotated[
        bool,
        typer.Option(
            "--allow-new-data-order",
            help="Resume although the global batch, dataset or tokenizer changed: keep the model and "
            "optimizer state, start the data in a new order (recorded in the checkpoints' meta).",
        ),
    ] = False,
) -> None:
    """Train an experiment; rerun the same command to resume from its last checkpoint (on any
    number of hosts and devices: the data order stays the same)."""
    from equipax.launch.training import startup

    startup.reset()
    startup.mark("start-up")  # the interpreter and the imports so far
    if profile is not None:
        set_ = [*(set_ or []), *profile_overrides(profile)]
    job_given = job_path(job_log_dir) if job_log_dir is not None else None
    if exp is None and job_given is not None and (job_given / "config.json").exists():
        entry, cfg, sources = resolve_job(job_given, set_)  # the job's own experiment (an imported model...)
    else:
        entry, cfg, sources = resolve(exp or DEFAULT_EXPERIMENT, set_)  # a pure value: no device touched yet
    # Imported after the knobs resolved: a typo in --exp/--set answers without loading these.
    from equipax.launch.cluster.detect import find_job
    from equipax.launch.cluster.devices import check_cpu_devices, open_devices_early, use_cpu_devices
    from equipax.launch.cluster.distributed import HostConsole
    from equipax.launch.cluster.join import DistributedArgs, initialize
    from equipax.launch.cluster.shape import check_shape
    from equipax.launch.hardware.compiler_flags import apply_compiler_flags, check_compiler_flags
    from equipax.launch.training.pgle import check_profile, set_xla_flags

    dist = DistributedArgs(
        coordinator, num_processes, process_id, auto=distributed_auto, coordinator_timeout_s=coordinator_timeout
    )
    try:
        # --distributed-auto under SLURM / Open MPI: the job's shape is read (and checked) before JAX starts.
        job = (
            find_job(cfg.mesh if entry.kind == "train" else None, cpu_devices=cpu_devices) if distributed_auto else None
        )
        if job is not None:
            dist = dist.joining(job)
        if entry.kind == "train":  # refuse a device count the mesh cannot use before creating them
            check_cpu_devices(cpu_devices, cfg.mesh, num_processes=dist.num_processes or 1)
            # train.compiler.xla_flags / libtpu_init_args, then PGLE: read when the backend (libtpu) starts.
            compiler = cfg.train.compiler
            changed = apply_compiler_flags(compiler.xla_flags, compiler.libtpu_init_args)
            for var, value in changed.items():
                err.print(f"{var}={value}", highlight=False, markup=False)
            check_compiler_flags(changed, xla_flags=compiler.xla_flags, libtpu_init_args=compiler.libtpu_init_args)
            check_profile(cfg.train.pgle)
            set_xla_flags(cfg.train.pgle)
        use_cpu_devices(cpu_devices)
        initialize(dist)
        if dist.requested and entry.kind == "train":  # every process, once the job has started
            import jax

            check_shape(cfg.mesh, num_processes=jax.process_count(), local_devices=jax.local_device_count())
    except ConfigError as e:
        fail(str(e))
    job_dir = job_given or Path("runs") / cfg.name
    if entry.kind == "train":
        from equipax.launch.hardware.tpu import host_buffer_for_new_job

        loads_weights = bool(flatten(cfg).get("model.init_from"))
        if (size := host_buffer_for_new_job(job_dir, loads_weights=loads_weights)) is not None:
            err.print(f"TPU_PREMAPPED_BUFFER_SIZE={size} (a new job: docs/compile.md)", highlight=False, markup=False)
    open_devices_early()  # while the training code imports (the devices phase)
    startup.mark("config")  # the knobs, the compiler flags (the devices open meanwhile, on the thread above)
    if entry.kind == "benchmark":
        from equipax.launch.bench.attention_timing import run_attention_bench

        if not isinstance(job_dir, Path):
            fail(f"{cfg.name} is a benchmark: it writes to a local --job-log-dir, not {str(job_dir)!r}.")
        run_attention_bench(cfg, job_dir, console=out)
        return
    from equipax.launch.training.loop import run_experiment

    # Errors (ConfigError -> exit 2, Preempted -> 75, NonFiniteError -> 4) are mapped in errors.py.
    run_experiment(
        cfg,
        job_dir=job_dir,
        sources=sources,
        console=HostConsole(soft_wrap=True),
        allow_new_data_order=allow_new_data_order,
    )
