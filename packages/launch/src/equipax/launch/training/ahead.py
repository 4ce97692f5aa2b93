"""The programs a run needs, compiled on a background thread while the run builds its state and trains.

The train step's XLA compile depends only on the train state's shapes and shardings, not on its
values, so it need not wait for the state: while the main thread initialises (or restores) the
state, one background thread compiles the train step, then the eval step (given the state's model
once it exists) and the checkpoint checksums' program, while the first steps run. JAX keeps a
compiled program with the lowering it came from, and a later call with arguments of the same
shapes, shardings and structure finds it there: the first step, the first eval and the first
checkpoint then compile nothing (tests/launch/test_compile_ahead.py). XLA compiles with the GIL
released, so on a host with cores to spare the compiles overlap each other and the state's
initialisation (benchmarks/README.md, "Start-up").

The main thread waits for a program (`CompileAhead.wait`) before its first use, so nothing is
compiled twice. A background compile that fails is dropped: the program's first call compiles it
again and raises its error where it always did.
"""

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from equipax.core.trees import flat_arrays
from equipax.launch.jobdir.checksums import lower_checksums

if TYPE_CHECKING:
    from equipax.launch.program.training import Training

__all__ = ["CHECKSUMS", "CompileAhead", "EVAL_STEP", "TRAIN_STEP", "wait_for"]

# The programs compiled ahead, by the names `CompileAhead.wait` takes.
TRAIN_STEP = "train step"
EVAL_STEP = "eval step"
CHECKSUMS = "checksums"


def _zeros(x: jax.ShapeDtypeStruct) -> jax.Array:
    """A zero array of `x`'s shape, dtype and sharding (every process gives its own part)."""
    zeros = np.zeros(x.shape, x.dtype)
    return jax.make_array_from_callback(x.shape, x.sharding, lambda index: zeros[index])  # pyright: ignore[reportArgumentType]


class CompileAhead:
    """One background thread that compiles a run's train step, eval step and checksum program,
    from `start()` on.

    Arguments:
        training: the run's program (`build_training`).
        eval_step: also compile the eval step, once `state_ready` gives it the model (the eval
            batches have the train batches' shape).
    """

    def __init__(self, training: "Training", *, eval_step: bool) -> None:
        self._training = training
        self._done = {name: threading.Event() for name in (TRAIN_STEP, EVAL_STEP, CHECKSUMS)}
        if not eval_step:
            self._done[EVAL_STEP].set()
        self._state: Any = None
        self._state_ready = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="equipax-compile-ahead", daemon=True)

    def start(self) -> None:
        """Start the compiles (once the run's refusals are behind it: a refused run compiles nothing)."""
        self._thread.start()

    def _run(self) -> None:
        t = self._training
        self._attempt(TRAIN_STEP, lambda: t.train_step.lower(t.abstract_state, t.abstract_batch(), t.keys.step))
        if not self._done[EVAL_STEP].is_set():
            self._state_ready.wait()
            state = self._state
            if state is not None and not self._stop.is_set():
                batch = {k: _zeros(v) for k, v in t.abstract_batch().items()}
                self._attempt(EVAL_STEP, lambda: t.eval_step.lower(state.model, batch, state.model_state))
            self._done[EVAL_STEP].set()
        if not self._stop.is_set():
            self._attempt(CHECKSUMS, lambda: lower_checksums(flat_arrays(t.abstract_state)))
        self._done[CHECKSUMS].set()

    def _attempt(self, name: str, lower: Callable[[], Any]) -> None:
        try:
            lowered = lower()
            if lowered is not None and not self._stop.is_set():
                lowered.compile()
        except Exception:  # the program's first call compiles it again and raises there
            pass
        finally:
            self._done[name].set()

    def state_ready(self, state: Any) -> None:
        """The run's train state exists: the eval step can be lowered for its model."""
        self._state = state
        self._state_ready.set()

    def wait(self, name: str) -> None:
        """Block until the background compile of `name` (`TRAIN_STEP`, `EVAL_STEP`, `CHECKSUMS`) is
        over, so that its first call finds it instead of compiling it a second time."""
        self._done[name].wait()

    def close(self) -> None:
        """Skip what is not started yet and wait for the thread (a compile in progress finishes)."""
        self._stop.set()
        self._state_ready.set()
        if self._thread.ident is not None:  # started
            self._thread.join()


def wait_for(ahead: CompileAhead | None, name: str) -> None:
    """`ahead.wait(name)` where the run compiles ahead (`RunContext.ahead`), else nothing."""
    if ahead is not None:
        ahead.wait(name)
