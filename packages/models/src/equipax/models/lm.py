"""Decoder-only transformer language model (Pax `TransformerLm`): model, loss, sampling."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.sharding import Mesh
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from equipax.core.nn import Embedding, LayerNorm, RMSNorm, TransformerStack
from equipax.core.nn.pipeline import PipelinedStack, make_stack
from equipax.core.nn.transformer import make_norm
from equipax.core.partition import constrain_batch, constrain_batch_and_last
from equipax.core.task import Batch
from equipax.models.configs import LMConfig
from equipax.models.llama import LlamaLM, token_ids

__all__ = [
    "generate",
    "LanguageModel",
    "lm_loss",
    "LMConfig",
    "sinusoidal_positions",
    "TransformerLM",
]

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def sinusoidal_positions(seq_len: int, dims: int) -> Float[Array, "seq embed"]:
    """Pax sinusoidal position embeddings `[sin | cos]`, timescales 1 to 1e4.

    Arguments:
        seq_len: number of positions.
        dims: embedding width.

    Returns:
        Float32 position embeddings.
    """
    num_timescales = dims // 2
    log_inc = math.log(1.0e4) / max(num_timescales - 1, 1)
    inv_timescales = jnp.exp(jnp.arange(num_timescales, dtype=jnp.float32) * -log_inc)
    scaled = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_timescales[None, :]
    pos = jnp.concatenate([jnp.sin(scaled), jnp.cos(scaled)], axis=1)
    return jnp.pad(pos, ((0, 0), (0, dims % 2)))


class TransformerLM(eqx.Module):
    """Embedding (x sqrt(model_dims)) + positions -> transformer stack -> norm -> tied logits."""

    embedding: Embedding
    stack: TransformerStack | PipelinedStack
    final_norm: LayerNorm | RMSNorm
    cfg: LMConfig = eqx.field(static=True)

    def __init__(self, cfg: LMConfig, *, key: PRNGKeyArray) -> None:
        """Arguments:
        cfg: model config.
        key: PRNG key.
        """
        k_emb, k_stack = jr.split(key)
        self.cfg = cfg
        self.embedding = Embedding(cfg.vocab_size, cfg.transformer.model_dims, key=k_emb)
        self.stack = make_stack(cfg.transformer, key=k_stack)  # pipelined if pipeline_stages > 1
        self.final_norm = make_norm(cfg.transformer)

    def __call__(
        self, ids: Int[ArrayLike, "batch seq"], *, key: PRNGKeyArray | None = None,
        mesh: Mesh | None = None,
        segment_ids: Int[ArrayLike, "batch seq"] | None = None,
        positions: Int[ArrayLike, "batch seq"] | None = None,
    ) -> Float[Array, "batch seq vocab"]:
        """Next-token logits.

        Arguments:
            ids: token ids, at most `max_seq_len` per row.
            key: unused (no dropout); `None` means deterministic.
            mesh: the device mesh, for `tensor_parallel="shard_map"` (see TransformerStack).
            segment_ids: packed rows: token t attends only to earlier tokens of its own
                segment (one document each); `None` = one sequence per row.
            positions: each token's position within its segment (restarting at 0), indexing
                the sinusoidal table; `None` = `0 .. seq-1`.

        Returns:
            Float32 logits; `logits[:, t]` predicts the token after `ids[:, t]`.
        """
        del key
        ids, segment_ids, positions = token_ids(ids, segment_ids, positions)
        seq_len = ids.shape[1]
        if seq_len > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence length {seq_len} exceeds LMConfig.max_seq_len="
                f"{self.cfg.max_seq_len}; shorten the inputs or raise max_seq_len."
            )
        dims = self.cfg.transformer.model_dims
        x = self.embedding(ids) * math.sqrt(dims)
        if self.cfg.position == "sinusoidal":
            table = sinusoidal_positions(seq_len, dims)
            x = x + (table[None] if positions is None else jnp.take(table, positions, axis=0))
        x = constrain_batch(x.astype(_DTYPES[self.cfg.dtype]), mesh)
        x = self.final_norm(self.stack(x, mesh=mesh, segment_ids=segment_ids))
        # Mixed precision (docs/knobs.md): the logits matmul runs in `dtype` and its result is cast
        # to float32 for the softmax and the loss (Pax; MaxText's logits_dot_in_fp32=False). A
        # float32-output matmul here (einsum_f32) cost c4_22b_2x 2 GiB more per chip on XLA:TPU
        # (temporaries 29.06 vs 27.03 GiB: over a v4's HBM).
        logits = self.embedding.attend(x).astype(jnp.float32)
        logits = constrain_batch_and_last(logits, mesh)  # vocab split over `tensor`
        cap = self.cfg.output_logit_cap
        if cap is not None:
            logits = cap * jnp.tanh(logits / cap)
        return logits


# Every LM family: same call signature (ids, key, mesh, segment_ids, positions) -> logits.
LanguageModel = TransformerLM | LlamaLM


def lm_loss(
    model: LanguageModel, batch: Batch, *, key: PRNGKeyArray | None = None,
    mesh: Mesh | None = None,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """Weighted mean next-token cross-entropy.

    Arguments:
        model: the language model.
        batch: `ids` int32 `[batch seq]`, `labels` int32 `[batch seq]` (the token after
            each id) and `weights` float32 `[batch seq]` (0 excludes a position); packed
            batches also carry `segment_ids` and `positions` int32 `[batch seq]`.
        key: forwarded to the model.
        mesh: forwarded to the model (bind it with functools.partial for a train step).

    Returns:
        `(loss, aux)` with aux scalars `loss_sum`, `weight_sum`, `correct_sum` (weighted
        count of argmax == label) and `accuracy`.
    """
    logits = model(batch["ids"], key=key, mesh=mesh, segment_ids=batch.get("segment_ids"),
                   positions=batch.get("positions"))
    labels, weights = jnp.asarray(batch["labels"]), jnp.asarray(batch["weights"], jnp.float32)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]
    loss_sum = jnp.sum(nll * weights)
    weight_sum = jnp.sum(weights)
    correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    correct_sum = jnp.sum(correct * weights)
    denom = jnp.maximum(weight_sum, 1e-8)
    aux = {
        "loss_sum": loss_sum,
        "weight_sum": weight_sum,
        "correct_sum": correct_sum,
        "accuracy": correct_sum / denom,
    }
    return loss_sum / denom, aux


@eqx.filter_jit
def _generate(
    model: LanguageModel,
    prompt: Array,
    num_tokens: int,
    temperature: float,
    key: PRNGKeyArray | None,
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
    model: LanguageModel,
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
        raise ValueError(f"generate takes one prompt of shape [seq]; got shape {prompt.shape}. "
                         "Generate for each row of a batch separately.")
    if prompt.shape[0] < 1:
        raise ValueError("generate needs a prompt of at least one token.")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}.")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}.")
    if temperature > 0 and key is None:
        raise ValueError("sampling with temperature > 0 needs a PRNG key: pass key=...")
    return _generate(
        model, prompt, int(num_tokens), float(temperature), key if temperature > 0 else None
    )
