"""Llama-style decoder LM: RoPE, SwiGLU, grouped-query attention, RMSNorm, untied embeddings.

The 2023-24 decoder recipe shared by Llama 2/3, Mistral and Qwen, built from equipax.core
layers. No biases anywhere, no position table (rotary angles in every attention layer), no
embedding scaling and no output logit cap. The layer stack is scanned over stacked parameters
or run as a Python loop (`scan_layers`), with the same remat policies as `TransformerStack`.
"""

import dataclasses
from collections.abc import Callable
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.sharding import Mesh
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from equipax.core.nn.embedding import Embedding
from equipax.core.nn.gqa_attention import GroupedQueryAttention
from equipax.core.nn.linear import Linear
from equipax.core.nn.mlp import FeedForward
from equipax.core.nn.norm import RMSNorm
from equipax.core.nn.rotary import rotary_angles
from equipax.core.partition import Axes, constrain_batch

__all__ = [
    "LlamaBlock",
    "LlamaConfig",
    "LlamaLM",
    "llama_flops_per_token",
    "llama_param_counts",
    "token_ids",
]

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_REMATS = ("none", "full", "dots_saveable")


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Hyperparameters of the Llama-style decoder (defaults: a tiny CPU model).

    Attributes:
        vocab_size: token ids are in `[0, vocab_size)` (embedding and unembedding rows).
        max_seq_len: the longest sequence the model takes.
        num_layers: decoder blocks.
        model_dims: width of the residual stream (`embed`).
        num_heads: query heads per block.
        head_dim: dimensions per head.
        rope_theta: base of the rotary position frequencies.
        norm_eps: epsilon of the RMS norms.
        scan_layers: run the blocks as one `jax.lax.scan` over stacked weights.
        remat: recompute each block in the backward pass: "none", "full" or "dots_saveable".
        dtype: the activations' dtype; parameters and logits stay float32.
    """

    vocab_size: int = 2048
    max_seq_len: int = 128
    num_layers: int = 4
    model_dims: int = 256
    num_heads: int = 4
    # Key/value heads shared by groups of query heads: num_heads = MHA, 1 = MQA.
    num_kv_heads: int = 2
    head_dim: int = 64
    # SwiGLU width (each of gate, up and down has model_dims x hidden_dims weights).
    hidden_dims: int = 688
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    scan_layers: bool = True
    remat: Literal["none", "full", "dots_saveable"] = "none"
    dtype: Literal["float32", "bfloat16"] = "float32"

    def __post_init__(self) -> None:
        for name, low in (
            ("vocab_size", 2), ("max_seq_len", 1), ("num_layers", 1), ("model_dims", 1),
            ("num_heads", 1), ("num_kv_heads", 1), ("head_dim", 2), ("hidden_dims", 1),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(
                    f"LlamaConfig.{name} must be an int >= {low}, got {value!r}; "
                    f"set {name}=<int >= {low}>."
                )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"LlamaConfig.num_heads={self.num_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads} (each key/value head serves a group of "
                "query heads); pick num_kv_heads among the divisors of num_heads."
            )
        if self.head_dim % 2:
            raise ValueError(
                f"LlamaConfig.head_dim must be even for rotary embeddings, got {self.head_dim}."
            )
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"LlamaConfig.{name} must be a number > 0, got {value!r}.")
        if self.remat not in _REMATS:
            raise ValueError(f"LlamaConfig.remat must be one of {_REMATS}, got {self.remat!r}.")
        if self.dtype not in _DTYPES:
            raise ValueError(
                f"LlamaConfig.dtype must be one of {tuple(_DTYPES)}, got {self.dtype!r}; "
                "use 'float32' on CPU."
            )


def llama_param_counts(cfg: LlamaConfig) -> dict[str, int]:
    """Analytic parameter counts of `LlamaLM`.

    Arguments:
        cfg: model config.

    Returns:
        `embedding` (input table), `unembedding` (output projection), `per_layer` (one
        block: two norms, attention, SwiGLU), `final_norm` and `total`.
    """
    d, hd, f = cfg.model_dims, cfg.head_dim, cfg.hidden_dims
    attention = d * cfg.num_heads * hd * 2 + d * 2 * cfg.num_kv_heads * hd
    per_layer = 2 * d + attention + 3 * d * f
    counts = {
        "embedding": cfg.vocab_size * d,
        "unembedding": d * cfg.vocab_size,
        "per_layer": per_layer,
        "final_norm": d,
    }
    counts["total"] = (
        counts["embedding"] + counts["unembedding"] + cfg.num_layers * per_layer + d
    )
    return counts


def llama_flops_per_token(cfg: LlamaConfig, *, seq_len: int) -> dict[str, float]:
    """FLOPs per token of `LlamaLM`, with the accounting of
    `equipax.core.flops.transformer_lm_flops_per_token` (a matmul `[m k] @ [k n]` counts
    `2 m k n`; causal attention half of `QK^T` and `PV`; training 3x forward).

    Grouped-query attention projects `num_heads + 2 num_kv_heads` heads; the attention
    products themselves run over all `num_heads` query heads.

    Arguments:
        cfg: model config.
        seq_len: sequence length (for the attention term).

    Returns:
        Per-token FLOPs, all layers summed: `qkv_projection`, `output_projection`, `mlp`,
        `attention`, `unembedding`, `forward`, `training` (the model FLOPs), `remat` (extra
        forward work recomputed under `cfg.remat`) and `training_with_remat`.
    """
    d, h, hd, n = cfg.model_dims, cfg.num_heads, cfg.head_dim, cfg.num_layers
    qkv = 2.0 * d * (h + 2 * cfg.num_kv_heads) * hd
    out_proj = 2.0 * h * hd * d
    mlp = 2.0 * d * cfg.hidden_dims * 3
    attention = 2.0 * 2.0 * seq_len * h * hd / 2.0
    unembedding = 2.0 * d * cfg.vocab_size
    layers_forward = n * (qkv + out_proj + mlp + attention)
    forward = layers_forward + unembedding
    remat = {"full": layers_forward, "dots_saveable": n * attention}.get(cfg.remat, 0.0)
    return {
        "qkv_projection": n * qkv,
        "output_projection": n * out_proj,
        "mlp": n * mlp,
        "attention": n * attention,
        "unembedding": unembedding,
        "forward": forward,
        "training": 3.0 * forward,
        "remat": remat,
        "training_with_remat": 3.0 * forward + remat,
    }


class LlamaBlock(eqx.Module):
    """Pre-norm block: `x + attn(rmsnorm(x))`, then `x + swiglu(rmsnorm(x))`."""

    atten_norm: RMSNorm
    attention: GroupedQueryAttention
    ffn_norm: RMSNorm
    ffn: FeedForward

    def __init__(self, cfg: LlamaConfig, *, key: PRNGKeyArray) -> None:
        """Arguments:
        cfg: model config.
        key: PRNG key.
        """
        k_att, k_ffn = jr.split(key)
        self.atten_norm = RMSNorm(cfg.model_dims, eps=cfg.norm_eps)
        self.attention = GroupedQueryAttention(
            cfg.model_dims, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, key=k_att
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
        x = x + self.attention(self.atten_norm(x), sin, cos, segment_ids)
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
        self.embedding = Embedding(cfg.vocab_size, cfg.model_dims, key=k_emb)
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
