"""The CNN tutorial's image classifier (docs/tutorial_cnn.md), `AdvancedCNN`: residual conv blocks
with BatchNorm, global mean pooling, multi-head self-attention and a dropout-regularised head.

conv 3x3 (32) + ReLU -> ResidualBlock(64) x2 -> max-pool 2x2 -> ResidualBlock(128) x2 -> mean
over height and width -> a length-1 sequence through 4-head self-attention (dim 128) -> dense
256 + ReLU -> dropout 0.5 -> dense num_classes. BatchNorm running statistics live in an
`eqx.nn.State`: build with `eqx.nn.make_with_state(AdvancedCNN)(cfg, key=key)`.

The tutorial's attention einsums (`'bhqd,bhkd->bhqk'` on `[batch seq heads head_dim]` arrays)
attend across heads rather than positions; this is standard multi-head attention over the
sequence. On a length-1 sequence every query sees one key, so the softmax is 1 and the block is
`out(v(x))`: two learned linear maps, as in the tutorial up to that mix-up.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray

from equipax.core.nn import Linear, dot_product_attention
from equipax.core.nn.conv import BatchNorm, Conv2d, max_pool
from equipax.models.configs import CNNConfig

__all__ = ["AdvancedCNN", "CNNConfig", "ResidualBlock", "SelfAttention"]


class ResidualBlock(eqx.Module):
    """conv-BN-ReLU-conv-BN plus the input (1x1 projection when channels change), then ReLU."""

    conv1: Conv2d
    bn1: BatchNorm
    conv2: Conv2d
    bn2: BatchNorm
    shortcut: Conv2d | None

    def __init__(self, in_channels: int, channels: int, *, bn_momentum: float = 0.99, key: PRNGKeyArray) -> None:
        """Arguments:
        in_channels: channels of the input.
        channels: channels of the output (the tutorial's `features`).
        bn_momentum: BatchNorm momentum.
        key: PRNG key.
        """
        k1, k2, k3 = jr.split(key, 3)
        self.conv1 = Conv2d(in_channels, channels, (3, 3), key=k1)
        self.bn1 = BatchNorm(channels, momentum=bn_momentum)
        self.conv2 = Conv2d(channels, channels, (3, 3), key=k2)
        self.bn2 = BatchNorm(channels, momentum=bn_momentum)
        self.shortcut = Conv2d(in_channels, channels, (1, 1), key=k3) if in_channels != channels else None

    def __call__(
        self, x: Float[Array, "batch height width cin"], state: eqx.nn.State, *, inference: bool
    ) -> tuple[Float[Array, "batch height width cout"], eqx.nn.State]:
        """Arguments:
        x: feature maps.
        state: BatchNorm statistics.
        inference: use running statistics (and leave them unchanged).

        Returns:
            `(feature maps, state)`.
        """
        y, state = self.bn1(self.conv1(x), state, inference=inference)
        y, state = self.bn2(self.conv2(jax.nn.relu(y)), state, inference=inference)
        residual = x if self.shortcut is None else self.shortcut(x)
        return jax.nn.relu(y + residual), state


class SelfAttention(eqx.Module):
    """Multi-head self-attention over a sequence (no mask), fused QKV, biases as Flax's Dense."""

    qkv: Linear
    out: Linear
    num_heads: int = eqx.field(static=True)

    def __init__(self, dim: int, num_heads: int, *, key: PRNGKeyArray) -> None:
        """Arguments:
        dim: model width (split over the heads).
        num_heads: attention heads.
        key: PRNG key.
        """
        k1, k2 = jr.split(key)
        self.num_heads = num_heads
        axes = ("in_channels", "out_channels")  # replicated: the CNN trains data parallel
        self.qkv = Linear(dim, 3 * dim, use_bias=True, axes=axes, key=k1)
        self.out = Linear(dim, dim, use_bias=True, axes=axes, key=k2)

    def __call__(self, x: Float[Array, "batch seq embed"]) -> Float[Array, "batch seq embed"]:
        b, s, d = x.shape
        qkv = self.qkv(x).reshape(b, s, 3, self.num_heads, d // self.num_heads)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        return self.out(dot_product_attention(q, k, v, causal=False).reshape(b, s, d))


class AdvancedCNN(eqx.Module):
    """The tutorial's classifier. Build with `eqx.nn.make_with_state(AdvancedCNN)(cfg, key=key)`."""

    stem: Conv2d
    stages: tuple[tuple[ResidualBlock, ...], ...]
    attention: SelfAttention
    hidden: Linear
    head: Linear
    dropout_rate: float = eqx.field(static=True)

    def __init__(self, cfg: CNNConfig, *, key: PRNGKeyArray) -> None:
        """Arguments:
        cfg: the hyperparameters.
        key: PRNG key.
        """
        keys = iter(jr.split(key, 4 + len(cfg.stage_channels) * cfg.blocks_per_stage))
        self.stem = Conv2d(cfg.in_channels, cfg.stem_channels, (3, 3), key=next(keys))
        stages, channels = [], cfg.stem_channels
        for width in cfg.stage_channels:
            blocks = []
            for _ in range(cfg.blocks_per_stage):
                blocks.append(ResidualBlock(channels, width, bn_momentum=cfg.bn_momentum, key=next(keys)))
                channels = width
            stages.append(tuple(blocks))
        self.stages = tuple(stages)
        self.attention = SelfAttention(channels, cfg.num_heads, key=next(keys))
        axes = ("in_channels", "out_channels")  # replicated: the CNN trains data parallel
        self.hidden = Linear(channels, cfg.hidden_dims, use_bias=True, axes=axes, key=next(keys))
        self.head = Linear(cfg.hidden_dims, cfg.num_classes, use_bias=True, axes=axes, key=next(keys))
        self.dropout_rate = cfg.dropout_rate

    def __call__(
        self,
        images: Float[Array, "batch height width channels"],
        state: eqx.nn.State,
        *,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> tuple[Float[Array, "batch classes"], eqx.nn.State]:
        """Class logits for a batch of images.

        Arguments:
            images: channels-last images.
            state: BatchNorm running statistics.
            key: dropout key; required in training when `dropout_rate > 0`.
            inference: evaluation mode: BatchNorm uses (and keeps) its running statistics and
                dropout is off.

        Returns:
            `(logits, state)`; in training the state holds updated running statistics.
        """
        x = jax.nn.relu(self.stem(images))
        for i, stage in enumerate(self.stages):
            if i > 0:
                x = max_pool(x, (2, 2))
            for block in stage:
                x, state = block(x, state, inference=inference)
        x = jnp.mean(x, axis=(1, 2))[:, None, :]  # a length-1 sequence
        x = self.attention(x)[:, 0, :]
        x = jax.nn.relu(self.hidden(x))
        if not inference and self.dropout_rate > 0:
            if key is None:
                raise ValueError(
                    "AdvancedCNN in training mode needs a dropout `key`; pass key=... or inference=True for evaluation."
                )
            keep = 1.0 - self.dropout_rate
            mask = jr.bernoulli(key, keep, x.shape)
            x = jnp.where(mask, x / keep, 0.0)
        return self.head(x), state
