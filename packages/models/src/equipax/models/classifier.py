"""Classification loss (Pax's `ClassificationModel`): softmax cross-entropy on integer labels,
accuracy, per-example weights.

`classification_loss` is a stateful loss function for `equipax.core.step.make_train_step`:
`loss_fn(model, batch, *, key, model_state) -> (loss, aux, new_model_state)`. The batch holds
`images` `[batch height width channels]`, `labels` `[batch]` and optional `weights` `[batch]`
(0 for padding rows). `key=None` is evaluation: BatchNorm uses its running statistics (which
stay unchanged) and dropout is off.
"""

from collections.abc import Callable, Mapping

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray, Scalar

from equipax.core.task import AbstractTask, Batch, Metrics
from equipax.models.cnn import AdvancedCNN, CNNConfig

__all__ = ["classification_loss", "classification_metrics", "ImageClassificationTask", "ImageClassifier"]

# `model(images, state, *, key, inference) -> (logits, state)`, e.g. `AdvancedCNN`.
ImageClassifier = Callable[..., tuple[Float[Array, "batch classes"], eqx.nn.State]]


def classification_metrics(
    logits: Float[Array, "batch classes"], labels: Int[Array, " batch"], weights: Float[Array, " batch"]
) -> tuple[Scalar, dict[str, Array]]:
    """Weighted mean cross-entropy, and summed metrics that combine over batches by addition.

    Arguments:
        logits: class logits.
        labels: integer class labels.
        weights: per-example weights (0 drops an example).

    Returns:
        `(mean loss, aux)`; aux holds `accuracy` (this batch's weighted accuracy), `loss_sum`,
        `correct_sum` and `weight_sum`.
    """
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    weight_sum = jnp.sum(weights)
    denom = jnp.maximum(weight_sum, 1e-9)
    loss_sum = jnp.sum(losses * weights)
    correct_sum = jnp.sum(correct * weights)
    aux = {"accuracy": correct_sum / denom, "loss_sum": loss_sum, "correct_sum": correct_sum, "weight_sum": weight_sum}
    return loss_sum / denom, aux


def classification_loss(
    model: ImageClassifier,
    batch: Mapping[str, Array | np.ndarray],
    *,
    key: PRNGKeyArray | None,
    model_state: eqx.nn.State,
) -> tuple[Scalar, dict[str, Array], eqx.nn.State]:
    """Softmax cross-entropy of `model` on a batch of labelled images.

    Arguments:
        model: `model(images, state, *, key, inference) -> (logits, state)`.
        batch: `images`, `labels` and optionally `weights`.
        key: dropout key for training; None evaluates (running BatchNorm statistics, no dropout).
        model_state: the model's BatchNorm state.

    Returns:
        `(mean loss, aux, new_model_state)`; see `classification_metrics` for aux.
    """
    images = jnp.asarray(batch["images"])
    labels = jnp.asarray(batch["labels"])
    weights = jnp.asarray(batch["weights"], jnp.float32) if "weights" in batch else jnp.ones(labels.shape, jnp.float32)
    logits, new_state = model(images, model_state, key=key, inference=key is None)
    loss, aux = classification_metrics(logits, labels, weights)
    return loss, aux, new_state


class ImageClassificationTask(AbstractTask[AdvancedCNN]):
    """Train an `AdvancedCNN` on labelled images (Pax's ClassificationModel task).

    Attributes:
        config: the CNN's hyperparameters.
        image_shape: `(height, width, channels)` of the images.
    """

    config: CNNConfig = eqx.field(static=True)
    image_shape: tuple[int, int, int] = eqx.field(static=True)

    def __check_init__(self) -> None:
        if self.image_shape[-1] != self.config.in_channels:
            raise ValueError(
                f"images have {self.image_shape[-1]} channels but the model reads "
                f"in_channels={self.config.in_channels}."
            )

    def init(self, key: PRNGKeyArray) -> tuple[AdvancedCNN, eqx.nn.State]:
        """The model and its BatchNorm state (`eqx.nn.make_with_state`)."""
        return eqx.nn.make_with_state(AdvancedCNN)(self.config, key=key)

    def loss(
        self, model: AdvancedCNN, batch: Batch, *, key: PRNGKeyArray | None, model_state: eqx.nn.State | None
    ) -> tuple[Scalar, Metrics, eqx.nn.State]:
        """`classification_loss`; `key=None` evaluates with the running BatchNorm statistics."""
        assert model_state is not None, "an AdvancedCNN needs its BatchNorm state"
        return classification_loss(model, batch, key=key, model_state=model_state)

    def abstract_batch(self, global_batch: int) -> dict[str, jax.ShapeDtypeStruct]:
        """`images` float32 `[batch height width channels]`, `labels` int32 and `weights` float32 `[batch]`."""
        return {
            "images": jax.ShapeDtypeStruct((global_batch, *self.image_shape), jnp.float32),
            "labels": jax.ShapeDtypeStruct((global_batch,), jnp.int32),
            "weights": jax.ShapeDtypeStruct((global_batch,), jnp.float32),
        }
