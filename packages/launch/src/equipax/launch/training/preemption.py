"""Graceful stop on SIGTERM/SIGINT: finish the step in flight, checkpoint, exit.

The handler only sets a flag that the loop checks between steps, so a signal can never land
between a donated state's dispatch and its replacement. A second SIGINT aborts at once.
"""

import signal
import threading
from types import FrameType



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
