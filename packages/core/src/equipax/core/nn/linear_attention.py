"""Linear attention with the feature map phi(x) = elu(x) + 1 (Katharopoulos et al., 2020).

Softmax attention weighs value j for query i by `exp(q_i . k_j)`; linear attention uses the
kernel `phi(q_i) . phi(k_j)` instead, so the sum over keys factorises:

    out_i = phi(q_i)^T (sum_j phi(k_j) v_j^T) / (phi(q_i) . sum_j phi(k_j) + eps)

Computing the `[head_dim head_dim]` matrix `phi(K)^T V` first costs O(N d^2) time and
O(d^2) extra memory instead of O(N^2 d) and O(N^2). Under a causal mask the sums run
over `j <= i`; the chunked form here is quadratic inside a chunk of `chunk_size` positions
and carries the running `d x d` state across chunks with `lax.scan`, so memory stays
O(N d + chunk^2 + d^2). All kernels share the softmax kernels' interface:
`(q, k, v, *, causal) -> out` on `[batch seq heads head_dim]` arrays.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from equipax.core.configs import LINEAR_ATTENTION_CHUNK_SIZE

__all__ = ["DEFAULT_CHUNK_SIZE", "DEFAULT_EPS", "elu_feature_map", "linear_attention", "reference_linear_attention"]

# Default positions per chunk in causal linear attention (also used by equipax.core.flops).
DEFAULT_CHUNK_SIZE = LINEAR_ATTENTION_CHUNK_SIZE
DEFAULT_EPS = 1e-6


def elu_feature_map(x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
    """phi(x) = elu(x) + 1: positive, so the normaliser never vanishes.

    Arguments:
        x: queries or keys.

    Returns:
        phi(x), same shape and dtype.
    """
    return jax.nn.elu(x) + 1.0


def reference_linear_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq heads head_dim"],
    v: Float[Array, "batch seq heads head_dim"],
    *,
    causal: bool,
    eps: float = DEFAULT_EPS,
) -> Float[Array, "batch seq heads head_dim"]:
    """Slow, obvious linear attention: the full `[q k]` kernel matrix, O(N^2) memory.

    Arguments:
        q, k, v: queries, keys and values.
        causal: each query sees keys at its own and earlier positions only.
        eps: added to the normaliser.

    Returns:
        Attention outputs in `v.dtype`.
    """
    pq, pk = (elu_feature_map(t.astype(jnp.float32)) for t in (q, k))
    weights = jnp.einsum("bqhd,bkhd->bhqk", pq, pk)
    if causal:
        n_q, n_k = q.shape[1], k.shape[1]
        mask = jnp.arange(n_k)[None, :] <= jnp.arange(n_q)[:, None] + (n_k - n_q)
        weights = jnp.where(mask[None, None], weights, 0.0)
    num = jnp.einsum("bhqk,bkhd->bqhd", weights, v.astype(jnp.float32))
    den = jnp.transpose(jnp.sum(weights, axis=-1), (0, 2, 1))[..., None]
    return (num / (den + eps)).astype(v.dtype)


def _noncausal(pq: Array, pk: Array, v: Array, eps: float) -> Array:
    kv = jnp.einsum("bkhd,bkhe->bhde", pk, v)  # phi(K)^T V: [d d] per head
    k_sum = jnp.sum(pk, axis=1)  # [b h d]
    num = jnp.einsum("bqhd,bhde->bqhe", pq, kv)
    den = jnp.einsum("bqhd,bhd->bqh", pq, k_sum)[..., None]
    return num / (den + eps)


def _causal_chunked(pq: Array, pk: Array, v: Array, chunk_size: int, eps: float) -> Array:
    b, n, h, d = pq.shape
    e = v.shape[-1]
    c = min(chunk_size, n)
    num_chunks = -(-n // c)
    pad = num_chunks * c - n
    if pad:
        # Zero features: padded keys add nothing to any state, padded queries are cut off.
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        pq, pk, v = (jnp.pad(t, widths) for t in (pq, pk, v))

    def chunks(t: Array) -> Array:  # [b n h x] -> [chunks b c h x]
        return jnp.moveaxis(t.reshape(b, num_chunks, c, h, t.shape[-1]), 1, 0)

    tril = jnp.tril(jnp.ones((c, c), jnp.bool_))[None, None]

    def body(carry: tuple[Array, Array], xs: tuple[Array, Array, Array]):
        state, k_sum = carry  # [b h d e], [b h d]: sums over all earlier chunks
        cq, ck, cv = xs
        w = jnp.where(tril, jnp.einsum("bqhd,bkhd->bhqk", cq, ck), 0.0)
        num = jnp.einsum("bhqk,bkhe->bqhe", w, cv) + jnp.einsum("bqhd,bhde->bqhe", cq, state)
        den = jnp.transpose(jnp.sum(w, axis=-1), (0, 2, 1)) + jnp.einsum("bqhd,bhd->bqh", cq, k_sum)
        out = num / (den + eps)[..., None]
        state = state + jnp.einsum("bkhd,bkhe->bhde", ck, cv)
        k_sum = k_sum + jnp.sum(ck, axis=1)
        return (state, k_sum), out

    init = (jnp.zeros((b, h, d, e), pq.dtype), jnp.zeros((b, h, d), pq.dtype))
    _, out = jax.lax.scan(body, init, (chunks(pq), chunks(pk), chunks(v)))
    out = jnp.moveaxis(out, 0, 1).reshape(b, num_chunks * c, h, e)
    return out[:, :n]


def linear_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq heads head_dim"],
    v: Float[Array, "batch seq heads head_dim"],
    *,
    causal: bool,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    eps: float = DEFAULT_EPS,
) -> Float[Array, "batch seq heads head_dim"]:
    """Linear attention, phi = elu + 1, in O(N) time and memory.

    Non-causal: `phi(K)^T V` first, then `phi(Q) @` it. Causal: chunks of `chunk_size`
    positions (the last one zero-padded when `chunk_size` does not divide N), quadratic
    inside a chunk plus a running `[head_dim head_dim]` state from earlier chunks.
    Computes in float32 (the state is a long sum).

    Arguments:
        q, k, v: queries, keys and values.
        causal: each query sees keys at its own and earlier positions only.
        chunk_size: positions per chunk in the causal form (>= 1; capped at N).
        eps: added to the normaliser `phi(q) . sum phi(k)`.

    Returns:
        Attention outputs in `v.dtype`.
    """
    if chunk_size < 1:
        raise ValueError(f"linear_attention chunk_size must be >= 1, got {chunk_size}.")
    pq, pk = (elu_feature_map(t.astype(jnp.float32)) for t in (q, k))
    vf = v.astype(jnp.float32)
    out = _causal_chunked(pq, pk, vf, chunk_size, eps) if causal else _noncausal(pq, pk, vf, eps)
    return out.astype(v.dtype)
