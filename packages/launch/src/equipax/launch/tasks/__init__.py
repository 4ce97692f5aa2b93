"""Task families as the launcher sees them: one `Family` per family, the same methods in each.

`equipax.core.task.AbstractTask` is the model side of a family (model, loss, eval sums, batch
shapes). What the launcher adds per family is a `Family` (`lm_family.py`, `image_family.py`):

- `numbers(cfg)`: derived numbers from the config alone (parameters, FLOPs, throughput units);
  pure and cheap, for `launch list` / `show` (no loop, no data, no devices);
- `make_task(cfg, mesh)`: the family's Task for this experiment;
- `build_inputs(cfg, job_dir, *, mesh, log)`: this host's train and eval inputs (`Inputs`): the
  rows of each global batch that `mesh` gives it (`equipax.core.infeed.host_infeed(mesh)`'s
  `num_infeed_hosts` and `infeed_host_index`);
- `finish(cfg, model, inputs, *, key, log)`: what a finished run adds (the LM's sample);
- `init_state(cfg, state, *, model_sharding, log)`: the state a run without a checkpoint starts
  from (the LM's `model.init_from=hf:DIR` weights);
- `data_fingerprint(cfg, job_dir)` and `vocabulary(cfg, job_dir)`: what a checkpoint's saved data
  position and ids mean beyond the data knobs (compared on resume), and the vocabulary file.

`family(cfg)` picks the implementation by `cfg.kind` (the data config's family name). A new
family subclasses `Family` (which gives the last three their defaults) and registers an instance
with `register_family(kind, impl)` (docs/extending.md).
"""

import dataclasses
import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from equipax.launch.configs.experiment import ExperimentConfig
from equipax.launch.store.storage import AnyPath

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from equipax.core.step import TrainState
    from equipax.core.task import AbstractTask
    from equipax.data import BaseInput
else:
    # Not imported at run time: equipax.data pulls in grain and orbax (seconds), which `launch list`
    # and `launch show` (derived_numbers) never use; `build_inputs` imports it when it runs.
    BaseInput = Any

__all__ = ["derived_numbers", "FAMILIES", "family", "Family", "Inputs", "register_family"]


@dataclasses.dataclass
class Inputs:
    """This host's inputs for one run, and what the family reports about them.

    Attributes:
        train: the training input (repeating).
        eval: the eval input (reset before each eval run).
        info: family-specific facts for the run's result (e.g. `unigram_entropy`).
        extra: family-specific objects the `finish` step needs (e.g. the tokenizer).
    """

    train: BaseInput
    eval: BaseInput
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


@runtime_checkable
class Family(Protocol):
    """What `launch run`, `compile`, `show`, `eval` and `decode` ask of a task family.

    Attributes:
        UNIT: what throughput counts ("tokens", "examples").
    """

    UNIT: ClassVar[str]

    def numbers(self, cfg: ExperimentConfig) -> dict[str, Any]:
        """Derived numbers from the config alone (`params_total`, `global_batch`, ...; for an LM also
        `model_flops_per_step`), for `launch show`: no JAX, no data, no devices."""
        ...

    def units_per_example(self, cfg: ExperimentConfig) -> int:
        """`UNIT`s per example (an LM's sequence length; 1 image)."""
        ...

    def make_task(self, cfg: ExperimentConfig, mesh: "Mesh | None") -> "AbstractTask[Any]":
        """The family's Task for `cfg` on `mesh`."""
        ...

    def build_inputs(
        self, cfg: ExperimentConfig, job_dir: AnyPath, *, mesh: "Mesh", log: Callable[[str], object]
    ) -> "Inputs":
        """This host's train and eval inputs: the rows of each global batch `mesh` gives it."""
        ...

    def finish(
        self, cfg: ExperimentConfig, model: Any, inputs: "Inputs", *, key: Any, log: Callable[[str], object]
    ) -> dict[str, Any]:
        """What a finished run adds to result.json (the LM's sample)."""
        ...

    def init_state(
        self, cfg: ExperimentConfig, state: "TrainState[Any]", *, model_sharding: Any, log: Callable[[str], object]
    ) -> "TrainState[Any]":
        """The state a run with no checkpoint starts from: `state` (the random initialisation), or
        with weights the family loads in the model's shardings (the LM's `model.init_from`)."""
        return state

    def data_fingerprint(self, cfg: ExperimentConfig, job_dir: AnyPath) -> dict[str, Any]:
        """What a checkpoint's saved data position and ids mean beyond the `data.*` knobs, JSON-ready
        (saved with each checkpoint, compared when the job resumes: `equipax.launch.training.resume_checks`):
        `knobs` (more knobs that must not change, e.g. `model.vocab_size`), `train_shards` (a
        fingerprint of the training examples on disk, or None) and `vocabulary` (of the vocabulary
        file, or None)."""
        return {"knobs": {}, "train_shards": None, "vocabulary": None}

    def vocabulary(self, cfg: ExperimentConfig, job_dir: AnyPath) -> AnyPath | None:
        """The vocabulary file the job's ids come from (None: the family has none). Reading a job
        from outside refuses to start when it is the job's own and missing (never training anew)."""
        return None


# cfg.kind -> a module of this package holding its `FAMILY` (imported on first use), or a registered Family.
FAMILIES: dict[str, "str | Family"] = {"lm": "lm_family", "image_classification": "image_family"}


def register_family(kind: str, impl: Family, *, configs: tuple[type, ...] = ()) -> None:
    """Make `launch run`/`compile`/`show` handle experiments whose `data.kind` is `kind`.

    Arguments:
        kind: the family's name (the data config's `kind` class attribute).
        impl: the family (a `Family`: subclass it and implement `UNIT`, `numbers`,
            `units_per_example`, `make_task`, `build_inputs` and `finish`).
        configs: the family's own config classes (its model and data configs), so a job's
            config.json reads back into them (`equipax.core.knobs.register_config`).
    """
    from equipax.core.knobs import register_config

    for cls in configs:
        register_config(cls)
    FAMILIES[kind] = impl


def family(cfg: ExperimentConfig) -> Family:
    """The implementation of `cfg`'s task family."""
    impl = FAMILIES.get(cfg.kind)
    if impl is None:
        raise KeyError(
            f"No task family {cfg.kind!r} is registered (known: {sorted(FAMILIES)}); "
            "call equipax.launch.tasks.register_family first."
        )
    return importlib.import_module(f"{__name__}.{impl}").FAMILY if isinstance(impl, str) else impl


def derived_numbers(cfg: ExperimentConfig) -> dict[str, Any]:
    """Numbers computed from the config alone (no devices touched)."""
    return family(cfg).numbers(cfg)
