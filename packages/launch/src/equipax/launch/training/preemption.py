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

from equipax.launch.exit_codes import EXIT_PREEMPTED

__all__ = ["EarlyInterrupts", "Interrupted", "StopRequest"]


class Interrupted(Exception):
    """SIGINT or SIGTERM outside the training loop (exit 75: run the same command again)."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


class EarlyInterrupts:
    """SIGINT/SIGTERM handlers for the whole command outside the loop's `StopRequest`.

    Until `arm()` (the imports: nothing is written yet, and raising inside an import would print a
    traceback) a signal ends the process at once with `message` and exit 75; from then on a signal
    raises `Interrupted`, which the command reports the same way.
    """

    def __init__(
        self,
        message: str = "error: Stopped by {signal} while starting up; nothing was written. Run the same command again.",
    ) -> None:
        self.message = message
        self.armed = False

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if not self.armed:
            sys.stderr.write(self.message.format(signal=name) + "\n")
            sys.stderr.flush()
            os._exit(EXIT_PREEMPTED)
        raise Interrupted(name)

    def arm(self) -> None:
        """From now on a signal raises `Interrupted` (the command is running)."""
        self.armed: bool = True


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
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()
