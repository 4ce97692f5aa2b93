"""One train step lowered and compiled ahead of time, with its per-device memory (`launch compile`
and `model.transformer.remat="auto"`, which compiles one per candidate policy)."""

import dataclasses
import math
import time
from typing import Any

import jax
import jax.numpy as jnp

from equipax.launch.aot.memory import memory_figures, out_of_memory_figures
from equipax.launch.program.training import Training

__all__ = ["compile_step", "CompiledStep", "per_device_bytes"]


def per_device_bytes(abstract: Any) -> int:
    """Bytes one device holds of `abstract` (`ShapeDtypeStruct`s, each its sharding's shard)."""
    total = 0
    for leaf in jax.tree.leaves(abstract):
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            continue
        shard = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shard) * jnp.dtype(leaf.dtype).itemsize
    return total


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    """A train step lowered and compiled ahead of time, with its per-device memory.

    `compiled` is None when the compiler refused the program for lack of device memory (XLA:TPU
    does so within seconds); `memory` then holds the figures of its refusal.
    """

    training: Training
    lowered: Any
    compiled: Any
    memory: dict[str, Any]
    lower_s: float
    compile_s: float
    compile_cpu_s: float


def compile_step(training: Training, lowered: Any = None, lower_s: float = 0.0) -> CompiledStep:
    """Lower and compile `training`'s train step on its abstract state (nothing is allocated).

    `lowered` (with the seconds it took, `lower_s`): the step already lowered, to compile here (in
    any thread: XLA's compile releases the GIL, tracing and lowering do not).
    """
    if lowered is None:
        t0 = time.monotonic()
        lowered = training.lower()
        lower_s = time.monotonic() - t0
    t0, cpu0 = time.monotonic(), time.process_time()
    try:
        compiled = lowered.compile()
        memory = memory_figures(compiled.memory_analysis())
    except jax.errors.JaxRuntimeError as e:
        # XLA:TPU refuses a program whose buffers exceed the chip's HBM: that is the answer.
        state = training.abstract_state
        memory = out_of_memory_figures(str(e), per_device_bytes(state), per_device_bytes(training.abstract_batch()))
        if memory is None:
            raise
        compiled = None
    return CompiledStep(training, lowered, compiled, memory, lower_s, time.monotonic() - t0, time.process_time() - cpu0)
