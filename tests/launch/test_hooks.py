"""The hook protocol: order constraints in code, caller hooks through `run_experiment(hooks=...)`,
read-only step contexts, outputs read by later hooks, hook time kept out of step time, hook state
saved with checkpoints and given back on resume."""

import dataclasses
import json
import time

import pytest

from helpers.cli import FAST


def _hook(name, **attrs):
    from equipax.launch.training.hooks import Hook

    return type(name, (Hook,), {"name": name, **attrs})()


def _names(hooks):
    from equipax.launch.training.hooks import order_hooks

    return [h.key for h in order_hooks(hooks)]


def test_order_follows_first_after_and_star():
    hooks = [
        _hook("ckpt", after=("*",)),
        _hook("epoch", after=("eval",)),
        _hook("eval"),
        _hook("mine"),
        _hook("profile", first=True),
        _hook("late", after=("*",)),
    ]
    assert _names(hooks) == ["profile", "eval", "epoch", "mine", "ckpt", "late"]
    assert _names([_hook("b", after=("a",)), _hook("a")]) == ["a", "b"]
    assert _names([_hook("a"), _hook("b")]) == ["a", "b"]  # otherwise as given


@pytest.mark.parametrize(
    "hooks, message",
    [
        (lambda: [_hook("a"), _hook("a")], "Two hooks are named 'a'"),
        (lambda: [_hook("a", after=("nope",))], "runs after 'nope', but no hook has that name"),
        (lambda: [_hook("a", after=("b",)), _hook("b", after=("a",))], "form a circle"),
    ],
)
def test_order_refuses_what_cannot_hold(hooks, message):
    with pytest.raises(ValueError, match=message):
        _names(hooks())


SLEEP = 0.3  # seconds the slow hook takes at every step


def test_caller_hooks_run_read_only_in_order_outside_the_step_time_and_resume(tmp_path):
    from equipax.core.knobs import apply_overrides
    from equipax.launch.experiments.registry import get_experiment
    from equipax.launch.training.hooks import Hook, StepContext
    from equipax.launch.training.loop import run_experiment

    class Slow(Hook):
        name = "slow"

        def __init__(self):
            self.calls = 0

        def after_step(self, ctx: StepContext) -> int:
            time.sleep(SLEEP)
            self.calls += 1
            return ctx.step

        def state(self):
            return {"slow_calls": self.calls}

        def load(self, state):
            self.calls = state.get("slow_calls", 0)

    class Reader(Hook):
        name = "reader"
        after = ("slow",)
        every = 2

        def __init__(self):
            self.seen = []

        def after_step(self, ctx: StepContext) -> None:
            with pytest.raises(dataclasses.FrozenInstanceError):
                ctx.step = 0  # pyright: ignore[reportAttributeAccessIssue]
            with pytest.raises(TypeError):
                ctx.outputs["slow"] = 0  # pyright: ignore[reportIndexIssue]
            self.seen.append((ctx.step, ctx.outputs["slow"], ctx.outputs.get("eval", {}).get("loss")))

    cfg, _ = apply_overrides(
        get_experiment("shakespeare_tiny"), [*FAST, "train.num_steps=4", "train.eval_every=4", "train.log_every=1"]
    )
    slow, reader = Slow(), Reader()
    job = tmp_path / "job"
    run_experiment(cfg, job_dir=job, hooks=[reader, slow])  # given out of order: `after` decides
    assert slow.calls == 4
    # Every second step, after the slow hook of the same step; at step 4 after the built-in eval.
    assert [(s, o) for s, o, _ in reader.seen] == [(2, 2), (4, 4)] and reader.seen[1][2] is not None
    records = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    step_times = [r["step_time_s"] for r in records if r["split"] == "train" and r["step"] > 1]
    assert len(step_times) == 3 and max(step_times) < SLEEP, step_times  # hook time is not step time

    # Resumed for two more steps: the hook's state came back from the step-4 checkpoint.
    slow2 = Slow()
    cfg6, _ = apply_overrides(cfg, ["train.num_steps=6"])
    run_experiment(cfg6, job_dir=job, hooks=[slow2])
    assert slow2.calls == 4 + 2
