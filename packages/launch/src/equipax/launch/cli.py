"""The `launch` command line: list, show and run registered experiments."""

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from equipax.core.config import ConfigError, apply_overrides, format_knobs, to_dict
from equipax.launch.experiments import registry
from equipax.launch.commands.bench import AttentionBenchConfig, bench_app, run_attention_bench
from equipax.launch.experiments.classify_config_old import ClassifierExperimentConfig
from equipax.launch.commands.data import data_app
from equipax.launch.errors import GuardedGroup
from equipax.launch.experiments.config import ExperimentConfig

DEFAULT_EXPERIMENT = "shakespeare_tiny"
EXIT_USER_ERROR = 2

app = typer.Typer(
    help="Configure and run ML experiments on JAX (equipax).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=GuardedGroup,  # exceptions -> one paragraph + exit code (docs/errors.md)
)


@app.callback()
def _options(
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks of unexpected errors.")] = False,
) -> None:
    """Read by GuardedGroup (errors.py) from the group's parsed parameters."""


app.add_typer(bench_app, name="bench")
app.add_typer(data_app, name="data")
out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)

ExpOption = Annotated[str, typer.Option("--exp", "-e", help="Experiment: short name or dotted path.")]
CpuDevicesOption = Annotated[
    int | None,
    typer.Option("--cpu-devices", help="Simulate N devices on this CPU host (e.g. 8 for a _smoke mesh)."),
]
SetOption = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override a knob: KNOB=VALUE (repeatable), e.g. model.transformer.num_layers=2."),
]


def fail(message: str, code: int = EXIT_USER_ERROR) -> None:
    """Print a one-paragraph error and exit with `code`."""
    err.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)


def resolve(exp: str, overrides: list[str] | None) -> tuple[registry.Experiment, dict[str, str]]:
    """The experiment's config with overrides applied, or a clean exit on a user error."""
    try:
        return apply_overrides(registry.get_experiment(exp), overrides or [])
    except ConfigError as e:
        fail(str(e))
        raise AssertionError("unreachable")


@app.command("list")
def list_cmd() -> None:
    """List registered experiments."""
    from equipax.launch.training.loop import derived_numbers

    def count(n: int | float) -> str:
        for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
            if n >= size:
                return f"{n / size:.1f}{unit}"
        return str(int(n))

    table = Table(title="Registered experiments")
    for col in ("name", "params", "mesh", "data", "steps"):
        table.add_column(col, no_wrap=True)
    for entry in registry.entries():
        cfg = entry.fn()
        if isinstance(cfg, AttentionBenchConfig):
            table.add_row(entry.name, "-", "1", "random q/k/v", "-")
            continue
        if isinstance(cfg, ClassifierExperimentConfig):
            from equipax.launch.training.classify_old import classifier_numbers

            table.add_row(entry.name, count(classifier_numbers(cfg)["params_total"]), "1",
                          f"{cfg.data.source} images", count(cfg.num_steps))
            continue
        n = derived_numbers(cfg)
        mesh = "x".join(str(s) for s in cfg.mesh.shape) if cfg.mesh.num_devices > 1 else "1"
        table.add_row(entry.name, count(n["params_total"]), mesh, cfg.data.source, count(cfg.train.num_steps))
    out.print(table)
    out.print("mesh = data x fsdp x tensor devices; `launch show --exp NAME` for everything else.",
              highlight=False)


@app.command()
def show(
    exp: ExpOption = DEFAULT_EXPERIMENT,
    set_: SetOption = None,
    format: Annotated[str, typer.Option("--format", help="text or json.")] = "text",
    cpu_devices: CpuDevicesOption = None,
) -> None:
    """Print the resolved config and derived numbers without touching any device."""
    from equipax.launch.training.loop import derived_numbers

    cfg, sources = resolve(exp, set_)
    numbers = derived_numbers(cfg) if isinstance(cfg, ExperimentConfig) else {}
    if isinstance(cfg, ClassifierExperimentConfig):
        from equipax.launch.training.classify_old import classifier_numbers

        numbers = classifier_numbers(cfg)
    if isinstance(cfg, ExperimentConfig) and cpu_devices is not None and cpu_devices != cfg.mesh.num_devices:
        err.print(f"note: the mesh needs {cfg.mesh.num_devices} devices; --cpu-devices {cpu_devices} "
                  "would not run it.", highlight=False)
    if format == "json":
        print(json.dumps({"config": to_dict(cfg), "derived": numbers, "sources": sources}, indent=2))
    elif format == "text":
        out.print(f"[bold]# {cfg.name}[/]: {cfg.description}", highlight=False)
        out.print(format_knobs(cfg, sources), highlight=False, markup=False, end="")
        out.print("[bold]# derived[/]", highlight=False)
        for k, v in numbers.items():
            text = f"{v:,}" if isinstance(v, int) else f"{v:.4g}" if isinstance(v, float) else str(v)
            out.print(f"{k} = {text}", highlight=False)
    else:
        fail(f"--format must be 'text' or 'json'; got {format!r}.")


@app.command()
def run(
    exp: ExpOption = DEFAULT_EXPERIMENT,
    set_: SetOption = None,
    job_log_dir: Annotated[
        Path | None, typer.Option("--job-log-dir", help="Job directory (default: runs/<exp>).")
    ] = None,
    cpu_devices: CpuDevicesOption = None,
    coordinator: Annotated[
        str | None, typer.Option("--coordinator", help="Multi-process: HOST:PORT of process 0.")
    ] = None,
    num_processes: Annotated[int | None, typer.Option("--num-processes", help="Multi-process: N.")] = None,
    process_id: Annotated[int | None, typer.Option("--process-id", help="Multi-process: this process, 0..N-1.")] = None,
    distributed_auto: Annotated[
        bool, typer.Option("--distributed-auto", help="Join a multi-host job detected from the environment (Cloud TPU, SLURM, Open MPI).")
    ] = False,
) -> None:
    """Train an experiment; rerun the same command to resume from its last checkpoint."""
    from equipax.launch.cluster.devices import use_cpu_devices
    from equipax.launch.cluster.distributed import DistributedArgs, HostConsole, initialize

    try:
        use_cpu_devices(cpu_devices)
        initialize(DistributedArgs(coordinator, num_processes, process_id, auto=distributed_auto))
    except ConfigError as e:
        fail(str(e))
    console = HostConsole(soft_wrap=True)
    cfg, sources = resolve(exp, set_)
    if isinstance(cfg, AttentionBenchConfig):
        run_attention_bench(cfg, job_log_dir or Path("runs") / cfg.name, console=out)
        return
    from equipax.launch.training.preemption import EXIT_PREEMPTED

    if isinstance(cfg, ClassifierExperimentConfig):
        from equipax.launch.training.classify_old import run_classifier
        from equipax.launch.training.loop import Preempted

        try:
            run_classifier(cfg, job_dir=job_log_dir or Path("runs") / cfg.name, sources=sources, console=out)
        except ConfigError as e:
            fail(str(e))
        except Preempted:
            raise typer.Exit(EXIT_PREEMPTED)
        return
    from equipax.launch.training.loop import Preempted, run_experiment

    job_dir = job_log_dir or Path("runs") / cfg.name
    try:
        run_experiment(cfg, job_dir=job_dir, sources=sources, console=console)
    except ConfigError as e:
        fail(str(e))
    except Preempted:
        raise typer.Exit(EXIT_PREEMPTED)


@app.command(
    "local-cluster",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
def local_cluster(
    command: Annotated[list[str] | None, typer.Argument(help="The command to run: -- run --exp NAME ...")] = None,
    processes: Annotated[int, typer.Option("--processes", "-n", help="How many processes (hosts).")] = 2,
    cpu_devices: CpuDevicesOption = None,
    grace_s: Annotated[float, typer.Option("--grace-s", help="Seconds stopped processes get before SIGKILL.")] = 20.0,
) -> None:
    """Run `launch run ...` as N processes on this machine: `launch local-cluster -n 2 -- run --exp X`."""
    from equipax.launch.cluster.local_cluster import run_local_cluster

    args = list(command or [])
    if args[:1] == ["--"]:
        args = args[1:]
    if args[:1] != ["run"]:
        fail("local-cluster runs a `run` command: launch local-cluster --processes 2 -- run --exp NAME ...")
    if processes < 1:
        fail(f"--processes must be >= 1; got {processes}.")
    code = run_local_cluster(processes, args, cpu_devices=cpu_devices, grace_s=grace_s,
                             write=lambda line: print(line, flush=True))
    raise typer.Exit(code)


EXIT_DOES_NOT_FIT = 3


@app.command("compile")
def compile_cmd(
    exp: ExpOption = DEFAULT_EXPERIMENT,
    set_: SetOption = None,
    target: Annotated[str, typer.Option("--target", help="tpu-v4, tpu-v5e, tpu-v5p, tpu-v6e, h100 or h200.")] = "tpu-v4",
    hbm_gib: Annotated[float | None, typer.Option("--hbm-gib", help="Memory budget per device (default: the target's HBM).")] = None,
    assumed_mfu: Annotated[float, typer.Option("--assumed-mfu", help="MFU for the realistic step-time projection.")] = 0.5,
    strict: Annotated[bool, typer.Option("--strict", help="Exit 3 if the step does not fit the budget.")] = False,
    job_log_dir: Annotated[
        Path | None, typer.Option("--job-log-dir", help="Where compile.json goes (default: runs/<exp>).")
    ] = None,
) -> None:
    """Compile the experiment's exact train step for its full mesh on this CPU host (AOT)."""
    from equipax.launch.aot.report import TARGETS, check_compile_devices, compile_report, format_report
    from equipax.launch.cluster.devices import use_cpu_devices

    cfg, _ = resolve(exp, set_)
    if not isinstance(cfg, ExperimentConfig):
        fail(f"{cfg.name} is not a training experiment; there is no train step to compile.")
        return
    if target not in TARGETS:
        fail(f"Unknown --target {target!r}; choose one of {', '.join(TARGETS)}.")
    try:
        # The mesh is simulated with CPU devices; this must happen before JAX starts.
        use_cpu_devices(cfg.mesh.num_devices)
        check_compile_devices(cfg)
        report = compile_report(cfg, target=TARGETS[target], hbm_gib=hbm_gib, assumed_mfu=assumed_mfu,
                                log=lambda m: err.print(m, highlight=False))
    except ConfigError as e:
        fail(str(e))
        return
    job_dir = job_log_dir or Path("runs") / cfg.name
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / "compile.json").write_text(json.dumps(report, indent=2) + "\n")
    out.print(format_report(report), highlight=False, markup=False)
    out.print(f"Wrote {job_dir / 'compile.json'}", highlight=False)
    if not report["memory_per_device"]["fits"]:
        err.print(
            f"warning: {cfg.name} needs {report['memory_per_device']['total_bytes'] / 2**30:.1f} GiB per "
            f"device, over the {report['memory_per_device']['budget_gib']:.0f} GiB budget: use more "
            "devices (a larger fsdp axis), full remat, or a smaller per-device batch.", highlight=False)
        if strict:
            raise typer.Exit(EXIT_DOES_NOT_FIT)


def main() -> None:
    """Console-script entry point."""
    app(prog_name="launch")


if __name__ == "__main__":
    sys.exit(main())
