"""`launch ...` with every log line stamped: milliseconds since the process started and the thread.

With `JAX_LOG_COMPILES=1` JAX logs when each program starts compiling ("Compiling jit(train_step)
..."), when its tracing and compile end, and which thread did it (the main thread, `remat="auto"`'s
pool `equipax-remat_N` and its `equipax-remat-beside`, the run's `equipax-compile-ahead`). Stamped,
those lines are the start-up's timeline: what waits for what, and what compiles beside what.

    JAX_LOG_COMPILES=1 uv run python benchmarks/launch_timeline.py run --exp shakespeare_tiny --set train.num_steps=3

`--checkpoints` first (before the command) also logs how long each of the checkpointer's calls took,
stamped the same way: `restore_latest` (until the restored arrays are on the devices), `save` (what
blocks the run: the copy to the host, and the earlier save's write, whose `wait` is logged first
on its own), `wait` and `close` (the writes waited for). How a resume's
restore and a save were timed under each libtpu host buffer (benchmarks/README.md, "twelfth session";
the checkpointer's imports, orbax's among them, then come before the command, in its start-up phase):

    uv run python benchmarks/launch_timeline.py --checkpoints run --exp shakespeare_tiny --set train.num_steps=3

The arguments are `launch`'s own; the exit status is its own. (The CLI's own lines, such as the
phases of "Time to first step", print unstamped.)
"""

import functools
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

CHECKPOINTER_CALLS = ("restore_latest", "save", "wait", "close")
log = logging.getLogger("equipax.benchmarks.launch_timeline")


def _timed(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(call)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = call(*args, **kwargs)
        if name == "restore_latest":
            import jax

            jax.block_until_ready(out)  # on the devices, not only dispatched
        log.warning("Checkpointer.%s: %.3f s", name, time.perf_counter() - start)
        return out

    setattr(timed, "equipax_timed", True)  # noqa: B010  (a marker: wrapped once)
    return timed


def time_checkpointer() -> None:
    """Log the duration of every call of the checkpointer's `CHECKPOINTER_CALLS` (once)."""
    from equipax.launch.jobdir.checkpoints import Checkpointer

    for name in CHECKPOINTER_CALLS:
        call = getattr(Checkpointer, name)
        if not getattr(call, "equipax_timed", False):
            setattr(Checkpointer, name, _timed(name, call))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    logging.basicConfig(format="%(relativeCreated)8.0f [%(threadName)s] %(message)s")
    if args[:1] == ["--checkpoints"]:
        args = args[1:]
        time_checkpointer()
    from equipax.launch.cli import main as launch

    sys.argv = ["launch", *args]
    launch()  # exits with launch's status (typer's SystemExit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
