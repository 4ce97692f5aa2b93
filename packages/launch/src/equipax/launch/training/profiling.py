"""The profiling window as a loop hook, and the list of the run's profiling hooks.

`ProfileHook` traces `train.profile.steps` steps with `jax.profiler` into `<job>/profile/`, one
step annotation per step, where TensorBoard's profile plugin and xprof look for it
(`plugins/profile/<run>/<host>.xplane.pb`). PGLE's hook is in `pgle.py`.
"""

from collections.abc import Mapping
from typing import Any

import jax

from equipax.launch.configs.train import ProfileConfig
from equipax.launch.store.storage import AnyPath
from equipax.launch.training.hooks import Hook, RunContext, StepContext
from equipax.launch.training.pgle import PGLEHook

__all__ = ["latest_trace", "PROFILE_DIR", "profile_log_dir", "profile_window", "ProfileHook", "profiling_hooks"]

PROFILE_DIR = "profile"


def profiling_hooks(run: RunContext) -> list[Hook]:
    """The hooks of `train.pgle.mode` (always: it records the XLA flags) and the profile window."""
    hooks: list[Hook] = [PGLEHook()]
    window = profile_window(run.cfg.train.profile, start=run.start, total=run.total)
    if window is not None and (run.primary or run.cfg.train.profile.all_processes):
        hooks.append(ProfileHook(*window, log_dir=profile_log_dir(run.job_dir)))
    elif run.cfg.train.profile.steps and window is None:
        run.log(
            f"note: the profile window (train.profile.start_step="
            f"{run.cfg.train.profile.start_step}, {run.cfg.train.profile.steps} steps) lies "
            f"outside steps {run.start + 1}..{run.total} of this run; nothing is profiled."
        )
    return hooks


def profile_window(profile: ProfileConfig, *, start: int, total: int) -> tuple[int, int] | None:
    """The first and last step to trace in a run of steps `start+1..total`, or None."""
    if profile.steps == 0:
        return None
    first = profile.start_step if profile.start_step is not None else start + 2
    last = min(first + profile.steps - 1, total)
    return (first, last) if first > start and first <= last else None


def profile_log_dir(job_dir: AnyPath) -> AnyPath:
    """Where this process writes its trace: `<job>/profile` (process 0) or a subfolder."""
    index = jax.process_index()
    return job_dir / PROFILE_DIR if index == 0 else job_dir / PROFILE_DIR / f"process_{index}"


def latest_trace(log_dir: AnyPath) -> AnyPath | None:
    """The newest `plugins/profile/<run>` folder under `log_dir`, or None."""
    runs = sorted(p for p in (log_dir / "plugins" / "profile").glob("*") if p.is_dir())
    return runs[-1] if runs else None


class ProfileHook(Hook):
    """Traces steps `first..last` with `jax.profiler`, a `train` step annotation per step."""

    name: str = "profile"
    first: bool = True  # its step annotations bracket the dispatch alone

    def __init__(self, first: int, last: int, *, log_dir: AnyPath) -> None:
        self.first_step: int = first
        self.last_step: int = last
        self.log_dir: AnyPath = log_dir
        self.tracing = False
        self.annotation: Any = None
        self.trace_dir: AnyPath | None = None

    def before_step(self, run: RunContext, step: int) -> None:
        if step == self.first_step:
            if step == run.start + 1:
                run.log(f"note: the profile starts at step {step}, the run's first: it holds the compilation.")
            self.log_dir.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.log_dir), create_perfetto_trace=True)
            self.tracing = True
        if self.tracing:
            self.annotation = jax.profiler.StepTraceAnnotation("train", step_num=step)
            self.annotation.__enter__()

    def after_step(self, ctx: StepContext) -> None:
        if self.annotation is not None:
            self.annotation.__exit__(None, None, None)
            self.annotation = None
        if self.tracing and (ctx.step == self.last_step or ctx.stopping):
            jax.block_until_ready(ctx.metrics)  # the device work of the window belongs in it
            self.stop(ctx.run, ctx.step)

    def stop(self, run: RunContext, step: int) -> None:
        jax.profiler.stop_trace()
        self.tracing: bool = False
        self.trace_dir = latest_trace(self.log_dir)
        run.log(
            f"Profiled steps {self.first_step}-{step} -> {self.trace_dir}. Open it with `xprof --logdir "
            f"{self.log_dir}` (pip install xprof) or `tensorboard --logdir {self.log_dir}` with "
            "tensorboard-plugin-profile, or load its perfetto_trace.json.gz in https://ui.perfetto.dev."
        )

    def close(self, run: RunContext) -> None:
        if self.annotation is not None:
            self.annotation.__exit__(None, None, None)
            self.annotation = None
        if self.tracing:  # stopped inside the window
            self.stop(run, self.last_step)

    def result(self, run: RunContext, outputs: Mapping[str, Any]) -> dict[str, Any]:
        return {"profile_dir": str(self.trace_dir)} if self.trace_dir is not None else {}
