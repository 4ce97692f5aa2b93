"""Fused softmax attention kernels behind `model.transformer.attention_impl` (docs/attention.md).

- "xla": `equipax.core.nn.attention.dot_product_attention`, plain einsums (every platform);
- "cudnn": cuDNN flash attention through `jax.nn.dot_product_attention(implementation="cudnn")`
  (CUDA GPUs, bfloat16/float16 inputs, no tanh logit cap);
- "splash": Pallas splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`, the kernel
  MaxText uses on TPU), run per device under `jax.shard_map` (a Pallas call has no GSPMD rule);
- "auto": the best of these the platform has, else "xla".

The platform is the one the program is lowered for: the mesh's devices (an ahead-of-time compile
for a TPU topology lowers for TPU on a CPU host), else JAX's default backend. A model built for a
mesh (the launcher's task) gets its kernel resolved once, from the mesh, the sequence length and
the dtype (`resolve_attention`, `with_resolved_attention`): its layers then run that kernel. All kernels take
the same arguments as `reference_attention` (grouped-query heads, packed segments, a sliding
window) and agree with it (tests/core/test_attention_impl.py, tests/core/test_attention_kernels.py).
"""

import dataclasses
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from equipax.core.configs import TransformerConfig
from equipax.core.knobs import ConfigError
from equipax.core.mesh_config import BATCH_AXES, CONTEXT, TENSOR
from equipax.core.nn.remat import ATTENTION_OUT

__all__ = [
    "attention_kernel",
    "resolve_attention",
    "with_resolved_attention",
    "AttentionImpl",
    "block_attention_impl",
    "cudnn_attention",
    "mesh_platform",
    "resolve_attention_impl",
    "splash_attention",
    "splash_block_size",
    "splash_block_sizes",
    "splash_local",
]

AttentionImpl = Literal["xla", "cudnn", "splash", "auto"]
_KNOB = "model.transformer.attention_impl"


def mesh_platform(mesh: Mesh | None) -> str:
    """The platform a program on `mesh` is lowered for: "cpu", "gpu" or "tpu".

    Arguments:
        mesh: the device mesh (its devices may be compile-only TPU topology devices), or None for
            JAX's default backend.
    """
    platform = str(mesh.devices.flat[0].platform) if mesh is not None and mesh.devices.size else jax.default_backend()
    return "gpu" if platform in ("cuda", "rocm") else platform


def splash_block_size(seq_len: int) -> int | None:
    """The splash kernel's query/key block for `seq_len` positions, or None if it has none.

    A block is a multiple of 128 (the TPU's lane width; the interpreter checks it too) that
    divides the sequence: the largest of 512, 256, 128, as MaxText's `sa_block_*` defaults.
    """
    for block in (512, 256, 128):
        if seq_len % block == 0:
            return block
    return None


def splash_block_sizes(q_len: int, kv_len: int, head_dim: int) -> tuple[int, int, int] | None:
    """`(block_q, block_kv, block_kv_compute)` of the splash kernel, forward and backward alike, or
    None where a length has no block (`splash_block_size`).

    Blocks of 1024 queries and keys with 512 keys per compute step where both lengths divide by
    1024 and heads are at most 128 wide: on the TPU v5e, forward + backward (fused) of the causal
    kernel took 5.06 ms against 5.81 at 512 (qwen3_0_6b's heads, seq 4096), 15.86 against 18.87
    (llama3_2_1b's, seq 8192), 3.00 against 3.05 (c4_1b's, seq 1024); 2048-blocks exceed the
    kernel's on-chip memory (benchmarks/README.md, "Splash block sizes"). Otherwise
    `splash_block_size` of each length, computed whole.
    """
    block_q, block_kv = splash_block_size(q_len), splash_block_size(kv_len)
    if block_q is None or block_kv is None:
        return None
    if q_len % 1024 == 0 and kv_len % 1024 == 0 and head_dim <= 128:
        return 1024, 1024, 512
    return block_q, block_kv, block_kv


def resolve_attention_impl(
    impl: str, platform: str, *, seq_len: int, dtype: Any, logit_cap: float | None
) -> Literal["xla", "cudnn", "splash"]:
    """The kernel `impl` runs as on `platform`, or a ConfigError saying why it cannot run there.

    Arguments:
        impl: the knob's value: "xla", "cudnn", "splash" or "auto".
        platform: "cpu", "gpu" or "tpu" (`mesh_platform`).
        seq_len: positions per sequence.
        dtype: the dtype of the queries, keys and values.
        logit_cap: the tanh logit cap, or None.

    Returns:
        "xla", "cudnn" or "splash". "auto" picks splash on TPU and cuDNN on GPU where they can
        run this shape and dtype, else xla.
    """
    low_precision = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if impl == "auto":
        if platform == "tpu" and splash_block_size(seq_len) is not None:
            return "splash"
        if platform == "gpu" and logit_cap is None and low_precision:
            return "cudnn"
        return "xla"
    if impl == "cudnn":
        if platform != "gpu":
            raise ConfigError(
                f"{_KNOB}='cudnn' needs a CUDA GPU, but this program runs on {platform}. Set "
                f"{_KNOB}='auto' (picks the best kernel this platform has) or 'xla'."
            )
        if not low_precision:
            raise ConfigError(
                f"{_KNOB}='cudnn' takes bfloat16 or float16 inputs, found {jnp.dtype(dtype).name}; set "
                f"model.dtype='bfloat16', or {_KNOB}='auto' / 'xla'."
            )
        if logit_cap is not None:
            raise ConfigError(
                f"{_KNOB}='cudnn' has no tanh logit cap (model.transformer.atten_logit_cap={logit_cap}); "
                f"set model.transformer.atten_logit_cap=None, or {_KNOB}='auto' / 'xla'."
            )
        return "cudnn"
    if impl == "splash":
        if platform != "tpu":
            raise ConfigError(
                f"{_KNOB}='splash' is a TPU kernel, but this program runs on {platform}. Set "
                f"{_KNOB}='auto' (picks the best kernel this platform has) or 'xla'; "
                "`launch compile --topology v5p-8` lowers it for a TPU on any host."
            )
        if splash_block_size(seq_len) is None:
            raise ConfigError(
                f"{_KNOB}='splash' needs a sequence length divisible by 128 (its block size), found "
                f"{seq_len}; change data.seq_len, or set {_KNOB}='auto' / 'xla'."
            )
        return "splash"
    return "xla"


def block_attention_impl(cfg: TransformerConfig) -> AttentionImpl:
    """`cfg.attention_impl`, except that "auto" means "xla" inside a pipeline stage or a
    `tensor_parallel="shard_map"` block (splash runs in its own shard_map, which cannot nest there)."""
    nested = cfg.pipeline_stages > 1 or cfg.tensor_parallel != "gspmd"
    return "xla" if cfg.attention_impl == "auto" and nested else cfg.attention_impl


def resolve_attention(
    cfg: TransformerConfig, platform: str, *, seq_len: int, dtype: Any, context: int = 1
) -> Literal["xla", "cudnn", "splash"] | None:
    """The kernel a transformer's softmax attention runs with, decided once for where it runs:
    `cfg.attention_impl` ("auto" picks per `resolve_attention_impl`), except that "auto" is "xla"
    inside a pipeline stage or a shard_map block (`block_attention_impl`) and on a `context` axis
    (`equipax.core.nn.self_attention.Attention` runs splash per chunk there only when asked to).

    Arguments:
        cfg: the transformer config.
        platform: "cpu", "gpu" or "tpu" (`mesh_platform`).
        seq_len: positions per sequence (the whole row, before a `context` axis splits it).
        dtype: the activations' dtype.
        context: the mesh's `context` axis size.

    Returns:
        "xla", "cudnn" or "splash"; None for `attention="linear"` (no kernel to pick).

    Raises:
        ConfigError: the kernel asked for cannot run on this platform, sequence length or dtype.
    """
    if cfg.attention != "softmax":
        return None
    impl = block_attention_impl(cfg)
    if context > 1 and impl != "splash":
        return "xla"
    return resolve_attention_impl(impl, platform, seq_len=seq_len, dtype=dtype, logit_cap=cfg.atten_logit_cap)


def with_resolved_attention(
    cfg: TransformerConfig, mesh: Mesh | None, *, seq_len: int, dtype: Any
) -> TransformerConfig:
    """`cfg` with `attention_impl` resolved for `mesh` (`resolve_attention`: its platform and
    `context` axis), as a Task built on the mesh gives its model.

    Arguments:
        cfg: the transformer config.
        mesh: the device mesh (None: JAX's default backend, no `context` axis).
        seq_len: positions per sequence the model is trained and evaluated on.
        dtype: the activations' dtype.
    """
    context = int(dict(mesh.shape).get(CONTEXT, 1)) if mesh is not None else 1
    kernel = resolve_attention(cfg, mesh_platform(mesh), seq_len=seq_len, dtype=dtype, context=context)
    if kernel is None or kernel == cfg.attention_impl:
        return cfg
    return dataclasses.replace(cfg, attention_impl=kernel)


def attention_kernel(
    cfg: TransformerConfig, platform: str, *, seq_len: int, dtype: Any, context: int = 1
) -> str | None:
    """The kernel a transformer's training step computes softmax attention with, for the record
    (what `attention_impl="auto"` resolved to: knobs.txt, compile.json): `resolve_attention`'s.

    Arguments:
        cfg: the transformer config.
        platform: "cpu", "gpu" or "tpu" (`mesh_platform`).
        seq_len: positions per training sequence.
        dtype: the activations' dtype.
        context: the mesh's `context` axis size.

    Returns:
        "xla", "cudnn" or "splash"; on a `context` axis, the kernel and the strategy that runs it
        (`equipax.core.nn.self_attention.Attention`: splash per chunk there, else XLA's blocks),
        e.g. "splash (ring)"; None for `attention="linear"` (no kernel to pick).
    """
    kernel = resolve_attention(cfg, platform, seq_len=seq_len, dtype=dtype, context=context)
    if kernel is None or context == 1:
        return kernel
    return f"{kernel} ({cfg.context_parallel_strategy})"


def cudnn_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq kv_heads head_dim"],
    v: Float[Array, "batch seq kv_heads head_dim"],
    *,
    causal: bool,
    segment_ids: Int[Array, "batch seq"] | None = None,
    window: int | None = None,
    implementation: Literal["cudnn", "xla"] = "cudnn",
) -> Float[Array, "batch seq heads head_dim"]:
    """Softmax attention through `jax.nn.dot_product_attention` (cuDNN flash attention on GPU).

    Grouped-query heads go in as they are (cuDNN reads each key/value head once per group); a
    sliding window is cuDNN's own (`local_window_size`, left side only); packed segments become a
    boolean mask (cuDNN then reads a dense `[q k]` mask).

    Arguments:
        q: queries (bfloat16 or float16 for cuDNN).
        k, v: keys and values; `heads` must be a multiple of `kv_heads`.
        causal: mask keys after each query's position.
        segment_ids: packed sequences: positions attend only within their own segment.
        window: with `causal`, each query sees itself and the `window - 1` keys before it.
        implementation: "cudnn", or "xla" to run the same call on any platform (tests).

    Returns:
        Attention outputs in `v.dtype`.
    """
    mask = None if segment_ids is None else (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    local = None if window is None else (window - 1, 0)
    out = jax.nn.dot_product_attention(
        q, k, v, mask=mask, is_causal=causal, local_window_size=local, implementation=implementation
    )
    return out.astype(v.dtype)


def _splash_kernel(
    heads: int,
    q_len: int,
    kv_len: int,
    *,
    offset: int,
    causal: bool,
    window: int | None,
    logit_cap: float | None,
    interpret: bool,
    save_residuals: bool = False,
    head_dim: int | None = None,
) -> Any:
    """The splash kernel for `q_len` queries starting at key position `offset` over `kv_len` keys
    (offset 0 and equal lengths: ordinary self-attention; a context-parallel chunk otherwise).
    `save_residuals`: the kernel also returns each row's log-sum-exp (forward only: what ring
    attention merges blocks with, `equipax.core.nn.splash_ring_attention.splash_ring_attention_shard`).

    Otherwise the kernel's forward rule names its residuals, its output and each row's
    log-sum-exp, `ATTENTION_OUT` (`equipax.core.nn.remat`): a remat policy that keeps the
    attention's context keeps both, and the backward pass runs without the forward kernel. (A
    `save_residuals` kernel is ring attention's, never differentiated: the ring names its merged
    output instead.)"""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    # head_dim None (ring attention's chunks, not measured with larger blocks): 512-blocks at most.
    blocks = splash_block_sizes(q_len, kv_len, head_dim if head_dim is not None else 2**31)
    if blocks is None:
        found = q_len if splash_block_size(q_len) is None else kv_len
        raise ConfigError(f"{_KNOB}='splash' needs a sequence length divisible by 128, found {found}.")
    block_q, block_kv, block_kv_compute = blocks
    shape = (q_len, kv_len)
    if window is not None:
        # Left side `window - 1` keys, none to the right: causal within the window (Mistral).
        one = sa.LocalMask(shape, window_size=(window - 1, 0), offset=offset)
    else:
        one = sa.CausalMask(shape, offset=offset) if causal else sa.FullMask(shape)
    # One backward kernel for dq, dk and dv (MaxText's `sa_use_fused_bwd_kernel`): the separate
    # dq and dkv kernels each recompute the block's logits and probabilities (7 matmuls per block
    # against 5).
    sizes = sa.BlockSizes(
        block_q=block_q,
        block_kv=block_kv,
        block_kv_compute=block_kv_compute,
        block_q_dkv=block_q,
        block_kv_dkv=block_kv,
        block_kv_dkv_compute=block_kv_compute,
        use_fused_bwd_kernel=True,
    )
    return sa.make_splash_mha(
        sa.MultiHeadMask([one] * heads),
        block_sizes=sizes,
        head_shards=1,
        q_seq_shards=1,
        attn_logits_soft_cap=logit_cap,
        save_residuals=save_residuals,
        residual_checkpoint_name=None if save_residuals else ATTENTION_OUT,
        interpret=interpret,
    )


def splash_local(
    q: Float[Array, "batch q_len heads head_dim"],
    k: Float[Array, "batch kv_len kv_heads head_dim"],
    v: Float[Array, "batch kv_len kv_heads head_dim"],
    q_segments: Int[Array, "batch q_len"] | None,
    kv_segments: Int[Array, "batch kv_len"] | None,
    *,
    offset: int = 0,
    causal: bool,
    window: int | None = None,
    logit_cap: float | None = None,
    interpret: bool = False,
) -> Float[Array, "batch q_len heads head_dim"]:
    """The splash kernel on one device's arrays: queries (already scaled by 1/sqrt(head_dim)) at
    key positions `offset .. offset + q_len - 1` against `kv_len` keys. What `splash_attention`
    runs per device, and context parallelism per chunk of queries
    (`equipax.core.nn.context_parallel.splash_all_gather_attention`). Segments None (both):
    the kernel without segment ids, which loads and compares no segment blocks. The kernel's
    output and log-sum-exp are named `ATTENTION_OUT` for remat (`_splash_kernel`)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    kernel = _splash_kernel(
        q.shape[2],
        q.shape[1],
        k.shape[1],
        offset=offset,
        causal=causal,
        window=window,
        logit_cap=logit_cap,
        interpret=interpret,
        head_dim=q.shape[3],
    )
    heads_first = lambda t: jnp.swapaxes(t, 1, 2)  # noqa: E731  [b s h d] <-> [b h s d]
    if q_segments is None or kv_segments is None:
        if q_segments is not None or kv_segments is not None:
            raise ValueError("splash_local: give both q_segments and kv_segments, or neither.")
        out = jax.vmap(kernel)(heads_first(q), heads_first(k), heads_first(v))
    else:
        segments = sa.SegmentIds(q=q_segments, kv=kv_segments)
        out = jax.vmap(kernel)(heads_first(q), heads_first(k), heads_first(v), segment_ids=segments)
    return heads_first(out).astype(v.dtype)


def splash_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq kv_heads head_dim"],
    v: Float[Array, "batch seq kv_heads head_dim"],
    *,
    causal: bool,
    logit_cap: float | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None,
    window: int | None = None,
    mesh: Mesh | None = None,
    interpret: bool = False,
) -> Float[Array, "batch seq heads head_dim"]:
    """Softmax attention with the Pallas TPU splash kernel (flash attention with block sparsity).

    Grouped-query heads are the kernel's own (each key/value head serves its group of query
    heads); a sliding window is its `LocalMask` (blocks outside the window are skipped). With a
    mesh of more than one device, each device runs the kernel on its own rows (batch over the
    batch axes) and heads (over `tensor` when it divides both head counts) inside `jax.shard_map`.

    Arguments:
        q: queries.
        k, v: keys and values; `heads` must be a multiple of `kv_heads`.
        causal: mask keys after each query's position (the kernel skips fully masked blocks).
        logit_cap: if set, logits become `cap * tanh(logits / cap)` before masking.
        segment_ids: packed sequences: positions attend only within their own segment.
        window: with `causal`, each query sees itself and the `window - 1` keys before it.
        mesh: the device mesh the inputs are sharded over, or None (one device).
        interpret: run the kernel in the Pallas interpreter (any platform; slow: for tests).

    Returns:
        Attention outputs in `v.dtype`.
    """
    if window is not None and not causal:
        raise ValueError("a sliding window limits the causal prefix: pass causal=True with window.")
    q = q * jnp.asarray(1.0 / math.sqrt(q.shape[-1]), q.dtype)
    # Unpacked rows (no segment ids) run the kernel without them: the segmented kernel also
    # loads and compares a block of ids per block of logits (benchmarks/README.md, "On a real TPU").
    seg = None if segment_ids is None else segment_ids.astype(jnp.int32)

    def local(q: Array, k: Array, v: Array, seg: Array | None = None) -> Array:
        return splash_local(q, k, v, seg, seg, causal=causal, window=window, logit_cap=logit_cap, interpret=interpret)

    if mesh is None or mesh.size == 1:
        return local(q, k, v, seg)
    batch = tuple(a for a in BATCH_AXES if a in mesh.shape and mesh.shape[a] > 1)
    batch_size = int(np.prod([mesh.shape[a] for a in batch])) if batch else 1
    if q.shape[0] % batch_size:
        batch = ()
    tp = mesh.shape.get(TENSOR, 1)
    # Query heads split over `tensor` keep their key/value heads on the same device only when
    # both counts divide: query head h reads key/value head h // group.
    heads = TENSOR if tp > 1 and q.shape[2] % tp == 0 and k.shape[2] % tp == 0 else None
    qkv_spec = P(batch or None, None, heads, None)
    seg_spec = P(batch or None, None)
    if seg is None:
        return jax.shard_map(
            local, mesh=mesh, in_specs=(qkv_spec, qkv_spec, qkv_spec), out_specs=qkv_spec, check_vma=False
        )(q, k, v)
    return jax.shard_map(
        local, mesh=mesh, in_specs=(qkv_spec, qkv_spec, qkv_spec, seg_spec), out_specs=qkv_spec, check_vma=False
    )(q, k, v, seg)
