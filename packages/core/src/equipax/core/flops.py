"""Analytic FLOP and parameter counts for the transformer LM (MaxText-style accounting).

`cost_analysis()` counts a scanned layer body once, so model FLOPs are computed here
from the config instead.
"""

import math
from typing import Any

from equipax.core.configs import LINEAR_ATTENTION_CHUNK_SIZE as DEFAULT_CHUNK_SIZE
from equipax.core.configs import TransformerConfig

__all__ = ["count_params", "lm_param_counts", "transformer_lm_flops_per_token"]


def transformer_lm_flops_per_token(cfg: TransformerConfig, *, vocab_size: int, seq_len: int) -> dict[str, float]:
    """FLOPs per token of a decoder-only LM (any family: tied or untied output, grouped heads).

    A matmul `[m k] @ [k n]` counts `2 m k n`. Causal softmax attention counts half of the full
    `QK^T` and `PV` products; with a sliding window of W < seq_len positions, the keys a query sees
    on average, `W - W^2 / (2 seq_len)` (= seq_len / 2 at W = seq_len). Grouped-query attention
    projects `num_heads + 2 num_kv_heads` heads; the attention products run over all `num_heads`
    query heads. The output projection counts `2 d vocab` tied or untied. Linear attention
    (`cfg.attention == "linear"`, causal and chunked) counts, per token and head, the state update
    `phi(k) v^T` and read-out `phi(q)^T S` (`2 hd^2` each) plus the causal half of the quadratic
    products inside a chunk of `min(seq_len, DEFAULT_CHUNK_SIZE)` positions; element-wise work
    (feature map, normaliser) is not counted, as for softmax. A mixture-of-experts feed-forward
    (`num_experts > 0`) counts its active parameters: the router (`2 d experts`), the
    `num_experts_per_tok` experts a token goes through and the shared expert, so MFU is computed
    from the active parameters (dispatch and dropped tokens are not counted). Training is 3x
    forward (forward + backward). Remat recomputation is reported as `remat` and is not part of the model FLOPs.

    Arguments:
        cfg: transformer config.
        vocab_size: vocabulary size (for the unembedding matmul).
        seq_len: sequence length (for the attention term).

    Returns:
        Per-token FLOPs, all layers summed: `qkv_projection`, `output_projection`, `mlp`,
        `attention`, `unembedding`, `forward` (their sum), `training` (3x forward: the
        model FLOPs), `remat` (extra forward work recomputed in the backward pass under
        `cfg.remat`; "auto" counts as "full", the most it can choose) and `training_with_remat`
        (what the hardware executes).
    """
    d, h, hd, n = (cfg.model_dims, cfg.num_heads, cfg.head_dim, cfg.num_layers)
    qkv = 2.0 * d * (h + 2 * cfg.kv_heads) * hd
    out_proj = 2.0 * h * hd * d
    mlp = 2.0 * _mlp_params(cfg, active=True)
    if cfg.attention == "linear":
        chunk = min(seq_len, DEFAULT_CHUNK_SIZE)
        attention = 2.0 * 2.0 * hd * hd * h + 2.0 * 2.0 * chunk * h * hd / 2.0
    else:
        # QK^T and PV: 2 matmuls of 2 * keys * h * hd per token, keys = seq / 2 under the causal
        # mask (the average over queries), fewer under a sliding window.
        w = cfg.sliding_window
        keys = seq_len / 2.0 if w is None or w >= seq_len else w - w * w / (2.0 * seq_len)
        attention = 2.0 * 2.0 * keys * h * hd
    unembedding = 2.0 * d * vocab_size
    layers_forward = n * (qkv + out_proj + mlp + attention)
    forward = layers_forward + unembedding
    training = 3.0 * forward
    remat = n * _remat_per_layer(cfg, qkv=qkv, out_proj=out_proj, mlp=mlp, attention=attention)
    return {
        "qkv_projection": n * qkv,
        "output_projection": n * out_proj,
        "mlp": n * mlp,
        "attention": n * attention,
        "unembedding": unembedding,
        "forward": forward,
        "training": training,
        "remat": remat,
        "training_with_remat": training + remat,
    }


def _remat_per_layer(cfg: TransformerConfig, *, qkv: float, out_proj: float, mlp: float, attention: float) -> float:
    """Forward FLOPs per token one block recomputes in the backward pass under `cfg.remat`.

    What the backward pass needs and the policy did not save is recomputed: under "full" the whole
    block; "dots_saveable" saves the projections (dots without batch dimensions), so the attention
    einsums (batch and head dimensions; with splash, its forward kernel) run again;
    "dots_with_context" saves the context beside them, so only the scores `QK^T` run again;
    "save_attention_out" / "offload_attention_out" save the attention context and the MLP's input,
    so the QKV projection, the scores `QK^T` (half the attention einsums; `PV`'s output is the
    saved context) and the MLP's input projections (all of its matrices but the output one, whose
    input is recomputed from them) run again; "save_context" saves the context alone, so the output
    projection too (the MLP's input is recomputed from it). With `attention_impl="splash"` the
    saved context includes the kernel's log-sum-exp and its backward kernel computes the scores
    itself: these policies recompute none of the attention. ("auto" kernels count as XLA's:
    the kernel is resolved for a platform, which the config does not name.)
    """
    if cfg.remat in ("full", "auto"):
        return qkv + out_proj + mlp + attention
    if cfg.remat == "dots_saveable":
        return attention
    scores = 0.0 if cfg.attention_impl == "splash" else attention / 2.0
    if cfg.remat == "dots_with_context":
        return scores
    inputs = 2 if cfg.gated else 1  # input matrices of the feed-forward (or each expert)
    if cfg.remat in ("save_attention_out", "offload_attention_out"):
        return qkv + scores + mlp * inputs / (inputs + 1)
    if cfg.remat == "save_context":
        return qkv + scores + out_proj + mlp * inputs / (inputs + 1)
    return 0.0


def count_params(tree: Any) -> int:
    """Number of parameters: total size of the inexact (float/complex) array leaves.

    Arguments:
        tree: any pytree, e.g. a model, or its `eqx.filter_eval_shape` abstract version
            (leaves `jax.ShapeDtypeStruct`; counts a model without allocating it).

    Returns:
        The parameter count.
    """
    # Imported here: the analytic counts below serve `launch show`, which does not load JAX.
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    def is_inexact(x: object) -> bool:
        if isinstance(x, jax.ShapeDtypeStruct):
            return bool(jnp.issubdtype(x.dtype, jnp.inexact))
        return eqx.is_inexact_array(x)

    leaves = [x for x in jax.tree.leaves(tree) if is_inexact(x)]
    return sum(math.prod(x.shape) for x in leaves)


def _mlp_params(cfg: TransformerConfig, *, active: bool) -> int:
    """Feed-forward matmul parameters of one block (an MoE's: router, experts, shared expert;
    `active`: only the `num_experts_per_tok` experts one token uses), biases excluded."""
    d = cfg.model_dims
    if not cfg.num_experts:
        return d * cfg.hidden_dims * (3 if cfg.gated else 2)
    experts = cfg.num_experts_per_tok if active else cfg.num_experts
    return d * cfg.num_experts + 3 * d * (experts * cfg.expert_hidden_dims + cfg.shared_expert_intermediate_size)


def lm_param_counts(cfg: TransformerConfig, vocab_size: int, *, tie_embeddings: bool = True) -> dict[str, int]:
    """Analytic parameter counts of a transformer LM (embedding, blocks, final norm, output).

    Arguments:
        cfg: transformer config.
        vocab_size: vocabulary size.
        tie_embeddings: the output logits reuse the input table (else a second `[embed vocab]`
            table).

    Returns:
        `embedding` (the input table, plus the output projection when untied), `unembedding`
        (the output projection alone; 0 when tied), `per_layer` (one block), `final_norm`,
        `total`, and `active` (the parameters one token uses: `total` less the experts it is not
        routed to; `total` for a dense model).
    """
    d, h, kv, hd, f = cfg.model_dims, cfg.num_heads, cfg.kv_heads, cfg.head_dim, cfg.hidden_dims
    bias = cfg.use_bias
    norm = d * (2 if (cfg.norm == "layernorm" and bias) else 1)
    attention = d * (h + 2 * kv) * hd + h * hd * d + ((h + 2 * kv) * hd + d if bias else 0)
    attention += 2 * hd if cfg.qk_norm else 0
    num_in = 2 if cfg.gated else 1
    mlp = _mlp_params(cfg, active=False) + (num_in * f + d if bias else 0)
    per_layer = 2 * norm + attention + mlp
    unembedding = 0 if tie_embeddings else d * vocab_size
    embedding = vocab_size * d + unembedding
    # Shared layers (`num_hidden_groups`) hold `layer_groups` blocks: counted once each.
    total = embedding + cfg.layer_groups * per_layer + norm
    inactive = cfg.layer_groups * (_mlp_params(cfg, active=False) - _mlp_params(cfg, active=True))
    return {
        "embedding": embedding,
        "unembedding": unembedding,
        "per_layer": per_layer,
        "final_norm": norm,
        "total": total,
        "active": total - inactive,
    }
