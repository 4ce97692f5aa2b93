"""Orbax's noise after a failed save, silenced: the failure itself reaches `Checkpointer.save` /
`wait` as an exception and is reported there in one paragraph."""

import logging
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["QuietOrbaxErrors", "QuietOrbaxFutures", "quiet_closed_loops", "quiet_process"]


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


class QuietOrbaxFutures(logging.Filter):
    """Drop asyncio's "exception was never retrieved" reports of orbax's write tasks after a failed
    save (one traceback per array, logged whenever the futures are collected, even after the
    run ended); the save's failure itself is reported once, by `Checkpointer`."""

    quiets_orbax_futures = True

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info is None or "never retrieved" not in record.getMessage():
            return True
        # A tensorstore write wrapped as an asyncio future carries no Python frames of orbax, but its
        # error names the checkpoint directory orbax was writing (`<step>.orbax-checkpoint-tmp`).
        if ".orbax-checkpoint-tmp" in str(record.exc_info[1]):
            return False
        tb = record.exc_info[2]
        while tb is not None:
            if "/orbax/" in tb.tb_frame.f_code.co_filename:
                return False
            tb = tb.tb_next
        return True


def quiet_process() -> None:
    """Install, once per process, the filters for what outlives a checkpointer: tensorstore callbacks
    on a closed event loop (`sys.unraisablehook`) and orbax's never-retrieved write futures (asyncio)."""
    if not getattr(sys.unraisablehook, "quiets_closed_loops", False):
        sys.unraisablehook = quiet_closed_loops(sys.unraisablehook)
    asyncio_log = logging.getLogger("asyncio")
    if not any(getattr(f, "quiets_orbax_futures", False) for f in asyncio_log.filters):
        asyncio_log.addFilter(QuietOrbaxFutures())
