"""The language-modelling Task: a decoder LM (`TransformerLM`, any family) + next-token
cross-entropy on token batches."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jaxtyping import Array, Float, PRNGKeyArray, Scalar

from equipax.core.losses import NamedLosses
from equipax.core.task import AbstractTask, Batch, Metrics
from equipax.models.lm import LMConfig, TransformerLM, lm_losses
from equipax.models.lora import LoRALM

__all__ = ["LMTask"]


class LMTask(AbstractTask[TransformerLM | LoRALM]):
    """Train a decoder LM on `[batch seq]` token windows (Pax's TransformerLM task); with
    `config.lora.enabled`, low-rank adapters on the frozen model (`LoRALM`).

    With `model.transformer.router_bias_update_rate > 0` (a mixture of experts' auxiliary-loss-free
    balancing) the non-trained state is the last training step's load, `[layers experts]`
    assignments per expert: `loss` returns it, and `update_model` moves the routing biases from it
    after the optimizer's update. Otherwise a language model has no non-trained state (None).

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

    def init(self, key: PRNGKeyArray) -> tuple[TransformerLM | LoRALM, Float[Array, "layers experts"] | None]:
        """A freshly initialised model (with LoRA: adapters over it, their A from a split of `key`)
        and its non-trained state (the class docstring)."""
        t = self.config.transformer
        state = jnp.zeros((t.num_layers, t.num_experts), jnp.float32) if t.router_bias_update_rate else None
        if not self.config.lora.enabled:
            return TransformerLM(self.config, key=key), state
        return self.adapt(TransformerLM(self.config, key=jax.random.split(key)[0]), key), state

    def adapt(self, base: TransformerLM, key: PRNGKeyArray) -> TransformerLM | LoRALM:
        """`base` (e.g. imported weights) with this task's LoRA adapters, their A from the same
        split of `key` as `init`'s; `base` itself when LoRA is off."""
        if not self.config.lora.enabled:
            return base
        return LoRALM(base, self.config.lora, key=jax.random.split(key)[1])

    def loss(
        self,
        model: TransformerLM | LoRALM,
        batch: Batch,
        *,
        key: PRNGKeyArray | None,
        model_state: Float[Array, "layers experts"] | None,
    ) -> tuple[Scalar | NamedLosses, Metrics, Float[Array, "layers experts"] | None]:
        """`lm_losses`: the weighted mean next-token cross-entropy, alone as a scalar, or with the
        z-loss and a mixture of experts' router losses as named losses (each logged and
        evaluated: `equipax.core.losses`); in training with routing biases, the step's load per
        layer and expert as the new state (evaluation passes it through)."""
        losses, aux, stats = lm_losses(model, batch, key=key, mesh=self.mesh)
        loss = losses if len(losses) > 1 else losses["cross_entropy"][0]
        if model_state is None or key is None:
            return loss, aux, model_state
        assert stats is not None  # routing biases come with num_experts > 0 (the config checks)
        return loss, aux, jax.lax.stop_gradient(stats.tokens_per_expert)

    def update_model(
        self, model: TransformerLM | LoRALM, model_state: Float[Array, "layers experts"] | None
    ) -> TransformerLM | LoRALM:
        """The routing biases moved by one balancing step from the step's load (the class docstring)."""
        if model_state is None:
            return model
        if isinstance(model, LoRALM):
            return eqx.tree_at(lambda m: m.base, model, model.base.with_router_load(model_state))
        return model.with_router_load(model_state)

    def abstract_batch(self, global_batch: int) -> dict[str, jax.ShapeDtypeStruct]:
        """`ids`, `labels` int32 and `weights` float32 `[batch seq]`; packed: `segment_ids`, `positions`."""
        shape = (global_batch, self.seq_len)
        fields = {"ids": jnp.int32, "labels": jnp.int32, "weights": jnp.float32}
        if self.packed:
            fields |= {"segment_ids": jnp.int32, "positions": jnp.int32}
        return {k: jax.ShapeDtypeStruct(shape, dtype) for k, dtype in fields.items()}
