"""Where a job's files live: a local (or mounted) directory, or object storage (`gs://`, `s3://`).

Every file a run writes or reads in its job directory goes through the few functions here, so a
job directory can be `gs://bucket/job` or `s3://bucket/job` as well as a local path, and so can
the data a run reads (`data.path`'s shards, `data.vocab_path`):

- `job_path` turns what the user gave into a path: `pathlib.Path` for a local one, `etils.epath.Path`
  for a URL (epath reads and writes objects through fsspec's `gcsfs` / `s3fs`). Orbax takes the
  same epath for checkpoints and writes their arrays with TensorStore's own `gcs` / `s3` driver
  (`orbax_s3` routes `s3://` there).
- Object stores have no atomic rename, but a single object appears whole or not at all: small files
  (`write_atomic`) are written as one object, an appended line (`append_line`) rewrites the object
  with the line added, and checkpoints commit the way orbax does on GCS (a `commit_success.txt`
  marker written last; a step without it is never restored; `orbax_s3.atomicity_options` asks for
  it on S3). docs/object_storage.md.
- `checks.check_store` fails in seconds, naming the variable to set, when the store cannot be
  reached, has no credentials, or the bucket does not exist; `lock.StoreLock` is the job's
  lock there.

Emulators (tests, local development): `STORAGE_EMULATOR_HOST=http://127.0.0.1:PORT` points gcsfs
(and, through `TENSORSTORE_GCS_HTTP_URL`, set from it here when unset, TensorStore) at a GCS
emulator; `AWS_ENDPOINT_URL` (or `AWS_ENDPOINT_URL_S3`) points s3fs (botocore reads it) and
TensorStore (`orbax_s3.kvstore_spec` puts it in the spec) at an S3 one.
"""

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any

from etils import epath

from equipax.core.paths import remote_scheme

__all__ = [
    "AnyPath",
    "append_line",
    "COMMIT_MARKER",
    "configure_endpoints",
    "filesystem",
    "is_remote",
    "job_path",
    "local_copy",
    "local_file",
    "move",
    "mtime",
    "rmtree",
    "size",
    "upload",
    "write_atomic",
]

if TYPE_CHECKING:
    from typing_extensions import TypeAliasType

    # PEP 695's alias (`type AnyPath = ...` needs Python 3.12) in its typing_extensions form, its
    # value a string so that type checkers keep it lazy: etils ships no py.typed, and an eager
    # `Path | epath.Path` reads as partially unknown to `pyright --verifytypes`
    # (tests/repo/test_wheels.py). At run time, the union itself (what beartype checks).
    AnyPath = TypeAliasType("AnyPath", "Path | epath.Path")
else:
    AnyPath = Path | epath.Path
"""A job directory or a file in it: local (`pathlib.Path`) or in object storage (`epath.Path`)."""


def is_remote(path: AnyPath | PurePath | str) -> bool:
    """Whether `path` names an object in a store (`gs://...`, `s3://...`)."""
    return remote_scheme(str(path)) is not None


def job_path(value: AnyPath | PurePath | str) -> AnyPath:
    """`value` as a path: `etils.epath.Path` for `gs://` and `s3://`, `pathlib.Path` otherwise."""
    if isinstance(value, Path) or not is_remote(value):
        return Path(value)
    configure_endpoints(remote_scheme(str(value)))
    return value if isinstance(value, epath.Path) else epath.Path(str(value))


def configure_endpoints(scheme: str | None = "gs") -> None:
    """One variable per store: TensorStore's GCS driver reads its own, set from gcsfs's when unset;
    for S3, orbax is taught TensorStore's `s3` driver, with the endpoint in its spec (`orbax_s3`)."""
    if scheme == "s3":
        from equipax.launch.store import orbax_s3

        orbax_s3.install()
        return
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
    fs, src = filesystem(source)
    dst = filesystem(target)[1]
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


def size(path: AnyPath) -> int:
    """The size of the file `path` in bytes (a store's object: from its listing, nothing downloaded)."""
    if isinstance(path, Path):
        return path.stat().st_size
    return int(path.stat().length)


def rmtree(path: AnyPath) -> None:
    """Remove a directory and everything under it; nothing when it is not there."""
    if is_remote(path):
        fs, p = filesystem(path)
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


def filesystem(path: AnyPath) -> tuple[Any, str]:
    """The fsspec filesystem of a store path (the very instance `epath` and so orbax use, so a
    listing cached there is invalidated here) and the path as that filesystem names it."""
    from etils.epath import backend

    fs = backend.fsspec_backend.fs(str(path))
    return fs, str(fs._strip_protocol(str(path)))


def local_file(path: AnyPath, *, siblings: tuple[str, ...] = ()) -> Path:
    """A local file with `path`'s bytes: `path` itself when local; for a store, a copy downloaded
    into a temporary directory removed when the process exits (for readers that open local files
    only, e.g. SentencePiece's and Hugging Face's tokenizers), with those of the files named
    `siblings` that are next to `path` (a tokenizer.json's tokenizer_config.json) beside it."""
    if not is_remote(path):
        return Path(path)
    import atexit
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="equipax-download-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    for name in siblings:
        if name != path.name and (other := path.parent / name).is_file():
            (folder / name).write_bytes(other.read_bytes())
    target = folder / path.name
    target.write_bytes(path.read_bytes())
    return target
