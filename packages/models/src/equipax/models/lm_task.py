"""The language-modelling Task: a decoder LM (`TransformerLM`, any family) + next-token
cross-entropy on token batches."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jaxtyping import PRNGKeyArray, Scalar

from equipax.core.task import AbstractTask, Batch, Metrics
from equipax.models.lm import LMConfig, TransformerLM, lm_loss

__all__ = ["LMTask"]


class LMTask(AbstractTask[TransformerLM]):
    """Train a decoder LM on `[batch seq]` token windows (Pax's TransformerLM task).

    Attributes:
        config: the model's hyperparameters (an `LMConfig`: any family).
        seq_len: tokens per example.
        packed: batches carry `segment_ids` and `positions` (documents packed into rows).
        mesh: the device mesh the model pins its activations' batch dimension to (None: none).
    """

    config: LMConfig = eqx.field(static=True)
    seq_len: int = eqx.field(static=True)
    packed: bool = eqx.field(static=True, default=False)
    mesh: Mesh | None = eqx.field(static=True, default=None)

    def __check_init__(self) -> None:
        if self.seq_len > self.config.max_seq_len:
            raise ValueError(f"seq_len={self.seq_len} exceeds the model's max_seq_len={self.config.max_seq_len}.")

    def init(self, key: PRNGKeyArray) -> tuple[TransformerLM, None]:
        """A freshly initialised model; a language model has no non-trained state."""
        return TransformerLM(self.config, key=key), None

    def loss(
        self, model: TransformerLM, batch: Batch, *, key: PRNGKeyArray | None, model_state: None
    ) -> tuple[Scalar, Metrics, None]:
        """`lm_loss` (weighted mean next-token cross-entropy) with the model's state passed through."""
        loss, aux = lm_loss(model, batch, key=key, mesh=self.mesh)
        return loss, aux, model_state

    def abstract_batch(self, global_batch: int) -> dict[str, jax.ShapeDtypeStruct]:
        """`ids`, `labels` int32 and `weights` float32 `[batch seq]`; packed: `segment_ids`, `positions`."""
        shape = (global_batch, self.seq_len)
        fields = {"ids": jnp.int32, "labels": jnp.int32, "weights": jnp.float32}
        if self.packed:
            fields |= {"segment_ids": jnp.int32, "positions": jnp.int32}
        return {k: jax.ShapeDtypeStruct(shape, dtype) for k, dtype in fields.items()}
