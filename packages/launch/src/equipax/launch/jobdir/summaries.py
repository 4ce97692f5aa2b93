"""Run metrics: one JSON object per logged step in metrics.jsonl, and TensorBoard scalars.

Only process 0 writes (multi-host runs call this with `enabled=False` elsewhere).
"""

import contextlib
import json
import math
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from tensorboardX import SummaryWriter

from equipax.launch.store.storage import AnyPath, append_line, is_remote, job_path, upload, write_atomic

__all__ = ["MetricsWriter", "read_metrics"]


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class MetricsWriter:
    """Append metrics to `<job>/metrics.jsonl` and `<job>/summaries/{train,eval}`.

    A full disk (or any failed write) raises the OSError from `write`, `flush` or `close` once, with
    nothing half-written: a line that did not fit is cut back, and TensorBoard's writer thread and
    exit hook print no tracebacks of their own after it.

    Arguments:
        job_dir: the job's directory.
        enabled: False on processes other than 0 (writes nothing).
        log: where a warning about unreadable lines dropped on resume goes.
        path: the JSON-lines file (default `<job>/metrics.jsonl`).
        summaries: the TensorBoard directory whose subdirectories are the splits (default
            `<job>/summaries`).
    """

    def __init__(
        self,
        job_dir: AnyPath,
        *,
        enabled: bool = True,
        log: Callable[[str], object] = print,
        path: AnyPath | None = None,
        summaries: AnyPath | None = None,
    ) -> None:
        self.enabled = enabled
        self.log = log
        self.path: AnyPath = job_path(path) if path is not None else job_path(job_dir) / "metrics.jsonl"
        self._tb: dict[str, SummaryWriter] = {}
        self._summaries = job_path(summaries) if summaries is not None else job_path(job_dir) / "summaries"
        # TensorBoard's writer writes local files: for a store, here, uploaded on every flush.
        self._staging: Path | None = None
        _quiet_writer_threads()

    def _writer(self, split: str) -> SummaryWriter:
        if split not in self._tb:
            if is_remote(self._summaries) and self._staging is None:
                import tempfile

                self._staging = Path(tempfile.mkdtemp(prefix="equipax-summaries-"))
            where = self._staging if self._staging is not None else self._summaries
            self._tb[split] = SummaryWriter(str(where / split))
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
        write_atomic(self.path, "".join(ln + "\n" for ln in kept))  # a kill here never loses the earlier records

    def write(self, step: int, split: str, metrics: Mapping[str, float | int], *, flush: bool = False) -> None:
        """Record `metrics` of `split` ("train" or "eval") at `step`: the TensorBoard scalars, then
        (with `flush`: once they are on disk) the metrics.jsonl line, so the line says the step is
        recorded.

        Raises:
            OSError: the scalars or the line could not be written (metrics.jsonl is as it was before).
        """
        if not self.enabled:
            return
        tb = self._writer(split)
        with self._guard(tb):
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    tb.add_scalar(k, v, step)
            if flush:
                tb.flush()
        if flush:
            self._upload()
        record = {"step": step, "split": split, **{k: _jsonable(v) for k, v in metrics.items()}}
        append_line(self.path, (json.dumps(record) + "\n").encode())

    def abandon(self) -> None:
        """After a failed write: stop every TensorBoard writer without writing to it again."""
        for tb in self._tb.values():
            _retire(tb)
        self._tb.clear()

    def add_text(self, split: str, tag: str, text: str, step: int) -> None:
        if self.enabled:
            tb = self._writer(split)
            with self._guard(tb):
                tb.add_text(tag, text, step)

    def flush(self) -> None:
        for tb in list(self._tb.values()):
            with self._guard(tb):
                tb.flush()
        self._upload()

    def _upload(self) -> None:
        """A store's summaries: the staged event files copied to `<job>/summaries` (whole objects)."""
        if self._staging is not None:
            upload(self._staging, self._summaries)

    def close(self) -> None:
        """Close every TensorBoard writer; the first failure is raised after all are closed."""
        failure: OSError | None = None
        for tb in list(self._tb.values()):
            try:
                with self._guard(tb):
                    tb.close()
            except OSError as e:
                failure = failure or e
        self._tb.clear()
        self._upload()
        if self._staging is not None:
            import shutil

            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None
        if failure is not None:
            raise failure

    @contextlib.contextmanager
    def _guard(self, tb: SummaryWriter) -> Iterator[None]:
        """On a failed write, retire `tb`: its thread stopped, and its exit hook (which would flush
        into the same full disk and print a traceback at exit) disarmed."""
        try:
            yield
        except OSError:
            for split, writer in list(self._tb.items()):
                if writer is tb:
                    del self._tb[split]
            _retire(tb)
            raise


def _retire(tb: SummaryWriter) -> None:
    """Stop a TensorBoard writer whose file cannot be written, without writing to it again."""
    events = getattr(getattr(tb, "file_writer", None), "event_writer", None)
    if events is None or getattr(events, "_closed", True):
        return
    worker = getattr(events, "_worker", None)
    with contextlib.suppress(Exception):
        if worker is not None and worker.is_alive():
            worker.stop()
    with contextlib.suppress(Exception):
        events._ev_writer.close()
    events._closed = True  # its atexit hook closes only what is not closed


def _quiet_writer_threads() -> None:
    """`threading.excepthook` without the traceback of TensorBoard's writer thread dying on a full
    disk: the same failure reaches the command through `flush`/`close`, said once."""
    if getattr(threading.excepthook, "quiets_tensorboard", False):
        return
    previous = threading.excepthook

    def hook(args: Any) -> None:
        if isinstance(args.exc_value, OSError) and type(args.thread).__name__ == "_EventLoggerThread":
            return
        previous(args)

    hook.quiets_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def _parse(raw: bytes) -> dict[str, Any] | None:
    """One metrics.jsonl line as a record, or None when it is not a JSON object in UTF-8."""
    try:
        record = json.loads(raw.decode("utf-8"))
    except ValueError:  # UnicodeDecodeError and JSONDecodeError alike
        return None
    return record if isinstance(record, dict) and isinstance(record.get("step", 0), int) else None


def read_metrics(path: AnyPath) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file (lines that are not JSON objects are skipped)."""
    return [r for r in map(_parse, job_path(path).read_bytes().splitlines()) if r is not None]
