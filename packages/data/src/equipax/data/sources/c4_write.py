"""Writing C4-format shards (`launch data prepare`): C4's file names, the output checks made before
any work, and an all-or-nothing write of a shard set (JSON lines, gzipped or ArrayRecord). The
reading side is `equipax.data.sources.c4`."""

import gzip
import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Literal

import numpy as np

from equipax.core.paths import output_problem
from equipax.data.base import Documents
from equipax.data.sources.c4 import DataError, is_shard

__all__ = ["check_shard_output", "shard_names", "write_shards"]


def shard_names(prefix: str, num_shards: int, format: Literal["jsonl", "jsonl.gz", "arrayrecord"]) -> list[str]:
    """File names `{prefix}.{i:05d}-of-{n:05d}.{ext}` for a set of shards (C4's naming)."""
    ext = {"jsonl": "jsonl", "jsonl.gz": "jsonl.gz", "arrayrecord": "array_record"}[format]
    return [f"{prefix}.{i:05d}-of-{num_shards:05d}.{ext}" for i in range(num_shards)]


def check_shard_output(
    output: str | Path, prefix: str, *, output_setting: str = "--output", prefix_setting: str = "--split"
) -> None:
    """Raise DataError unless shards named `prefix.*` can be written into directory `output`.

    Checked before any work (`write_shards` checks again): `output` must be a directory or
    creatable as one, and `prefix` a plain name (letters, digits, "-", "_"; it starts each file
    name). `output_setting` / `prefix_setting` name how the caller's user sets them.
    """
    if not re.fullmatch(r"(c4-)?[A-Za-z0-9_-]+", prefix) or prefix == "c4-":
        raise DataError(
            f"{prefix_setting} must be a plain name (letters, digits, '-' or '_'), e.g. train or validation; "
            f"got {prefix.removeprefix('c4-')!r}. It becomes part of each file name: c4-train.00000-of-00001.jsonl."
        )
    problem = output_problem(output, kind="directory")
    if problem:
        raise DataError(
            f"{output_setting} {str(output)!r} {problem}. Pass a directory for the shards (it is created if missing)."
        )


def write_shards(
    documents: Documents,
    output: str | Path,
    *,
    prefix: str = "c4-train",
    num_shards: int = 1,
    format: Literal["jsonl", "jsonl.gz", "arrayrecord"] = "jsonl",
    overwrite: bool = False,
) -> list[Path]:
    """Write documents as C4-format shards: consecutive runs of documents, one run per shard.

    Reading the shards back in sorted order gives the documents in their original order. The
    write is all or nothing: the shards are written into a hidden temporary directory (beside
    `output` when it does not exist yet, inside it otherwise) and moved into place only when all
    are complete, so a full disk or a kill leaves no partial set (and, with `overwrite`, the old
    shards stay until the new set is complete).

    **Arguments:**

    - `documents`: the texts.
    - `output`: the directory (created if needed).
    - `prefix`: file-name prefix, e.g. "c4-train" or "c4-validation" (no "/", not empty).
    - `num_shards`: number of files; at most the number of documents.
    - `format`: "jsonl", "jsonl.gz" or "arrayrecord".
    - `overwrite`: replace existing shards with the same prefix (otherwise an error).

    **Returns:** the paths written.
    """
    if format not in ("jsonl", "jsonl.gz", "arrayrecord"):
        raise DataError(f"format must be 'jsonl', 'jsonl.gz' or 'arrayrecord', got {format!r}.")
    if num_shards < 1 or num_shards > len(documents):
        raise DataError(
            f"num_shards={num_shards} must be between 1 and the number of documents ({len(documents)}); "
            f"every shard must hold at least one document."
        )
    out = Path(output).expanduser()
    check_shard_output(out, prefix)
    existing = sorted(p.name for p in out.glob(f"{prefix}.*") if is_shard(p)) if out.is_dir() else []
    if existing and not overwrite:
        raise DataError(
            f"{str(out)!r} already holds {len(existing)} shard(s) named {prefix}.* (e.g. {existing[0]}); "
            f"choose another --output or pass --overwrite."
        )
    new_dir = not out.is_dir()
    if new_dir:
        out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(
        tempfile.mkdtemp(
            prefix=f".{out.name}.partial-" if new_dir else f".{prefix}.partial-", dir=out.parent if new_dir else out
        )
    )
    try:
        names = shard_names(prefix, num_shards, format)
        bounds = np.linspace(0, len(documents), num_shards + 1).round().astype(int)
        for name, lo, hi in zip(names, bounds[:-1], bounds[1:]):
            _write_shard(tmp / name, [documents[i] for i in range(lo, hi)], format)
        if new_dir:
            tmp.rename(out)
        else:
            for name in existing:
                (out / name).unlink()
            for name in names:
                (tmp / name).replace(out / name)
            tmp.rmdir()
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise DataError(
            f"Could not write the shards to {str(out)!r}: {e.strerror or e} ({e.filename or 'a shard'}). "
            f"Nothing was written there (the shards are written to a temporary directory and moved in "
            f"place only when all are complete); free space or fix the permissions, then run the same "
            f"command again."
        ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return [out / name for name in names]


def _write_shard(path: Path, documents: list[str], format: str) -> None:
    records = [json.dumps({"text": doc}, ensure_ascii=False) for doc in documents]
    if format == "arrayrecord":
        from array_record.python.array_record_module import ArrayRecordWriter

        writer = ArrayRecordWriter(str(path), "group_size:1")
        for r in records:
            writer.write(r.encode("utf-8"))
        writer.close()
    else:
        data = ("\n".join(records) + "\n").encode("utf-8")
        path.write_bytes(gzip.compress(data, mtime=0) if format == "jsonl.gz" else data)
