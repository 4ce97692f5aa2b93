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
from jax.sharding import PartitionSpec as P
from jaxtyping import PRNGKeyArray

from equipax.core.infeed import HostInfeed, host_infeed
from equipax.core.knobs import ConfigError
from equipax.core.learner_config import VariationalNoiseConfig
from equipax.core.mesh_config import CONTEXT
from equipax.core.nn.fused_attention import attention_kernel, mesh_platform
from equipax.core.optim import Learner, group_schedules, make_learner
from equipax.core.param_paths import param_paths
from equipax.core.partition import batch_sharding, train_state_shardings
from equipax.core.step import TrainState, TrainStep, init_train_state, make_eval_step, make_train_step
from equipax.core.task import AbstractTask, trainable
from equipax.launch.configs.experiment import ExperimentConfig, as_lm
from equipax.launch.tasks import family

__all__ = ["ATTENTION_KNOB", "attention_record", "build_training", "check_host_rows", "Keys", "Training"]


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
        infeed: which rows of each global batch this process reads and which part of their
            sequence it places (`equipax.core.infeed.host_infeed`); None where no batch is placed
            (`build_training(feeds_batches=False)`).
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
    infeed: HostInfeed | None = None

    def init_state(self) -> TrainState[Any]:
        """The initial train state, built directly in its sharded layout (no full copy on one device)."""

        def make(key: PRNGKeyArray) -> TrainState[Any]:
            return eqx.filter_shard(_initial_state(self.task, self.learner.optimizer, key), self.state_sharding)

        return eqx.filter_jit(make)(self.keys.init)

    def place(self, batch: Mapping[str, Any]) -> dict[str, jax.Array]:
        """This host's rows of the fields the task reads -> global arrays split over the mesh.

        The rows are the host's input's (`infeed.infeed_host_index`); of a `[batch seq ...]` field
        on a `context` axis, only the part of the sequence this process's devices hold is placed
        (`infeed.seq_slice`: the hosts of one context group read the same rows, each places its part).
        """
        if self.infeed is None:
            raise RuntimeError("This Training was built with feeds_batches=False: it places no batches.")
        return {k: self._place_field(batch[k], self.infeed) for k in self.task.abstract_batch(1) if k in batch}

    def _place_field(self, x: Any, infeed: HostInfeed) -> jax.Array:
        global_shape = (x.shape[0] * infeed.num_infeed_hosts, *x.shape[1:])
        if x.ndim < 2:  # no sequence dimension: split the rows only
            rows = NamedSharding(self.mesh, P(*self.batch_sharding.spec[:1]))
            return jax.make_array_from_process_local_data(rows, x, global_shape)
        if infeed.num_seq_blocks > 1:
            # JAX maps a dimension shorter than the global one onto the positions this process's
            # devices address, in order: exactly the contiguous part `seq_slice` cuts.
            x = x[:, infeed.seq_slice(x.shape[1])]
        return jax.make_array_from_process_local_data(self.batch_sharding, x, global_shape)

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


def build_training(cfg: ExperimentConfig, mesh: Mesh, *, feeds_batches: bool = True) -> Training:
    """Build the task, learner, shardings and jitted steps of `cfg` on `mesh`.

    Nothing is allocated: the state is traced abstractly (`Training.init_state()` builds it).

    Arguments:
        cfg: the resolved experiment.
        mesh: the mesh to shard over (`equipax.core.mesh.build_mesh`).
        feeds_batches: whether this process will place real batches on the mesh, so that its part
            of each batch is worked out (`Training.infeed`; a mesh that gives a process a
            non-contiguous part is then a ConfigError). False for an AOT compile, which lowers the
            step on abstract arguments: the program is the same whichever host reads which rows.

    Returns:
        A `Training`.
    """
    infeed = host_infeed(mesh) if feeds_batches else None  # a mesh no host can feed fails before compiling
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
        check_update_norm=cfg.train.check_update_norm,
        variational_noise=_checked_vn(cfg, abstract.model),
        group_schedules=group_schedules(cfg.learner),
        platform=mesh_platform(mesh),
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
        infeed=infeed,
    )


ATTENTION_KNOB = "model.transformer.attention_impl"


def attention_record(cfg: ExperimentConfig, mesh: Mesh) -> dict[str, Any] | None:
    """What the train step's attention runs as on `mesh` (`attention_kernel`: "auto" resolved for
    the mesh's platform, the training sequence length and dtype), JSON-ready (compile.json's
    `attention`, knobs.txt's note); None for a model without softmax attention."""
    if cfg.kind != "lm":
        return None
    lm = as_lm(cfg)
    transformer, platform = lm.model.transformer, mesh_platform(mesh)
    seq_len, dtype = lm.data.seq_len, lm.model.dtype
    context = int(dict(mesh.shape).get(CONTEXT, 1))
    kernel = attention_kernel(transformer, platform, seq_len=seq_len, dtype=dtype, context=context)
    if kernel is None:
        return None
    return {"knob": ATTENTION_KNOB, "value": transformer.attention_impl, "kernel": kernel, "platform": platform,
            "seq_len": seq_len, "dtype": dtype}  # fmt: skip


def check_host_rows(training: Any, inp: Any) -> None:
    """Check that the part of each global batch this process's devices hold (a `Training`'s batch
    sharding, as JAX computes it) is the part `Training.place` gives them: the rows its input `inp`
    reads, `[index * batch_size, (index + 1) * batch_size)` (Pax's `infeed_host_index` contract), and
    on a `context` axis the positions `training.infeed.seq_slice`. ConfigError otherwise (an input
    built with another host index than the mesh's, `equipax.core.infeed.host_infeed`)."""
    shape = next(iter(training.abstract_batch().values())).shape
    rows: set[int] = set()
    positions: set[int] = set()
    for index in training.batch_sharding.addressable_devices_indices_map(shape).values():
        rows.update(range(*index[0].indices(shape[0])))
        if len(shape) > 1:
            positions.update(range(*index[1].indices(shape[1])))
    want = range(inp.infeed_host_index * inp.batch_size, (inp.infeed_host_index + 1) * inp.batch_size)
    where = f"each global batch of {shape[0]} (the batch sharding over mesh {dict(training.mesh.shape)})"
    if sorted(rows) != list(want):
        found = f"{len(rows)} rows from {min(rows)} to {max(rows)}" if rows else "no rows"
        infeed = training.infeed
        raise ConfigError(
            f"Process {jax.process_index()} of {jax.process_count()} holds {found} of {where}, but its input reads "
            f"rows {want.start} to {want.stop - 1} (infeed_host_index={inp.infeed_host_index} of "
            f"num_infeed_hosts={inp.num_infeed_hosts}). Build the input with the mesh's host index and count: "
            f"infeed_host_index={infeed.infeed_host_index}, num_infeed_hosts={infeed.num_infeed_hosts} "
            "(equipax.core.infeed.host_infeed(mesh); docs/multihost.md)."
        )
    placed = range(shape[1])[training.infeed.seq_slice(shape[1])] if len(shape) > 1 else range(0)
    if sorted(positions) != list(placed):
        raise ConfigError(
            f"Process {jax.process_index()} of {jax.process_count()} holds positions {min(positions)} to "
            f"{max(positions)} of each sequence of {where}, but would place positions {placed.start} to "
            f"{placed.stop - 1}. Order the mesh so that each process holds one contiguous block of the sequence "
            "(the context axis's hosts in mesh.dcn_mesh_shape, its devices within a host in mesh.ici_mesh_shape)."
        )
