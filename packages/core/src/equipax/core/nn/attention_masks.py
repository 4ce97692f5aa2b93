"""Which keys each query sees: the causal, sliding-window and packed-segment masks, defined once.

Every softmax kernel (`equipax.core.nn.attention`, `equipax.core.nn.fused_attention`) masks with
these: the reference and XLA kernels and the KV-cache kernel build the boolean mask here, and the
fused kernels take the same rules as their own arguments (cuDNN's `local_window_size`, splash's
`LocalMask`), checked against the reference.
"""

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

__all__ = ["MASK_VALUE", "attention_mask", "self_attention_mask"]

# Large finite negative: -inf would give NaN gradients through fully masked rows.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def attention_mask(
    query_positions: Int[Array, "#batch q"],
    key_positions: Int[Array, "#batch k"],
    *,
    causal: bool,
    window: int | None = None,
    query_segments: Int[Array, "#batch q"] | None = None,
    key_segments: Int[Array, "#batch k"] | None = None,
) -> Bool[Array, "#batch q k"] | None:
    """Bool `[batch q k]`: True where a query may attend to a key.

    Arguments:
        query_positions, key_positions: positions of the queries and keys (a leading axis of 1
            broadcasts over the batch).
        causal: a query at position p sees keys at positions <= p.
        window: with `causal`, a query at p sees only keys at positions > p - window (itself and
            the `window - 1` before it: Mistral's sliding window); None = no limit.
        query_segments, key_segments: packed documents: a query sees only keys of its segment.

    Returns:
        The mask, or None when nothing is masked.

    Raises:
        ValueError: a window without `causal`.
    """
    if window is not None and not causal:
        raise ValueError("a sliding window limits the causal prefix: pass causal=True with window.")
    q, k = query_positions[:, :, None], key_positions[:, None, :]
    mask = None
    if causal:
        mask = k <= q
        if window is not None:
            mask = mask & (k > q - window)
    if query_segments is not None and key_segments is not None:
        same = query_segments[:, :, None] == key_segments[:, None, :]
        mask = same if mask is None else mask & same
    return mask


def self_attention_mask(
    q_len: int,
    k_len: int,
    *,
    causal: bool,
    window: int | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None,
) -> Bool[Array, "#batch q k"] | None:
    """`attention_mask` of a sequence attending to itself (queries aligned to the end of the keys).

    Arguments:
        q_len, k_len: numbers of queries and keys.
        causal, window: as `attention_mask`.
        segment_ids: packed documents (`[batch seq]`, the same for queries and keys).

    Returns:
        The mask, or None when nothing is masked.
    """
    q_pos = (jnp.arange(q_len) + (k_len - q_len))[None]
    k_pos = jnp.arange(k_len)[None]
    return attention_mask(
        q_pos, k_pos, causal=causal, window=window, query_segments=segment_ids, key_segments=segment_ids
    )
