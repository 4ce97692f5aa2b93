"""Where a run starts: the newest checkpoint that restores and verifies, or a fresh state.

`resume_or_start` restores into the train state's abstract arrays (a resumed run never compiles or
runs the random initialisation the checkpoint would overwrite), refuses a checkpoint this run may
not resume (`equipax.launch.training.resume_checks.check_resume`, with the knobs that changed since the
job's config.json), puts the checkpoint's data position into the training input, and otherwise
builds the state its task family starts from (`Family.init_state`: random, or `model.init_from`).
"""

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from equipax.core.knobs import ConfigError, flatten, from_json
from equipax.core.step import TrainState
from equipax.launch.configs.experiment import ExperimentConfig
from equipax.launch.jobdir.checkpoints import Checkpointer
from equipax.launch.program.training import Training
from equipax.launch.store.storage import AnyPath
from equipax.launch.tasks import Family
from equipax.launch.training.ahead import CompileAhead
from equipax.launch.training.resume_checks import check_resume, layout_change, restore_data_state

if TYPE_CHECKING:
    from equipax.data import BaseInput

__all__ = ["resume_or_start", "Start"]


@dataclasses.dataclass(frozen=True)
class Start:
    """Where a run starts.

    Attributes:
        step: the steps already trained (0 for a fresh run, else the checkpoint's step).
        state: the train state, on the run's mesh.
        loop_state: what the hooks and the non-finite monitor saved with the checkpoint ({} when fresh).
    """

    step: int
    state: TrainState[Any]
    loop_state: dict[str, Any]


@dataclasses.dataclass
class _ResumeCheck:
    """`Checkpointer.restore_latest`'s `check_meta`: refuses a checkpoint this run may not resume,
    logs the notes on accepted differences, and keeps what the checkpoint it reads recorded."""

    current: dict[str, Any]
    where: AnyPath
    allow_new_data_order: bool
    log: Callable[[str], object]
    saved: dict[str, Any] = dataclasses.field(default_factory=dict)
    new_order: bool = False

    def __call__(self, saved: dict[str, Any], step: int) -> None:
        notes, self.new_order = check_resume(
            saved, self.current, step=step, where=self.where, allow_new_data_order=self.allow_new_data_order
        )
        for note in notes:
            self.log(f"note: {note}")
        self.saved = dict(saved)


def knob_changes(cfg: ExperimentConfig, job_dir: AnyPath) -> str:
    """The knobs that differ from the job's recorded config.json, as text (or "")."""
    try:
        old = flatten(from_json(ExperimentConfig, (job_dir / "config.json").read_text()))
    except (OSError, ConfigError, ValueError):
        return ""
    diffs = [f"  {k}: {old.get(k)!r} -> {v!r}" for k, v in flatten(cfg).items() if old.get(k) != v]
    return "\nKnobs that differ from the job's config.json:\n" + "\n".join(diffs) if diffs else ""


def resume_or_start(
    training: Training,
    fam: Family,
    train_input: "BaseInput",
    checkpointer: Checkpointer,
    *,
    job_dir: AnyPath,
    ahead: CompileAhead | None,
    allow_new_data_order: bool,
    log: Callable[[str], object],
) -> Start:
    """The newest checkpoint that restores and verifies (damaged ones are set aside with a
    message), else a fresh state. `ahead`'s compiles start once the checkpoint is restored or
    found missing (a refused run compiles nothing) and are given the state when it exists.

    Raises:
        ConfigError: the checkpoint may not be resumed with these knobs, or it is past
            `train.num_steps` (checkpointer closed, nothing rewritten).
    """
    cfg = training.cfg
    check = _ResumeCheck(checkpointer.meta, job_dir / "checkpoints", allow_new_data_order, log)
    try:
        restored = checkpointer.restore_latest(training.abstract_state, log=log, check_meta=check)
    except ConfigError as e:
        checkpointer.close()
        raise ConfigError(f"{e}{knob_changes(cfg, job_dir)}") from None
    if restored is not None and restored[0] > cfg.num_steps:  # before anything is rewritten
        checkpointer.close()
        raise ConfigError(
            f"The job in {job_dir} already trained to step {restored[0]} (its newest checkpoint), past "
            f"train.num_steps={cfg.num_steps}; its result.json is kept as it is. Raise train.num_steps "
            f"to at least {restored[0]} to continue it, or point --job-log-dir at a new directory for a "
            "shorter run."
        )
    if ahead is not None:
        ahead.start()
    if restored is None:  # the family may load weights into it (model.init_from=hf:DIR)
        state = fam.init_state(cfg, training.init_state(), model_sharding=training.model_sharding, log=log)
        start = Start(0, state, {})
    else:
        start = _resumed(training, train_input, checkpointer, check, restored, job_dir=job_dir, log=log)
    if ahead is not None:
        ahead.state_ready(start.state)
    return start


def _resumed(
    training: Training,
    train_input: "BaseInput",
    checkpointer: Checkpointer,
    check: _ResumeCheck,
    restored: tuple[int, Any, dict[str, Any], dict[str, Any]],
    *,
    job_dir: AnyPath,
    log: Callable[[str], object],
) -> Start:
    """The restored checkpoint's start: its optimizer started where it holds the model alone, its
    data position in the training input (or a new order, recorded in the checkpoints' meta)."""
    step, state, data_state, loop_state = restored
    if state.opt_state is None:  # a checkpoint of the model alone (hf-import's step 0)
        state = training.start_optimizer(state)
    moved = layout_change(check.saved, checkpointer.meta)
    fresh = check.new_order or restore_data_state(  # a new order: changed data knobs
        train_input, data_state, moved=moved is not None, allow_new_data_order=check.allow_new_data_order, log=log
    )
    changes = check.saved.get("data_order_changes", [])
    if fresh:  # recorded in every later checkpoint's meta
        changes = [*changes, {"step": step, "layout": checkpointer.meta["layout"]}]
    checkpointer.meta["data_order_changes"] = changes
    if moved is None:
        log(f"Resumed from step {step} ({job_dir / 'checkpoints'}).")
    else:
        order = "the data starts a new order" if fresh else "the data order is unchanged"
        log(f"Resumed from step {step} on {moved}: state re-sharded onto the new mesh, {order}.")
    return Start(step, state, loop_state)
