"""The job directory's safety checks, before a run writes anything into it.

- It must be a writable directory (checked by creating and removing a probe file), so a
  typo'd or read-only `--job-log-dir` fails in a second with a message, not after compiling.
- It must not belong to another experiment: resuming `B` from `A`'s checkpoints would be
  wrong even when the shapes happen to match.
- It is owned by one live run at a time (`JobLock`).
- Small files are replaced atomically (`write_text_atomic`), so a kill never leaves half a
  config.json, tokenizer or metrics file behind.
"""

import errno
import fcntl
import json
import os
import socket
import stat
import time
from collections.abc import Callable
from pathlib import Path

from equipax.core.knobs import ConfigError
from equipax.launch.store.lock import StoreLock
from equipax.launch.store.storage import AnyPath, is_remote, job_path, write_atomic

__all__ = ["JobLock", "prepare_job_dir", "write_text_atomic"]


def write_text_atomic(path: AnyPath, text: str) -> None:
    """Write `text` to `path`, never half a file (`storage.write_atomic`: a temporary file and a
    rename, or one object in a store)."""
    write_atomic(path, text)


def prepare_job_dir(job_dir: AnyPath, experiment: str) -> None:
    """Create `job_dir` if needed and check it is writable and holds no other experiment.

    Raises:
        ConfigError: not a directory, not writable, or another experiment's job directory.
    """
    job_dir = job_path(job_dir)
    fix = "Choose another --job-log-dir, or fix the directory's permissions."
    try:
        job_dir.mkdir(parents=True, exist_ok=True)
        probe = job_dir / f".write-probe-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"The job directory {str(job_dir)!r} is not a writable directory "
            f"({e.strerror or type(e).__name__}: {e.filename or job_dir}). {fix}"
        ) from None
    recorded = job_dir / "config.json"
    checkpoints = job_dir / "checkpoints"
    for name in ("checkpoints", "corrupt_checkpoints", "unstable_checkpoints", "summaries", "plots"):
        if (job_dir / name).exists() and not (job_dir / name).is_dir():
            raise ConfigError(
                f"{job_dir / name} is a file, but the run keeps a directory there. Move or delete the file, "
                "or choose another --job-log-dir."
            )
    if not (recorded.exists() and checkpoints.is_dir() and any(checkpoints.iterdir())):
        return
    try:
        name = json.loads(recorded.read_text()).get("name")
    except (OSError, ValueError, AttributeError):
        return  # unreadable record: the checkpoint shape check still guards the restore
    if name is not None and name != experiment:
        raise ConfigError(
            f"The job directory {str(job_dir)!r} holds checkpoints of experiment {name!r} "
            f"(its config.json), not {experiment!r}; resuming one from the other would be wrong. "
            f"Point --job-log-dir at a new directory to start {experiment!r} fresh, or run "
            f"--exp {name} to resume that job."
        )


class JobLock:
    """One live run per job directory: an exclusive `flock` on `<job>/.lock` for the run's lifetime.

    The lock file records the owner's host and pid. A second run while the owner lives gets a
    ConfigError naming it; a lock file left by a dead process (the kernel dropped its flock) is
    taken over with a warning. Only process 0 of a multi-host job locks: its processes are one run.

    Arguments:
        job_dir: the job directory (exists).
        log: where the take-over warning goes.
    """

    def __init__(self, job_dir: AnyPath, *, log: Callable[[str], object] = print) -> None:
        self.path: AnyPath = job_path(job_dir) / ".lock"
        self.log = log
        self._fd: int | None = None
        self._store: StoreLock | None = None

    def __enter__(self) -> "JobLock":
        import jax

        if jax.process_index() != 0:
            return self
        if is_remote(self.path):  # no flock in an object store: a renewed lease (`StoreLock`)
            store = StoreLock(self.path)
            previous = store.acquire()
            if previous is not None:
                self.log(
                    f"warning: took over the job directory's lock left by {_owner(json.dumps(previous).encode())}, "
                    "which is no longer running."
                )
            self._store = store
            return self
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            owner = _owner(os.read(fd, 4096))
            os.close(fd)
            raise ConfigError(
                f"The job directory {str(self.path.parent)!r} is in use by another run ({owner}); two "
                "runs would overwrite each other's checkpoints. Wait for it to finish, stop it, or choose "
                "another --job-log-dir."
            ) from None
        previous = os.read(fd, 4096)
        if previous.strip():
            self.log(
                f"warning: took over the job directory's lock left by {_owner(previous)}, which is no longer running."
            )
        os.ftruncate(fd, 0)
        os.pwrite(
            fd,
            json.dumps(
                {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
            ).encode(),
            0,
        )
        self._fd = fd
        return self

    def _open(self) -> int:
        """The lock file, opened (created if missing) without following a symbolic link there.

        Anything but a regular file at `.lock` (a link, which truncating would empty the target of;
        a directory; a device) is a ConfigError naming it: nothing is opened through it.
        """
        what = None
        try:
            fd = os.open(Path(self.path), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.EACCES, errno.EPERM):
                raise
            fd, what = None, "a symbolic link" if Path(self.path).is_symlink() else None
            if what is None and e.errno in (errno.EACCES, errno.EPERM):
                what = f"not writable ({e.strerror})"
        if fd is not None and not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            fd = None
        if fd is None:
            if what is None:
                mode = Path(self.path).lstat().st_mode
                what = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
            raise ConfigError(
                f"The job directory's lock file {str(self.path)!r} is {what}; a run keeps a regular file "
                "there that records its owner, and never writes through anything else. Remove it (it is "
                "not part of the job's data), or choose another --job-log-dir."
            )
        return fd

    def __exit__(self, *exc: object) -> None:
        if self._store is not None:
            self._store.release()
            self._store = None
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)  # a clean exit leaves no owner to warn about
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


def _owner(raw: bytes) -> str:
    try:
        info = json.loads(raw.decode() or "{}")
        return f"pid {info['pid']} on host {info['host']}, started {info.get('started', '?')}"
    except (ValueError, KeyError, TypeError):
        return "a process that left no readable record"
