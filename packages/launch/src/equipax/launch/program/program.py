"""`build_program`: an experiment's model on a mesh, as every command that runs it needs it.

A `Program` is the task, the keys, the model's abstract arrays with their shardings, how a batch
is split over the mesh and the jitted eval step: what `launch decode`, `launch eval`, the Hugging
Face conversions and a checkpoint's restore read. It builds no learner, no optimizer state and no
train step; `Training` (`program/training.py`) adds those for `launch run` and `launch compile`.
"""

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import PRNGKeyArray

from equipax.core.infeed import HostInfeed, host_infeed
from equipax.core.knobs import ConfigError
from equipax.core.partition import batch_sharding, model_shardings
from equipax.core.step import make_eval_step
from equipax.core.task import AbstractTask, Metrics
from equipax.launch.configs.experiment import ExperimentConfig
from equipax.launch.tasks import family

if TYPE_CHECKING:
    from equipax.data import BaseInput
else:
    BaseInput = Any  # equipax.data pulls in grain and orbax (seconds): imported only where it runs

__all__ = ["build_program", "check_host_rows", "Keys", "Program", "with_shardings"]


@dataclasses.dataclass(frozen=True)
class Keys:
    """The run's keys: separate splits of one root key (`train.seed`)."""

    init: PRNGKeyArray
    step: PRNGKeyArray
    sample: PRNGKeyArray

    @classmethod
    def from_seed(cls, seed: int) -> "Keys":
        """The keys of `seed`, derived on the host's CPU backend where JAX has one beside an
        accelerator (`host_device`): each eager op here compiles a program of its own, four on
        the TPU v5e's chip taking 1.5-1.7 s before anything else of a run could start, 0.56 s on
        its host's CPU (benchmarks/README.md, "eighth session" and "ninth session"). Threefry is
        the same function on every backend, so the keys are the same; they are not committed to
        the CPU, so each program that takes one moves it to its own devices."""
        with contextlib.nullcontext() if (device := host_device()) is None else jax.default_device(device):
            init, step, sample = jax.random.split(jax.random.key(seed), 3)
        return cls(init=init, step=step, sample=sample)


def host_device() -> Any:
    """The CPU device (a `jax.Device`) to derive small host-side values on (`Keys.from_seed`),
    where the default backend is an accelerator and JAX also has its CPU backend (JAX_PLATFORMS
    may leave it out); None where the default backend is the CPU."""
    if jax.default_backend() == "cpu":
        return None
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Program:
    """An experiment's model on a mesh: what running, evaluating or restoring it needs.

    Attributes:
        cfg: the experiment.
        mesh: the device mesh (real or abstract devices).
        task: the model family's Task.
        keys: init, step and sample keys.
        abstract_model: the model's shapes, dtypes and shardings (`jax.ShapeDtypeStruct`s in the
            model's structure): what a checkpoint's model restores into.
        abstract_model_state: the model's non-trained state the same way (None for a stateless model).
        model_sharding: NamedShardings of the model's arrays (`equipax.core.partition.model_shardings`).
        batch_sharding: how a global batch is split over the mesh.
        eval_step: the jitted eval step (`model, batch, model_state -> eval sums`).
        infeed: which rows of each global batch this process reads and which part of their
            sequence it places (`equipax.core.infeed.host_infeed`); None where no batch is placed
            (`build_program(feeds_batches=False)`).
    """

    cfg: ExperimentConfig
    mesh: Mesh
    task: AbstractTask[Any]
    keys: Keys
    abstract_model: Any
    abstract_model_state: Any
    model_sharding: Any
    batch_sharding: NamedSharding
    eval_step: Callable[..., Metrics]
    infeed: HostInfeed | None = None

    def place(self, batch: Mapping[str, Any]) -> dict[str, jax.Array]:
        """This host's rows of the fields the task reads -> global arrays split over the mesh.

        The rows are the host's input's (`infeed.infeed_host_index`); of a `[batch seq ...]` field
        on a `context` axis, only the part of the sequence this process's devices hold is placed
        (`infeed.seq_slice`: the hosts of one context group read the same rows, each places its part).
        """
        if self.infeed is None:
            raise RuntimeError("This program was built with feeds_batches=False: it places no batches.")
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


def with_shardings(tree: Any, shardings: Any) -> Any:
    """`tree`'s `ShapeDtypeStruct`s carrying `shardings` (the structure of its arrays)."""
    arrays, static = eqx.partition(tree, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    placed = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), arrays, shardings)
    return eqx.combine(placed, static)


def build_program(cfg: ExperimentConfig, mesh: Mesh, *, feeds_batches: bool = True) -> Program:
    """Build the task, keys, the model's abstract arrays and shardings and the eval step of `cfg`
    on `mesh`. Nothing is allocated: the model is traced abstractly.

    Arguments:
        cfg: the resolved experiment.
        mesh: the mesh to shard over (`equipax.core.mesh.build_mesh`).
        feeds_batches: whether this process will place real batches on the mesh, so that its part
            of each batch is worked out (`Program.infeed`; a mesh that gives a process a
            non-contiguous part is then a ConfigError). False for an AOT compile, which lowers the
            step on abstract arguments: the program is the same whichever host reads which rows.
    """
    infeed = host_infeed(mesh) if feeds_batches else None  # a mesh no host can feed fails before compiling
    task = family(cfg).make_task(cfg, mesh)
    keys = Keys.from_seed(cfg.train.seed)
    model, model_state = eqx.filter_eval_shape(task.init, keys.init)
    sharding = model_shardings(model, mesh, dict(cfg.mesh.logical_axis_rules))
    replicated = jax.tree.map(lambda _: NamedSharding(mesh, P()), eqx.filter(model_state, _is_abstract))
    return Program(
        cfg=cfg,
        mesh=mesh,
        task=task,
        keys=keys,
        abstract_model=with_shardings(model, sharding),
        abstract_model_state=with_shardings(model_state, replicated),
        model_sharding=sharding,
        batch_sharding=batch_sharding(mesh),
        eval_step=make_eval_step(task),
        infeed=infeed,
    )


def _is_abstract(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def check_host_rows(program: Program, inp: BaseInput) -> None:
    """Check that the part of each global batch this process's devices hold (a program's batch
    sharding, as JAX computes it) is the part `Program.place` gives them: the rows its input `inp`
    reads, `[index * batch_size, (index + 1) * batch_size)` (Pax's `infeed_host_index` contract), and
    on a `context` axis the positions `program.infeed.seq_slice`. ConfigError otherwise (an input
    built with another host index than the mesh's, `equipax.core.infeed.host_infeed`)."""
    infeed = program.infeed
    if infeed is None:
        raise RuntimeError("This program was built with feeds_batches=False: it places no batches.")
    shape = next(iter(program.abstract_batch().values())).shape
    rows: set[int] = set()
    positions: set[int] = set()
    for index in program.batch_sharding.addressable_devices_indices_map(shape).values():
        assert index is not None  # every addressable device holds a part
        rows.update(range(*index[0].indices(shape[0])))
        if len(shape) > 1:
            positions.update(range(*index[1].indices(shape[1])))
    want = range(inp.infeed_host_index * inp.batch_size, (inp.infeed_host_index + 1) * inp.batch_size)
    where = f"each global batch of {shape[0]} (the batch sharding over mesh {dict(program.mesh.shape)})"
    if sorted(rows) != list(want):
        found = f"{len(rows)} rows from {min(rows)} to {max(rows)}" if rows else "no rows"
        raise ConfigError(
            f"Process {jax.process_index()} of {jax.process_count()} holds {found} of {where}, but its input reads "
            f"rows {want.start} to {want.stop - 1} (infeed_host_index={inp.infeed_host_index} of "
            f"num_infeed_hosts={inp.num_infeed_hosts}). Build the input with the mesh's host index and count: "
            f"infeed_host_index={infeed.infeed_host_index}, num_infeed_hosts={infeed.num_infeed_hosts} "
            "(equipax.core.infeed.host_infeed(mesh); docs/multihost.md)."
        )
    placed = range(shape[1])[infeed.seq_slice(shape[1])] if len(shape) > 1 else range(0)
    if sorted(positions) != list(placed):
        raise ConfigError(
            f"Process {jax.process_index()} of {jax.process_count()} holds positions {min(positions)} to "
            f"{max(positions)} of each sequence of {where}, but would place positions {placed.start} to "
            f"{placed.stop - 1}. Order the mesh so that each process holds one contiguous block of the sequence "
            "(the context axis's hosts in mesh.dcn_mesh_shape, its devices within a host in mesh.ici_mesh_shape)."
        )
