"""The Task: the contract between a model family and the training machinery.

Pax's Task bundles a model with its loss and metrics; here a Task is a small frozen value
(an `eqx.Module` with no arrays) that says, for one model family and one input shape:

- `init(key) -> (model, model_state)`: build the model (and its non-trained state, e.g.
  BatchNorm statistics in an `eqx.nn.State`; None for a stateless model);
- `loss(model, batch, *, key, model_state) -> (loss, aux, model_state)`: the scalar that is
  differentiated (or several named, weighted losses that the steps sum: `equipax.core.losses`),
  a dict of scalar metrics, and the new non-trained state. `key=None` means
  evaluation (no dropout, running statistics unchanged). `aux` carries the eval sums
  (`EVAL_SUMS`) so that results over batches combine by addition;
- `eval_sums(model, batch, *, model_state)`: those sums for one eval batch;
- `update_model(model, model_state) -> model` (optional): after a training step's update, the
  parameters the step's statistics set rather than the gradient (a mixture of experts' router
  biases, from the load the loss returned as its new state); default: the model unchanged;
- `abstract_batch(global_batch)`: the batch it consumes as `jax.ShapeDtypeStruct`s, for AOT
  lowering without data and for checking what an input produces (`check_batch`).

Everything else - the optimizer, sharding, the jitted steps, the loop, checkpoints - is
model-agnostic and lives outside the Task (`equipax.core.step`, `equipax.launch`). Adding a
model family means writing one Task (docs/extending.md).
"""

import abc
from collections.abc import Mapping
from typing import Any, Generic, TypeVar, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PRNGKeyArray, Scalar

from equipax.core.losses import NamedLosses, aggregate_losses, is_named_losses, named_loss_sums

__all__ = [
    "AbstractTask",
    "Batch",
    "BatchError",
    "EVAL_SUMS",
    "is_param",
    "Metrics",
    "ModelState",
    "ModelT",
    "trainable",
]

# The per-batch sums an eval step returns (combined by `equipax.core.step.mean_eval_metrics`).
EVAL_SUMS = ("loss_sum", "weight_sum", "correct_sum")

Metrics = dict[str, Array]
# A model's non-trained state: an `eqx.nn.State` (BatchNorm statistics), any other pytree of arrays
# (a mixture of experts' last load, `equipax.models.LMTask`), or None for a stateless model.
ModelState = eqx.nn.State | Array | None
# Host batches (numpy) are accepted as well as device arrays; jit transfers them.
Batch = Mapping[str, Array | np.ndarray]


class BatchError(ValueError):
    """A batch does not match what the Task consumes; the message names the field and the fix."""


ModelT = TypeVar("ModelT")


class AbstractTask(eqx.Module, Generic[ModelT]):
    """A model family's contract with the training machinery (module docstring), generic over
    the type of the model it builds (`AbstractTask[TransformerLM]`)."""

    @abc.abstractmethod
    def init(self, key: PRNGKeyArray) -> tuple[ModelT, ModelState]:
        """Build the model and its non-trained state (None when it has none).

        Arguments:
            key: the init key.

        Returns:
            `(model, model_state)`.
        """

    @abc.abstractmethod
    def loss(
        self, model: ModelT, batch: Batch, *, key: PRNGKeyArray | None, model_state: ModelState
    ) -> tuple[Scalar | NamedLosses, Metrics, ModelState]:
        """The training loss on one batch.

        Arguments:
            model: the model `init` built (with current parameters).
            batch: the batch (`abstract_batch` describes its fields).
            key: randomness for training (dropout); None evaluates deterministically.
            model_state: the non-trained state, or None.

        Returns:
            `(loss, aux, new_model_state)`; aux holds scalar metrics including `EVAL_SUMS`. `loss`
            is one scalar, or named losses `{name: (value, weight)}` that the steps sum, log as
            `loss/<name>` and evaluate each (`equipax.core.losses`).
        """

    @abc.abstractmethod
    def abstract_batch(self, global_batch: int) -> dict[str, jax.ShapeDtypeStruct]:
        """The fields of a batch of `global_batch` examples, as shapes and dtypes.

        Arguments:
            global_batch: examples per step over all hosts.

        Returns:
            `{field: ShapeDtypeStruct}`; fields a batch may omit are not listed.
        """

    def update_model(self, model: ModelT, model_state: ModelState) -> ModelT:
        """The model after a training step's optimizer update, given the step's new non-trained
        state: where a model keeps non-trained parameters that the step's statistics set (marked
        untrainable by its `trainable_spec`). Called inside the jitted train step; a skipped
        (non-finite) step discards it with the update. Default: the model unchanged."""
        return model

    def eval_sums(self, model: ModelT, batch: Batch, *, model_state: ModelState) -> Metrics:
        """Summed metrics of one eval batch (`EVAL_SUMS`, and `loss_sum/<name>` of each named loss:
        `equipax.core.losses`): deterministic, state unchanged."""
        loss, aux, _ = self.loss(model, batch, key=None, model_state=model_state)
        sums = {k: aux[k] for k in EVAL_SUMS}
        if is_named_losses(loss):
            sums |= named_loss_sums(aggregate_losses(cast(NamedLosses, loss))[1] | sums)
        return sums

    def check_batch(self, batch: Mapping[str, Any], batch_size: int) -> None:
        """Raise BatchError unless `batch` has the fields, shapes and dtype kinds expected.

        Arguments:
            batch: a (host) batch, e.g. the first an input produced.
            batch_size: its leading dimension (the per-host batch).
        """
        expected = self.abstract_batch(batch_size)
        missing = sorted(set(expected) - set(batch))
        if missing:
            raise BatchError(
                f"The input's batches lack the field(s) {missing} that {type(self).__name__} reads "
                f"(found {sorted(batch)}); make the input emit them."
            )
        for name, want in expected.items():
            got = batch[name]
            shape, dtype = tuple(np.shape(got)), np.asarray(got).dtype if not hasattr(got, "dtype") else got.dtype
            if shape != tuple(want.shape) or np.dtype(dtype).kind != np.dtype(want.dtype).kind:
                raise BatchError(
                    f"Batch field {name!r}: expected shape {tuple(want.shape)} of {np.dtype(want.dtype)}, "
                    f"found {shape} of {np.dtype(dtype)}. The input and the model config disagree "
                    "(check data.seq_len / data.batch_size / the image size against the model)."
                )


def trainable(model: Any) -> Any:
    """Which leaves of `model` the optimizer trains: a pytree of bools of the model's structure.

    `model.trainable_spec()` where the model defines it (a LoRA model trains its adapters, not
    its frozen base: `equipax.models.LoRALM`), else every inexact array. Leaves it marks False
    get no gradient, no optimizer state and no update: they stay bit-identical.
    """
    spec = getattr(model, "trainable_spec", None)
    return spec() if callable(spec) else jax.tree.map(is_param, model)


def is_param(x: Any) -> bool:
    """An inexact array, concrete or abstract (`jax.ShapeDtypeStruct`, as sharding rules see it)."""
    return eqx.is_inexact_array(x) or (isinstance(x, jax.ShapeDtypeStruct) and jnp.issubdtype(x.dtype, jnp.inexact))
