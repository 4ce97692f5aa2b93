"""Exceptions -> one-paragraph messages and exit codes for the `launch` CLI (docs/errors.md).

Every command runs inside `GuardedGroup.invoke`: an exception that escapes a command becomes
one paragraph on stderr and a documented exit code, never a traceback from deep inside JAX.
`launch --debug COMMAND ...` lets it through with the full traceback instead. The failures that
end a run (`failures.py`) carry their own exit code; the rest are mapped here.

Exit codes (defined in `exit_codes.py`, which imports nothing so the start-up signal handler can
use it): 0 done; 1 unexpected error (a bug or an unsupported setup: rerun
with --debug); 2 bad input or environment (config, data, job directory, disk) - nothing saved was
damaged, fix it and rerun; 3 `launch compile --strict` found the step does not fit; 4 stopped on
non-finite steps (train.on_nonfinite); 75 stopped by SIGTERM/SIGINT (in the loop: after a checkpoint).
"""

import errno
from typing import Any

import typer
from rich.console import Console
from rich.text import Text
from typer.core import TyperGroup
from typer.exceptions import Abort, Exit, TyperException

from equipax.core.knobs import ConfigError
from equipax.launch.exit_codes import EXIT_UNEXPECTED, EXIT_USER_ERROR
from equipax.launch.failures import CheckpointSaveError, Interrupted, NonFiniteError, Preempted

__all__ = ["describe", "GuardedGroup", "pax_spellings", "PAX_SPELLINGS"]

_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_NO_PERMISSION = {errno.EACCES, errno.EPERM, errno.EROFS}


def _first_line(exc: BaseException, limit: int = 300) -> str:
    text = (str(exc).strip().splitlines() or [""])[0]
    return text if len(text) <= limit else text[:limit] + "..."


# What a signal outside the training steps leaves, by command (`launch run` and the default below).
_STOPPED = {
    "eval": "the checkpoints evaluated before are recorded in <job>/eval_job/metrics.jsonl (each line "
    "whole) and nothing of the training job was changed. Run the same command again: it evaluates "
    "the checkpoints not recorded yet.",
    "decode": "nothing was written to --output (it is written whole at the end) and nothing of the "
    "job was changed. Run the same command again: it decodes from the start.",
    "compile": "nothing was half-written (compile.json is written at the end). Run the same command again.",
    "convert": "nothing was half-written (the output is renamed into place only when complete). Run "
    "the same command again.",
}


def describe(exc: BaseException, command: str = "") -> tuple[str, int]:
    """The one-paragraph message and the exit code for an exception that ended a command
    (`command`: the `launch` subcommand, for what a signal leaves behind)."""
    # The signals first, before importing anything: a SIGTERM can interrupt the command while it
    # imports JAX (the CLI loads it only when a run starts), leaving half-initialised modules that
    # the imports below would trip over (found by benchmarks/fault_injection.py).
    if isinstance(exc, Preempted):
        return "", exc.exit_code  # the loop said where the checkpoint is
    if isinstance(exc, Interrupted):
        if command in _STOPPED:
            return f"Stopped by {exc.signal_name}; {_STOPPED[command]}", exc.exit_code
        return (
            f"Stopped by {exc.signal_name} outside the training steps (while starting up, or after "
            "the last step); nothing was half-written. Run the same command again (a training run "
            "resumes from its newest checkpoint, or starts the job if there is none)."
        ), exc.exit_code
    if isinstance(exc, (NonFiniteError, CheckpointSaveError)):
        return str(exc), exc.exit_code
    from equipax.core.task import BatchError
    from equipax.data import DataError

    if isinstance(exc, (ConfigError, BatchError)):
        return str(exc), EXIT_USER_ERROR
    if isinstance(exc, DataError):
        return f"data: {exc}", EXIT_USER_ERROR
    if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
        return (
            f"Out of disk space writing {exc.filename or 'a file'} ({exc.strerror}). Free space "
            "and run the same command again: what was written completely before (checkpoints, "
            "recorded steps) is kept, and it carries on from there."
        ), EXIT_USER_ERROR
    if isinstance(exc, OSError) and exc.errno in _NO_PERMISSION:
        return (
            f"No permission to write {exc.filename or 'a file'} ({exc.strerror}). Fix the "
            "permissions or choose another --job-log-dir."
        ), EXIT_USER_ERROR
    if isinstance(exc, MemoryError) or _is_out_of_memory(exc):
        return (
            f"Out of memory ({type(exc).__name__}: {_first_line(exc).rstrip('.')}). Reduce what one "
            "step holds: data.batch_size (or data.per_device_batch), data.seq_len, the model's size "
            "(e.g. model.transformer.num_layers), or model.transformer.remat='full'; `launch compile "
            "--exp NAME` reports the step's memory without running it."
        ), EXIT_USER_ERROR
    backend = _backend_error(exc)
    if backend:
        return backend, EXIT_USER_ERROR
    text = _first_line(exc).rstrip(".")
    return (
        f"Unexpected {type(exc).__name__}{': ' + text if text else ' (no message)'}. This is not a "
        "known user mistake; it may be a bug in equipax or an unsupported setup. Rerun with "
        "`launch --debug ...` to see the full traceback (and include it in a bug report)."
    ), EXIT_UNEXPECTED


def _is_out_of_memory(exc: BaseException) -> bool:
    """XLA's allocation failures (host or device): `RESOURCE_EXHAUSTED: Out of memory ...`."""
    text = str(exc)
    return type(exc).__name__ in ("XlaRuntimeError", "JaxRuntimeError", "RuntimeError") and (
        "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text
    )


def _backend_error(exc: BaseException) -> str:
    """A message for a JAX platform that cannot start (e.g. JAX_PLATFORMS=cuda on a CPU host), or ""."""
    import os

    text = str(exc)
    requested = os.environ.get("JAX_PLATFORMS", "")
    if (
        "Unable to initialize backend" in text
        or "Unknown backend" in text
        or (
            requested
            and requested != "cpu"
            and isinstance(exc, (AssertionError, RuntimeError))
            and _platform_missing(requested)
        )
    ):
        tpu = (
            " On a TPU host, check that no other process holds the chip (one program at a time) and "
            "that libtpu is installed (jax[tpu])."
            if "tpu" in requested.lower()
            else ""
        )
        return (
            f"JAX could not start the platform(s) JAX_PLATFORMS={requested or '(unset)'!r} on this "
            f"machine ({type(exc).__name__}{': ' + _first_line(exc).rstrip('.') if str(exc).strip() else ''}). "
            "Unset JAX_PLATFORMS (JAX picks what is present), set it to 'cpu', or install the "
            f"jax plugin for the accelerator (e.g. jax[cuda12]).{tpu}"
        )
    return ""


def _platform_missing(requested: str) -> bool:
    try:
        import jax

        jax.devices()
    except Exception:
        return True
    return False


# Options as Pax's absl flags spell them, accepted for the documented ones (docs/coming_from_pax.md):
# `--job_log_dir=gs://...` is what every command of the Pax README passes.
PAX_SPELLINGS = {"--job_log_dir": "--job-log-dir"}


def pax_spellings(args: list[str]) -> list[str]:
    """`args` with Pax's option spellings (`--job_log_dir X`, `--job_log_dir=X`) as equipax's."""
    fixed = []
    for arg in args:
        name, eq, value = arg.partition("=")
        fixed.append(PAX_SPELLINGS[name] + eq + value if name in PAX_SPELLINGS else arg)
    return fixed


class GuardedGroup(TyperGroup):
    """The `launch` command group: maps exceptions escaping a command to a message + exit code,
    and reads Pax's option spellings (`PAX_SPELLINGS`) as the documented ones."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        return super().parse_args(ctx, pax_spellings(args))

    def invoke(self, ctx: Any) -> Any:  # a click Context (typer's vendored click)
        try:
            return super().invoke(ctx)
        except (Exit, Abort, TyperException):
            raise  # typer.Exit(code), usage errors: click reports these itself
        except Exception as e:
            if ctx.params.get("debug"):  # `launch --debug ...` (the app callback's option)
                raise
            message, code = describe(e)
            if message:
                Console(stderr=True, soft_wrap=True).print(Text.assemble(("error:", "bold red"), " ", message))
            raise typer.Exit(code) from None
