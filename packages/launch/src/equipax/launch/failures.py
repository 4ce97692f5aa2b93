"""The failures that end a `launch` command, each with the exit code it ends with (`exit_code`).

They are raised where the failure is found (the training loop, the checkpointer, the signal
handlers, the non-finite monitor) and reported by `errors.describe` as one paragraph and their
`exit_code` (docs/errors.md). Like `exit_codes`, this module is layer 0 of launch
(docs/extending.md, "Layers"): it imports nothing but the exit codes, so the code that raises a
failure and the code that reports it both import it from below, and the entry point's signal
handler (`training.preemption`) can use it before typer, rich or JAX are loaded.
"""

from typing import ClassVar

from equipax.launch.exit_codes import EXIT_NONFINITE, EXIT_PREEMPTED, EXIT_USER_ERROR

__all__ = ["CheckpointSaveError", "Interrupted", "NonFiniteError", "Preempted"]


class Preempted(Exception):
    """The run stopped on SIGTERM/SIGINT after checkpointing `step` (exit 75; already reported)."""

    exit_code: ClassVar[int] = EXIT_PREEMPTED

    def __init__(self, step: int) -> None:
        super().__init__(f"stopped after step {step}")
        self.step = step


class Interrupted(BaseException):
    """SIGINT or SIGTERM outside the training loop (exit 75: run the same command again).

    A BaseException, like KeyboardInterrupt: the `except Exception` of a library (or of the code
    that names a user's mistake) must not turn a preemption into another error, or swallow it.
    """

    exit_code: ClassVar[int] = EXIT_PREEMPTED

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


class NonFiniteError(Exception):
    """The run stopped on non-finite steps; the message names the step, the quantity, the checkpoint
    (`training.nonfinite.NonFiniteMonitor` writes it)."""

    exit_code: ClassVar[int] = EXIT_NONFINITE

    def __init__(self, message: str, *, step: int, last_checkpoint: int | None) -> None:
        super().__init__(message)
        self.step = step
        self.last_checkpoint = last_checkpoint


class CheckpointSaveError(Exception):
    """Writing a checkpoint failed (disk full, permissions); the message says what is intact
    (`jobdir.save_errors.save_error` writes it)."""

    exit_code: ClassVar[int] = EXIT_USER_ERROR
