"""Paths a command is about to write, checked before any work: one answer for every command.

`output_problem` says why a path cannot become the file or directory a command writes (it is
empty, the wrong kind of thing, lies under a file, or no permission), so each command refuses it
at once, naming its option, instead of failing after the work is done.
"""

import os
import re
from pathlib import Path
from typing import Literal

__all__ = ["local_only_problem", "output_problem", "REMOTE_SCHEMES", "remote_scheme", "url_problem"]

_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")

REMOTE_SCHEMES = ("gs", "s3")
"""The object stores a path may name: Google Cloud Storage (`gs://bucket/...`) and S3 (`s3://bucket/...`)."""


def remote_scheme(value: str | Path) -> str | None:
    """`"gs"` or `"s3"` when `value` names an object in that store, else None."""
    m = _URL.match(str(value).strip())
    return m.group(1).lower() if m and m.group(1).lower() in REMOTE_SCHEMES else None


def url_problem(value: str | Path, *, stores: bool = True) -> str | None:
    """Why `value` cannot be used as a path when it is a URL, or None. Local paths and, with
    `stores`, the object stores of `REMOTE_SCHEMES` are paths (`equipax.launch.store.storage`);
    any other URL (`http://`, `hdfs://`) is refused: as a path it would quietly become a local
    directory named after its scheme (`http:`)."""
    text = str(value).strip()
    m = _URL.match(text)
    if m is None:
        return None
    scheme = m.group(1).lower()
    if scheme in REMOTE_SCHEMES and stores:
        if not re.match(r"[A-Za-z0-9+.-]+://[^/\s]+", text):
            return f"{str(value)!r} names no bucket: write {scheme}://BUCKET/PATH"
        return None
    if scheme in REMOTE_SCHEMES:
        return (
            f"{str(value)!r} is in object storage, where job directories (--job-log-dir gs://BUCKET/JOB) and data "
            "(data.path, data.vocab_path) can be, but not this path. Give a local or shared-filesystem path (e.g. "
            "where the bucket is mounted: gcsfuse, s3fs); docs/object_storage.md"
        )
    return (
        f"{str(value)!r} is a {m.group(1)}:// URL: object storage is supported as gs:// and s3://, and as "
        "a path it would become a local directory named after the scheme. Give a gs:// or s3:// path, or a local or "
        "shared-filesystem path (e.g. where the store is mounted); docs/object_storage.md"
    )


def local_only_problem(value: str | Path, what: str) -> str | None:
    """Why `value`, named `what` (e.g. "hf-import's directory"), cannot be a path that is read only
    from a local or mounted filesystem, when it is a URL; None for a local path. An object store's
    path is refused saying how to copy it first (as a path it would become a local `gs:` folder)."""
    scheme = remote_scheme(value)
    if scheme is None:
        return url_problem(value, stores=False)
    copy = "gcloud storage cp -r" if scheme == "gs" else "aws s3 cp --recursive"
    return (
        f"{what} {str(value)!r} is in object storage, but it is read from a local or mounted filesystem only: "
        f"copy it first (e.g. `{copy} {str(value).rstrip('/')} /models/NAME`) or mount the bucket (gcsfuse, "
        "s3fs), and give that path"
    )


def output_problem(path: str | Path, *, kind: Literal["file", "directory"]) -> str | None:
    """Why `path` cannot be written as a `kind`, or None when it can.

    Missing directories on the way are fine (commands create them); the nearest existing
    ancestor must be a writable directory. The answer is a clause to follow the path's name,
    e.g. "is a directory, not a file".
    """
    if str(path) == "":
        return "is empty (an empty path would write into the current directory)"
    p = Path(path).expanduser()
    if p.is_symlink() and not p.exists():
        return f"is a broken symbolic link (to {os.readlink(p)!r})"
    if p.exists():
        if kind == "file" and p.is_dir():
            return "is a directory, not a file"
        if kind == "directory" and not p.is_dir():
            return "is a file, not a directory"
        if not os.access(p, os.W_OK):
            return "is not writable (no permission)"
        return None
    ancestor = p.absolute().parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"lies under {str(ancestor)!r}, which is a file, not a directory"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"cannot be created: no permission to write in {str(ancestor)!r}"
    return None
