"""Timing the real train step of an experiment on random tokens, shared by the benchmarks that
compare step times across meshes (`moe_dispatch.py`, `pipeline_bubble.py`, `context_memory.py`,
`ring_one_chip.py`).

`step_timer(cfg)` builds, compiles on the first step and times. `PreparedStep` splits the same
into stages for one accelerator chip: lower every configuration first (tracing, in this thread),
compile them all at once in threads (`compile_all`: XLA compiles without holding Python's lock,
and a 1B-class train step takes XLA:TPU about a minute of one core), then run each in turn,
allocating its state only when it starts and freeing it when done (`PreparedStep.start`,
`Runner.close`), so one chip's memory holds one state at a time.
"""

import concurrent.futures
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from equipax.core.mesh import build_mesh
from equipax.launch.program.training import build_training

__all__ = ["PreparedStep", "Runner", "compile_all", "quartiles", "step_timer"]


class Runner:
    """`run(n)`: time n more train steps (each to `block_until_ready`; the state carries over
    between calls). `metrics` holds the last step's metrics as floats; `close()` frees the state."""

    def __init__(self, step: Callable[..., Any], state: Any, batch: dict[str, Any], key: Any) -> None:
        self._step, self._state, self._batch, self._key = step, state, batch, key
        self._metrics: dict[str, Any] = {}

    def __call__(self, n: int) -> list[float]:
        times = []
        for _ in range(n):
            start = time.perf_counter()
            self._state, self._metrics = self._step(self._state, self._batch, self._key)
            jax.block_until_ready((self._state, self._metrics))
            times.append(time.perf_counter() - start)
        return times

    @property
    def metrics(self) -> dict[str, float]:
        """The last step's scalar metrics."""
        return {k: float(v) for k, v in self._metrics.items() if np.ndim(v) == 0}

    def close(self) -> None:
        """Free the state and the batch on the devices (the runner cannot run again)."""
        for leaf in jax.tree.leaves((self._state, self._batch)):
            if isinstance(leaf, jax.Array):
                leaf.delete()
        self._state = self._batch = None


class PreparedStep:
    """A configuration's train step, built (`build_training` on its mesh, over `devices`: default
    all of JAX's) and lowered on abstract arguments: nothing is allocated until `start`."""

    def __init__(self, cfg: Any, devices: Sequence[Any] | None = None) -> None:
        self.cfg = cfg
        self.training = build_training(cfg, build_mesh(cfg.mesh, devices))
        t0 = time.perf_counter()
        self.lowered = self.training.lower()
        self.lower_s = time.perf_counter() - t0
        self.compiled: Any = None
        self.compile_s: float | None = None

    def compile(self) -> "PreparedStep":
        """XLA's compile of the lowered step (in any thread)."""
        t0 = time.perf_counter()
        self.compiled = self.lowered.compile()
        self.compile_s = time.perf_counter() - t0
        return self

    def memory(self) -> dict[str, int] | None:
        """XLA's per-device bytes of the compiled step (arguments, outputs, temporaries), if given."""
        mem = None if self.compiled is None else self.compiled.memory_analysis()
        if mem is None:
            return None
        return {
            "argument_bytes": int(mem.argument_size_in_bytes),
            "output_bytes": int(mem.output_size_in_bytes),
            "alias_bytes": int(mem.alias_size_in_bytes),
            "temp_bytes": int(mem.temp_size_in_bytes),
        }

    def start(self) -> Runner:
        """The initial state and one fixed batch of random token ids (unit weights) on the devices,
        and a `Runner` of the compiled step (the jitted one, compiling on its first call, if
        `compile` was not called)."""
        training = self.training
        step = training.train_step if self.compiled is None else _state_step(self.compiled)
        return Runner(step, training.init_state(), _random_batch(training, self.cfg), training.keys.step)


def _state_step(compiled: Any) -> Callable[..., Any]:
    """`step(state, batch, key)` of a compiled `TrainStep.lower(...)`: the program takes and gives
    the state's array leaves (`equipax.core.step.TrainStep`), the state donated."""

    def step(state: Any, batch: Any, key: Any) -> Any:
        leaves, treedef = jax.tree.flatten(state)
        assert all(isinstance(x, jax.Array) for x in leaves), "a train state with leaves other than arrays"
        new_leaves, metrics = compiled(leaves, batch, key)
        return jax.tree.unflatten(treedef, new_leaves), metrics

    return step


def compile_all(steps: Sequence[PreparedStep], threads: int | None = None) -> None:
    """Compile every step at once, one thread each (`threads` at most)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=threads or max(len(steps), 1)) as pool:
        for done in [pool.submit(s.compile) for s in steps]:
            done.result()


def step_timer(cfg: Any) -> Callable[[int], list[float]]:
    """`run(n)`: time n more train steps of `cfg` (built on its mesh, one fixed batch of random
    token ids, unit weights), each to `block_until_ready`; the state carries over between calls."""
    training = build_training(cfg, build_mesh(cfg.mesh))
    return Runner(training.train_step, training.init_state(), _random_batch(training, cfg), training.keys.step)


def _random_batch(training: Any, cfg: Any) -> dict[str, Any]:
    """One fixed batch of random token ids (unit weights), placed as the step takes it."""
    rng = np.random.default_rng(0)
    batch = {}
    for name, spec in training.abstract_batch().items():
        host = (
            rng.integers(0, cfg.model.vocab_size, spec.shape).astype(spec.dtype)  # pyright: ignore
            if name in ("ids", "labels")
            else np.ones(spec.shape, spec.dtype)
        )
        batch[name] = jax.device_put(host, training.batch_sharding)
    return batch


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile) of `xs` (all three the value for one sample)."""
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[0], statistics.median(xs), q[2]
