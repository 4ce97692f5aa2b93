"""What every `launch` command shares: consoles, option types, resolving an experiment."""

from collections.abc import Callable, Mapping
from pathlib import Path, PurePath
from typing import Annotated, Any, Literal, NoReturn

import typer
from rich.console import Console

from equipax.core.knobs import ConfigError, apply_overrides
from equipax.core.paths import url_problem
from equipax.launch.exit_codes import EXIT_USER_ERROR
from equipax.launch.experiments import registry
from equipax.launch.store.storage import AnyPath, is_remote

__all__ = [
    "check_output",
    "command_line",
    "CpuDevicesOption",
    "DEFAULT_EXPERIMENT",
    "emit",
    "err",
    "ExpOption",
    "fail",
    "job_dir_option",
    "JobLogDirOption",
    "out",
    "path_option",
    "resolve",
    "resolve_job",
    "resolve_train",
    "JobSetOption",
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
# `launch eval` / `decode`: the job's own knobs, changed for this command only (its files stay as they are).
JobSetOption = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        "-s",
        help="Change a knob of the job for this command only: KNOB=VALUE (repeatable), e.g. data.path=DIR "
        "when the data moved. Model knobs stay as trained (the checkpoint must fit).",
    ),
]


def path_option(value: str) -> Path:
    """A path given on the command line; an empty one (`--job-log-dir ""`: an unset shell variable)
    is a usage error (exit 2), never the current directory and whatever is there. So is a URL
    other than a job directory's (`job_dir_option`): as a path it would quietly become a local
    directory named after its scheme (`gs:`)."""
    return _path(value, stores=False)  # pyright: ignore[reportReturnType]: never remote here


def job_dir_option(value: str) -> AnyPath:
    """A job directory given on the command line: `path_option`, or a directory in object storage
    (`gs://BUCKET/JOB`, `s3://BUCKET/JOB`; an `etils.epath.Path`, `equipax.launch.store.storage`).
    Typed `Path` for typer, which reads the annotation; what comes back is a `storage.AnyPath`."""
    path = _path(value, stores=True)
    from equipax.launch.store.checks import check_store

    try:  # in seconds: an unreachable endpoint, no credentials, a missing bucket
        check_store(path, "--job-log-dir")
    except ConfigError as e:
        raise typer.BadParameter(str(e).removeprefix(f"--job-log-dir {str(path)!r}: ")) from None
    return path


def _path(value: str, *, stores: bool) -> AnyPath:
    if not value.strip():
        raise typer.BadParameter(
            "is empty (an unset shell variable?): give a path. An empty path would mean the current "
            "directory, and the command would write over what is there."
        )
    if (problem := url_problem(value, stores=stores)) is not None:
        raise typer.BadParameter(problem + ".")
    from equipax.launch.store.storage import job_path

    return job_path(value)


# The files a job's run keeps at the top of its directory (its subdirectories are all its own).
JOB_FILES = frozenset(
    {
        ".lock",
        "compile.json",
        "config.json",
        "knobs.txt",
        "metrics.jsonl",
        "profile.pb",
        "remat_auto.json",
        "result.json",
        "tokenizer.model",
        "xla_flags.json",
    }
)

# Typed PurePath, the common base of `pathlib.Path` and `etils.epath.Path` (typer takes one type):
# `storage.job_path` gives it back as an `AnyPath`.
JobLogDirOption = Annotated[
    PurePath | None,
    typer.Option(
        "--job-log-dir",
        parser=job_dir_option,
        help="Job directory: a path, gs://BUCKET/JOB or s3://BUCKET/JOB (default: runs/<exp>).",
    ),
]


def check_output(
    path: Path, option: str, *, kind: Literal["file", "directory"], job_dir: AnyPath | None = None
) -> None:
    """Refuse (exit 2), before any work, an output a command could not write or must not write.

    Every command that writes a file or directory checks it here first: it must be creatable as
    a `kind` (`equipax.core.paths.output_problem`), and, when the command reads the job
    `job_dir`, it must not replace the job's files (`JOB_FILES`, or anything under one of its
    directories such as checkpoints/).
    """
    from equipax.core.paths import output_problem

    problem = output_problem(path, kind=kind)
    if problem:
        fail(f"{option} {str(path)!r} {problem}. Choose another {option}.")
    if job_dir is None or is_remote(job_dir):  # a local output is never inside a bucket's job
        return
    target, job = Path(path).expanduser().absolute().resolve(), job_dir.expanduser().absolute().resolve()
    if target == job or job not in target.parents:
        return
    first = job / target.relative_to(job).parts[0]
    if first.name in JOB_FILES or (first != target and first.is_dir()):
        fail(
            f"{option} {str(path)!r} would replace the job's own "
            f"{first.name if first == target else first.name + '/'} in {str(job_dir)!r}; only the job's run "
            f"writes there. Write to a file outside the job directory, e.g. {option} {job.name}-{target.name}."
        )


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
    check_output(output, "--output", kind="file")
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


def resolve_job(job_dir: AnyPath, overrides: list[str] | None) -> tuple[registry.Entry, Any, dict[str, str]]:
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
