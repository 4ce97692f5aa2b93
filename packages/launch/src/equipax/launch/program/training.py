"""`build_training`: the one place that turns an experiment into a train step, an eval step and a
(sharded) train state. `launch run`, `launch compile` and `benchmarks/train_step.py` all call it,
so the program compiled ahead of time is the program a run executes.
"""

import dataclasses
import re
from typing import Any

import equinox as eqx
import jax
import optax
from jax.sharding import Mesh
from jaxtyping import PRNGKeyArray

from equipax.core.knobs import ConfigError
from equipax.core.learner_config import VariationalNoiseConfig
from equipax.core.nn.fused_attention import mesh_platform
from equipax.core.optim import Learner, group_schedules, make_learner
from equipax.core.param_paths import param_paths
from equipax.core.partition import train_state_shardings
from equipax.core.step import TrainState, TrainStep, init_train_state, make_train_step
from equipax.core.task import AbstractTask, trainable
from equipax.launch.configs.experiment import ExperimentConfig
from equipax.launch.program.program import Program, build_program, with_shardings

__all__ = ["build_training", "INIT_COMPILER_OPTIONS", "Training"]

# The initialisation runs once per job, so XLA compiles it at its lowest effort (its effort level
# O0, 9 in XLA's numbering): the initial state is the same bit for bit, on the TPU v5e and on the
# CPU, and on the v5e's host the compile alone takes about half the time (c4_1b at 6 layers: 6.5-6.7
# s at O0, 12.6-12.8 s at the default when it is not the process's first compile;
# benchmarks/init_effort.py and compile_overlap.py, benchmarks/README.md "On a real TPU, seventh
# session"). End to end, with the policy named, the time to the first step is the same either way
# (the train step's compile is the longer; "eighth session"); the initialisation frees the host's
# cores sooner, which counts beside remat="auto"'s compiles.
INIT_COMPILER_OPTIONS: dict[str, Any] = {"optimization_level": 9}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Training(Program):
    """A `Program` that trains: the learner, the train state and the train step besides the model.

    Attributes:
        learner: the optimizer and its schedule.
        abstract_state: the train state's shapes, dtypes and shardings (`jax.ShapeDtypeStruct`s).
        state_sharding: NamedShardings of the state's arrays.
        train_step: the jitted train step (`state, batch, key -> state, metrics`), non-finite
            updates skipped in-graph.
    """

    learner: Learner
    abstract_state: TrainState[Any]
    state_sharding: Any
    train_step: TrainStep[Any]

    def init_state(self) -> TrainState[Any]:
        """The initial train state, built directly in its sharded layout (no full copy on one device)."""
        return self.compile_init()(self.keys.init)

    def lower_init(self) -> Any:
        """`init_state`'s program, lowered (nothing is allocated). No remat policy changes it."""
        return self._init_program().lower(self.keys.init)

    def compile_init(self) -> Any:
        """`init_state`'s program, compiled with `INIT_COMPILER_OPTIONS`: compiled ahead (remat
        "auto" compiles it beside its candidates), JAX's persistent compilation cache holds it for
        `init_state`."""
        return self.lower_init().compile(compiler_options=INIT_COMPILER_OPTIONS)

    def _init_program(self) -> Any:
        def make(key: PRNGKeyArray) -> TrainState[Any]:
            return eqx.filter_shard(_initial_state(self.task, self.learner.optimizer, key), self.state_sharding)

        return eqx.filter_jit(make)

    def start_optimizer(self, state: TrainState[Any]) -> TrainState[Any]:
        """`state` of a checkpoint that holds the model alone (`opt_state=None`: `launch convert
        hf-import`'s step 0), with the optimizer state a fresh run starts from, in its sharded layout."""

        def make(state: TrainState[Any]) -> TrainState[Any]:
            fresh = init_train_state(state.model, self.learner.optimizer, model_state=state.model_state)
            return eqx.filter_shard(eqx.tree_at(lambda s: s.step, fresh, state.step), self.state_sharding)

        return eqx.filter_jit(make)(state)

    def lower(self) -> Any:
        """Lower the train step on abstract arguments: nothing is allocated."""
        return self.trace().lower()

    def trace(self) -> Any:
        """Trace the train step on abstract arguments (`jax.stages.Traced`: its `jaxpr`, and
        `lower()`); nothing is allocated."""
        key = jax.eval_shape(lambda: self.keys.step)
        return self.train_step.trace(self.abstract_state, self.abstract_batch(), key)


def _initial_state(
    task: AbstractTask[Any], optimizer: optax.GradientTransformation, key: PRNGKeyArray
) -> TrainState[Any]:
    model, model_state = task.init(key)
    return init_train_state(model, optimizer, model_state=model_state)


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
    """`build_program`, plus the learner, the train state's shardings and the jitted train step.

    Nothing is allocated: the state is traced abstractly (`Training.init_state()` builds it).

    Arguments:
        cfg: the resolved experiment.
        mesh: the mesh to shard over (`equipax.core.mesh.build_mesh`).
        feeds_batches: as `build_program`'s (False for an AOT compile).

    Returns:
        A `Training`.
    """
    program = build_program(cfg, mesh, feeds_batches=feeds_batches)
    learner = make_learner(cfg.learner)
    abstract = eqx.filter_eval_shape(
        lambda m, s: init_train_state(m, learner.optimizer, model_state=s),
        program.abstract_model,
        program.abstract_model_state,
    )
    state_sharding = train_state_shardings(abstract, learner.optimizer, mesh, dict(cfg.mesh.logical_axis_rules))
    train_step = make_train_step(
        program.task,
        learner.optimizer,
        learner.schedule,
        state_sharding=state_sharding,
        batch_sharding=program.batch_sharding,
        skip_nonfinite=True,
        check_update_norm=cfg.train.check_update_norm,
        variational_noise=_checked_vn(cfg, abstract.model),
        group_schedules=group_schedules(cfg.learner),
        platform=mesh_platform(mesh),
    )
    return Training(
        **{f.name: getattr(program, f.name) for f in dataclasses.fields(Program)},
        learner=learner,
        abstract_state=with_shardings(abstract, state_sharding),
        state_sharding=state_sharding,
        train_step=train_step,
    )
