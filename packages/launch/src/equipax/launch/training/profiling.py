"""The profiling window and PGLE (XLA's profile-guided latency estimator), as loop hooks.

`ProfileHook` traces `train.profile_steps` steps with `jax.profiler` into `<job>/profile/`, one
step annotation per step, where TensorBoard's profile plugin and xprof look for it
(`plugins/profile/<run>/<host>.xplane.pb`). `PGLEHook` records the XLA flags and the PGLE mode
of the run in `<job>/xla_flags.json`, turns on JAX's automatic PGLE for the train step
(`train.pgle=auto`) and says when the step was recompiled with the collected profile.

XLA reads `XLA_FLAGS` once, when JAX starts its backend, so `launch run` calls `set_xla_flags`
before the first device is used. PGLE only changes XLA:GPU's latency-hiding scheduler: on other
platforms the hook says so in one line and leaves JAX's PGLE off.
"""

import dataclasses
import json
import os
import shlex
import struct
from collections.abc import MutableMapping
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax

from equipax.launch.configs.experiment import TrainConfig
from equipax.launch.jobdir.ownership import write_text_atomic
from equipax.launch.training.hooks import Hook, RunContext, StepContext

__all__ = [
    "COLLECT_XLA_FLAGS",
    "device_platform",
    "latest_trace",
    "PGLE_AUTO_AOT",
    "pgle_settings",
    "PGLEHook",
    "PGLESettings",
    "PROFILE_DIR",
    "profile_log_dir",
    "PROFILE_PATH_FLAG",
    "profiled_instructions",
    "profile_window",
    "ProfileHook",
    "profiling_hooks",
    "SCHEDULER_FLAG",
    "set_xla_flags",
    "XLA_FLAGS_FILE",
]

PROFILE_DIR = "profile"
XLA_FLAGS_FILE = "xla_flags.json"
SCHEDULER_FLAG = "--xla_gpu_enable_latency_hiding_scheduler=true"
PROFILE_PATH_FLAG = "--xla_gpu_pgle_profile_file_or_directory_path"
# `launch pgle collect` compiles the program the manual run will compile, except that XLA:GPU's
# command buffers (CUDA graphs) are off: with them on, the profiler sees one `command_buffer_N`
# launch per graph instead of its instructions, and the profile matches none of the run's
# instructions (measured on an H200: 5 entries, all command buffers; XLA then logs "Found 0
# instructions from the profile"). JAX's automatic PGLE turns them off for its profiled runs too.
COLLECT_XLA_FLAGS = (SCHEDULER_FLAG, "--xla_gpu_enable_command_buffer=")
PGLE_AUTO_AOT = (
    "train.pgle='auto' cannot be compiled ahead of time: JAX's automatic PGLE profiles the first "
    "train.pgle_profiling_runs runs of the jitted step and then recompiles it, which a precompiled "
    "(AOT) step never does (the Pax README says the same). Compile with --set train.pgle=off, or use "
    "the manual workflow: `launch pgle collect --exp NAME` on a GPU host, then --set train.pgle=manual "
    "--set train.pgle_profile_path=PATH (docs/pgle.md)."
)


@dataclasses.dataclass(frozen=True)
class PGLESettings:
    """What a PGLE mode changes: XLA flags (read at backend start) and JAX config values."""

    xla_flags: tuple[str, ...] = ()
    jax_config: dict[str, Any] = dataclasses.field(default_factory=dict)


def pgle_settings(train: TrainConfig) -> PGLESettings:
    """The XLA flags and JAX config values of `train.pgle` (exactly those the Pax README names)."""
    if train.pgle == "auto":
        return PGLESettings((SCHEDULER_FLAG,), {"jax_enable_pgle": True,
                                                "jax_pgle_profiling_runs": train.pgle_profiling_runs,
                                                "jax_pgle_aggregation_percentile": train.pgle_aggregation_percentile})
    if train.pgle == "manual":
        path = os.path.abspath(os.path.expanduser(train.pgle_profile_path))
        return PGLESettings((SCHEDULER_FLAG, f"{PROFILE_PATH_FLAG}={path}"))
    return PGLESettings()


def profiled_instructions(proto: bytes) -> dict[str, float]:
    """The instruction costs (microseconds) of a `profile.pb`, by instruction name.

    The file is XLA's `ProfiledInstructionsProto`: field 1 repeats `InstructionCost {string name =
    1; double cost_us = 2;}`; other fields (latencies between instructions) are skipped. Decoded
    here rather than through the proto classes, which jaxlib does not expose.
    """

    def fields(buf: bytes):
        i = 0
        while i < len(buf):
            key, i = _varint(buf, i)
            number, wire = key >> 3, key & 7
            if wire == 0:
                value, i = _varint(buf, i)
                yield number, value
            elif wire == 1:
                yield number, buf[i:i + 8]
                i += 8
            elif wire == 2:
                size, i = _varint(buf, i)
                yield number, buf[i:i + size]
                i += size
            elif wire == 5:
                yield number, buf[i:i + 4]
                i += 4
            else:
                raise ValueError(f"not a profile.pb: wire type {wire} at byte {i}")

    costs: dict[str, float] = {}
    for number, value in fields(proto):
        if number == 1 and isinstance(value, bytes):
            entry = dict(fields(value))
            name, cost = entry.get(1, b""), entry.get(2, bytes(8))
            if isinstance(name, bytes) and isinstance(cost, bytes) and len(cost) == 8:
                costs[name.decode()] = struct.unpack("<d", cost)[0]
    return costs


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(buf):
            raise ValueError("not a profile.pb: truncated varint")
        byte = buf[i]
        value |= (byte & 0x7F) << shift
        i += 1
        if not byte & 0x80:
            return value, i
        shift += 7


def set_xla_flags(train: TrainConfig, environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Add the PGLE mode's flags to `XLA_FLAGS` (a flag already there is replaced); call before
    JAX starts its backend. Returns the flags added."""
    env = os.environ if environ is None else environ
    flags = list(pgle_settings(train).xla_flags)
    if not flags:
        return []
    names = {f.split("=", 1)[0] for f in flags}
    kept = [f for f in shlex.split(env.get("XLA_FLAGS", "")) if f.split("=", 1)[0] not in names]
    env["XLA_FLAGS"] = " ".join(kept + flags)
    return flags


def profiling_hooks(run: RunContext) -> list[Hook]:
    """The hooks of `train.pgle` (always: it records the XLA flags) and the profile window."""
    hooks: list[Hook] = [PGLEHook()]
    window = profile_window(run.cfg.train, start=run.start, total=run.total)
    if window is not None and (run.primary or run.cfg.train.profile_all_processes):
        hooks.append(ProfileHook(*window, log_dir=profile_log_dir(run.job_dir)))
    elif run.cfg.train.profile_steps and window is None:
        run.log(f"note: the profile window (train.profile_start_step="
                             f"{run.cfg.train.profile_start_step}, {run.cfg.train.profile_steps} steps) lies "
                             f"outside steps {run.start + 1}..{run.total} of this run; nothing is profiled.")
    return hooks


def device_platform() -> str:
    """This process's device platform: cpu, gpu or tpu."""
    return jax.devices()[0].platform


def profile_window(train: TrainConfig, *, start: int, total: int) -> tuple[int, int] | None:
    """The first and last step to trace in a run of steps `start+1..total`, or None."""
    if train.profile_steps == 0:
        return None
    first = train.profile_start_step if train.profile_start_step is not None else start + 2
    last = min(first + train.profile_steps - 1, total)
    return (first, last) if first > start and first <= last else None


def profile_log_dir(job_dir: Path) -> Path:
    """Where this process writes its trace: `<job>/profile` (process 0) or a subfolder."""
    index = jax.process_index()
    return job_dir / PROFILE_DIR if index == 0 else job_dir / PROFILE_DIR / f"process_{index}"


def latest_trace(log_dir: Path) -> Path | None:
    """The newest `plugins/profile/<run>` folder under `log_dir`, or None."""
    runs = sorted(p for p in (log_dir / "plugins" / "profile").glob("*") if p.is_dir())
    return runs[-1] if runs else None


class ProfileHook(Hook):
    """Traces steps `first..last` with `jax.profiler`, a `train` step annotation per step."""

    name = "profile"
    first = True  # its step annotations bracket the dispatch alone

    def __init__(self, first: int, last: int, *, log_dir: Path) -> None:
        self.first_step: int = first
        self.last_step: int = last
        self.log_dir: Path = log_dir
        self.tracing = False
        self.annotation: Any = None
        self.trace_dir: Path | None = None

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
        run.log(f"Profiled steps {self.first_step}-{step} -> {self.trace_dir}. Open it with `xprof --logdir "
                f"{self.log_dir}` (pip install xprof) or `tensorboard --logdir {self.log_dir}` with "
                "tensorboard-plugin-profile, or load its perfetto_trace.json.gz in https://ui.perfetto.dev.")

    def close(self, run: RunContext) -> None:
        if self.annotation is not None:
            self.annotation.__exit__(None, None, None)
            self.annotation = None
        if self.tracing:  # stopped inside the window
            self.stop(run, self.last_step)

    def result(self, run: RunContext, outputs: Mapping[str, Any]) -> dict[str, Any]:
        return {"profile_dir": str(self.trace_dir)} if self.trace_dir is not None else {}


class PGLEHook(Hook):
    """Records the run's XLA flags; with `train.pgle=auto` on GPU, JAX's automatic PGLE is on for
    the run and the recompile with the collected profile is reported."""

    name = "pgle"
    first = True

    def __init__(self) -> None:
        self.active = False
        self.saved: dict[str, Any] = {}
        self.first_step = 1

    def start(self, run: RunContext) -> None:
        train = run.cfg.train
        settings = pgle_settings(train)
        platform = device_platform()
        self.active = train.pgle == "auto" and platform == "gpu"
        in_effect = train.pgle != "off" and platform == "gpu"
        self.saved = {k: jax.config.values[k] for k in settings.jax_config} if in_effect else {}
        for k, v in settings.jax_config.items() if in_effect else ():
            jax.config.update(k, v)
        if train.pgle != "off" and not in_effect:
            run.log(f"note: train.pgle={train.pgle!r} has no effect on {platform}: PGLE feeds XLA:GPU's "
                    f"latency-hiding scheduler; the flags are recorded in {run.job_dir / XLA_FLAGS_FILE} and "
                    "ignored here.")
        if run.primary:
            record = {"XLA_FLAGS": shlex.split(os.environ.get("XLA_FLAGS", "")), "pgle": train.pgle,
                      "pgle_xla_flags": list(settings.xla_flags), "jax_config": settings.jax_config,
                      "platform": platform, "pgle_in_effect": in_effect}
            write_text_atomic(run.job_dir / XLA_FLAGS_FILE, json.dumps(record, indent=2) + "\n")
        self.first_step = run.start + 1

    def after_step(self, ctx: StepContext) -> None:
        if self.active and ctx.compile_seconds and ctx.step > self.first_step:
            ctx.run.log(f"step {ctx.step}: the train step was recompiled with its PGLE profile "
                        f"({ctx.compile_seconds:.1f} s) after {ctx.run.cfg.train.pgle_profiling_runs} profiled runs.")

    def close(self, run: RunContext) -> None:
        for k, v in self.saved.items():
            jax.config.update(k, v)
        self.saved = {}
