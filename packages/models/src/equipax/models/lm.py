"""Decoder-only transformer language model (Pax `TransformerLm`) for every family: model, loss,
sampling.

`TransformerLM` is one class for Pax's GPT, Llama, Qwen and Mistral: an `LMConfig` says which
(token embedding with an optional multiplier, sinusoidal or rotary positions, the block stack of
`equipax.core.nn`, final norm, tied or untied output projection, optional output logit cap).
Decoding with a KV cache (`TransformerLM.cached`, `equipax.models.decode`) runs the same modules.
"""

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.sharding import Mesh
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from equipax.core.losses import aggregate_losses
from equipax.core.mesh import CONTEXT
from equipax.core.nn import Embedding, LayerNorm, Linear, RMSNorm, TransformerStack
from equipax.core.nn.context_parallel import zigzag_batch
from equipax.core.nn.fused_attention import mesh_platform
from equipax.core.nn.moe import MoEStats, update_router_bias
from equipax.core.nn.moe_metrics import moe_loss_and_metrics
from equipax.core.nn.pipeline import PipelinedStack, make_stack
from equipax.core.nn.rotary import rotary_angles
from equipax.core.nn.self_attention import Rotary
from equipax.core.nn.transformer import StackCache, make_norm
from equipax.core.partition import constrain_batch, constrain_batch_and_last
from equipax.core.task import Batch, is_param
from equipax.models.configs import LMConfig
from equipax.models.cross_entropy import HeadStats, chunked_head_stats, head_stats, soft_cap

__all__ = [
    "generate",
    "lm_loss",
    "lm_loss_and_stats",
    "lm_losses",
    "LMConfig",
    "sinusoidal_embedding",
    "token_ids",
    "TransformerLM",
]

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


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
        raise ValueError(
            f"a language model takes token ids of shape [batch seq]; got shape {arr.shape}. "
            "For one sequence pass `ids[None]`."
        )
    return (
        arr,
        None if segment_ids is None else jnp.asarray(segment_ids),
        None if positions is None else jnp.asarray(positions),
    )


def sinusoidal_embedding(positions: Int[Array, "batch seq"], dims: int) -> Float[Array, "batch seq embed"]:
    """Pax sinusoidal position embeddings `[sin | cos]` of each position, timescales 1 to 1e4.

    Arguments:
        positions: each token's position.
        dims: embedding width.

    Returns:
        Float32 position embeddings.
    """
    num_timescales = dims // 2
    log_inc = math.log(1.0e4) / max(num_timescales - 1, 1)
    inv_timescales = jnp.exp(jnp.arange(num_timescales, dtype=jnp.float32) * -log_inc)
    scaled = positions.astype(jnp.float32)[..., None] * inv_timescales[None, None, :]
    pos = jnp.concatenate([jnp.sin(scaled), jnp.cos(scaled)], axis=-1)
    return jnp.pad(pos, ((0, 0), (0, 0), (0, dims % 2)))


class TransformerLM(eqx.Module):
    """Embedding (x multiplier) + positions -> transformer stack -> norm -> tied or untied logits."""

    embedding: Embedding
    stack: TransformerStack | PipelinedStack
    final_norm: LayerNorm | RMSNorm
    unembed: Linear | None
    cfg: LMConfig = eqx.field(static=True)

    def __init__(self, cfg: LMConfig, *, key: PRNGKeyArray) -> None:
        """Arguments:
        cfg: model config.
        key: PRNG key.
        """
        d = cfg.transformer.model_dims
        # Tied: (embedding, stack); untied: (embedding, stack, output) keys: the splits the two
        # families' models were first written with, so their initial weights are unchanged.
        keys = jr.split(key, 2 if cfg.tie_embeddings else 3)
        self.cfg = cfg
        table = Embedding(cfg.vocab_size, d, key=keys[0])  # N(0, 1/model_dims)
        if cfg.embedding_init_std is not None:
            table = eqx.tree_at(lambda e: e.weight, table, table.weight * (cfg.embedding_init_std * math.sqrt(d)))
        self.embedding = table
        # Pipelined if pipeline_stages > 1; its projections compute as model.quantization says.
        self.stack = make_stack(cfg.transformer, key=keys[1], quantization=cfg.quantization)
        self.final_norm = make_norm(cfg.transformer)
        self.unembed = None if cfg.tie_embeddings else Linear(d, cfg.vocab_size, axes=("embed", "vocab"), key=keys[2])

    def embed(
        self, ids: Int[Array, "batch seq"], positions: Int[Array, "batch seq"]
    ) -> tuple[Float[Array, "batch seq embed"], Rotary | None]:
        """The stack's input (token embedding x multiplier, + sinusoidal positions) in the
        model's dtype, and the rotary angles of `positions` (None unless `position="rope"`)."""
        cfg = self.cfg
        x = self.embedding(ids)
        scale = cfg.embedding_scale
        if scale is not None:
            x = x * scale
        if cfg.position == "sinusoidal":
            x = x + sinusoidal_embedding(positions, cfg.transformer.model_dims)
        rotary = None
        if cfg.position == "rope":
            rotary = rotary_angles(positions, cfg.transformer.head_dim, cfg.rope_theta, cfg.rope_scaling)
        return x.astype(DTYPES[cfg.dtype]), rotary

    def logits(self, h: Float[Array, "*batch embed"], mesh: Mesh | None = None) -> Float[Array, "*batch vocab"]:
        """Next-token logits of final hidden states (after `final_norm`), float32, capped.

        Mixed precision (docs/knobs.md): the logits matmul runs in the model's dtype and its result
        is cast to float32 for the softmax and the loss (Pax; MaxText's logits_dot_in_fp32=False). A
        float32-output matmul here (einsum_f32) cost c4_22b_2x 2 GiB more per chip on XLA:TPU
        (temporaries 29.06 vs 27.03 GiB: over a v4's HBM).
        """
        out = self.embedding.attend(h) if self.unembed is None else self.unembed(h)
        logits = constrain_batch_and_last(out.astype(jnp.float32), mesh)  # vocab split over `tensor`
        return soft_cap(logits, self.cfg.output_logit_cap)

    def head_stats(
        self, h: Float[Array, "batch seq embed"], labels: Int[Array, "batch seq"], mesh: Mesh | None = None
    ) -> HeadStats:
        """The per-token softmax statistics of `logits(h)` against `labels` (`lm_losses` takes the
        cross-entropy, z-loss and accuracy from them), in as few passes over the logits as XLA makes
        (`equipax.models.cross_entropy`): the whole head at once, or with `num_vocab_tiling > 1`
        a chunk of the vocabulary at a time.

        Off the CPU the form XLA:TPU fuses (`head_stats(fused=True)`: no float32 logits written;
        with a logit cap every reduction in the matmul's own pass); on the CPU the numbers the
        golden tests recorded (the two differ in low bits).
        """
        cfg = self.cfg
        if cfg.num_vocab_tiling > 1:
            table, axis = (self.embedding.weight, 0) if self.unembed is None else (self.unembed.weight, 1)
            assert isinstance(table, jax.Array), "the output head is never quantized (model.quantization)"
            return chunked_head_stats(
                h, table, labels, cap=cfg.output_logit_cap, chunks=cfg.num_vocab_tiling, vocab_axis=axis, mesh=mesh
            )
        raw = self.embedding.attend(h) if self.unembed is None else self.unembed(h)
        raw = constrain_batch_and_last(raw, mesh)  # vocab split over `tensor`
        return head_stats(raw, labels, cfg.output_logit_cap, fused=mesh_platform(mesh) != "cpu")

    def _positions(self, ids: Array, positions: Array | None) -> Array:
        seq_len = ids.shape[1]
        if seq_len > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence length {seq_len} exceeds LMConfig.max_seq_len="
                f"{self.cfg.max_seq_len}; shorten the inputs or raise max_seq_len."
            )
        if positions is None:
            return jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), ids.shape)
        return positions

    def __call__(
        self,
        ids: Int[ArrayLike, "batch seq"],
        *,
        key: PRNGKeyArray | None = None,
        mesh: Mesh | None = None,
        segment_ids: Int[ArrayLike, "batch seq"] | None = None,
        positions: Int[ArrayLike, "batch seq"] | None = None,
        sequence_index: Int[ArrayLike, "batch seq"] | None = None,
    ) -> Float[Array, "batch seq vocab"]:
        """Next-token logits (`forward` without the mixture-of-experts stats).

        Arguments:
            ids: token ids, at most `max_seq_len` per row.
            key: unused (no dropout); `None` means deterministic.
            mesh: the device mesh: activations are pinned to its batch axes, and
                `tensor_parallel="shard_map"` and the pipeline run on it (see TransformerStack).
            segment_ids: packed rows: token t attends only to earlier tokens of its own
                segment (one document each); `None` = one sequence per row.
            positions: each token's position within its segment (restarting at 0), for the
                sinusoidal table or the rotary angles; `None` = `0 .. seq-1`.
            sequence_index: each token's index in its unreordered row, when the rows come in a
                context-parallel layout (`equipax.core.nn.context_parallel.zigzag_batch`): the
                causal and window masks compare these; `None` = `0 .. seq-1`.

        Returns:
            Float32 logits; `logits[:, t]` predicts the token after `ids[:, t]`.
        """
        return self.forward(
            ids, key=key, mesh=mesh, segment_ids=segment_ids, positions=positions, sequence_index=sequence_index
        )[0]

    def forward(
        self,
        ids: Int[ArrayLike, "batch seq"],
        *,
        key: PRNGKeyArray | None = None,
        mesh: Mesh | None = None,
        segment_ids: Int[ArrayLike, "batch seq"] | None = None,
        positions: Int[ArrayLike, "batch seq"] | None = None,
        sequence_index: Int[ArrayLike, "batch seq"] | None = None,
    ) -> tuple[Float[Array, "batch seq vocab"], MoEStats | None]:
        """Next-token logits and the mixture-of-experts layers' stats.

        Arguments:
            ids, key, mesh, segment_ids, positions, sequence_index: as for `__call__`.

        Returns:
            `(float32 logits, MoEStats with a leading layer axis)`; the stats are None for a
            dense model.
        """
        h, stats = self.hidden(
            ids, key=key, mesh=mesh, segment_ids=segment_ids, positions=positions, sequence_index=sequence_index
        )
        return self.logits(h, mesh), stats

    def hidden(
        self,
        ids: Int[ArrayLike, "batch seq"],
        *,
        key: PRNGKeyArray | None = None,
        mesh: Mesh | None = None,
        segment_ids: Int[ArrayLike, "batch seq"] | None = None,
        positions: Int[ArrayLike, "batch seq"] | None = None,
        sequence_index: Int[ArrayLike, "batch seq"] | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], MoEStats | None]:
        """`forward` up to the output head: the final hidden states (after `final_norm`, in the
        model's dtype) and the mixture-of-experts stats (arguments as for `__call__`)."""
        del key
        ids, segment_ids, positions = token_ids(ids, segment_ids, positions)
        x, rotary = self.embed(ids, self._positions(ids, positions))
        index = None if sequence_index is None else jnp.asarray(sequence_index)
        x, stats = self.stack.forward(
            constrain_batch(x, mesh), mesh=mesh, segment_ids=segment_ids, rotary=rotary, sequence_index=index
        )
        return self.final_norm(x), stats

    def cached(
        self, ids: Int[Array, "batch seq"], positions: Int[Array, "batch seq"], cache: StackCache
    ) -> tuple[Float[Array, "batch seq embed"], StackCache]:
        """Final hidden states (after `final_norm`) of `ids` at `positions`, attending over the KV
        cache: each token's keys and values are written to its slot first, so it sees itself and
        the earlier slots of its row (`equipax.models.decode`: a prompt, then one token a call).

        Arguments:
            ids: token ids.
            positions: each token's position (its cache slot), below the cache's length.
            cache: the stack's cache (`init_cache`).

        Returns:
            `(hidden states, the updated cache)`; `logits(hidden)` gives the next-token logits.
        """
        x, rotary = self.embed(ids, positions)
        x, cache = self.stack.cached(x, cache, positions, rotary=rotary)
        return self.final_norm(x), cache

    def trainable_spec(self) -> "TransformerLM":
        """True on every parameter but the mixture-of-experts routing biases (`router_bias`), which
        the train step sets from each step's load (`with_router_load`), never the gradient."""

        def spec(path: Any, x: Any) -> bool:
            bias = bool(path) and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "router_bias"
            return is_param(x) and not bias

        return jax.tree_util.tree_map_with_path(spec, self)

    def with_router_load(self, load: Float[Array, "layers experts"]) -> "TransformerLM":
        """This model with every layer's routing biases moved towards balance by one step of
        `model.transformer.router_bias_update_rate` (`update_router_bias`), from `load`: each
        layer's assignments per expert in the step (`MoEStats.tokens_per_expert`). The model itself
        when the rate is 0 (a mixture of experts never runs in a pipeline: the config refuses it)."""
        rate = self.cfg.transformer.router_bias_update_rate
        if not rate:
            return self
        layers = self.stack.layers  # pyright: ignore[reportAttributeAccessIssue]
        blocks = layers if isinstance(layers, tuple) else (layers,)
        old: list[Array] = []
        for b in blocks:
            bias = getattr(b.ffn, "router_bias", None)
            if not isinstance(bias, jax.Array):
                raise ValueError("with_router_load: the model's feed-forwards hold no routing biases")
            old.append(bias)
        if isinstance(layers, tuple):  # unrolled: one block per layer
            new = tuple(update_router_bias(b, load[i], rate) for i, b in enumerate(old))
            where = lambda m: tuple(b.ffn.router_bias for b in m.stack.layers)  # noqa: E731
            return eqx.tree_at(where, self, new)
        return eqx.tree_at(lambda m: m.stack.layers.ffn.router_bias, self, update_router_bias(old[0], load, rate))

    def init_cache(self, batch_size: int, max_len: int) -> StackCache:
        """An empty (zero) KV cache for `batch_size` rows of up to `max_len` tokens.

        Arguments:
            batch_size: number of rows.
            max_len: slots per row: prompt plus generated tokens; at most `cfg.max_seq_len`.

        Returns:
            The cache, in the model's dtype; with grouped-query attention it holds
            `num_kv_heads` heads.
        """
        if max_len > self.cfg.max_seq_len:
            raise ValueError(
                f"a cache of {max_len} tokens exceeds the model's max_seq_len="
                f"{self.cfg.max_seq_len}; shorten the prompt or max_new_tokens, or raise "
                "max_seq_len."
            )
        return self.stack.init_cache(batch_size, max_len, DTYPES[self.cfg.dtype])


def lm_loss(
    model: Any, batch: Batch, *, key: PRNGKeyArray | None = None, mesh: Mesh | None = None
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """`lm_loss_and_stats` without the mixture-of-experts stats: `(loss, aux)`."""
    loss, aux, _ = lm_loss_and_stats(model, batch, key=key, mesh=mesh)
    return loss, aux


def lm_loss_and_stats(
    model: Any, batch: Batch, *, key: PRNGKeyArray | None = None, mesh: Mesh | None = None
) -> tuple[Float[Array, ""], dict[str, Array], MoEStats | None]:
    """`lm_losses` summed (`equipax.core.losses.aggregate_losses`): `(loss, aux, moe_stats)`."""
    losses, aux, moe_stats = lm_losses(model, batch, key=key, mesh=mesh)
    return aggregate_losses(losses)[0], aux, moe_stats


def lm_losses(
    model: Any, batch: Batch, *, key: PRNGKeyArray | None = None, mesh: Mesh | None = None
) -> tuple[dict[str, tuple[Float[Array, ""], float]], dict[str, Array], MoEStats | None]:
    """The language model's named losses (`equipax.core.losses`), its metrics and its stats.

    Arguments:
        model: the language model (a `TransformerLM`, or a `LoRALM` over one): its `hidden`
            gives the final hidden states and the mixture-of-experts stats, its `head_stats` the
            softmax statistics of their logits (`equipax.models.cross_entropy`).
        batch: `ids` int32 `[batch seq]`, `labels` int32 `[batch seq]` (the token after
            each id) and `weights` float32 `[batch seq]` (0 excludes a position); packed
            batches also carry `segment_ids` and `positions` int32 `[batch seq]`.
        key: forwarded to the model.
        mesh: forwarded to the model (bind it with functools.partial for a train step).

    Returns:
        `(losses, aux, moe_stats)`. `losses` is `{name: (value, weight)}`: `cross_entropy`
        (the weighted mean next-token cross-entropy, weight 1); with `model.z_loss_coef > 0`,
        `z_loss` (the weighted mean of `logsumexp(logits)**2`); with `num_experts > 0`,
        `router_aux` and `router_z` (layer means, weighted by `router_aux_loss_coef` and
        `router_z_loss_coef`). aux holds the scalars `loss_sum`, `weight_sum`, `correct_sum`
        (weighted count of positions whose label has the largest logit; a tie counts) and
        `accuracy` (`loss_sum` is the cross-entropy alone), and `moe_loss_and_metrics`'
        metrics. Third, the `MoEStats` with a leading layer axis (None for dense feed-forwards).

        On a mesh with a `context` axis and `context_parallel_load_balance`, the batch is first
        reordered into the zigzag layout (`zigzag_batch`): the same loss, balanced causal work.
    """
    index = None
    cp = 1 if mesh is None else mesh.shape.get(CONTEXT, 1)
    if cp > 1 and model.cfg.transformer.context_parallel_load_balance:
        batch, index = zigzag_batch(batch, cp)
    h, moe_stats = model.hidden(
        batch["ids"],
        key=key,
        mesh=mesh,
        segment_ids=batch.get("segment_ids"),
        positions=batch.get("positions"),
        sequence_index=index,
    )
    labels, weights = jnp.asarray(batch["labels"]), jnp.asarray(batch["weights"], jnp.float32)
    # The statistics of the logits, not the logits: the accuracy reads the maximum the softmax
    # takes anyway (a label is correct where its logit is the largest; a tie counts), with no argmax
    # pass over the [batch seq vocab] logits (benchmarks/README.md, "On a real TPU").
    stats = model.head_stats(h, labels, mesh)
    loss_sum = jnp.sum((stats.log_sum - stats.label) * weights)
    weight_sum = jnp.sum(weights)
    correct_sum = jnp.sum(stats.correct * weights)
    denom = jnp.maximum(weight_sum, 1e-8)
    aux = {"loss_sum": loss_sum, "weight_sum": weight_sum, "correct_sum": correct_sum, "accuracy": correct_sum / denom}
    losses = {"cross_entropy": (loss_sum / denom, 1.0)}
    if model.cfg.z_loss_coef > 0:
        normaliser = stats.log_sum + stats.ref  # logsumexp(logits)
        losses["z_loss"] = (jnp.sum(jnp.square(normaliser) * weights) / denom, model.cfg.z_loss_coef)
    if moe_stats is not None:
        block = model.cfg.transformer
        _, metrics = moe_loss_and_metrics(
            moe_stats, aux_loss_coef=block.router_aux_loss_coef, z_loss_coef=block.router_z_loss_coef
        )
        losses["router_aux"] = (metrics["moe_aux_loss"], block.router_aux_loss_coef)
        losses["router_z"] = (metrics["moe_z_loss"], block.router_z_loss_coef)
        aux |= metrics
    return losses, aux, moe_stats


@eqx.filter_jit
def _generate(
    model: TransformerLM, prompt: Array, num_tokens: int, temperature: float, key: PRNGKeyArray | None
) -> Array:
    prompt_len = prompt.shape[0]
    total = prompt_len + num_tokens
    window = min(model.cfg.max_seq_len, total)
    buf = jnp.zeros((total,), jnp.int32).at[:prompt_len].set(prompt.astype(jnp.int32))

    def step(pos: Array, state: tuple[Array, PRNGKeyArray | None]):
        buf, k = state
        # The last `window` tokens before `pos`; at the start, the window is right-padded
        # and causal masking keeps the padding out of the logits we read.
        start = jnp.maximum(pos - window, 0)
        ids = jax.lax.dynamic_slice(buf, (start,), (window,))
        logits = model(ids[None])[0, pos - 1 - start]
        if temperature == 0.0 or k is None:
            nxt = jnp.argmax(logits)
        else:
            k, sub = jr.split(k)
            nxt = jr.categorical(sub, logits / temperature)
        return buf.at[pos].set(nxt.astype(jnp.int32)), k

    buf, _ = jax.lax.fori_loop(prompt_len, total, step, (buf, key))
    return buf


def generate(
    model: TransformerLM,
    prompt: Int[ArrayLike, " seq"],
    num_tokens: int,
    *,
    temperature: float = 0.0,
    key: PRNGKeyArray | None = None,
) -> Int[Array, " total"]:
    """Extend `prompt` by `num_tokens` tokens, greedily or by sampling (jit-compiled).

    Each step recomputes the forward pass over a fixed window of the last
    `min(max_seq_len, total)` tokens (no KV cache); longer outputs slide the window.

    Arguments:
        model: the language model.
        prompt: at least one token id.
        num_tokens: number of tokens to generate (>= 0).
        temperature: 0 for greedy decoding, > 0 to sample from `softmax(logits / T)`.
        key: PRNG key, required when `temperature > 0`.

    Returns:
        int32 ids `[prompt, generated]` of length `len(prompt) + num_tokens`.
    """
    prompt = jnp.asarray(prompt)
    if prompt.ndim != 1:
        raise ValueError(
            f"generate takes one prompt of shape [seq]; got shape {prompt.shape}. "
            "Generate for each row of a batch separately."
        )
    if prompt.shape[0] < 1:
        raise ValueError("generate needs a prompt of at least one token.")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}.")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}.")
    if temperature > 0 and key is None:
        raise ValueError("sampling with temperature > 0 needs a PRNG key: pass key=...")
    return _generate(model, prompt, int(num_tokens), float(temperature), key if temperature > 0 else None)
