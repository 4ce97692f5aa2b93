"""The experiment config: task (model + data) + learner + training loop + mesh, fully resolved.

One shape for every experiment: `model` and `data` are the task part (an `LMConfig`, any LM family,
with token `DataConfig`, or a `CNNConfig` with an `ImageDataConfig`); the learner, the loop and the mesh
are the same knobs for all. An experiment is a pure value: building it never touches devices or
files. Derived numbers (parameters, tokens per step) come from `equipax.launch.tasks`.
"""

import dataclasses
from typing import Any, ClassVar, Protocol, cast, runtime_checkable

from equipax.core.knobs import ConfigError
from equipax.core.learner_config import LearnerConfig
from equipax.core.mesh_config import CONTEXT, MeshConfig
from equipax.launch.configs.data import BYTE_VOCAB_SIZE, DataConfig, ImageDataConfig
from equipax.launch.configs.train import TrainConfig
from equipax.models.configs import CNNConfig, LMConfig

__all__ = [
    "BYTE_VOCAB_SIZE",
    "DataConfig",
    "ExperimentConfig",
    "FamilyDataConfig",
    "FamilyModelConfig",
    "ImageDataConfig",
    "LMExperiment",
    "as_lm",
    "is_lm",
]


@runtime_checkable
class FamilyModelConfig(Protocol):
    """The model config of a family registered outside equipax (docs/extending.md): any frozen
    dataclass of knobs; its family's Task reads them."""

    __dataclass_fields__: ClassVar[dict[str, Any]]


@runtime_checkable
class FamilyDataConfig(Protocol):
    """The data config of a family registered outside equipax: a frozen dataclass whose `kind` names
    the family (`register_family`), with what `ExperimentConfig` asks of every data config."""

    __dataclass_fields__: ClassVar[dict[str, Any]]
    kind: ClassVar[str]
    batch_size: int
    per_device_batch: int | None

    @property
    def train_examples(self) -> int | None: ...
    def check_model(self, model: object) -> None: ...
    def check_eval_batches(self, eval_batches: int) -> None: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExperimentConfig:
    """A registered experiment, resolved: everything a run needs.

    Attributes:
        name: the registered name (`launch run --exp NAME`).
        description: one line shown by `launch list` and `launch show`.
    """

    name: str
    description: str = ""
    model: LMConfig | CNNConfig | FamilyModelConfig = dataclasses.field(default_factory=LMConfig)
    data: DataConfig | ImageDataConfig | FamilyDataConfig = dataclasses.field(default_factory=DataConfig)
    learner: LearnerConfig = dataclasses.field(default_factory=LearnerConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)

    def for_devices(self, num_devices: int) -> "ExperimentConfig":
        """This experiment with a -1 mesh axis sized for `num_devices` (validated again)."""
        if not self.mesh.flexible:
            return self
        return dataclasses.replace(self, mesh=self.mesh.fit(num_devices))

    @property
    def kind(self) -> str:
        """The task family: "lm" or "image_classification" (`equipax.launch.tasks`)."""
        return self.data.kind

    @property
    def global_batch_size(self) -> int:
        """Examples per step over all hosts (derived from the mesh with per_device_batch)."""
        if self.data.per_device_batch is not None:
            return self.data.per_device_batch * self.mesh.num_devices
        return self.data.batch_size

    @property
    def steps_per_epoch(self) -> int | None:
        """Full batches in one pass over the training data; None for a stream."""
        n = self.data.train_examples
        return None if n is None else n // self.global_batch_size

    @property
    def num_steps(self) -> int:
        """Training steps: `train.num_steps`, or `train.num_epochs` epochs."""
        spe = self.steps_per_epoch
        if self.train.num_epochs is not None and spe is not None:
            return self.train.num_epochs * spe
        return self.train.num_steps

    def __post_init__(self) -> None:
        self.data.check_model(self.model)
        if self.train.decode.every and self.kind != "lm":
            raise ValueError(
                f"train.decode.every={self.train.decode.every} samples text from a language model; "
                f"this is a {self.kind} experiment. Set train.decode.every=0."
            )
        self.data.check_eval_batches(self.train.eval_batches)
        split = self.mesh.batch_parallelism
        if self.global_batch_size % split:
            raise ValueError(
                f"The global batch {self.global_batch_size} is not divisible by the data-parallel "
                f"size {split} (mesh axes data x fsdp of {self.mesh.shape}); change data.batch_size "
                f"(or data.per_device_batch) to a multiple of {split}, or change the mesh."
            )
        if self.kind != "lm" and self.mesh.axis_size(CONTEXT) > 1:
            raise ConfigError(
                f"The mesh's `context` axis ({self.mesh.axis_size(CONTEXT)} devices, axes {self.mesh.axis_names}) "
                f"splits a token sequence; this is a {self.kind} experiment, which has none. Make the `context` "
                "axis 1 (or drop it from mesh.axis_names)."
            )
        check_mesh = getattr(self.model, "check_mesh", None)
        if check_mesh is not None:  # the model's own constraints on the mesh (pipeline stages, context)
            check_mesh(self.mesh, self.global_batch_size, getattr(self.data, "seq_len", None))
        if self.train.num_epochs is not None:
            if self.steps_per_epoch is None:
                raise ValueError(
                    f"train.num_epochs={self.train.num_epochs} needs a finite training set, but "
                    f"data.source={getattr(self.data, 'source', self.kind)!r} is a stream; set train.num_steps instead "
                    "(and train.num_epochs=None)."
                )
            if self.steps_per_epoch < 1:
                raise ValueError(
                    f"The global batch {self.global_batch_size} exceeds the {self.data.train_examples} "
                    "training examples: an epoch would have no full batch. Lower data.batch_size."
                )


@runtime_checkable
class LMExperiment(Protocol):
    """An ExperimentConfig whose task part is a language model: what `as_lm` returns (typed view)."""

    @property
    def name(self) -> str: ...
    @property
    def model(self) -> LMConfig: ...
    @property
    def data(self) -> DataConfig: ...
    @property
    def train(self) -> TrainConfig: ...
    @property
    def mesh(self) -> MeshConfig: ...
    @property
    def global_batch_size(self) -> int: ...
    @property
    def num_steps(self) -> int: ...


def is_lm(cfg: ExperimentConfig) -> bool:
    """Whether `cfg` is a language-model experiment (its data is token data: `as_lm` takes it)."""
    return cfg.kind == "lm"


def as_lm(cfg: ExperimentConfig) -> LMExperiment:
    """`cfg` typed as a language-model experiment (TypeError if its data is not token data)."""
    if not is_lm(cfg):
        raise TypeError(f"{cfg.name} is a {cfg.kind} experiment, not a language model.")
    return cast(LMExperiment, cfg)
