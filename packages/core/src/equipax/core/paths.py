"""Paths a command is about to write, checked before any work: one answer for every command.

`output_problem` says why a path cannot become the file or directory a command writes (it is
empty, the wrong kind of thing, lies under a file, or no permission), so each command refuses it
at once, naming its option, instead of failing after the work is done.
"""

import os
import re
from pathlib import Path
from typing import Literal

__all__ = ["output_problem", "url_problem"]

_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def url_problem(value: str | Path) -> str | None:
    """Why `value` cannot be used as a path when it is a URL (`gs://bucket/job`, `s3://...`), or
    None. equipax reads and writes local or mounted filesystems only; as a path a URL would quietly
    become a local directory named after its scheme (`gs:`)."""
    if not _URL.match(str(value).strip()):
        return None
    return (
        f"{str(value)!r} is a URL: object storage (gs://, s3://) is not supported yet, and as a path it would "
        "become a local directory named after the scheme. Give a local or shared-filesystem path, e.g. where "
        "the bucket is mounted (gcsfuse, s3fs); docs/coming_from_pax.md"
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
