"""Orbax's noise after a failed save or restore, silenced process-wide (the failure itself reaches
`Checkpointer.save` / `wait` as an exception and is reported there in one paragraph), and the one
line that names why a checkpoint did not restore (`restore_failure`)."""

import logging
import sys
import warnings
from collections.abc import Callable
from typing import Any

__all__ = [
    "QuietOrbaxErrors",
    "QuietOrbaxFutures",
    "quiet_closed_loops",
    "quiet_process",
    "quiet_unawaited",
    "restore_failure",
]


def restore_failure(e: BaseException, limit: int = 400) -> str:
    """One line naming why a checkpoint did not restore: the innermost cause, where orbax wraps
    tensorstore's error (`Encountered error while reading array index ... See full TensorStore
    details: <bound method ...>`) around the one that says what is wrong (`OUT_OF_RANGE: Error
    reading ".model...": Requested byte range [...) is not valid for value of size 100`)."""
    root, seen = e, {id(e)}
    while root.__cause__ is not None and id(root.__cause__) not in seen:
        root = root.__cause__
        seen.add(id(root))
    first = (str(root).strip().splitlines() or [""])[0]
    return f"{type(root).__name__}: {first[:limit]}{'...' if len(first) > limit else ''}"


def _from_orbax(exc: BaseException | None, obj: object = None) -> bool:
    """Whether an error (or the coroutine it escaped from) comes from orbax's own code."""
    code = getattr(obj, "cr_code", None)
    if code is not None and "/orbax/" in code.co_filename:
        return True
    while exc is not None:
        tb = exc.__traceback__
        while tb is not None:
            if "/orbax/" in tb.tb_frame.f_code.co_filename:
                return True
            tb = tb.tb_next
        exc = exc.__cause__
    return False


def quiet_closed_loops(previous: Callable[[Any], object]) -> Callable[[Any], object]:
    """`sys.unraisablehook` without orbax's leftovers: after a failed save or restore, tensorstore's
    completion callbacks can land on orbax's already closed event loop ("Event loop is closed"), and
    orbax's read coroutines are dropped with their error unraised (a traceback each, after the
    failure itself was reported in one paragraph)."""

    def hook(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed":
            return
        if _from_orbax(unraisable.exc_value, getattr(unraisable, "object", None)):
            return
        previous(unraisable)

    hook.quiets_closed_loops = True  # type: ignore[attr-defined]
    return hook


def quiet_unawaited(previous: Callable[[Any], object]) -> Callable[[Any], object]:
    """`warnings._showwarnmsg` without "coroutine ... was never awaited" for orbax's coroutines: a
    failed save leaves its pending write coroutines unstarted, and Python warns for each one when it
    is collected, often at exit (`sys:1: RuntimeWarning: coroutine
    'async_serialize_from_host.<locals>.write_fragment' was never awaited`, then a tracemalloc hint),
    after the failure itself was reported in one paragraph. The warning's `source` is the coroutine:
    only those whose code is orbax's are dropped."""

    def show(msg: Any) -> None:
        if issubclass(msg.category, RuntimeWarning) and _from_orbax(None, getattr(msg, "source", None)):
            return
        previous(msg)

    show.quiets_unawaited = True  # type: ignore[attr-defined]
    return show


class QuietOrbaxErrors(logging.Filter):
    """Drop orbax's logged tracebacks of a failed save (hundreds of lines from its threads): the
    failure reaches `save`/`wait` as an exception and is reported there in one paragraph."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and record.exc_info is not None)


class QuietOrbaxFutures(logging.Filter):
    """Drop asyncio's "exception was never retrieved" reports of orbax's write and read tasks after a
    failed save or restore (one traceback per array, logged whenever the futures are collected, even
    after the run ended); the failure itself is reported once, by `Checkpointer` or the command."""

    quiets_orbax_futures = True

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info is None or "never retrieved" not in record.getMessage():
            return True
        # A tensorstore write wrapped as an asyncio future carries no Python frames of orbax, but its
        # error names the checkpoint directory orbax was writing (`<step>.orbax-checkpoint-tmp`).
        # A failed read names the OCDBT database it was reading (a checkpoint's `state` item).
        text = str(record.exc_info[1])
        if ".orbax-checkpoint-tmp" in text or "in OCDBT database at" in text:
            return False
        tb = record.exc_info[2]
        while tb is not None:
            if "/orbax/" in tb.tb_frame.f_code.co_filename:
                return False
            tb = tb.tb_next
        return True


def quiet_process() -> None:
    """Install, once per process, the filters for what outlives a checkpointer: tensorstore callbacks
    on a closed event loop (`sys.unraisablehook`), orbax's never-retrieved write futures (asyncio)
    and its never-awaited write coroutines (`warnings`)."""
    if not getattr(sys.unraisablehook, "quiets_closed_loops", False):
        sys.unraisablehook = quiet_closed_loops(sys.unraisablehook)
    show = getattr(warnings, "_showwarnmsg", None)  # the hook every shown warning goes through
    if show is not None and not getattr(show, "quiets_unawaited", False):
        warnings._showwarnmsg = quiet_unawaited(show)  # pyright: ignore[reportAttributeAccessIssue]
    asyncio_log = logging.getLogger("asyncio")
    if not any(getattr(f, "quiets_orbax_futures", False) for f in asyncio_log.filters):
        asyncio_log.addFilter(QuietOrbaxFutures())
