"""Time to the first step of `launch run`, by phase, and JAX's persistent compilation cache.

The phases: start-up (the interpreter and the imports up to the `launch run` command), config
(resolving the experiment and its knobs, the compiler flags), devices (the training code's imports
and JAX's backend, opening an accelerator: the two at once, the backend started on a background
thread at the end of config, `equipax.launch.cluster.devices.open_devices_early`), with
`model.transformer.remat="auto"` remat auto (the compiles that choose the policy,
`equipax.launch.aot.remat`, and beside them the initialisation's), inputs (opening the data and
the tokenizer), build (the train state's shapes, shardings, its initialisation and the checkpoint
restore, while the train step compiles on a background thread, `ahead.py`, where remat auto has not
compiled it) and the first step (what is left of the train step's compile, and one step).
`launch run` prints them after the first step.

`train.compiler.cache_dir` (docs/compile.md, "The persistent compilation cache") turns on JAX's
persistent compilation cache for the run: by default the machine's (`xla/` in `EQUIPAX_CACHE_DIR`,
at most `MACHINE_CACHE_BYTES`, the least recently used programs evicted), so another job of the same
experiment and shapes, a resume or the same command again loads its compiled programs instead of
compiling them again (c4_1b at 6 layers on the v5e: the train step's compile is most of the time to
the first step, benchmarks/README.md "Start-up"). A cache that cannot be
written or read (a full disk, a file-size limit, a truncated entry) does not stop the run: JAX warns
once per program, with its source line; `compile_cache` turns those warnings into one line per run
(`warning: could not write JAX's compilation cache (...)`), whichever directory the cache is in.
"""

import contextlib
import itertools
import os
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from equipax.launch.store.machine_cache import cache_root
from equipax.launch.store.storage import AnyPath

__all__ = ["MACHINE", "MACHINE_CACHE_BYTES", "compile_cache", "mark", "phases_line", "process_age_s", "reset"]

# `train.compiler.cache_dir`'s value for the machine's cache, and that cache's size limit.
MACHINE = "machine"
MACHINE_CACHE_BYTES = 8 * 2**30

_MARKS: list[tuple[str, float]] = []


def process_age_s() -> float | None:
    """Seconds since this process started (Linux `/proc`; None elsewhere)."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)


def reset() -> None:
    """Forget the marks (a new run in this process starts its own)."""
    _MARKS.clear()


def mark(phase: str) -> None:
    """The phase `phase` ends now (the first mark closes the start-up phase)."""
    if not _MARKS:
        age = process_age_s()
        _MARKS.append(("", time.monotonic() - (age if age is not None else 0.0)))
    _MARKS.append((phase, time.monotonic()))


def phases_line() -> str:
    """`Time to first step N s: start-up A, config B, ...` from the marks so far, then forgets them."""
    if len(_MARKS) < 2:
        return ""
    parts = [f"{name} {t - prev:.1f}" for (_, prev), (name, t) in itertools.pairwise(_MARKS)]
    total = _MARKS[-1][1] - _MARKS[0][1]
    _MARKS.clear()
    return f"Time to first step {total:.1f} s: " + ", ".join(parts) + " (s)."


# How JAX's warnings about its persistent cache begin (jax/_src/compiler.py), by what failed.
_CACHE_ERRORS = {
    "Error writing persistent compilation cache entry": "write",
    "Error reading persistent compilation cache entry": "read",
}


def _once_per_run(previous: Callable[..., object], shown: set[str]) -> Callable[..., object]:
    """`warnings.showwarning` that reports a failing compilation cache in one line per run and
    failure kind (JAX warns once per program, two lines each); other warnings go to `previous`."""

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        text = str(message)
        kind = next((k for prefix, k in _CACHE_ERRORS.items() if text.startswith(prefix)), None)
        if kind is None:
            previous(message, category, filename, lineno, file, line)
            return
        if kind not in shown:
            shown.add(kind)
            reason = text.split("': ", 1)[-1]  # after the program's name: the error's type and text
            print(
                f"warning: could not {kind} JAX's compilation cache ({reason}); the run goes on and "
                "compiles its programs again next time (train.compiler.cache_dir='' turns the cache off).",
                file=file if file is not None else sys.stderr,
            )

    return show


def _can_limit(jax: Any) -> bool:
    """Whether JAX's compilation cache can be size-limited here (the option, and `filelock`)."""
    import importlib.util

    return "jax_compilation_cache_max_size" in jax.config.values and importlib.util.find_spec("filelock") is not None


def _cache_path(cache_dir: str, job_dir: AnyPath) -> AnyPath:
    """Where `train.compiler.cache_dir` puts the cache: "machine" -> the machine's cache (the job's
    `compile_cache/` where that is off, `EQUIPAX_CACHE_DIR=""`); a relative path under the job."""
    if cache_dir == MACHINE:
        root = cache_root()
        return root / "xla" if root is not None else job_dir / "compile_cache"
    local = Path(cache_dir).expanduser()
    return local if local.is_absolute() else job_dir / cache_dir


@contextlib.contextmanager
def compile_cache(cache_dir: str, job_dir: AnyPath, *, reads: bool = True) -> Iterator[AnyPath | None]:
    """JAX's persistent compilation cache in `cache_dir` (relative: under `job_dir`) while inside.

    Yields the directory, or None where the cache is off (`cache_dir` empty) or already chosen
    outside the run (`JAX_COMPILATION_CACHE_DIR`, or `jax_compilation_cache_dir` set in this
    process), which is then left as it is. JAX's settings are restored on leaving. Either way, a
    cache that fails to write or read is reported in one line per run (`_once_per_run`); with
    `reads=False`, failures to read are not (`launch compile --topology`: libtpu's compile-only
    client cannot load a program it finds, it compiles it again).
    """
    import jax

    with warnings.catch_warnings():  # the filters and `warnings.showwarning`, restored on leaving
        warnings.showwarning = _once_per_run(warnings.showwarning, set())
        if not reads:
            reading = next(prefix for prefix, kind in _CACHE_ERRORS.items() if kind == "read")
            warnings.filterwarnings("ignore", message=re.escape(reading))
        if not cache_dir or os.environ.get("JAX_COMPILATION_CACHE_DIR") or jax.config.jax_compilation_cache_dir:
            yield None
            return
        from jax._src import compilation_cache  # its directory is read once; reset it to switch

        path = _cache_path(cache_dir, job_dir)
        # JAX evicts the least recently used programs past the limit. Its eviction needs the
        # `filelock` package, and without it JAX refuses every read and write of a size-limited
        # cache (a TPU image without filelock ran with no cache at all): without it, or with a JAX
        # that has no such option, the cache keeps every program.
        limit = "jax_compilation_cache_max_size" if _can_limit(jax) else None
        before = jax.config.values[limit] if limit else None
        if limit and cache_dir == MACHINE:
            jax.config.update(limit, MACHINE_CACHE_BYTES)
        jax.config.update("jax_compilation_cache_dir", str(path))
        compilation_cache.reset_cache()
        try:
            yield path
        finally:
            jax.config.update("jax_compilation_cache_dir", None)
            if limit:
                jax.config.update(limit, before)
            compilation_cache.reset_cache()
