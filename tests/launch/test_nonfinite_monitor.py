"""The non-finite monitor's verdict, from the per-step metrics alone: where the run became unstable
and which checkpoint is named good (the CLI runs in tests/launch/test_reliability2.py)."""

import math

import numpy as np
import pytest

from equipax.launch.failures import NonFiniteError
from equipax.launch.training.nonfinite import NonFiniteMonitor


def verdict(steps: dict[int, dict[str, float]], checkpoints: list[int]) -> tuple[NonFiniteError, list[int]]:
    """Feed `steps` (without train.check_update_norm: no `update_norm`) to a "skip" monitor with
    `checkpoints` saved; the error it raises and the checkpoints left."""
    kept = list(checkpoints)

    def rollback(step):
        moved = [c for c in kept if c >= step]
        kept[:] = [c for c in kept if c < step]
        return (kept[-1] if kept else None), moved, "unstable_checkpoints"

    monitor = NonFiniteMonitor("skip", 3)
    for s, m in steps.items():
        monitor.record(s, {"learning_rate": 1e-3, "grad_norm": 1.0, **{k: np.float32(v) for k, v in m.items()}})
    with pytest.raises(NonFiniteError) as e:
        monitor.check(max(steps), rollback=rollback, where="checkpoints", log=lambda m: None)
    return e.value, kept


OK = {"nonfinite": 0.0, "loss": 5.0, "param_norm": 30.0}
NAN = {"nonfinite": 1.0, "loss": math.nan}


def test_a_checkpoint_whose_parameters_overflowed_is_never_named_good():
    # Step 3 found the parameters step 2 wrote to have no finite norm (it was skipped, though its
    # loss was finite); step 4 trained on; the final streak is 5-8. Checkpoint 2 holds those
    # parameters: it is set aside too, not named good.
    steps = {1: OK, 2: OK, 3: {**OK, "nonfinite": 1.0, "param_norm": math.inf}, 4: OK}
    error, kept = verdict({**steps, **{s: {**NAN, "param_norm": 30.0} for s in range(5, 9)}}, [2])
    assert kept == [] and error.last_checkpoint is None
    assert "No checkpoint from before that step remains" in str(error) and "step 2" in str(error)


def test_without_the_update_norm_a_jump_in_the_parameter_norm_names_the_step_that_made_it():
    # Step 2's update took the parameter norm from 30 to 7e11 (so the update's norm was at least
    # that much larger than the parameters'): the losses from step 3 on are NaN. Step 2 is where
    # the run became unstable, and checkpoint 2 is set aside.
    steps = {1: OK, 2: OK, **{s: {**NAN, "param_norm": 7e11} for s in range(3, 7)}}
    error, kept = verdict(steps, [2, 4])
    assert kept == [] and error.last_checkpoint is None
    assert "The run became unstable at step 2" in str(error)
    assert "update norm at least 7e+11" in str(error) and "the learning rate is likely too high" in str(error)
