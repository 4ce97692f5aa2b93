"""The job's lock in an object store, which has no `flock`: a renewed lease (`StoreLock`)."""

import contextlib
import json
import os
import socket
import time
from typing import Any

from equipax.core.knobs import ConfigError
from equipax.launch.store.storage import AnyPath, filesystem

__all__ = ["LEASE_S", "StoreLock"]

LEASE_S = 120.0
"""A store's lock whose owner has not renewed it for this long belongs to a run that is gone."""


class StoreLock:
    """One live run per job directory in an object store: a `.lock` object naming its owner (host,
    pid, a token) and renewed by a thread every `LEASE_S / 4`. Object stores have no `flock`: a
    second run refuses while the owner's lease is fresh; a lock left by a run that is gone (its
    process dead on this host, or not renewed for `LEASE_S`) is taken over with a warning. The lock
    is created with the store's create-only-if-absent precondition where the store honours it, and
    read back: of two runs starting at once, the one whose token is not there refuses.
    """

    def __init__(self, path: AnyPath) -> None:
        self.path: AnyPath = path
        self.token: str = f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}"
        self._stop: Any = None
        self._thread: Any = None

    def _record(self, started: str) -> bytes:
        return json.dumps(
            {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "started": started,
                "renewed": time.time(),
                "token": self.token,
            }
        ).encode()

    def owner(self) -> dict[str, Any] | None:
        """The recorded owner, or None when there is no lock (or an unreadable one)."""
        try:
            info = json.loads(self.path.read_bytes().decode() or "{}")
        except (FileNotFoundError, ValueError):
            return None
        return info if isinstance(info, dict) and info.get("token") else None

    def stale(self, info: dict[str, Any]) -> bool:
        """Whether the run that wrote `info` is gone."""
        if info.get("host") == socket.gethostname():
            try:
                os.kill(int(info["pid"]), 0)
            except ProcessLookupError:
                return True
            except (PermissionError, ValueError, KeyError, TypeError):
                pass
        return time.time() - float(info.get("renewed", 0)) > LEASE_S

    def acquire(self) -> dict[str, Any] | None:
        """Take the lock. Returns the owner taken over from (a run that is gone), or None.

        Raises:
            ConfigError: another live run owns it.
        """
        previous = self.owner()
        if previous is not None and not self.stale(previous):
            raise _in_use(self.path, previous)
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        fs, name = filesystem(self.path)
        if previous is None:
            try:
                with fs.open(name, "xb") as f:  # create only if absent, where the store supports it
                    f.write(self._record(started))
            except FileExistsError:
                raise _in_use(self.path, self.owner() or {}) from None
        else:
            self.path.write_bytes(self._record(started))
        time.sleep(0.2)
        now = self.owner()
        if now is None or now.get("token") != self.token:
            raise _in_use(self.path, now or {})
        import threading

        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, args=(started,), daemon=True, name="equipax-lock")
        self._thread.start()
        return previous

    def _renew(self, started: str) -> None:
        while not self._stop.wait(LEASE_S / 4):
            with contextlib.suppress(Exception):  # a missed renewal is retried; the lease is long
                self.path.write_bytes(self._record(started))

    def release(self) -> None:
        if self._stop is not None:
            self._stop.set()
            self._thread.join(timeout=10)
            self._stop = None
        info = self.owner()
        if info is not None and info.get("token") == self.token:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


def _in_use(path: AnyPath, info: dict[str, Any]) -> ConfigError:
    owner = (
        f"pid {info['pid']} on host {info['host']}, started {info.get('started', '?')}"
        if "pid" in info and "host" in info
        else "a run that left no readable record"
    )
    return ConfigError(
        f"The job directory {str(path.parent)!r} is in use by another run ({owner}); two runs would "
        "overwrite each other's checkpoints. Wait for it to finish, stop it, or choose another "
        f"--job-log-dir (a lock not renewed for {LEASE_S:.0f} s is taken over)."
    )
