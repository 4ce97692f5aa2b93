"""The image sources of `ImageDataConfig` (`data.source`): synthetic images and the handwritten digits.

Each class says what its images look like (size, channels, classes, training images), checks its
knobs and loads its train and test arrays; `equipax.launch.tasks.image_family` feeds them to the loop.
"""

from typing import TYPE_CHECKING, Any, ClassVar

from equipax.launch.configs.sources import Source, register_source

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "Digits",
    "ImageSource",
    "SyntheticImages",
    "DIGITS_CHANNELS",
    "DIGITS_CLASSES",
    "DIGITS_COUNT",
    "DIGITS_IMAGE_SIZE",
    "SYNTHETIC_TEST",
    "SYNTHETIC_TRAIN",
]

# The digits' fixed geometry (equipax.data.load_digits).
DIGITS_IMAGE_SIZE = 8
DIGITS_CHANNELS = 1
DIGITS_CLASSES = 10
DIGITS_COUNT = 1797

# The synthetic source's image counts where `data.num_train` / `data.num_test` are unset (the
# tutorial's).
SYNTHETIC_TRAIN = 1000
SYNTHETIC_TEST = 200

Arrays = tuple["np.ndarray", "np.ndarray"]


class ImageSource(Source):
    """A source of labelled images (base class)."""

    kind: ClassVar[str] = "image_classification"

    def image_size(self, data: Any) -> int:
        """Height and width of the images."""
        return data.image_size

    def channels(self, data: Any) -> int:
        """Channels of the images."""
        return data.channels

    def classes(self, data: Any) -> int:
        """Number of label classes."""
        return data.num_classes

    def train_size(self, data: Any) -> int:
        """Training images (one epoch)."""
        raise NotImplementedError

    def test_size(self, data: Any) -> int:
        """Test images (one evaluation pass)."""
        raise NotImplementedError

    def load(self, data: Any) -> tuple[Arrays, Arrays]:
        """`((train_images, train_labels), (test_images, test_labels))`, the whole split on every host."""
        raise NotImplementedError


@register_source
class SyntheticImages(ImageSource):
    """The tutorial's standard-normal images with random labels (nothing to learn: test accuracy
    stays at chance); `data.num_train`, `num_test`, `image_size`, `channels`, `num_classes`."""

    name: ClassVar[str] = "synthetic"

    def train_size(self, data: Any) -> int:
        return SYNTHETIC_TRAIN if data.num_train is None else data.num_train

    def test_size(self, data: Any) -> int:
        return SYNTHETIC_TEST if data.num_test is None else data.num_test

    def load(self, data: Any) -> tuple[Arrays, Arrays]:
        from equipax.data import synthetic_images

        # Separate seeds: the tutorial drew its test set with the training set's key.
        shape: dict[str, Any] = dict(image_size=data.image_size, channels=data.channels, num_classes=data.num_classes)
        return (
            synthetic_images(self.train_size(data), seed=data.seed, **shape),
            synthetic_images(self.test_size(data), seed=data.seed + 1, **shape),
        )


@register_source
class Digits(ImageSource):
    """1797 8x8 one-channel handwritten digits in 10 classes, split once into train and test by
    `data.seed` (`data.test_fraction` held out); `data.num_train` / `data.num_test` keep the first
    that many of each split (the split itself is the same whatever they are), unset: all of it."""

    name: ClassVar[str] = "digits"

    @staticmethod
    def _splits(data: Any) -> tuple[int, int]:
        """(train, test) images of the whole seeded split at `data.test_fraction`."""
        test = round(DIGITS_COUNT * data.test_fraction)
        return DIGITS_COUNT - test, test

    def check(self, data: Any) -> None:
        train, test = self._splits(data)  # ImageDataConfig checked the fraction first
        for knob, value, available in (("num_train", data.num_train, train), ("num_test", data.num_test, test)):
            if value is not None and value > available:
                raise ValueError(
                    f"data.{knob}={value} but the digits' {knob[4:]} split has {available} images "
                    f"(data.test_fraction={data.test_fraction} of {DIGITS_COUNT}); set data.{knob}<={available}, "
                    f"or unset it to use the whole split."
                )

    def image_size(self, data: Any) -> int:
        return DIGITS_IMAGE_SIZE

    def channels(self, data: Any) -> int:
        return DIGITS_CHANNELS

    def classes(self, data: Any) -> int:
        return DIGITS_CLASSES

    def train_size(self, data: Any) -> int:
        return self._splits(data)[0] if data.num_train is None else data.num_train

    def test_size(self, data: Any) -> int:
        return self._splits(data)[1] if data.num_test is None else data.num_test

    def load(self, data: Any) -> tuple[Arrays, Arrays]:
        from equipax.data import split_digits

        (train_x, train_y), (test_x, test_y) = split_digits(data.test_fraction, seed=data.seed)
        n, m = self.train_size(data), self.test_size(data)
        return (train_x[:n], train_y[:n]), (test_x[:m], test_y[:m])
