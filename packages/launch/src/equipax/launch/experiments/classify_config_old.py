"""The config of an image-classification experiment: model + data + learner + epoch loop.

Like `ExperimentConfig`, a pure value: building one never touches devices or files. `launch run`
trains it with the epoch-based loop in `equipax.launch.training.classify_old`.
"""

import dataclasses
from typing import Literal

from equipax.core.optim import LearnerConfig
from equipax.models.cnn import CNNConfig

# The digits' fixed geometry (equipax.data.load_digits).
DIGITS_IMAGE_SIZE = 8
DIGITS_CHANNELS = 1
DIGITS_CLASSES = 10
DIGITS_COUNT = 1797


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImageDataConfig:
    """Labelled images.

    source: "synthetic" (the tutorial's standard-normal images with random labels: nothing to
    learn, test accuracy stays at chance) or "digits" (1797 8x8 handwritten digits, split once
    into train and test by `seed`).
    batch_size: the global batch (all hosts together).
    num_train, num_test, image_size, channels, num_classes: synthetic only; the digits are
    8x8x1 with 10 classes.
    test_fraction: digits only: the share of images held out for testing.
    shuffle: reshuffle the training images every epoch (the tutorial keeps their order).
    seed: the data seed (synthetic images; the digits' split and shuffling).
    """

    source: Literal["synthetic", "digits"] = "synthetic"
    batch_size: int = 32
    num_train: int = 1000
    num_test: int = 200
    image_size: int = 32
    channels: int = 3
    num_classes: int = 10
    test_fraction: float = 0.2
    shuffle: bool = True
    seed: int = 0

    def __post_init__(self):
        if self.source not in ("synthetic", "digits"):
            raise ValueError(f"data.source must be 'synthetic' or 'digits'; got {self.source!r}.")
        for name in ("batch_size", "num_train", "num_test", "image_size", "channels", "num_classes"):
            if getattr(self, name) < 1:
                raise ValueError(f"data.{name} must be positive; got {getattr(self, name)}.")
        if not 0.0 < self.test_fraction < 1.0:
            raise ValueError(f"data.test_fraction must be in (0, 1); got {self.test_fraction}.")
        if self.seed < 0:
            raise ValueError(f"data.seed must be >= 0; got {self.seed}.")

    @property
    def input_channels(self) -> int:
        """Channels of the images this source yields."""
        return DIGITS_CHANNELS if self.source == "digits" else self.channels

    @property
    def input_classes(self) -> int:
        """Number of classes of this source."""
        return DIGITS_CLASSES if self.source == "digits" else self.num_classes

    @property
    def train_size(self) -> int:
        """Training images."""
        if self.source == "digits":
            return DIGITS_COUNT - round(DIGITS_COUNT * self.test_fraction)
        return self.num_train


@dataclasses.dataclass(frozen=True, kw_only=True)
class EpochTrainConfig:
    """The epoch loop.

    num_epochs: passes over the training images (each `train_size // batch_size` steps).
    log_every: write step metrics (loss, learning rate, gradient norm) every N steps.
    checkpoint_every_epochs: checkpoint after every N epochs (and always after the last).
    keep_checkpoints: how many recent checkpoints to keep.
    seed: the root of the init and dropout keys.
    """

    num_epochs: int = 5
    log_every: int = 10
    checkpoint_every_epochs: int = 1
    keep_checkpoints: int = 3
    seed: int = 0

    def __post_init__(self):
        for name in ("num_epochs", "log_every", "checkpoint_every_epochs", "keep_checkpoints"):
            if getattr(self, name) <= 0:
                raise ValueError(f"train.{name} must be positive; got {getattr(self, name)}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClassifierExperimentConfig:
    """A registered image-classification experiment, resolved."""

    name: str
    description: str = ""
    model: CNNConfig = dataclasses.field(default_factory=CNNConfig)
    data: ImageDataConfig = dataclasses.field(default_factory=ImageDataConfig)
    learner: LearnerConfig = dataclasses.field(default_factory=LearnerConfig)
    train: EpochTrainConfig = dataclasses.field(default_factory=EpochTrainConfig)

    @property
    def steps_per_epoch(self) -> int:
        """Full batches per epoch (the remainder of the training images is dropped)."""
        return self.data.train_size // self.data.batch_size

    @property
    def num_steps(self) -> int:
        """Optimizer steps over all epochs."""
        return self.steps_per_epoch * self.train.num_epochs

    def __post_init__(self):
        if self.model.in_channels != self.data.input_channels:
            raise ValueError(
                f"model.in_channels={self.model.in_channels} but data.source={self.data.source!r} "
                f"yields {self.data.input_channels}-channel images; set "
                f"model.in_channels={self.data.input_channels}.")
        if self.model.num_classes != self.data.input_classes:
            raise ValueError(
                f"model.num_classes={self.model.num_classes} but data.source={self.data.source!r} "
                f"has {self.data.input_classes} classes; set model.num_classes={self.data.input_classes}.")
        if self.steps_per_epoch < 1:
            raise ValueError(
                f"data.batch_size={self.data.batch_size} exceeds the {self.data.train_size} training "
                "images: an epoch would have no full batch. Lower data.batch_size.")
