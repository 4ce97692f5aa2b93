"""Orbax's noise after a failed save, silenced: the failure itself reaches `Checkpointer.save` /
`wait` as an exception and is reported there in one paragraph."""

import logging
from collections.abc import Callable
from typing import Any

__all__ = ["QuietOrbaxErrors", "quiet_closed_loops"]


def quiet_closed_loops(previous: Callable[[Any], object]) -> Callable[[Any], object]:
    """`sys.unraisablehook` without "Event loop is closed": after a failed save, tensorstore's
    completion callbacks can land on orbax's already closed event loop (harmless; a traceback each)."""

    def hook(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed":
            return
        previous(unraisable)

    hook.quiets_closed_loops = True  # type: ignore[attr-defined]
    return hook


class QuietOrbaxErrors(logging.Filter):
    """Drop orbax's logged tracebacks of a failed save (hundreds of lines from its threads): the
    failure reaches `save`/`wait` as an exception and is reported there in one paragraph."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and record.exc_info is not None)
