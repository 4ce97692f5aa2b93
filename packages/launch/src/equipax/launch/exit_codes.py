"""The `launch` exit codes (docs/errors.md). What each exception maps to is `errors.describe`.

A module with no imports: the entry point's start-up signal handler (`training.preemption`) exits
with `EXIT_PREEMPTED` before typer, rich or JAX are loaded.
"""

__all__ = ["EXIT_DOES_NOT_FIT", "EXIT_NONFINITE", "EXIT_PREEMPTED", "EXIT_UNEXPECTED", "EXIT_USER_ERROR"]

EXIT_UNEXPECTED = 1  # a bug or an unsupported setup: rerun with --debug
EXIT_USER_ERROR = 2  # bad input or environment (config, data, job directory, disk); nothing saved damaged
EXIT_DOES_NOT_FIT = 3  # `launch compile --strict`: the step does not fit the memory budget
EXIT_NONFINITE = 4  # stopped on non-finite steps (train.on_nonfinite)
EXIT_PREEMPTED = 75  # stopped by SIGTERM/SIGINT (in the loop: after a checkpoint); rerun to resume
