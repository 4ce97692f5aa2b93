"""What every `launch` command shares: consoles, option types, resolving an experiment."""

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console

from equipax.core.knobs import ConfigError, apply_overrides
from equipax.launch.errors import EXIT_USER_ERROR
from equipax.launch.experiments import registry

__all__ = [
    "command_line",
    "CpuDevicesOption",
    "DEFAULT_EXPERIMENT",
    "emit",
    "err",
    "ExpOption",
    "fail",
    "out",
    "resolve",
    "resolve_job",
    "resolve_train",
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


def command_line(name: str, command: Callable[..., Any], values: Mapping[str, Any]) -> str:
    """`command` as a user would type it: `launch NAME` and the options in `values` that differ from
    their defaults (`values`: the command's parameters, e.g. its `locals()`).

    Files that a command writes (job scripts, manifests) name it, so they can be made again.
    """
    import inspect
    import shlex
    import typing

    words = ["launch", name]
    for param in inspect.signature(command).parameters.values():
        value = values[param.name]
        if value is None or value == param.default or value in ((), []):
            continue
        info = next(m for m in typing.get_args(param.annotation)[1:] if isinstance(m, typer.models.OptionInfo))
        # With Annotated, typer takes the first flag as the option's `default` field.
        flag = max(
            (d for d in (info.default, *(info.param_decls or ())) if isinstance(d, str) and d.startswith("-")), key=len
        )
        for v in value if isinstance(value, (list, tuple)) else [value]:
            words += [flag] if v is True else [flag, str(v)]
    return shlex.join(words)


def emit(text: str, output: Path | None, *, then: str, mode: int = 0o644) -> None:
    """Print a file a command made, or write it to `output` and say what to do with it.

    Arguments:
        text: the file's contents.
        output: where to write it (None: print it).
        then: the next step, with `{path}` for the file, e.g. "submit it with `sbatch {path}`".
        mode: the written file's permissions.
    """
    if output is None:
        print(text, end="")
        return
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text)
    output.chmod(mode)
    err.print(f"Wrote {output}: {then.format(path=output)}.", highlight=False)


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


def resolve_train(
    exp: str, overrides: list[str] | None, *, for_what: str
) -> tuple[registry.Entry, Any, dict[str, str]]:
    """`resolve` for a command that needs a train step (`for_what`: "to compile"); a benchmark is exit 2."""
    entry, cfg, sources = resolve(exp, overrides)
    if entry.kind != "train":
        fail(f"{cfg.name} is a benchmark, not a training experiment; there is no train step {for_what}.")
    return entry, cfg, sources
