"""C4-format shards: JSON lines with a "text" field (plain or gzipped) and ArrayRecord files.

A shard directory holds files such as `c4-train.00000-of-01024.json.gz` (the layout of the
public C4 release) or `c4-train.00000-of-00004.array_record` (written by `launch data prepare`).
`TextShards` gives random access to their documents, which is what a grain `MapDataset` needs
for a global seeded shuffle and per-host slicing.

The shards' directory may be in object storage: `find_shards` and `TextShards` take any
`ShardPath`, a `pathlib.Path` or a path that reads the same way, such as `etils.epath.Path` for
`gs://BUCKET/DIR` (what `equipax.launch` passes for a `gs://` `data.path`). JSON-lines shards are
read whole, so a bucket's are read like a disk's; ArrayRecord shards are read by random access
from local files only.
"""

import gzip
import json
import logging
import os
import re
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import numpy as np

__all__ = [
    "ARRAY_RECORD_SUFFIXES",
    "check_complete_sets",
    "read_json_lines",
    "check_not_dangling",
    "DataError",
    "find_shards",
    "input_files",
    "is_shard",
    "iter_text_documents",
    "JSONL_SUFFIXES",
    "parse_record",
    "shard_split",
    "SHARD_SUFFIXES",
    "ShardPath",
    "TextShards",
]

log: logging.Logger = logging.getLogger("equipax.data")

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
ARRAY_RECORD_SUFFIXES = (".array_record", ".arrayrecord")
SHARD_SUFFIXES = JSONL_SUFFIXES + ARRAY_RECORD_SUFFIXES


class DataError(ValueError):
    """A problem with data files or their contents; the message names the file and the fix."""


@runtime_checkable
class ShardPath(Protocol):
    """A shard file or directory: a `pathlib.Path`, or a path in object storage with the same
    reading methods (`etils.epath.Path` for `gs://BUCKET/...`)."""

    @property
    def name(self) -> str: ...

    @property
    def parent(self) -> "ShardPath": ...

    def read_bytes(self) -> bytes: ...

    def is_file(self) -> bool: ...

    def is_dir(self) -> bool: ...

    def exists(self) -> bool: ...

    def glob(self, pattern: str) -> Iterator["ShardPath"]: ...

    def iterdir(self) -> Iterator["ShardPath"]: ...

    def __lt__(self, other: Any, /) -> bool: ...


def as_shard_path(path: "str | ShardPath") -> ShardPath:
    """`path` as a `ShardPath`: a string or a local path as `pathlib.Path` (`~` expanded), a store's path as it is."""
    return Path(path).expanduser() if isinstance(path, str | Path) else path


def is_shard(path: ShardPath) -> bool:
    """True when `path`'s name ends in a shard suffix (`.jsonl`, `.json.gz`, `.array_record`, ...)."""
    return path.name.endswith(SHARD_SUFFIXES)


_C4_NAME = re.compile(r"c4-([^.]+)\.")


def shard_split(path: ShardPath) -> str | None:
    """The split a C4-named shard holds (`c4-validation.00000-of-00008.json.gz` -> "validation"), else None."""
    m = _C4_NAME.match(path.name)
    return m.group(1) if m and is_shard(path) else None


def check_not_dangling(path: ShardPath, what: str = "Shard") -> None:
    """Raise DataError when `path` is a symbolic link whose target does not exist (never so in a store).

    A dangling link (an unmounted volume, a moved file) must not be skipped silently: the run
    would read part of the data.
    """
    if isinstance(path, Path) and path.is_symlink() and not path.exists():
        raise DataError(
            f"{what} {str(path)!r} is a broken symbolic link (to {os.readlink(path)!r}, which does not "
            f"exist). Mount or restore the target, or remove the link if the file is not meant to be read."
        )


_NUMBERED = re.compile(r"(?P<stem>.+)\.(?P<index>\d+)-of-(?P<count>\d+)\.(?P<ext>.+)")


def check_complete_sets(files: Sequence[ShardPath], *, partial_setting: str = "data.allow_partial_shards") -> None:
    """Raise DataError when numbered shards (`NAME.00001-of-00003.EXT`) are not a whole set.

    A set read with shards missing (a copy or a `launch data prepare` cut short) would train on
    part of the data as if it were all of it; the message names the missing shards.
    `partial_setting`: how the caller's user accepts a partial set on purpose.
    """
    sets: dict[tuple[str, int, str], set[int]] = {}
    for f in files:
        m = _NUMBERED.fullmatch(f.name)
        if m:
            key = (m["stem"], int(m["count"]), m["ext"])
            sets.setdefault(key, set()).add(int(m["index"]))
    for (stem, count, ext), present in sorted(sets.items()):
        width = max(5, len(str(count)))
        missing = [f"{stem}.{i:0{width}d}-of-{count:0{width}d}.{ext}" for i in range(count) if i not in present]
        beyond = sorted(i for i in present if i >= count)
        if not missing and not beyond:
            continue
        where = str(files[0].parent)
        problem = (
            f"{len(missing)} shard(s) missing: {', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}"
            if missing
            else f"shard number(s) {beyond[:4]} are beyond the count {count}"
        )
        raise DataError(
            f"The shard set {stem}.*-of-{count:0{width}d}.{ext} in {where!r} is incomplete: {problem} "
            f"({count - len(missing)} of {count} present). Reading it would train on part of the data as if it were "
            f"all of it. Restore the missing shards (copy them again, or rerun `launch data prepare`), or "
            f"set {partial_setting}=true to read the shards present on purpose (e.g. a downloaded part of C4)."
        )


def find_shards(
    path: str | ShardPath,
    pattern: str = "*",
    *,
    allow_partial: bool = False,
    partial_setting: str = "data.allow_partial_shards",
) -> list[ShardPath]:
    """The shard files in directory `path` whose names match the glob `pattern`, sorted.

    `path` is a local directory or one in object storage (a `ShardPath`); the files come back as
    the same kind of path. Raises DataError for a missing directory, when no shard file matches,
    or (unless `allow_partial`) when numbered shards `NAME.i-of-N.EXT` are not all N of their set
    (`check_complete_sets`; `partial_setting` is named in its message).
    """
    root = as_shard_path(path)
    if not root.is_dir():
        what = "is a file, not a directory" if root.exists() else "does not exist"
        raise DataError(
            f"data.path {str(root)!r} {what}. Point data.path at a directory of C4-format shards "
            f"(JSON lines with a 'text' field, optionally .gz, or ArrayRecord), e.g. written by "
            f"`launch data prepare --input TEXT_FILES --output DIR`."
        )
    files = []
    for p in sorted(root.glob(pattern)):
        if is_shard(p):
            check_not_dangling(p)
            if p.is_file():
                files.append(p)
    if not files:
        present = sorted(p.name for p in root.iterdir())[:5]
        raise DataError(
            f"No shard files matching {pattern!r} with a suffix in {SHARD_SUFFIXES} in {str(root)!r} "
            f"(it holds {present or 'nothing'}). Fix data.path or the file pattern knob "
            f"(data.train_files / data.eval_files)."
        )
    if not allow_partial:
        check_complete_sets(files, partial_setting=partial_setting)
    return files


def parse_record(raw: bytes | str, text_field: str = "text") -> str | None:
    """The text of one JSON record, or None when it is malformed (not JSON, or no string field)."""
    try:
        record = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict):
        return None
    text = record.get(text_field)
    return text if isinstance(text, str) else None


def read_json_lines(path: ShardPath, what: str = "Shard") -> bytes:
    """The bytes of a JSON-lines file, decompressed when its name ends in `.gz`.

    Raises:
        DataError: a `.gz` file that is not gzip (`what` names the file's kind in the message).
    """
    data = path.read_bytes()
    if path.name.endswith(".gz"):
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as e:
            raise DataError(f"{what} {str(path)!r} is not a valid gzip file ({e}); re-copy it.") from None
    return data


class _JsonLinesShard:
    """One JSON-lines file held as bytes with the offsets of its well-formed lines."""

    def __init__(self, path: ShardPath, text_field: str) -> None:
        data = read_json_lines(path)
        self.data = data
        starts, ends = [], []
        self.lines = 0
        self.malformed: int = 0
        pos = 0
        while pos < len(data):
            end = data.find(b"\n", pos)
            end = len(data) if end < 0 else end
            if data[pos:end].strip():
                self.lines += 1
                if parse_record(data[pos:end], text_field) is None:
                    self.malformed += 1
                else:
                    starts.append(pos)
                    ends.append(end)
            pos = end + 1
        self.starts = np.asarray(starts, np.int64)
        self.ends = np.asarray(ends, np.int64)

    def __len__(self) -> int:
        return len(self.starts)

    def text(self, i: int, text_field: str) -> str:
        text = parse_record(self.data[self.starts[i] : self.ends[i]], text_field)
        assert text is not None  # checked when indexed
        return text


if TYPE_CHECKING:
    _TextSequence = Sequence[str]
else:
    # At run time the base is the unsubscripted ABC: a runtime type checker (beartype, on in the
    # test suite) checks a `Sequence[str]` subclass by reading one random item, and for shards
    # that is a disk read whose `DataError` then surfaced as a type-check error.
    _TextSequence = Sequence


class TextShards(_TextSequence):
    """Random access to the documents of C4-format shard files: `len(shards)`, `shards[i] -> str`.

    JSON-lines files (`.jsonl`, `.json`, optionally `.gz`) are read into memory and checked line
    by line when opened: malformed lines (not JSON, or no string `text_field`) are skipped and
    counted. ArrayRecord files are read lazily by random access (the format for C4-sized data);
    their records are the same JSON objects, and a malformed record reads as an empty document.
    Malformed records are logged once; above `max_malformed_fraction` of the records read,
    DataError is raised. An empty shard is a DataError.

    **Arguments:**

    - `files`: shard paths, in order (e.g. from `find_shards`); local, or JSON-lines shards in a
      store (`ShardPath`).
    - `text_field`: the JSON field holding the document text.
    - `max_malformed_fraction`: the largest tolerated fraction of malformed records.
    - `fraction_setting`: how the caller's user sets `max_malformed_fraction` (a knob or a
      command-line option), named in the error message.
    """

    def __init__(
        self,
        files: Sequence[str | ShardPath],
        *,
        text_field: str = "text",
        max_malformed_fraction: float = 0.01,
        fraction_setting: str = "data.max_malformed_fraction",
    ) -> None:
        if not files:
            raise DataError("TextShards needs at least one shard file.")
        if not 0.0 <= max_malformed_fraction <= 1.0:
            raise DataError(f"max_malformed_fraction must be in [0, 1], got {max_malformed_fraction!r}.")
        self.files: list[ShardPath] = [Path(f) if isinstance(f, str) else f for f in files]
        self.text_field = text_field
        self.max_malformed_fraction: float = float(max_malformed_fraction)
        self.fraction_setting = fraction_setting
        self._lock = threading.Lock()
        self._records_read = 0
        self.malformed: int = 0
        self._logged = False
        self._lazy_reads = 0
        self._lazy_malformed = 0
        self._shards: list[_JsonLinesShard | object] = []
        sizes = []
        lines = 0
        for path in self.files:
            check_not_dangling(path)
            if not path.is_file():
                raise DataError(f"Shard {str(path)!r} does not exist.")
            if path.name.endswith(ARRAY_RECORD_SUFFIXES):
                if not isinstance(path, Path):
                    raise DataError(
                        f"Shard {str(path)!r} is an ArrayRecord file in object storage, which is read by random "
                        "access from local files only. Copy the shards to a local disk, mount the bucket (gcsfuse) "
                        "and point data.path there, or write JSON-lines shards "
                        "(`launch data prepare --format jsonl.gz`)."
                    )
                shard: Any = _open_array_record(path)
                size = len(shard)
                lines += size
            else:
                shard = _JsonLinesShard(path, text_field)
                size = len(shard)
                lines += shard.lines
                self.malformed += shard.malformed
                if shard.lines == 0:
                    size = 0
            if size == 0:
                detail = (
                    f"all {shard.lines} lines are malformed (no JSON object with a string {text_field!r} field)"
                    if isinstance(shard, _JsonLinesShard) and shard.lines
                    else "it is empty"
                )
                raise DataError(
                    f"Shard {str(path)!r} has no documents: {detail}. Remove it from the directory "
                    f"or regenerate it (`launch data prepare`)."
                )
            self._shards.append(shard)
            sizes.append(size)
        self._records_read = lines
        self._offsets = np.cumsum([0, *sizes])
        if self.malformed:
            self._report_malformed(f"while indexing {len(self.files)} JSON-lines shard(s)")

    def _report_malformed(self, where: str) -> None:
        fraction = self.malformed / max(self._records_read, 1)
        if fraction > self.max_malformed_fraction:
            raise DataError(
                f"{self.malformed} of {self._records_read} records ({fraction:.1%}) in the shards under "
                f"{str(self.files[0].parent)!r} are malformed (not a JSON object with a string "
                f"{self.text_field!r} field), above the tolerated {self.max_malformed_fraction:.1%} "
                f"({self.fraction_setting}). Fix the files or raise {self.fraction_setting}."
            )
        if not self._logged:
            self._logged = True
            log.warning(
                "Skipped %d malformed record(s) of %d %s (tolerated up to %.1f%%).",
                self.malformed,
                self._records_read,
                where,
                100 * self.max_malformed_fraction,
            )

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def __getitem__(self, index: int | slice) -> Any:  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        i = int(index)
        i = i + len(self) if i < 0 else i
        if not 0 <= i < len(self):
            raise IndexError(f"document {i} out of range [0, {len(self)}).")
        s = int(np.searchsorted(self._offsets, i, side="right")) - 1
        shard = self._shards[s]
        j = i - int(self._offsets[s])
        if isinstance(shard, _JsonLinesShard):
            return shard.text(j, self.text_field)
        try:
            raw = shard[j]  # type: ignore[index]
        except (RuntimeError, OSError) as e:
            raise _corrupt_array_record(self.files[s], e, f"record {j} does not read") from None
        text = parse_record(raw, self.text_field)
        with self._lock:
            self._lazy_reads += 1
            if text is None:
                self._lazy_malformed += 1
                fraction = self._lazy_malformed / self._lazy_reads
                if self._lazy_reads >= 100 and fraction > self.max_malformed_fraction:
                    raise DataError(
                        f"{self._lazy_malformed} of {self._lazy_reads} ArrayRecord records read from "
                        f"{str(self.files[s])!r} and its siblings are malformed ({fraction:.1%}, above "
                        f"{self.fraction_setting}={self.max_malformed_fraction}). Fix the files or raise "
                        f"{self.fraction_setting}."
                    )
                if not self._logged:
                    self._logged = True
                    log.warning("Malformed ArrayRecord record %d of %s read as an empty document.", j, self.files[s])
        return "" if text is None else text


def _corrupt_array_record(path: ShardPath, e: BaseException, what: str) -> DataError:
    reason = str(e).strip().splitlines()[0] if str(e).strip() else f"{type(e).__name__} with no message"
    return DataError(
        f"Shard {str(path)!r} is not a readable ArrayRecord file: {what} ({reason}). It is truncated or "
        f"damaged: re-copy it, or regenerate it (`launch data prepare --format arrayrecord`)."
    )


def _open_array_record(path: Path) -> Any:
    import grain

    try:
        return grain.sources.ArrayRecordDataSource([str(path)])
    except (RuntimeError, OSError, ValueError) as e:
        raise _corrupt_array_record(path, e, "it does not open") from None


def input_files(paths: Iterable[str | Path], *, c4_split: str | None = None) -> list[Path]:
    """The files `iter_text_documents` reads: files as given, directories expanded (sorted, recursively).

    Hidden files (names starting with ".") in directories are left out. A broken symbolic link or
    a missing input is a DataError.

    **Arguments:**

    - `paths`: text files, shard files or directories.
    - `c4_split`: when given, shards found in a directory whose C4 name says they hold another
      split (`c4-validation.*` when `c4_split="train"`) are left out; files named explicitly are kept.
    """
    files: list[Path] = []
    for p in paths:
        path = Path(p).expanduser()
        check_not_dangling(path, "Input")
        if path.is_dir():
            for f in sorted(path.rglob("*")):
                if f.name.startswith("."):
                    continue
                check_not_dangling(f, "Input")
                if not f.is_file():
                    continue
                found = shard_split(f)
                if c4_split is None or found is None or found == c4_split:
                    files.append(f)
        elif path.is_file():
            files.append(path)
        else:
            raise DataError(f"Input {str(path)!r} does not exist; pass text files or directories.")
    return files


def iter_text_documents(
    paths: Iterable[str | Path],
    *,
    split: Literal["file", "blank-line"] = "file",
    c4_split: str | None = None,
    max_malformed_fraction: float = 0.01,
    fraction_setting: str = "max_malformed_fraction",
) -> Iterator[str]:
    """Documents from plain text files or directories of them (sorted, recursively).

    Files with a shard suffix are read as C4-format shards, one document per record.

    **Arguments:**

    - `paths`: text files, shard files or directories (expanded by `input_files`).
    - `split`: "file" (a file is one document) or "blank-line" (blocks separated by blank lines).
    - `c4_split`: read only this split of the C4-named shards found in directories (`input_files`).
    - `max_malformed_fraction`, `fraction_setting`: as for `TextShards`, per shard file.
    """
    for f in input_files(paths, c4_split=c4_split):
        if is_shard(f):
            yield from TextShards([f], max_malformed_fraction=max_malformed_fraction, fraction_setting=fraction_setting)
            continue
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise DataError(f"Input {str(f)!r} is not UTF-8 text.") from None
        if split == "file":
            if text.strip():
                yield text
        else:
            for block in text.replace("\r\n", "\n").split("\n\n"):
                if block.strip():
                    yield block.strip("\n")
