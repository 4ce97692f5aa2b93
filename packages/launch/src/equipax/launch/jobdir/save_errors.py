"""A checkpoint that could not be written (disk full, permissions), in one paragraph: what failed,
why (the OS error at the end of orbax's text), which checkpoint is intact, and what to do."""

from equipax.launch.failures import CheckpointSaveError
from equipax.launch.store.storage import AnyPath

__all__ = ["save_error"]


def save_error(directory: AnyPath, step: int | None, e: Exception, *, intact: int | None) -> CheckpointSaveError:
    """The error of a failed save of `step` (None: not known) into `directory`; `intact` is the
    newest complete checkpoint left (None: none)."""
    what = f"the checkpoint of step {step}" if step is not None else "a checkpoint"
    kept = (
        f"The newest complete checkpoint, step {intact}, is intact"
        if intact is not None
        else "No complete checkpoint exists yet"
    )
    reason = (str(e).strip().splitlines() or [""])[0].rstrip(".")
    if len(reason) > 400:  # orbax's text names every path; the OS error is at its end
        reason = f"{reason[:150]} (...) {reason[-250:]}"
    return CheckpointSaveError(
        f"Could not write {what} to {directory}: {type(e).__name__}: {reason}. {kept}. "
        "Free disk space (or fix the directory's permissions) and run the same command again to resume."
    )
