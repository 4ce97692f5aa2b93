"""Where a job's files live: a local (or mounted) directory, or object storage (`gs://`).

Every file a run writes or reads in its job directory goes through the few functions here, so a
job directory can be `gs://bucket/job` as well as a local path (`s3://` paths are recognised and
refused by `check_store` until their checkpoints commit safely: `SUPPORTED`):

- `job_path` turns what the user gave into a path: `pathlib.Path` for a local one, `etils.epath.Path`
  for a URL (epath reads and writes objects through fsspec's `gcsfs`). Orbax takes the
  same epath for checkpoints and writes their arrays with TensorStore's own `gcs` driver.
- Object stores have no atomic rename, but a single object appears whole or not at all: small files
  (`write_atomic`) are written as one object, an appended line (`append_line`) rewrites the object
  with the line added, and checkpoints commit the way orbax does on GCS (a `commit_success.txt`
  marker written last; a step without it is never restored). docs/object_storage.md.
- `check_store` fails in seconds, naming the variable to set, when the store cannot be reached, has
  no credentials, or the bucket does not exist.

Emulators (tests, local development): `STORAGE_EMULATOR_HOST=http://127.0.0.1:PORT` points gcsfs
(and, through `TENSORSTORE_GCS_HTTP_URL`, set from it here when unset, TensorStore) at a GCS
emulator.
"""

import contextlib
import json
import os
import shutil
import socket
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path, PurePath
from typing import Any

from etils import epath

from equipax.core.knobs import ConfigError
from equipax.core.paths import remote_scheme

__all__ = [
    "AnyPath",
    "append_line",
    "check_store",
    "is_remote",
    "job_path",
    "local_copy",
    "move",
    "rmtree",
    "write_atomic",
]

type AnyPath = Path | epath.Path
"""A job directory or a file in it: local (`pathlib.Path`) or in object storage (`epath.Path`)."""


def is_remote(path: AnyPath | PurePath | str) -> bool:
    """Whether `path` names an object in a store (`gs://...`, `s3://...`)."""
    return remote_scheme(str(path)) is not None


def job_path(value: AnyPath | PurePath | str) -> AnyPath:
    """`value` as a path: `etils.epath.Path` for `gs://` and `s3://`, `pathlib.Path` otherwise."""
    if isinstance(value, Path) or not is_remote(value):
        return Path(value)
    _configure_endpoints()
    return value if isinstance(value, epath.Path) else epath.Path(str(value))


def _configure_endpoints() -> None:
    """One variable per store: TensorStore's GCS driver reads its own, set from gcsfs's when unset."""
    host = os.environ.get("STORAGE_EMULATOR_HOST")
    if host and not os.environ.get("TENSORSTORE_GCS_HTTP_URL"):
        os.environ["TENSORSTORE_GCS_HTTP_URL"] = host if "://" in host else f"http://{host}"
    if host:  # an emulator has no control-plane API: gcsfs's bucket-layout probe would wait a minute
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    import logging

    # gcsfs asks Google's control API whether a bucket is hierarchical and logs a warning for
    # every bucket where it cannot (no credentials for that API, an emulator): not the run's news.
    logging.getLogger("gcsfs").setLevel(logging.ERROR)


def write_atomic(path: AnyPath, data: str | bytes) -> None:
    """Write `data` to `path`, never half a file: locally a temporary file and a rename, in an object
    store one object (which appears whole or not at all)."""
    raw = data.encode() if isinstance(data, str) else data
    if is_remote(path):
        path.write_bytes(raw)
        return
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(raw)
    os.replace(tmp, path)


def append_line(path: AnyPath, line: bytes) -> None:
    """Append `line` whole or not at all. Locally a write cut short (a full disk) is truncated away;
    an object is rewritten with the line added (objects cannot be appended to)."""
    if is_remote(path):
        before = path.read_bytes() if path.exists() else b""
        path.write_bytes(before + line)
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start = os.fstat(fd).st_size
        try:
            view = memoryview(line)
            while view:
                view = view[os.write(fd, view) :]
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)
            raise
    finally:
        os.close(fd)


def move(source: AnyPath, target: AnyPath) -> None:
    """Move a file or directory. In a store, where nothing renames, every object under `source` is
    copied to `target` first, then deleted, a checkpoint's commit marker (`COMMIT_MARKER`) first:
    stopped half-way, `target` is whole or `source` still is, and `source` is never a complete step
    with objects missing."""
    if not is_remote(source):
        shutil.move(str(source), str(target))
        return
    fs, src = _fs(source)
    dst = _fs(target)[1]
    fs.invalidate_cache()
    objects = sorted(fs.find(src)) or [src]
    for name in objects:
        fs.copy(name, dst + name[len(src) :])
    for name in sorted(objects, key=lambda n: not n.endswith("/" + COMMIT_MARKER)):
        fs.rm_file(name)
    fs.invalidate_cache()


COMMIT_MARKER = "commit_success.txt"
"""What orbax writes last into a checkpoint step in an object store (where it cannot rename a
finished temporary folder into place): a step without it is incomplete and never restored."""


def mtime(path: AnyPath) -> float:
    """When `path` was last modified (seconds since the epoch)."""
    if isinstance(path, Path):
        return path.stat().st_mtime
    return float(path.stat().mtime)


def rmtree(path: AnyPath) -> None:
    """Remove a directory and everything under it; nothing when it is not there."""
    if is_remote(path):
        fs, p = _fs(path)
        fs.invalidate_cache()
        for name in sorted(fs.find(p)):
            with contextlib.suppress(FileNotFoundError):
                fs.rm_file(name)
        return
    shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def local_copy(path: AnyPath) -> Iterator[Path]:
    """A local directory standing for `path` while inside: `path` itself when it is local; for a
    store, a temporary directory whose files are uploaded to `path` on leaving (for writers that
    only write local files, e.g. TensorBoard's and matplotlib's)."""
    if not is_remote(path):
        yield Path(path)
        return
    import tempfile

    with tempfile.TemporaryDirectory(prefix="equipax-upload-") as tmp:
        yield Path(tmp)
        upload(Path(tmp), path)


def upload(local: Path, remote: AnyPath) -> None:
    """Copy every file under the local directory `local` to the same names under `remote`."""
    for file in sorted(p for p in local.rglob("*") if p.is_file()):
        target = remote / file.relative_to(local).as_posix()
        target.write_bytes(file.read_bytes())


def _fs(path: AnyPath) -> tuple[Any, str]:
    """The fsspec filesystem of a store path (the very instance `epath` and so orbax use, so a
    listing cached there is invalidated here) and the path as that filesystem names it."""
    from etils.epath import backend

    fs = backend.fsspec_backend.fs(str(path))
    return fs, str(fs._strip_protocol(str(path)))


# --- checked before any work -------------------------------------------------------------------

SUPPORTED = ("gs",)
"""The stores a job directory may be in so far."""


def _endpoint(scheme: str) -> tuple[str, str]:
    """(the endpoint URL requests go to, the variable that sets it) for a store (`SUPPORTED`)."""
    host = os.environ.get("STORAGE_EMULATOR_HOST")
    url = (host if "://" in host else f"http://{host}") if host else "https://storage.googleapis.com"
    return url, "STORAGE_EMULATOR_HOST"


def _credentials_problem(scheme: str) -> str | None:
    """Why requests to the store would be refused for want of credentials, or None."""
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        return None  # an emulator takes anonymous requests
    try:
        import google.auth

        google.auth.default()
    except Exception:
        return (
            "no Google Cloud credentials were found (Application Default Credentials: set "
            "GOOGLE_APPLICATION_CREDENTIALS to a service account key file, or run `gcloud auth "
            "application-default login`; on a Cloud TPU/GCE VM the VM's service account is used)"
        )
    return None


def check_store(path: AnyPath | str, option: str, *, timeout_s: float = 5.0) -> None:
    """Raise ConfigError, in seconds, when `path`'s store cannot be used: its endpoint does not
    answer, there are no credentials, or its bucket does not exist. Nothing for a local path.

    Arguments:
        path: a job directory or data path.
        option: the option or knob that gave it (named in the message).
        timeout_s: how long the endpoint has to accept a connection.
    """
    scheme = remote_scheme(str(path))
    if scheme is None:
        return
    if scheme not in SUPPORTED:
        raise ConfigError(
            f"{option} {str(path)!r}: {scheme}:// job directories are not supported yet (orbax's checkpoints "
            "commit without a rename on gs:// only). Use a gs:// bucket, or a local path where the bucket is "
            "mounted (mountpoint-s3, s3fs); docs/object_storage.md."
        )
    _configure_endpoints()
    url, variable = _endpoint(scheme)
    parsed = urllib.parse.urlsplit(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        socket.create_connection((parsed.hostname or "", port), timeout=timeout_s).close()
    except OSError as e:
        raise ConfigError(
            f"{option} {str(path)!r}: the {scheme}:// endpoint {url} does not answer ({e.strerror or e}). "
            f"Check the network, or set {variable} to the store's endpoint (an emulator: "
            f"{variable}=http://127.0.0.1:PORT)."
        ) from None
    if (problem := _credentials_problem(scheme)) is not None:
        raise ConfigError(f"{option} {str(path)!r}: {problem}.")
    bucket = urllib.parse.urlsplit(str(path)).netloc
    fs, _ = _fs(job_path(str(path)))
    try:
        found = fs.exists(bucket)
    except Exception as e:  # refused credentials, a malformed name: the store's own words
        raise ConfigError(
            f"{option} {str(path)!r}: {scheme}://{bucket} could not be read ({type(e).__name__}: {e}). "
            f"Check the credentials' permissions on the bucket, or {variable}."
        ) from None
    if not found:
        raise ConfigError(
            f"{option} {str(path)!r}: the bucket {scheme}://{bucket} does not exist at {url}. Create it "
            f"(`gcloud storage buckets create gs://{bucket}` or `aws s3 mb s3://{bucket}`), or fix the "
            "bucket's name."
        )


# --- the job's lock in a store ------------------------------------------------------------------

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
        fs, name = _fs(self.path)
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


def local_file(path: AnyPath) -> Path:
    """A local file with `path`'s bytes: `path` itself when local; for a store, a copy downloaded
    into a temporary directory removed when the process exits (for readers that open local files
    only, e.g. SentencePiece's)."""
    if not is_remote(path):
        return Path(path)
    import atexit
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="equipax-download-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    target = folder / path.name
    target.write_bytes(path.read_bytes())
    return target
