"""Graceful stop on SIGTERM/SIGINT: finish the step in flight, checkpoint, exit.

The handler only sets a flag that the loop checks between steps, so a signal can never land
between a donated state's dispatch and its replacement. A second SIGINT aborts at once.

Outside the loop (`EarlyInterrupts`, installed first thing by the `launch` entry point): a signal
during the imports ends the process at once; one during start-up (JAX, data, restore,
compilation) or after the loop raises `Interrupted`. Either way the command exits 75 with one
line, never a traceback, and nothing is half-written.
"""

import os
import signal
import sys
import threading
from types import FrameType

from equipax.launch.failures import Interrupted

__all__ = ["EARLY", "EarlyInterrupts", "StopRequest"]


class EarlyInterrupts:
    """The SIGINT/SIGTERM path of the whole command outside the loop's `StopRequest`, from process start.

    Until `arm()` (the imports: nothing is written yet, and raising inside an import would print a
    traceback) a signal ends the process at once with `message` and exit 75; from then on a signal
    is recorded (`pending`) and raises `Interrupted`, which the command reports the same way.

    Python drops an exception raised where it cannot propagate: in a garbage-collector callback
    (JAX registers one), a `__del__` or a weakref callback ("Exception ignored in ..."). A signal
    landing there would be lost and the run would carry on; so such an `Interrupted` is silenced
    (`sys.unraisablehook`) and the signal is sent again a moment later, until it lands in code
    that lets it through. `StopRequest` also raises a pending one before the first step.

    Nor is it raised inside an import (the start-up imports the data code lazily): raised in a
    compiled extension's initialisation, it leaves the module half-registered, and every later
    import of it fails ("generic_type: type ... is already registered": the command's own report
    of the stop then failed, exit 1 instead of 75). The signal is recorded and sent again a moment
    later, once the import is done.
    """

    RESEND_S = 0.05

    def __init__(
        self,
        message: str = "error: Stopped by {signal} while starting up; nothing was written. Run the same command again.",
    ) -> None:
        self.message = message
        self.armed = False
        self.pending: str | None = None
        self._previous_hook = sys.unraisablehook

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._handle)
            self._previous_hook = sys.unraisablehook
            sys.unraisablehook = self._unraisable

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if not self.armed:
            sys.stderr.write(self.message.format(signal=name) + "\n")
            sys.stderr.flush()
            os._exit(Interrupted.exit_code)
        self.pending = name
        if _importing(frame):
            self._resend(signum)
            return
        raise Interrupted(name)

    def _resend(self, signum: int) -> None:
        timer = threading.Timer(self.RESEND_S, os.kill, (os.getpid(), signum))
        timer.daemon = True
        timer.start()

    def _unraisable(self, info: "sys.UnraisableHookArgs") -> None:
        if not isinstance(info.exc_value, Interrupted):
            self._previous_hook(info)
            return
        self._resend(signal.Signals[info.exc_value.signal_name])

    def arm(self) -> None:
        """From now on a signal raises `Interrupted` (the command is running)."""
        self.armed: bool = True


def _importing(frame: FrameType | None) -> bool:
    """Whether `frame` (where a signal landed) runs inside an import (Python's import machinery is
    on its stack)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


# The entry point's one instance (`equipax.launch.cli` installs it first thing).
EARLY: EarlyInterrupts = EarlyInterrupts()


class StopRequest:
    """Context manager: installs the handlers (main thread only) and restores them on exit."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    def __bool__(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name

    def __enter__(self) -> "StopRequest":
        if EARLY.pending is not None:  # a start-up signal that something swallowed: stop before the first step
            raise Interrupted(EARLY.pending)
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()
