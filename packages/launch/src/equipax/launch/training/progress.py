"""Progress output: a rich progress bar on a terminal, plain periodic lines otherwise (CI logs)."""

import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

__all__ = ["ProgressReporter"]


class ProgressReporter:
    """Show training progress from `start` to `total` steps.

    Arguments:
        console: where to print.
        total: the last step.
        start: the first step of this run (non-zero when resuming).
    """

    def __init__(self, console: Console, *, total: int, start: int) -> None:
        self.console = console
        self.total = total
        self._bar: Progress | None = None
        self._task: Any = None
        if console.is_terminal:
            self._bar = Progress(
                TextColumn("[bold]train[/]"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
                console=console,
                transient=False,
            )
            self._task = self._bar.add_task("train", total=total, completed=start, info="compiling...")
            self._bar.start()
        self._t0 = time.monotonic()

    def update(self, step: int, metrics: dict[str, float]) -> None:
        """Report metrics read back at `step`."""
        rate = (
            f"{metrics['examples_per_s']:,.0f} examples/s"
            if "examples_per_s" in metrics
            else f"{metrics.get('tokens_per_s', 0.0):,.0f} tok/s"
        )
        info = (
            f"loss {metrics.get('loss', float('nan')):.4f}  lr {metrics.get('learning_rate', float('nan')):.2e}  {rate}"
        )
        if self._bar is not None:
            self._bar.update(self._task, completed=step, info=info)
        else:
            elapsed = time.monotonic() - self._t0
            self.console.print(f"step {step}/{self.total}  {info}  ({elapsed:.0f} s)", highlight=False)

    def message(self, text: str) -> None:
        """Print a line above the bar (or plainly)."""
        self.console.print(text, highlight=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
