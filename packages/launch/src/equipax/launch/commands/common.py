"""What every `launch` command shares: consoles, option types, resolving an experiment."""

from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console

from equipax.core.knobs import ConfigError, apply_overrides
from equipax.launch.errors import EXIT_USER_ERROR
from equipax.launch.experiments import registry

__all__ = [
    "CpuDevicesOption",
    "DEFAULT_EXPERIMENT",
    "err",
    "ExpOption",
    "fail",
    "out",
    "resolve",
    "resolve_job",
    "SetOption",
]

DEFAULT_EXPERIMENT = "shakespeare_tiny"

out: Console = Console(soft_wrap=True)
err: Console = Console(stderr=True, soft_wrap=True)

ExpOption = Annotated[str, typer.Option("--exp", "-e", help="Experiment: short name or dotted path.")]
CpuDevicesOption = Annotated[
    int | None, typer.Option("--cpu-devices", help="Simulate N devices on this CPU host (e.g. 8 for a _smoke mesh).")
]
SetOption = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override a knob: KNOB=VALUE (repeatable), e.g. model.transformer.num_layers=2."),
]


def fail(message: str, code: int = EXIT_USER_ERROR) -> NoReturn:
    """Print a one-paragraph error and exit with `code`."""
    err.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)


def resolve(exp: str, overrides: list[str] | None) -> tuple[registry.Entry, Any, dict[str, str]]:
    """The registry entry and its config with overrides applied, or a clean exit on a user error."""
    try:
        entry = registry.lookup(exp)
        cfg, sources = apply_overrides(registry.get_experiment(exp), overrides or [])
        return entry, cfg, sources
    except ConfigError as e:
        fail(str(e))


def resolve_job(job_dir: Path, overrides: list[str] | None) -> tuple[registry.Entry, Any, dict[str, str]]:
    """The experiment a job directory records (its config.json) with overrides applied: `launch run
    --job-log-dir JOB` without `--exp` continues that job, registered or not (an imported model)."""
    from equipax.launch.inference.trained_job import load_config

    try:
        cfg, sources = apply_overrides(load_config(job_dir), overrides or [])
    except ConfigError as e:
        fail(str(e))
    return registry.Entry(name=cfg.name, path=str(job_dir / "config.json"), fn=lambda: cfg, kind="train"), cfg, sources
