"""Safetensors files and Hugging Face checkpoint directories, read and written with numpy.

A `.safetensors` file is an 8-byte little-endian header length N, N bytes of JSON (`{name:
{"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`, offsets relative to
the end of the header) and the tensors' bytes, C order, little-endian. This reader parses the
header and reads any part of a tensor as a byte range of the file (`SafetensorsFile.read`), in
bounded chunks: loading a sharded model reads only the rows each device owns, and nothing holds a
whole file in memory. A checkpoint directory is one `model.safetensors` or the shards listed in
`model.safetensors.index.json` (`HFCheckpoint`). Damaged input is a `CheckpointFormatError` (a
`ConfigError`: exit 2 on the command line) naming the file and the tensor.
"""

import json
import math
import os
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from equipax.core.knobs import ConfigError

__all__ = [
    "CheckpointFormatError",
    "DTYPES",
    "HFCheckpoint",
    "INDEX_FILE",
    "SINGLE_FILE",
    "SafetensorsFile",
    "TensorInfo",
    "write_safetensors",
]

# The dtypes read and written: safetensors' names -> numpy (little-endian).
DTYPES: dict[str, np.dtype[Any]] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
_NAMES = {v: k for k, v in DTYPES.items()}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header
_CHUNK = 64 * 2**20  # bytes read at a time: the reader's peak on top of what it returns


class CheckpointFormatError(ConfigError):
    """A checkpoint file or directory that cannot be read as it claims to be (the message names it)."""


class TensorInfo:
    """One tensor's entry in a safetensors header."""

    __slots__ = ("begin", "dtype", "end", "shape")
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    begin: int
    end: int

    def __init__(self, dtype: np.dtype[Any], shape: tuple[int, ...], begin: int, end: int) -> None:
        self.dtype, self.shape, self.begin, self.end = dtype, shape, begin, end

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def _bad(path: Path, what: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"{path} is not a readable safetensors file: {what}")


class SafetensorsFile:
    """The header of one safetensors file, and reads of its tensors by byte range.

    Arguments:
        path: the file.

    Raises:
        CheckpointFormatError: missing file, truncated or malformed header, a tensor whose bytes do
            not match its dtype and shape or lie past the end of the file, an unsupported dtype.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path: Path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise _bad(self.path, f"{size} bytes, shorter than the 8-byte header length (truncated).")
                (n,) = struct.unpack("<Q", head)
                if n > _MAX_HEADER or 8 + n > size:
                    raise _bad(
                        self.path,
                        f"its header claims {n} bytes but the file has {size - 8} after the length (truncated).",
                    )
                raw = f.read(n)
        except FileNotFoundError:
            raise CheckpointFormatError(f"{self.path} does not exist.") from None
        except OSError as e:
            raise CheckpointFormatError(f"{self.path} cannot be read ({e.strerror or e}).") from None
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise _bad(self.path, f"its JSON header does not parse ({e}).") from None
        if not isinstance(header, dict):
            raise _bad(self.path, "its JSON header is not an object.")
        self.data_start: int = 8 + n
        self.metadata: dict[str, str] = dict(header.pop("__metadata__", None) or {})
        self.tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            self.tensors[name] = self._entry(name, entry, size - self.data_start)

    def _entry(self, name: str, entry: Any, data_size: int) -> TensorInfo:
        try:
            dtype_name, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise _bad(self.path, f"tensor {name!r} has no dtype, shape and data_offsets ({entry!r}).") from None
        if dtype_name not in DTYPES:
            raise CheckpointFormatError(
                f"{self.path}: tensor {name!r} is {dtype_name}; equipax reads {', '.join(DTYPES)} checkpoints. "
                "Convert the checkpoint to one of them first."
            )
        dtype = DTYPES[dtype_name]
        if any(not isinstance(d, int) or d < 0 for d in shape):
            raise _bad(self.path, f"tensor {name!r} has shape {list(shape)}.")
        expected = math.prod(shape) * dtype.itemsize
        if end - begin != expected:
            raise _bad(
                self.path,
                f"tensor {name!r} ({dtype_name} {list(shape)}) should hold {expected} bytes, its offsets give "
                f"{end - begin}.",
            )
        if begin < 0 or end > data_size:
            raise _bad(
                self.path, f"tensor {name!r} ends at byte {end} but the file holds {data_size} data bytes (truncated)."
            )
        return TensorInfo(dtype, shape, begin, end)

    def info(self, name: str) -> TensorInfo:
        """The header entry of `name` (CheckpointFormatError when the file has no such tensor)."""
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointFormatError(f"{self.path} has no tensor {name!r}.") from None

    def read(self, name: str, index: tuple[slice, ...] = (), *, view: tuple[int, ...] | None = None) -> np.ndarray:
        """`tensor[index]`, reading only the rows of the first axis it touches.

        Arguments:
            name: the tensor.
            index: one slice per leading axis (step 1); missing axes are whole.
            view: read the tensor as this shape (a reshape of its C-order bytes, e.g. `[heads,
                head_dim, embed]` for a `[heads * head_dim, embed]` projection); None = its shape.

        Returns:
            A new array of the file's dtype.
        """
        info = self.info(name)
        shape = info.shape if view is None else tuple(view)
        if math.prod(shape) != math.prod(info.shape):
            raise CheckpointFormatError(
                f"{self.path}: tensor {name!r} of shape {list(info.shape)} is not {list(shape)}."
            )
        if not shape:
            return self._bytes(info, 0, info.nbytes).view(info.dtype).reshape(())
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        rows = range(shape[0])[index[0]]
        row_items = math.prod(shape[1:])
        out = np.empty(tuple(len(range(n)[s]) for n, s in zip(shape, index, strict=True)), info.dtype)
        rest = index[1:]
        step = max(1, _CHUNK // max(row_items * info.dtype.itemsize, 1))
        for k in range(0, len(rows), step):
            lo, hi = rows.start + k, min(rows.start + k + step, rows.stop)
            chunk = self._bytes(info, lo * row_items * info.dtype.itemsize, hi * row_items * info.dtype.itemsize)
            out[k : k + hi - lo] = chunk.view(info.dtype).reshape((hi - lo, *shape[1:]))[(slice(None), *rest)]
        return out

    def _bytes(self, info: TensorInfo, lo: int, hi: int) -> np.ndarray:
        buf = np.empty(hi - lo, np.uint8)
        with open(self.path, "rb") as f:
            f.seek(self.data_start + info.begin + lo)
            if f.readinto(memoryview(buf)) != hi - lo:
                raise _bad(self.path, "it ended while reading a tensor (truncated).")
        return buf


def write_safetensors(
    path: str | os.PathLike[str], tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None
) -> None:
    """Write `tensors` (F32, F16 or BF16 numpy arrays) as one safetensors file.

    Tensors are laid out in the order given, the header padded with spaces to a multiple of 8 bytes
    (as the reference implementation does, so the data is aligned). The file is written whole;
    callers that need atomicity write into a temporary directory and rename it.

    Arguments:
        path: the file to write.
        tensors: name -> array.
        metadata: the header's `__metadata__` (Hugging Face expects `{"format": "pt"}`).
    """
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    arrays = []
    for name, value in tensors.items():
        a = np.asarray(value, order="C")
        dtype = a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype
        if dtype not in _NAMES:
            raise ValueError(f"tensor {name!r} is {a.dtype}; safetensors files here hold {', '.join(DTYPES)}.")
        a = a.astype(dtype, copy=False)
        header[name] = {"dtype": _NAMES[dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        arrays.append(a)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for a in arrays:
            f.write(a.tobytes())


class HFCheckpoint:
    """The weights of a Hugging Face model directory: `model.safetensors`, or the shards that
    `model.safetensors.index.json` lists (each opened once, when first read).

    Arguments:
        directory: the model directory.

    Raises:
        CheckpointFormatError: no weights, an unreadable index, a shard it lists that is missing.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory: Path = Path(directory)
        index = self.directory / INDEX_FILE
        self._files: dict[str, SafetensorsFile] = {}
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                self.where: dict[str, str] = {str(k): str(v) for k, v in dict(weight_map).items()}
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise CheckpointFormatError(
                    f"{index} does not read as a safetensors index (a JSON object with a 'weight_map': {e})."
                ) from None
            missing = sorted({f for f in self.where.values() if not (self.directory / f).is_file()})
            if missing:
                raise CheckpointFormatError(
                    f"{index} lists shard(s) that are not in {self.directory}: {', '.join(missing)} (e.g. tensor "
                    f"{next(k for k, f in self.where.items() if f == missing[0])!r}). Copy the missing files, or "
                    "download the checkpoint again."
                )
        elif (self.directory / SINGLE_FILE).is_file():
            single = self._open(SINGLE_FILE)
            self.where = dict.fromkeys(single.tensors, SINGLE_FILE)
        else:
            found = sorted(p.name for p in self.directory.glob("*")) if self.directory.is_dir() else []
            raise CheckpointFormatError(
                f"{self.directory} holds no safetensors weights (neither {SINGLE_FILE} nor {INDEX_FILE}; found "
                f"{', '.join(found[:8]) or 'nothing'}). Point at a Hugging Face model directory; a PyTorch "
                "`.bin` checkpoint must be saved as safetensors first (`save_pretrained`)."
            )

    def _open(self, file: str) -> SafetensorsFile:
        if file not in self._files:
            self._files[file] = SafetensorsFile(self.directory / file)
        return self._files[file]

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def names(self) -> Iterator[str]:
        """The tensor names, in the index's order."""
        return iter(self.where)

    def file_of(self, name: str) -> SafetensorsFile:
        """The file holding `name` (CheckpointFormatError when no file does)."""
        if name not in self.where:
            raise CheckpointFormatError(f"{self.directory} has no tensor {name!r}.")
        file = self._open(self.where[name])
        file.info(name)  # listed by the index but absent from its shard: named here
        return file

    def info(self, name: str) -> TensorInfo:
        """The header entry of `name`."""
        return self.file_of(name).info(name)

    def read(self, name: str, index: tuple[slice, ...] = (), *, view: tuple[int, ...] | None = None) -> np.ndarray:
        """`SafetensorsFile.read` of the file holding `name`."""
        return self.file_of(name).read(name, index, view=view)
