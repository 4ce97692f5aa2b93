"""Llama-style decoder LM: RoPE, SwiGLU, grouped-query attention, RMSNorm, untied embeddings.

The 2023-24 decoder recipe shared by Llama 2/3, Mistral and Qwen, built from equipax.core
layers. No biases anywhere, no position table (rotary angles in every attention layer), no
embedding multiplier and no output logit cap. The input embedding is initialised N(0, 1)
(`LlamaConfig.embedding_init_std`, as torchtitan's Llama), every projection with variance
1/fan_in. The layer stack is scanned over stacked parameters
or run as a Python loop (`scan_layers`), with the same remat policies as `TransformerStack`.
"""

import math
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.sharding import Mesh
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from equipax.core.nn.embedding import Embedding
from equipax.core.nn.self_attention import Attention
from equipax.core.nn.linear import Linear
from equipax.core.nn.mlp import FeedForward
from equipax.core.nn.norm import RMSNorm
from equipax.core.nn.rotary import rotary_angles
from equipax.core.partition import Axes, constrain_batch
from equipax.models.configs import LlamaConfig, llama_flops_per_token, llama_param_counts

__all__ = [
    "LlamaBlock",
    "LlamaConfig",
    "LlamaLM",
    "llama_flops_per_token",
    "llama_param_counts",
    "token_ids",
]

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def token_ids(
    ids: ArrayLike, segment_ids: ArrayLike | None = None, positions: ArrayLike | None = None
) -> tuple[Int[Array, "batch seq"], Int[Array, "batch seq"] | None, Int[Array, "batch seq"] | None]:
    """`ids` (and the optional packing fields) as int arrays of rank 2, e.g. from numpy.

    Arguments:
        ids: token ids `[batch seq]`.
        segment_ids, positions: optional, the same shape as `ids`.

    Returns:
        The three as jax arrays (None stays None).

    Raises:
        ValueError: `ids` is not of rank 2 (one sequence is `ids[None]`).
    """
    arr = jnp.asarray(ids)
    if arr.ndim != 2:
        raise ValueError(f"a language model takes token ids of shape [batch seq]; got shape {arr.shape}. "
                         "For one sequence pass `ids[None]`.")
    return (arr, None if segment_ids is None else jnp.asarray(segment_ids),
            None if positions is None else jnp.asarray(positions))


class LlamaBlock(eqx.Module):
    """Pre-norm block: `x + attn(rmsnorm(x))`, then `x + swiglu(rmsnorm(x))`."""

    atten_norm: RMSNorm
    attention: Attention
    ffn_norm: RMSNorm
    ffn: FeedForward

    def __init__(self, cfg: LlamaConfig, *, key: PRNGKeyArray) -> None:
        """Arguments:
        cfg: model config.
        key: PRNG key.
        """
        k_att, k_ffn = jr.split(key)
        self.atten_norm = RMSNorm(cfg.model_dims, eps=cfg.norm_eps)
        self.attention = Attention(
            cfg.model_dims, cfg.num_heads, cfg.head_dim, num_kv_heads=cfg.num_kv_heads, fused_qkv=False, key=k_att
        )
        self.ffn_norm = RMSNorm(cfg.model_dims, eps=cfg.norm_eps)
        self.ffn = FeedForward(
            cfg.model_dims, cfg.hidden_dims, activation="silu", gated=True, key=k_ffn
        )

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        sin: Float[Array, "batch seq half"],
        cos: Float[Array, "batch seq half"],
        segment_ids: Int[Array, "batch seq"] | None = None,
    ) -> Float[Array, "batch seq embed"]:
        """Apply the block.

        Arguments:
            x: inputs.
            sin, cos: rotation angles of each token's position (`rotary_angles`).
            segment_ids: packed sequences: attention stays within each segment.

        Returns:
            Outputs of the same shape and dtype.
        """
        y, _ = self.attention(self.atten_norm(x), segment_ids, rotary=(sin, cos))
        x = x + y
        return x + self.ffn(self.ffn_norm(x))


def _remat(remat: str, fn: Callable) -> Callable:
    if remat == "full":
        return jax.checkpoint(fn, policy=None)
    if remat == "dots_saveable":
        return jax.checkpoint(fn, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    return fn


class LlamaLM(eqx.Module):
    """Embedding -> `num_layers` Llama blocks -> RMSNorm -> untied output projection.

    With `cfg.scan_layers`, `layers` is ONE `LlamaBlock` whose array leaves carry a leading
    `[num_layers]` axis; otherwise a tuple of blocks. Both layouts built from the same key
    hold the same numbers (layer `i` is initialised from `split(key, num_layers)[i]`).
    """

    embedding: Embedding
    layers: LlamaBlock | tuple[LlamaBlock, ...]
    final_norm: RMSNorm
    unembed: Linear
    cfg: LlamaConfig = eqx.field(static=True)

    def __init__(self, cfg: LlamaConfig, *, key: PRNGKeyArray) -> None:
        """Arguments:
        cfg: model config.
        key: PRNG key.
        """
        k_emb, k_layers, k_out = jr.split(key, 3)
        self.cfg = cfg
        # Embedding draws N(0, 1/model_dims); rescaled to N(0, embedding_init_std^2) (see LlamaConfig).
        table = Embedding(cfg.vocab_size, cfg.model_dims, key=k_emb)
        self.embedding = eqx.tree_at(
            lambda e: e.weight, table, table.weight * (cfg.embedding_init_std * math.sqrt(cfg.model_dims))
        )
        keys = jr.split(k_layers, cfg.num_layers)
        if cfg.scan_layers:
            self.layers = eqx.filter_vmap(lambda k: LlamaBlock(cfg, key=k))(keys)
        else:
            self.layers = tuple(LlamaBlock(cfg, key=k) for k in keys)
        self.final_norm = RMSNorm(cfg.model_dims, eps=cfg.norm_eps)
        self.unembed = Linear(
            cfg.model_dims, cfg.vocab_size, axes=("embed", "vocab"), key=k_out
        )

    def logical_axes(self) -> dict[str, Axes]:
        """Scanned: every array of the one stacked block has a leading `layers` axis."""
        return {"layers": ("layers",)} if isinstance(self.layers, LlamaBlock) else {}

    def _run_layers(
        self, x: Array, sin: Array, cos: Array, mesh: Mesh | None, segment_ids: Array | None
    ) -> Array:
        def apply(params: LlamaBlock, static: LlamaBlock, h: Array) -> Array:
            return constrain_batch(eqx.combine(params, static)(h, sin, cos, segment_ids), mesh)

        if isinstance(self.layers, LlamaBlock):
            params, static = eqx.partition(self.layers, eqx.is_array)
            step = _remat(self.cfg.remat, lambda p, h: apply(p, static, h))

            def body(h: Array, layer_params: LlamaBlock) -> tuple[Array, None]:
                return step(layer_params, h), None

            x, _ = jax.lax.scan(body, x, params)
            return x
        for block in self.layers:
            params, static = eqx.partition(block, eqx.is_array)
            x = _remat(self.cfg.remat, lambda p, h, s=static: apply(p, s, h))(params, x)
        return x

    def __call__(
        self, ids: Int[ArrayLike, "batch seq"], *, key: PRNGKeyArray | None = None,
        mesh: Mesh | None = None,
        segment_ids: Int[ArrayLike, "batch seq"] | None = None,
        positions: Int[ArrayLike, "batch seq"] | None = None,
    ) -> Float[Array, "batch seq vocab"]:
        """Next-token logits (the same call signature as `TransformerLM`, so `lm_loss` and
        `generate` take either family).

        Arguments:
            ids: token ids, at most `max_seq_len` per row.
            key: unused (no dropout); `None` means deterministic.
            mesh: the device mesh: activations are pinned to its batch axes.
            segment_ids: packed rows: token t attends only to earlier tokens of its own
                segment; `None` = one sequence per row.
            positions: each token's position within its segment (the rotation angle);
                `None` = `0 .. seq-1`.

        Returns:
            Float32 logits; `logits[:, t]` predicts the token after `ids[:, t]`.
        """
        del key
        ids, segment_ids, positions = token_ids(ids, segment_ids, positions)
        batch, seq_len = ids.shape
        if seq_len > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence length {seq_len} exceeds LlamaConfig.max_seq_len="
                f"{self.cfg.max_seq_len}; shorten the inputs or raise max_seq_len."
            )
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (batch, seq_len))
        sin, cos = rotary_angles(positions, self.cfg.head_dim, self.cfg.rope_theta)
        x = constrain_batch(self.embedding(ids).astype(_DTYPES[self.cfg.dtype]), mesh)
        x = self.final_norm(self._run_layers(x, sin, cos, mesh, segment_ids))
        return constrain_batch(self.unembed(x).astype(jnp.float32), mesh)
