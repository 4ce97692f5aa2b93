"""The `launch` command line: list, show and run registered experiments."""

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from equipax.core.config import ConfigError, apply_overrides, format_knobs, to_dict
from equipax.launch import registry
from equipax.launch.experiment import ExperimentConfig

DEFAULT_EXPERIMENT = "shakespeare_tiny"
EXIT_USER_ERROR = 2

app = typer.Typer(
    help="Configure and run ML experiments on JAX (equipax).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)

ExpOption = Annotated[str, typer.Option("--exp", "-e", help="Experiment: short name or dotted path.")]
SetOption = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override a knob: KNOB=VALUE (repeatable), e.g. model.transformer.num_layers=2."),
]


def fail(message: str, code: int = EXIT_USER_ERROR) -> None:
    """Print a one-paragraph error and exit with `code`."""
    err.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)


def resolve(exp: str, overrides: list[str] | None) -> tuple[ExperimentConfig, dict[str, str]]:
    """The experiment's config with overrides applied, or a clean exit on a user error."""
    try:
        return apply_overrides(registry.get_experiment(exp), overrides or [])
    except ConfigError as e:
        fail(str(e))
        raise AssertionError("unreachable")


@app.command("list")
def list_cmd() -> None:
    """List registered experiments."""
    from equipax.launch.run import derived_numbers

    table = Table(title="Registered experiments")
    for col in ("name", "params", "mesh", "data", "steps"):
        table.add_column(col, no_wrap=True)
    table.add_column("description", ratio=1)
    for entry in registry.entries():
        cfg = entry.fn()
        n = derived_numbers(cfg)
        table.add_row(entry.name, f"{n['params_total'] / 1e6:,.1f}M", f"{n['devices_required']} device(s)",
                      f"{cfg.data.source}/{cfg.data.tokenizer}", str(cfg.train.num_steps), cfg.description)
    out.print(table)


@app.command()
def show(
    exp: ExpOption = DEFAULT_EXPERIMENT,
    set_: SetOption = None,
    format: Annotated[str, typer.Option("--format", help="text or json.")] = "text",
) -> None:
    """Print the resolved config and derived numbers without touching any device."""
    from equipax.launch.run import derived_numbers

    cfg, sources = resolve(exp, set_)
    numbers = derived_numbers(cfg)
    if format == "json":
        print(json.dumps({"config": to_dict(cfg), "derived": numbers, "sources": sources}, indent=2))
    elif format == "text":
        out.print(f"[bold]# {cfg.name}[/]: {cfg.description}", highlight=False)
        out.print(format_knobs(cfg, sources), highlight=False, markup=False, end="")
        out.print("[bold]# derived[/]", highlight=False)
        for k, v in numbers.items():
            out.print(f"{k} = {v:,}" if isinstance(v, int) else f"{k} = {v:.4g}", highlight=False)
    else:
        fail(f"--format must be 'text' or 'json'; got {format!r}.")


@app.command()
def run(
    exp: ExpOption = DEFAULT_EXPERIMENT,
    set_: SetOption = None,
    job_log_dir: Annotated[
        Path | None, typer.Option("--job-log-dir", help="Job directory (default: runs/<exp>).")
    ] = None,
) -> None:
    """Train an experiment; rerun the same command to resume from its last checkpoint."""
    cfg, sources = resolve(exp, set_)
    from equipax.launch.preemption import EXIT_PREEMPTED
    from equipax.launch.run import Preempted, run_experiment

    job_dir = job_log_dir or Path("runs") / cfg.name
    try:
        run_experiment(cfg, job_dir=job_dir, sources=sources, console=out)
    except ConfigError as e:
        fail(str(e))
    except Preempted:
        raise typer.Exit(EXIT_PREEMPTED)


def main() -> None:
    """Console-script entry point."""
    app(prog_name="launch")


if __name__ == "__main__":
    sys.exit(main())
