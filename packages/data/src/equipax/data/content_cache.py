"""A directory of results named by a digest of everything they were computed from.

Training a vocabulary and encoding a corpus are pure functions of their inputs (the texts, the
settings, the library's version), yet every fresh job recomputed them: on the default experiment
that was most of the time to its first step that was not compilation (benchmarks/README.md,
`first_step.py`). `ContentCache` keeps each result under `content_key(...)` of its inputs, so an
equal key can only come from equal inputs, and a result is reused only when its bytes are the ones
that were written: each file ends with the SHA-256 of its payload, checked on every read. A file
that fails the check (a damaged disk, a hand edit) is removed and reads as absent, so the caller
computes it again. Writes go to a temporary name first and are renamed into place, so concurrent
processes (the hosts of one job, several jobs) never read a partial file; a directory that cannot
be written (a read-only home, a full disk) only means nothing is kept.
"""

import contextlib
import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

__all__ = ["ContentCache", "content_key", "write_atomic"]

_DIGEST = hashlib.sha256().digest_size


def content_key(*parts: str | bytes | int | Iterable[str]) -> str:
    """A hex digest of `parts` in order; each part is length-prefixed, so no two different
    sequences of parts share a key. An iterable of strings (a corpus) is hashed item by item, with
    no Python call per item (a vocabulary's key covers every line of its corpus: 141,000 lines for
    the default experiment's plays)."""
    h = hashlib.sha256()

    def add(data: bytes) -> None:
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)

    for part in parts:
        if isinstance(part, bytes):
            add(b"b" + part)
        elif isinstance(part, str):
            add(b"s" + part.encode())
        elif isinstance(part, int):
            add(b"i" + str(part).encode())
        else:
            items = 0
            update = h.update
            for item in part:  # add(b"s" + item.encode()), inlined
                data = item.encode()
                update((len(data) + 1).to_bytes(8, "little"))
                update(b"s")
                update(data)
                items += 1
            add(b"n" + str(items).encode())
    return h.hexdigest()


def write_atomic(path: Path, data: bytes) -> None:
    """`data` into `path` (its folders made) through a temporary file renamed into place, so no
    reader sees a partial file; on failure the temporary file is removed and the OSError raised."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        tmp.replace(path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


class ContentCache:
    """Files of one kind of result (vocabularies, token streams) in `directory`, by key."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory: Path = Path(directory)

    def path(self, key: str) -> Path:
        return self.directory / key

    def get(self, key: str) -> bytes | None:
        """The payload stored under `key`, or None: absent, unreadable, or failing its checksum
        (that file is then removed)."""
        path = self.path(key)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        payload, digest = data[:-_DIGEST], data[-_DIGEST:]
        if len(data) < _DIGEST or hashlib.sha256(payload).digest() != digest:
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        return payload

    def put(self, key: str, payload: bytes) -> bool:
        """Store `payload` under `key` (atomically); False where the directory cannot be written."""
        try:
            write_atomic(self.path(key), payload + hashlib.sha256(payload).digest())
        except OSError:
            return False
        return True
