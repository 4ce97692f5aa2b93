"""PGLE (XLA's profile-guided latency estimator, XLA:GPU), as a loop hook and the settings behind it.

`PGLEHook` records the XLA flags and the PGLE mode of the run in `<job>/xla_flags.json`, turns on
JAX's automatic PGLE for the train step (`train.pgle.mode=auto`) and says when the step was recompiled
with the collected profile. `launch pgle collect` (manual PGLE) turns a trace into the profile.pb
XLA reads; `profiled_instructions` decodes one.

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
from typing import Any

import jax

from equipax.core.knobs import ConfigError
from equipax.launch.configs.train import PGLEConfig
from equipax.launch.jobdir.ownership import write_text_atomic
from equipax.launch.training.hooks import Hook, RunContext, StepContext

__all__ = [
    "check_profile",
    "COLLECT_XLA_FLAGS",
    "device_platform",
    "PGLE_AUTO_AOT",
    "pgle_settings",
    "PGLEHook",
    "PGLESettings",
    "PROFILE_PATH_FLAG",
    "profiled_instructions",
    "SCHEDULER_FLAG",
    "set_xla_flags",
    "XLA_FLAGS_FILE",
]


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
    "train.pgle.mode='auto' cannot be compiled ahead of time: JAX's automatic PGLE profiles the first "
    "train.pgle.profiling_runs runs of the jitted step and then recompiles it, which a precompiled "
    "(AOT) step never does (the Pax README says the same). Compile with --set train.pgle.mode=off, or use "
    "the manual workflow: `launch pgle collect --exp NAME` on a GPU host, then --set train.pgle.mode=manual "
    "--set train.pgle.profile_path=PATH (docs/pgle.md)."
)


@dataclasses.dataclass(frozen=True)
class PGLESettings:
    """What a PGLE mode changes: XLA flags (read at backend start) and JAX config values."""

    xla_flags: tuple[str, ...] = ()
    jax_config: dict[str, Any] = dataclasses.field(default_factory=dict)


def pgle_settings(pgle: PGLEConfig) -> PGLESettings:
    """The XLA flags and JAX config values of a PGLE mode (`train.pgle`: exactly those the Pax
    README names)."""
    if pgle.mode == "auto":
        return PGLESettings(
            (SCHEDULER_FLAG,),
            {
                "jax_enable_pgle": True,
                "jax_pgle_profiling_runs": pgle.profiling_runs,
                "jax_pgle_aggregation_percentile": pgle.aggregation_percentile,
            },
        )
    if pgle.mode == "manual":
        path = os.path.abspath(os.path.expanduser(pgle.profile_path))
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
                yield number, buf[i : i + 8]
                i += 8
            elif wire == 2:
                size, i = _varint(buf, i)
                yield number, buf[i : i + size]
                i += size
            elif wire == 5:
                yield number, buf[i : i + 4]
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


def check_profile(pgle: PGLEConfig) -> None:
    """ConfigError when `train.pgle.mode='manual'` names a profile that is not there: XLA reads it
    at the first compile and carries on without one, so the run would not be the one asked for."""
    if pgle.mode == "manual" and not os.path.exists(os.path.expanduser(pgle.profile_path)):
        raise ConfigError(
            f"train.pgle.profile_path={pgle.profile_path!r} does not exist; point it at the profile.pb "
            f"that `launch pgle collect` wrote (<job>/profile.pb), or set train.pgle.mode=off."
        )


def set_xla_flags(pgle: PGLEConfig, environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Add the PGLE mode's flags to `XLA_FLAGS` (a flag already there is replaced); call before
    JAX starts its backend. Returns the flags added."""
    env = os.environ if environ is None else environ
    flags = list(pgle_settings(pgle).xla_flags)
    if not flags:
        return []
    names = {f.split("=", 1)[0] for f in flags}
    kept = [f for f in shlex.split(env.get("XLA_FLAGS", "")) if f.split("=", 1)[0] not in names]
    env["XLA_FLAGS"] = " ".join(kept + flags)
    return flags


def device_platform() -> str:
    """This process's device platform: cpu, gpu or tpu."""
    return jax.devices()[0].platform


class PGLEHook(Hook):
    """Records the run's XLA flags; with `train.pgle.mode=auto` on GPU, JAX's automatic PGLE is on for
    the run and the recompile with the collected profile is reported."""

    name: str = "pgle"
    first: bool = True

    def __init__(self) -> None:
        self.active: bool = False
        self.saved: dict[str, Any] = {}
        self.first_step: int = 1

    def start(self, run: RunContext) -> None:
        pgle = run.cfg.train.pgle
        settings = pgle_settings(pgle)
        platform = device_platform()
        self.active = pgle.mode == "auto" and platform == "gpu"
        in_effect = pgle.mode != "off" and platform == "gpu"
        self.saved = {k: jax.config.values[k] for k in settings.jax_config} if in_effect else {}
        for k, v in settings.jax_config.items() if in_effect else ():
            jax.config.update(k, v)
        if pgle.mode != "off" and not in_effect:
            run.log(
                f"note: train.pgle.mode={pgle.mode!r} has no effect on {platform}: PGLE feeds XLA:GPU's "
                f"latency-hiding scheduler; the flags are recorded in {run.job_dir / XLA_FLAGS_FILE} and "
                "ignored here."
            )
        if run.primary:
            record = {
                "XLA_FLAGS": shlex.split(os.environ.get("XLA_FLAGS", "")),
                "pgle": pgle.mode,
                "pgle_xla_flags": list(settings.xla_flags),
                "jax_config": settings.jax_config,
                "platform": platform,
                "pgle_in_effect": in_effect,
            }
            write_text_atomic(run.job_dir / XLA_FLAGS_FILE, json.dumps(record, indent=2) + "\n")
        self.first_step = run.start + 1

    def after_step(self, ctx: StepContext) -> None:
        if self.active and ctx.compile_seconds and ctx.step > self.first_step:
            ctx.run.log(
                f"step {ctx.step}: the train step was recompiled with its PGLE profile "
                f"({ctx.compile_seconds:.1f} s) after {ctx.run.cfg.train.pgle.profiling_runs} profiled runs."
            )

    def close(self, run: RunContext) -> None:
        for k, v in self.saved.items():
            jax.config.update(k, v)
        self.saved = {}
