"""Neural-network layers: batched `(batch, seq, embed)` modules with `(in, out)` kernels."""

from equipax.core.nn.attention import (
    cached_attention,
    dot_product_attention,
    jax_nn_attention,
    reference_attention,
    softmax_attention,
)
from equipax.core.nn.embedding import Embedding
from equipax.core.nn.linear import Linear
from equipax.core.nn.linear_attention import elu_feature_map, linear_attention, reference_linear_attention
from equipax.core.nn.mlp import Activation, FeedForward
from equipax.core.nn.norm import LayerNorm, RMSNorm
from equipax.core.nn.pipeline import PipelinedStack, bubble_fraction, make_stack, num_microbatches
from equipax.core.nn.self_attention import Attention, AttentionCache
from equipax.core.nn.transformer import (
    TransformerBlock,
    TransformerConfig,
    TransformerStack,
    make_feed_forward,
    make_norm,
)

__all__ = [
    "Activation",
    "Attention",
    "AttentionCache",
    "Embedding",
    "FeedForward",
    "LayerNorm",
    "PipelinedStack",
    "Linear",
    "RMSNorm",
    "TransformerBlock",
    "TransformerConfig",
    "TransformerStack",
    "bubble_fraction",
    "cached_attention",
    "dot_product_attention",
    "elu_feature_map",
    "jax_nn_attention",
    "linear_attention",
    "make_feed_forward",
    "make_norm",
    "make_stack",
    "num_microbatches",
    "reference_attention",
    "reference_linear_attention",
    "softmax_attention",
]
