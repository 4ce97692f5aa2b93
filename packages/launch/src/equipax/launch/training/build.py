"""`build_training`: the one place that turns an experiment into a train step, an eval step and a
(sharded) train state. `launch run`, `launch compile` and `benchmarks/train_step.py` all call it,
so the program compiled ahead of time is the program a run executes.
"""

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
from jax.sharding import Mesh, NamedSharding
from jaxtyping import PRNGKeyArray

from equipax.core.configs import CONTEXT, VariationalNoiseConfig
from equipax.core.knobs import ConfigError
from equipax.core.optim import Learner, group_schedules, make_learner
from equipax.core.param_paths import param_paths
from equipax.core.partition import batch_sharding, train_state_shardings
from equipax.core.step import TrainState, TrainStep, init_train_state, make_eval_step, make_train_step
from equipax.core.task import AbstractTask, trainable
from equipax.launch.configs.experiment import ExperimentConfig
from equipax.launch.tasks import family

__all__ = ["build_training", "check_host_rows", "Keys", "Training"]


@dataclasses.dataclass(frozen=True)
class Keys:
    """The run's keys: separate splits of one root key (`train.seed`)."""

    init: PRNGKeyArray
    step: PRNGKeyArray
    sample: PRNGKeyArray

    @classmethod
    def from_seed(cls, seed: int) -> "Keys":
        init, step, sample = jax.random.split(jax.random.key(seed), 3)
        return cls(init=init, step=step, sample=sample)


@dataclasses.dataclass(frozen=True)
class Training:
    """Everything a training program needs, built from one experiment config.

    Attributes:
        cfg: the experiment.
        mesh: the device mesh (real or abstract devices).
        task: the model family's Task.
        learner: the optimizer and its schedule.
        keys: init, step and sample keys.
        abstract_state: the train state's shapes, dtypes and shardings (`jax.ShapeDtypeStruct`s).
        state_sharding: NamedShardings of the state's arrays.
        batch_sharding: how a global batch is split over the mesh.
        train_step: the jitted train step (`state, batch, key -> state, metrics`), non-finite
            updates skipped in-graph.
        eval_step: the jitted eval step (`model, batch, model_state -> eval sums`).
    """

    cfg: ExperimentConfig
    mesh: Mesh
    task: AbstractTask[Any]
    learner: Learner
    keys: Keys
    abstract_state: TrainState[Any]
    state_sharding: Any
    batch_sharding: NamedSharding
    train_step: TrainStep[Any]
    eval_step: Any

    def init_state(self) -> TrainState[Any]:
        """The initial train state, built directly in its sharded layout (no full copy on one device)."""

        def make(key: PRNGKeyArray) -> TrainState[Any]:
            return eqx.filter_shard(_initial_state(self.task, self.learner.optimizer, key), self.state_sharding)

        return eqx.filter_jit(make)(self.keys.init)

    def place(self, batch: Mapping[str, Any]) -> dict[str, jax.Array]:
        """This host's rows of the fields the task reads -> global arrays split over the mesh."""
        return {
            k: jax.make_array_from_process_local_data(self.batch_sharding, batch[k])
            for k in self.task.abstract_batch(1)
            if k in batch
        }

    def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        """One global batch as sharded `ShapeDtypeStruct`s (for AOT lowering)."""
        return {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=self.batch_sharding)
            for k, v in self.task.abstract_batch(self.cfg.global_batch_size).items()
        }

    def lower(self) -> Any:
        """Lower the train step on abstract arguments: nothing is allocated."""
        key = jax.eval_shape(lambda: self.keys.step)
        return self.train_step.lower(self.abstract_state, self.abstract_batch(), key)


def _initial_state(task: AbstractTask[Any], optimizer: Any, key: PRNGKeyArray) -> TrainState[Any]:
    model, model_state = task.init(key)
    return init_train_state(model, optimizer, model_state=model_state)


def _with_shardings(tree: Any, shardings: Any) -> Any:
    arrays, static = eqx.partition(tree, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    placed = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), arrays, shardings)
    return eqx.combine(placed, static)


def _checked_vn(cfg: ExperimentConfig, model: Any) -> VariationalNoiseConfig | None:
    """`train.vn` when it is on, after checking that `vn_regex` matches a trained parameter."""
    vn = cfg.train.vn
    if not vn.enabled:
        return None
    paths = param_paths(eqx.filter(model, trainable(model)))
    if not any(re.search(vn.vn_regex, p) for p in paths):
        shown = ", ".join(paths[:8]) + (f", ... ({len(paths)} in all)" if len(paths) > 8 else "")
        raise ConfigError(
            f"train.vn.vn_regex={vn.vn_regex!r} matches no trained parameter, so variational noise "
            f"(vn_scale={vn.vn_scale}) would never be added. The paths it is searched in: {shown}. "
            "Fix the pattern ('' = every parameter), or set train.vn.vn_scale=0."
        )
    return vn


def context_within_processes(devices: Any, axis_names: tuple[str, ...]) -> bool:
    """Whether every group of devices along the mesh's `context` axis (one sequence's shards)
    belongs to one process (`devices`, `axis_names`: a mesh's). The input places whole rows on
    each host (`Training.place`), so the parts of one row cannot come from several hosts yet."""
    if CONTEXT not in axis_names or devices.shape[axis_names.index(CONTEXT)] == 1:
        return True
    axis = axis_names.index(CONTEXT)
    groups = devices.swapaxes(axis, -1).reshape(-1, devices.shape[axis])
    return all(len({d.process_index for d in group}) == 1 for group in groups)


def build_training(cfg: ExperimentConfig, mesh: Mesh, *, feeds_batches: bool = True) -> Training:
    """Build the task, learner, shardings and jitted steps of `cfg` on `mesh`.

    Nothing is allocated: the state is traced abstractly (`Training.init_state()` builds it).

    Arguments:
        cfg: the resolved experiment.
        mesh: the mesh to shard over (`equipax.core.mesh.build_mesh`).
        feeds_batches: whether this process will place real batches on the mesh (False for an AOT
            compile, which lowers the step on abstract arguments: a `context` axis across processes
            is then allowed, the program being the same whichever host reads which rows).

    Returns:
        A `Training`.
    """
    if feeds_batches and not context_within_processes(mesh.devices, tuple(mesh.axis_names)):
        raise ConfigError(
            f"The mesh's `context` axis (size {mesh.shape[CONTEXT]}) spans several processes, but each host "
            "reads whole rows of the batch: the shards of one sequence cannot come from different hosts yet "
            "(docs/long_context.md). Keep the context axis within a host (mesh.ici_mesh_shape, with its "
            "mesh.dcn_mesh_shape entry 1) and split the hosts over data or fsdp."
        )
    task = family(cfg).make_task(cfg, mesh)
    learner = make_learner(cfg.learner)
    keys = Keys.from_seed(cfg.train.seed)
    abstract = eqx.filter_eval_shape(_initial_state, task, learner.optimizer, keys.init)
    state_sharding = train_state_shardings(abstract, learner.optimizer, mesh, dict(cfg.mesh.logical_axis_rules))
    data_sharding = batch_sharding(mesh)
    train_step = make_train_step(
        task,
        learner.optimizer,
        learner.schedule,
        state_sharding=state_sharding,
        batch_sharding=data_sharding,
        skip_nonfinite=True,
        variational_noise=_checked_vn(cfg, abstract.model),
        group_schedules=group_schedules(cfg.learner),
    )
    return Training(
        cfg=cfg,
        mesh=mesh,
        task=task,
        learner=learner,
        keys=keys,
        abstract_state=_with_shardings(abstract, state_sharding),
        state_sharding=state_sharding,
        batch_sharding=data_sharding,
        train_step=train_step,
        eval_step=make_eval_step(task),
    )


def check_host_rows(training: Any, inp: Any) -> None:
    """Check that the rows of each global batch this process's devices hold (a `Training`'s batch
    sharding) are the rows its input `inp` reads: `[index * batch_size, (index + 1) * batch_size)`,
    Pax's `infeed_host_index` contract, which `Training.place` relies on. ConfigError otherwise (a
    mesh whose device order does not give each process one contiguous block of the batch)."""
    shape = next(iter(training.abstract_batch().values())).shape
    rows: set[int] = set()
    for index in training.batch_sharding.addressable_devices_indices_map(shape).values():
        rows.update(range(*index[0].indices(shape[0])))
    want = range(inp.infeed_host_index * inp.batch_size, (inp.infeed_host_index + 1) * inp.batch_size)
    if sorted(rows) != list(want):
        found = f"{len(rows)} rows from {min(rows)} to {max(rows)}" if rows else "no rows"
        raise ConfigError(
            f"Process {jax.process_index()} of {jax.process_count()} holds {found} of each global batch of "
            f"{shape[0]} (the batch sharding over mesh {dict(training.mesh.shape)}), but its input reads rows "
            f"{want.start} to {want.stop - 1}. Order the mesh's devices so that each process holds one contiguous "
            "block of the batch dimension (mesh.dcn_mesh_shape for the axes across hosts)."
        )
