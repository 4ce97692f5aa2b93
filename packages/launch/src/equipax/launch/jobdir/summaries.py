"""Run metrics: one JSON object per logged step in metrics.jsonl, and TensorBoard scalars.

Only process 0 writes (multi-host runs call this with `enabled=False` elsewhere).
"""

import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tensorboardX import SummaryWriter

__all__ = ["MetricsWriter", "read_metrics"]


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class MetricsWriter:
    """Append metrics to `<job>/metrics.jsonl` and `<job>/summaries/{train,eval}`.

    Arguments:
        job_dir: the job's directory.
        enabled: False on processes other than 0 (writes nothing).
        log: where a warning about unreadable lines dropped on resume goes.
    """

    def __init__(self, job_dir: Path, *, enabled: bool = True, log: Callable[[str], object] = print) -> None:
        self.enabled = enabled
        self.log = log
        self.path: Path = Path(job_dir) / "metrics.jsonl"
        self._tb: dict[str, SummaryWriter] = {}
        self._job_dir = Path(job_dir)

    def _writer(self, split: str) -> SummaryWriter:
        if split not in self._tb:
            self._tb[split] = SummaryWriter(str(self._job_dir / "summaries" / split))
        return self._tb[split]

    def truncate_after(self, step: int) -> None:
        """Drop records past `step` (a resumed run rewrites those steps)."""
        if not (self.enabled and self.path.exists()):
            return
        kept, dropped = [], []
        for number, raw in enumerate(self.path.read_bytes().splitlines(), 1):
            record = _parse(raw)
            if record is None:
                if raw.strip():
                    dropped.append(number)  # cut short by a killed run, or damaged: not a record
            elif record.get("step", 0) <= step:
                kept.append(raw.decode("utf-8"))
        if dropped:
            self.log(
                f"warning: dropped {len(dropped)} unreadable line(s) of {self.path} (line "
                f"{', '.join(map(str, dropped[:5]))}{', ...' if len(dropped) > 5 else ''}): not a JSON "
                "object in UTF-8 (cut short by a killed run, or damaged). The steps they held are logged "
                "again where this run trains them."
            )
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(ln + "\n" for ln in kept))
        tmp.replace(self.path)  # atomic: a kill here never loses the earlier records

    def write(self, step: int, split: str, metrics: Mapping[str, float | int]) -> None:
        """Record `metrics` of `split` ("train" or "eval") at `step`."""
        if not self.enabled:
            return
        record = {"step": step, "split": split, **{k: _jsonable(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        tb = self._writer(split)
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                tb.add_scalar(k, v, step)

    def add_text(self, split: str, tag: str, text: str, step: int) -> None:
        if self.enabled:
            self._writer(split).add_text(tag, text, step)

    def flush(self) -> None:
        for tb in self._tb.values():
            tb.flush()

    def close(self) -> None:
        for tb in self._tb.values():
            tb.close()
        self._tb.clear()


def _parse(raw: bytes) -> dict[str, Any] | None:
    """One metrics.jsonl line as a record, or None when it is not a JSON object in UTF-8."""
    try:
        record = json.loads(raw.decode("utf-8"))
    except ValueError:  # UnicodeDecodeError and JSONDecodeError alike
        return None
    return record if isinstance(record, dict) and isinstance(record.get("step", 0), int) else None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file (lines that are not JSON objects are skipped)."""
    return [r for r in map(_parse, Path(path).read_bytes().splitlines()) if r is not None]
