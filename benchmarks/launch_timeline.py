"""`launch ...` with every log line stamped: milliseconds since the process started and the thread.

With `JAX_LOG_COMPILES=1` JAX logs when each program starts compiling ("Compiling jit(train_step)
..."), when its tracing and compile end, and which thread did it (the main thread, `remat="auto"`'s
pool `equipax-remat_N` and its `equipax-remat-beside`, the run's `equipax-compile-ahead`). Stamped,
those lines are the start-up's timeline: what waits for what, and what compiles beside what.

    JAX_LOG_COMPILES=1 uv run python benchmarks/launch_timeline.py run --exp shakespeare_tiny --set train.num_steps=3

The arguments are `launch`'s own; the exit status is its own. (The CLI's own lines, such as the
phases of "Time to first step", print unstamped.)
"""

import logging
import sys


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(format="%(relativeCreated)8.0f [%(threadName)s] %(message)s")
    from equipax.launch.cli import main as launch

    sys.argv = ["launch", *(sys.argv[1:] if argv is None else argv)]
    launch()  # exits with launch's status (typer's SystemExit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
