"""Timing the real train step of an experiment on random tokens, shared by the benchmarks that
compare step times across meshes (`moe_dispatch.py`, `pipeline_bubble.py`)."""

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from equipax.core.mesh import build_mesh
from equipax.launch.training.build import build_training

__all__ = ["quartiles", "step_timer"]


def step_timer(cfg: Any) -> Callable[[int], list[float]]:
    """`run(n)`: time n more train steps of `cfg` (built on its mesh, one fixed batch of random
    token ids, unit weights), each to `block_until_ready`; the state carries over between calls."""
    training = build_training(cfg, build_mesh(cfg.mesh))
    rng = np.random.default_rng(0)
    batch = {}
    for name, spec in training.abstract_batch().items():
        host = (
            rng.integers(0, cfg.model.vocab_size, spec.shape).astype(spec.dtype)  # pyright: ignore
            if name in ("ids", "labels")
            else np.ones(spec.shape, spec.dtype)
        )
        batch[name] = jax.device_put(host, training.batch_sharding)
    key = training.keys.step
    state = training.init_state()

    def run(n: int) -> list[float]:
        nonlocal state
        times = []
        for _ in range(n):
            start = time.perf_counter()
            state, metrics = training.train_step(state, batch, key)
            jax.block_until_ready((state, metrics))
            times.append(time.perf_counter() - start)
        return times

    return run


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile) of `xs` (all three the value for one sample)."""
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[0], statistics.median(xs), q[2]
