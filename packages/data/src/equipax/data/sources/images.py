"""Labelled images held in memory, as a `BaseInput`; the tutorial's synthetic images.

Batches are `{"images": float32 [batch height width channels], "labels": int32 [batch],
"weights": float32 [batch]}`. A training input (`repeat=True`) walks epochs of
`len(images) // global_batch` full batches (the remainder is dropped, as the tutorial's
`create_batches` does), reshuffled each epoch from `(seed, epoch)` when `shuffle` is on. An eval
input (`repeat=False`) makes one pass in order over every image; the last batch is padded with
weight-0 rows so every host emits the same number of batches.
"""

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from jaxtyping import Float, Int

from equipax.data.base import BaseInput, Batch, check_positive, check_state_keys

__all__ = ["ImageClassificationInput", "synthetic_images"]


def synthetic_images(
    num_images: int, *, image_size: int = 32, channels: int = 3, num_classes: int = 10, seed: int = 0
) -> tuple[Float[np.ndarray, "n height width channels"], Int[np.ndarray, " n"]]:
    """Standard-normal images with uniformly random labels (the tutorial's synthetic data).

    The labels are independent of the pixels: no model can beat chance (1 / num_classes) on
    held-out images; training accuracy above chance is memorisation.

    Arguments:
        num_images: how many.
        image_size: height and width.
        channels: channels per pixel.
        num_classes: labels are drawn from `[0, num_classes)`.
        seed: data seed.

    Returns:
        `(images, labels)` as float32 and int32 numpy arrays.
    """
    check_positive("num_images", num_images)
    rng = np.random.default_rng(seed)
    images = rng.standard_normal((num_images, image_size, image_size, channels), dtype=np.float32)
    labels = rng.integers(0, num_classes, (num_images,), dtype=np.int32)
    return images, labels


class ImageClassificationInput(BaseInput):
    """Batches of labelled images from in-memory arrays. State is `{"step": n}`, the same on every host.

    The order is global: batch j of an epoch is images `order[j * G : (j + 1) * G]` of the epoch's
    order for the global batch G, and host h reads its contiguous rows `[h * batch_size, (h + 1) *
    batch_size)` of it, so the global batches are the same at any number of hosts (a job resumes
    on another number of hosts and devices with the same batches). Training drops an epoch's last
    partial batch; eval pads it (weight 0).

    **Arguments:**

    - `images`: `[n height width channels]` float images.
    - `labels`: `[n]` integer labels.
    - `shuffle`: training only: a new order every epoch, from `(seed, epoch)`.
    - `batch_size`, `num_infeed_hosts`, `infeed_host_index`, `seed`, `repeat`: see `BaseInput`.
    """

    global_state = True  # the global batch count

    def __init__(
        self,
        images: Float[np.ndarray, "n height width channels"],
        labels: Int[np.ndarray, " n"],
        *,
        batch_size: int,
        num_infeed_hosts: int = 1,
        infeed_host_index: int = 0,
        seed: int = 0,
        repeat: bool = True,
        shuffle: bool = True,
    ) -> None:
        super().__init__(
            batch_size=batch_size,
            num_infeed_hosts=num_infeed_hosts,
            infeed_host_index=infeed_host_index,
            seed=seed,
            repeat=repeat,
        )
        if len(images) != len(labels):
            raise ValueError(f"images and labels differ in length: {len(images)} vs {len(labels)}.")
        if repeat and len(images) < self.global_batch_size:
            raise ValueError(
                f"A training input needs at least one full global batch: {len(images)} images, "
                f"global batch {self.global_batch_size}. Lower the batch size or add images."
            )
        self.images: np.ndarray = np.asarray(images, np.float32)
        self.labels: np.ndarray = np.asarray(labels, np.int32)
        self.shuffle: bool = bool(shuffle)
        self._step = 0

    @property
    def steps_per_epoch(self) -> int:
        """Batches per epoch: full global batches (training) or padded batches (eval)."""
        n, gb = len(self.images), self.global_batch_size
        return n // gb if self.repeat else math.ceil(n / gb)

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.images))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.images))

    def get_next(self) -> Batch:
        spe, gb = self.steps_per_epoch, self.global_batch_size
        if not self.repeat and self._step >= spe:
            raise StopIteration
        epoch, j = divmod(self._step, spe)
        order = self._order(epoch) if self.repeat else np.arange(len(self.images))
        first = j * gb + self.infeed_host_index * self.batch_size
        idx = order[first : first + self.batch_size]
        n = len(idx)
        shape = (self.batch_size, *self.images.shape[1:])
        images = np.zeros(shape, np.float32)
        labels = np.zeros((self.batch_size,), np.int32)
        weights = np.zeros((self.batch_size,), np.float32)
        images[:n], labels[:n], weights[:n] = self.images[idx], self.labels[idx], 1.0
        self._step += 1
        return {"images": images, "labels": labels, "weights": weights}

    def reset(self) -> None:
        self._step = 0

    def get_state(self) -> dict[str, Any]:
        return {"step": self._step}

    def set_state(self, state: Mapping[str, Any]) -> None:
        self._step = check_state_keys(state, ("step",), type(self).__name__)["step"]
