"""The handwritten digits: 1797 8x8 grey images of the digits 0-9.

The UCI "Optical Recognition of Handwritten Digits" test set, as shipped in scikit-learn
(`digits.csv.gz` beside this module; attribution and licence in `DIGITS_LICENSE.txt`). Read
with numpy, so scikit-learn is not needed.
"""

import functools
import gzip
from pathlib import Path

import numpy as np
from jaxtyping import Float, Int

__all__ = ["DIGITS_FILE", "load_digits", "NUM_DIGITS", "split_digits"]

DIGITS_FILE = Path(__file__).with_name("digits.csv.gz")
NUM_DIGITS = 1797


@functools.cache
def _read() -> tuple[np.ndarray, np.ndarray]:
    with gzip.open(DIGITS_FILE, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.int32)
    return table[:, :64], table[:, 64]


def load_digits() -> tuple[Float[np.ndarray, "n height width channels"], Int[np.ndarray, " n"]]:
    """All 1797 digits.

    Returns:
        `(images, labels)`: float32 `[1797 8 8 1]` with pixels scaled from 0..16 to [0, 1], and
        int32 labels 0..9.
    """
    pixels, labels = _read()
    images = (pixels.astype(np.float32) / 16.0).reshape(-1, 8, 8, 1)
    return images, labels.copy()


def split_digits(
    test_fraction: float = 0.2, *, seed: int = 0
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """A fixed, seeded train/test split of the digits.

    Arguments:
        test_fraction: share of the images held out for testing, in (0, 1).
        seed: the split's seed; the same seed always gives the same split.

    Returns:
        `((train_images, train_labels), (test_images, test_labels))`.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1); got {test_fraction}.")
    images, labels = load_digits()
    order = np.random.default_rng(seed).permutation(len(images))
    num_test = round(len(images) * test_fraction)
    test, train = order[:num_test], order[num_test:]
    return (images[train], labels[train]), (images[test], labels[test])
