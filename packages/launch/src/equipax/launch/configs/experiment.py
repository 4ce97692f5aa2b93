"""The experiment config: task (model + data) + learner + training loop + mesh, fully resolved.

One shape for every experiment: `model` and `data` are the task part (an `LMConfig` or a
`LlamaConfig` with token `DataConfig`, or a `CNNConfig` with an `ImageDataConfig`); the learner, the loop and the mesh
are the same knobs for all. An experiment is a pure value: building it never touches devices or
files. Derived numbers (parameters, tokens per step) come from `equipax.launch.tasks`.
"""

import dataclasses
import shlex
from typing import Any, ClassVar, Literal, Protocol, cast, runtime_checkable

from equipax.core.configs import LearnerConfig, MeshConfig
from equipax.launch.configs.data import BYTE_VOCAB_SIZE, DataConfig, ImageDataConfig
from equipax.models.configs import CNNConfig, LlamaConfig, LMConfig

__all__ = [
    "BYTE_VOCAB_SIZE",
    "DataConfig",
    "ExperimentConfig",
    "FamilyDataConfig",
    "FamilyModelConfig",
    "ImageDataConfig",
    "LMExperiment",
    "TrainConfig",
    "as_lm",
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
class TrainConfig:
    """The host loop around the jitted step.

    num_steps: training steps; num_epochs: when set, train this many passes over a finite
    training set instead (num_steps is then ignored: steps = num_epochs x examples // batch),
    and at each epoch's end the loop evaluates on the whole eval set, writes an `epoch` record
    (train loss/accuracy of the epoch, test loss/accuracy) and saves a checkpoint.
    eval_batches: batches per eval run; 0 = one whole pass of the eval input.
    log_every, eval_every, checkpoint_every: steps between metric lines (stdout, metrics.jsonl,
    TensorBoard), between evaluations, and between checkpoints. keep_checkpoints: how many of the
    newest checkpoints are kept. seed: the root seed of the init and step keys (the data has
    its own `data.seed`). peak_tflops_per_device: the device's peak TFLOP/s for the MFU figure;
    None = looked up from the device kind.
    sample_tokens, sample_prompt, sample_temperature: language models only: the sample generated
    after training.
    decode_every: language models only: every this many steps (0 = never), continue each of
    `decode_prompts` by `decode_tokens` tokens with the KV cache (greedy at decode_temperature 0),
    written to metrics.jsonl (split "decode") and TensorBoard text (Pax's decode during training).

    on_nonfinite: a step whose loss or gradient norm is not finite never updates the state
    (in-graph). "skip" carries on, and stops (exit 4) once more than
    `max_consecutive_nonfinite` steps in a row were skipped; "abort" stops at the first one.
    debug_nan_steps: FOR TESTS ONLY: these steps' batches get NaN weights (a poisoned batch).

    profile_steps: trace this many steps with `jax.profiler` into `<job>/profile/` (0 = off;
    `launch run --profile START:COUNT`); profile_start_step: the first traced step (None = the
    run's second step, so the window never holds the compiling first step unless asked for);
    profile_all_processes: trace every process, not only process 0 (docs/pgle.md).
    pgle: XLA's profile-guided latency estimator (GPU): "auto" is JAX's automatic PGLE
    (`pgle_profiling_runs` profiled runs, then a recompile; profiles aggregated at
    `pgle_aggregation_percentile`); "manual" compiles with the profile at `pgle_profile_path`
    (written by `launch pgle collect`).

    xla_flags: XLA flags added to `XLA_FLAGS` before JAX starts (`launch run`, `launch compile`),
    e.g. "--xla_gpu_enable_latency_hiding_scheduler=true"; a flag of the same name already in the
    environment is replaced. XLA:CPU refuses flags it does not know: TPU flags go in libtpu_init_args.
    libtpu_init_args: flags added to `LIBTPU_INIT_ARGS`, which libtpu reads when it loads (TPU runs
    and `launch compile --topology`): Pax's and MaxText's way of passing XLA:TPU flags, e.g.
    "--xla_tpu_enable_latency_hiding_scheduler=true" (docs/compile.md, "Compiler flags").
    """

    num_steps: int = 1000
    num_epochs: int | None = None
    log_every: int = 20
    eval_every: int = 250
    eval_batches: int = 8
    checkpoint_every: int = 250
    keep_checkpoints: int = 3
    seed: int = 0
    sample_tokens: int = 200
    sample_prompt: str = "ROMEO:"
    sample_temperature: float = 0.8
    decode_every: int = 0
    decode_prompts: tuple[str, ...] = ("ROMEO:",)
    decode_tokens: int = 32
    decode_temperature: float = 0.0
    peak_tflops_per_device: float | None = None
    on_nonfinite: Literal["skip", "abort"] = "skip"
    max_consecutive_nonfinite: int = 3
    debug_nan_steps: tuple[int, ...] = ()
    profile_steps: int = 0
    profile_start_step: int | None = None
    profile_all_processes: bool = False
    pgle: Literal["off", "auto", "manual"] = "off"
    pgle_profiling_runs: int = 3
    pgle_aggregation_percentile: int = 90
    pgle_profile_path: str = ""
    xla_flags: str = ""
    libtpu_init_args: str = ""

    def __post_init__(self) -> None:
        self._check_profiling()
        if self.max_consecutive_nonfinite < 0:
            raise ValueError(f"train.max_consecutive_nonfinite must be >= 0; got {self.max_consecutive_nonfinite}.")
        if self.num_epochs is not None and self.num_epochs <= 0:
            raise ValueError(f"train.num_epochs must be positive or None; got {self.num_epochs}.")
        for name in ("num_steps", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints"):
            if getattr(self, name) <= 0:
                raise ValueError(f"train.{name} must be positive; got {getattr(self, name)}.")
        if self.eval_batches < 0 or self.sample_tokens < 0:
            raise ValueError("train.eval_batches and train.sample_tokens must be >= 0.")
        if self.sample_temperature < 0:
            raise ValueError(f"train.sample_temperature must be >= 0; got {self.sample_temperature}.")
        if self.decode_every < 0 or self.decode_tokens < 1 or self.decode_temperature < 0:
            raise ValueError(
                f"train.decode_every must be >= 0 (0 = off), train.decode_tokens >= 1 and train.decode_temperature "
                f">= 0; got {self.decode_every}, {self.decode_tokens}, {self.decode_temperature}."
            )
        for name in ("xla_flags", "libtpu_init_args"):
            try:
                shlex.split(getattr(self, name))
            except ValueError as e:
                raise ValueError(
                    f"train.{name}={getattr(self, name)!r} does not split into flags ({e}); "
                    "give space-separated flags, quoting a value with spaces."
                ) from None
        if self.decode_every and not self.decode_prompts:
            raise ValueError(
                "train.decode_every > 0 needs at least one train.decode_prompts, e.g. "
                "--set \"train.decode_prompts=('ROMEO:',)\"."
            )

    def _check_profiling(self) -> None:
        if self.profile_steps < 0:
            raise ValueError(f"train.profile_steps must be >= 0 (0 = no profile); got {self.profile_steps}.")
        if self.profile_start_step is not None and self.profile_start_step < 1:
            raise ValueError(
                f"train.profile_start_step must be a step >= 1, or None for the run's second "
                f"step; got {self.profile_start_step}."
            )
        if self.pgle not in ("off", "auto", "manual"):
            raise ValueError(f"train.pgle must be 'off', 'auto' or 'manual'; got {self.pgle!r}.")
        if self.pgle_profiling_runs < 1:
            raise ValueError(f"train.pgle_profiling_runs must be >= 1; got {self.pgle_profiling_runs}.")
        if not 0 <= self.pgle_aggregation_percentile <= 100:
            raise ValueError(
                f"train.pgle_aggregation_percentile must be in [0, 100]; got {self.pgle_aggregation_percentile}."
            )
        if self.pgle == "manual" and not self.pgle_profile_path:
            raise ValueError(
                "train.pgle='manual' needs train.pgle_profile_path: the profile.pb written by "
                "`launch pgle collect --exp NAME` (docs/pgle.md)."
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExperimentConfig:
    """A registered experiment, resolved: everything a run needs.

    Attributes:
        name: the registered name (`launch run --exp NAME`).
        description: one line shown by `launch list` and `launch show`.
    """

    name: str
    description: str = ""
    model: LMConfig | LlamaConfig | CNNConfig | FamilyModelConfig = dataclasses.field(default_factory=LMConfig)
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
        if self.train.decode_every and self.kind != "lm":
            raise ValueError(
                f"train.decode_every={self.train.decode_every} samples text from a language model; "
                f"this is a {self.kind} experiment. Set train.decode_every=0."
            )
        self.data.check_eval_batches(self.train.eval_batches)
        split = self.mesh.batch_parallelism
        if self.global_batch_size % split:
            raise ValueError(
                f"The global batch {self.global_batch_size} is not divisible by the data-parallel "
                f"size {split} (mesh axes data x fsdp of {self.mesh.shape}); change data.batch_size "
                f"(or data.per_device_batch) to a multiple of {split}, or change the mesh."
            )
        check_mesh = getattr(self.model, "check_mesh", None)
        if check_mesh is not None:  # the model's own constraints on the mesh (pipeline stages)
            check_mesh(self.mesh, self.global_batch_size)
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
    def model(self) -> LMConfig | LlamaConfig: ...
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


def as_lm(cfg: ExperimentConfig) -> LMExperiment:
    """`cfg` typed as a language-model experiment (TypeError if its data is not token data)."""
    if cfg.kind != "lm":
        raise TypeError(f"{cfg.name} is a {cfg.kind} experiment, not a language model.")
    return cast(LMExperiment, cfg)
