"""The hook protocol of the training loop (docs/extending.md, "Writing a hook").

A hook is an object the loop (`loop.py`) calls around each step. It sees the run through a
read-only `RunContext` and each step through a read-only `StepContext`; what it produces it
returns (its output, which later hooks of the step and the end of the run read by the hook's
`name`) or records (metrics.jsonl and TensorBoard through `run.writer`, lines through `run.log`).

- `every`: `after_step` runs on the steps divisible by it (0: never periodically); a hook with
  more occasions (the run's last step, a stop, an epoch's end) says so in `due`.
- `waits_for_device`: the hook reads device values (eval, sampling, checkpoints). Before it runs
  the loop writes the step's train record and lets the step's device work finish, so that wait
  counts as the step's; whatever time the hooks take is kept out of the step time the loop reports.
- Order: hooks run in the order given, except that a hook runs after the hooks named in its
  `after` (`"*"`: after every other hook, as checkpoints must, to save their final state) and
  before those naming it; `first` hooks run before all others (the profile window brackets the
  step's dispatch). `order_hooks` sorts a list so, and rejects what cannot be satisfied.
"""

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from equipax.launch.store.storage import AnyPath

if TYPE_CHECKING:
    from equipax.launch.configs.experiment import ExperimentConfig
    from equipax.launch.jobdir.checkpoints import Checkpointer
    from equipax.launch.jobdir.summaries import MetricsWriter
    from equipax.launch.program.training import Training
    from equipax.launch.tasks import Inputs
    from equipax.launch.training.ahead import CompileAhead

__all__ = ["Hook", "order_hooks", "RunContext", "StepContext"]

ALL = "*"


@dataclasses.dataclass(frozen=True)
class RunContext:
    """What a run is, fixed from its first step to its last (read-only).

    Attributes:
        cfg: the resolved experiment.
        job_dir: the job directory.
        training: the built program (`build_training`): mesh, steps, keys, task.
        inputs: this host's train and eval inputs (the eval input is reset before each eval).
        start: the step this run starts after (0, or the step resumed from).
        total: the last step (`cfg.num_steps`).
        unit: what the family counts (tokens, examples).
        primary: True on process 0, which writes the job directory's files.
        writer: metrics.jsonl and TensorBoard (writes only on process 0).
        checkpointer: the job's checkpoints.
        log: prints a line above the progress bar.
        check_nonfinite: applies `train.on_nonfinite` to the steps up to the one given (raises to
            stop the run); call it before saving anything that could hold a skipped step's state.
        ahead: the programs compiled on a background thread (`ahead.py`; None: none are);
            `ahead.wait_for(run.ahead, name)` before a program's first use.
    """

    cfg: "ExperimentConfig"
    job_dir: AnyPath
    training: "Training"
    inputs: "Inputs"
    start: int
    total: int
    unit: str
    primary: bool
    writer: "MetricsWriter"
    checkpointer: "Checkpointer"
    log: Callable[[str], None]
    check_nonfinite: Callable[[int], None]
    ahead: "CompileAhead | None" = None

    @property
    def steps_per_epoch(self) -> int:
        return self.cfg.steps_per_epoch or 0

    def epoch_end(self, step: int) -> bool:
        """True after the last step of an epoch of a `train.num_epochs` run."""
        return self.cfg.train.num_epochs is not None and step % self.steps_per_epoch == 0


@dataclasses.dataclass(frozen=True)
class StepContext:
    """One step as the hooks see it, after its dispatch (read-only).

    Attributes:
        run: the run.
        step: the step just dispatched (1-based).
        state: the train state after it (device arrays, still being computed).
        metrics: its metrics (device arrays: reading one waits for the step).
        stopping: the loop stops after this step (SIGTERM/SIGINT on some process).
        outputs: the newest output of every hook that produced one, by hook name (the outputs of
            hooks earlier in this step included).
        train: the newest train record written (host numbers: loss, learning rate, step time,
            throughput, MFU; empty before the first one).
        compile_seconds: seconds XLA spent compiling while this step was dispatched (a recompile).
        loop_state: the JSON-ready state of the loop and its hooks as of now (saved with a
            checkpoint; `Hook.state` of each, and the non-finite counts).
    """

    run: RunContext
    step: int
    state: Any
    metrics: Mapping[str, Any]
    stopping: bool
    outputs: Mapping[str, Any]
    train: Mapping[str, float]
    compile_seconds: float
    loop_state: Callable[[], dict[str, Any]]

    @property
    def final(self) -> bool:
        """The run's last step (`train.num_steps`)."""
        return self.step == self.run.total

    @property
    def epoch_end(self) -> bool:
        return self.run.epoch_end(self.step)


class Hook:
    """A training-loop hook; every method is optional (see the module docstring for the protocol)."""

    name: str = ""  # the key of its output in `StepContext.outputs` (default: the class name)
    every: int = 1
    waits_for_device: bool = False
    first: bool = False
    after: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        return self.name or type(self).__name__

    def due(self, ctx: StepContext) -> bool:
        """Whether `after_step` runs at this step: every `every` steps."""
        return self.every > 0 and ctx.step % self.every == 0

    def load(self, state: dict[str, Any]) -> None:
        """Restore `state()` of the run this one resumes (called before `start`)."""

    def start(self, run: RunContext) -> None:
        """Before the first step: check settings (a bad one raises a ConfigError), open files."""

    def before_step(self, run: RunContext, step: int) -> None:
        """Just before step `step` is dispatched, every step (its batch is fetched); keep it cheap."""

    def after_step(self, ctx: StepContext) -> Any:
        """After the step's dispatch, where `due`: act, and return the output (None: none)."""

    def state(self) -> dict[str, Any]:
        """JSON-ready state saved with each checkpoint (its keys shared with the other hooks')."""
        return {}

    def close(self, run: RunContext) -> None:
        """The loop is over (finished or stopped): flush what is pending."""

    def result(self, run: RunContext, outputs: Mapping[str, Any]) -> dict[str, Any]:
        """What this hook adds to result.json of a finished run (`outputs`: every hook's newest)."""
        return {}


def order_hooks(hooks: Sequence[Hook]) -> list[Hook]:
    """`hooks` in the order they run: `first` ones first, each after the hooks its `after` names
    (`"*"`: after all the others), otherwise as given.

    Raises:
        ValueError: two hooks share a name, an `after` names no hook, or the constraints form a circle.
    """
    names = [h.key for h in hooks]
    if dup := sorted({n for n in names if names.count(n) > 1}):
        raise ValueError(
            f"Two hooks are named {dup[0]!r}: give one of them another `name` (hook outputs are kept by name)."
        )
    index = {n: i for i, n in enumerate(names)}
    last = {i for i, h in enumerate(hooks) if ALL in h.after}
    before: dict[int, set[int]] = {i: set() for i in range(len(hooks))}  # i runs after each of before[i]
    for i, h in enumerate(hooks):
        for name in h.after:
            if name == ALL:
                before[i] |= {j for j in range(len(hooks)) if j not in last}
            elif name not in index:
                raise ValueError(
                    f"Hook {h.key!r} runs after {name!r}, but no hook has that name (hooks: {', '.join(names)})."
                )
            else:
                before[i].add(index[name])
        if h.first:
            before[i] = {j for j in before[i] if hooks[j].first}
        else:
            before[i] |= {j for j, other in enumerate(hooks) if other.first}
        before[i].discard(i)
    order: list[int] = []
    while len(order) < len(hooks):
        ready = [i for i in range(len(hooks)) if i not in order and before[i] <= set(order)]
        if not ready:
            stuck = [names[i] for i in range(len(hooks)) if i not in order]
            raise ValueError(
                f"The order constraints of hooks {', '.join(stuck)} form a circle (`after`, `first`): drop one of them."
            )
        order.append(ready[0])
    return [hooks[i] for i in order]
