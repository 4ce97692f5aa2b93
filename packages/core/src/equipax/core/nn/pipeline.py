"""Pipeline parallelism: a transformer stack split into stages over the `stage` mesh axis.

The `num_layers` blocks are split into `pipeline_stages` (S) groups of consecutive layers; the
devices of mesh slice `stage=s` hold and run group `s` only. The global batch is split into M
microbatches. In every *iteration* each stage runs its layers on one microbatch, then hands
its output to the next stage with one `jax.lax.ppermute` over `stage` (a neighbour exchange on
the interconnect): stage s works on microbatch t - s in iteration t.

GPipe (`pipeline_schedule="gpipe"`), S = 2 stages, M = 4 microbatches (`.` = idle, the bubble)::

    iteration   0    1    2    3    4
    stage 0     m0   m1   m2   m3   .
    stage 1     .    m0   m1   m2   m3      -> outputs of m0..m3 leave stage 1

That is the whole forward pass (M + S - 1 iterations). The backward pass is the automatic
derivative of this loop, so it runs the same schedule in reverse, all forward then all backward
as in GPipe: the transpose of "send to stage s + 1" is "send the gradient to stage s - 1".

Circular (`pipeline_schedule="circular"`, Pax's CIRCULAR_REPEAT, MaxText's
`num_pipeline_repeats`) gives each device R = `pipeline_repeats` non-adjacent groups of layers
(virtual stages): layer group v = r x S + s lives on stage s, and a microbatch goes round the
ring of stages R times (the last stage sends back to stage 0). S = 2, R = 2, M = 2::

    iteration   0      1      2      3      4
    stage 0     r0m0   r0m1   r1m0   r1m1   .
    stage 1     .      r0m0   r0m1   r1m0   r1m1

Each iteration is 1/R of a stage's layers, so the same fill and drain of S - 1 iterations costs
R times less time. Stage 0 needs microbatch m's first-round output back before its second round:
M >= S is required, and with M > S stage 0 keeps arriving outputs in a buffer until their turn.

The *bubble* is the share of a stage's time spent idle: (S - 1) / (R x M + S - 1)
(`bubble_fraction`). More microbatches shrink it, at the cost of smaller matmuls per iteration
(docs/pipeline.md says how to choose).

Composition with the other axes: the pipeline is a `jax.shard_map` that is manual over `stage`
only; `data`, `fsdp` and `tensor` stay automatic (GSPMD) inside each stage, so a stage's layers
are FSDP- and tensor-sharded exactly as an unpipelined stack's (their leading `stage` logical
axis is the only difference) and each microbatch is split over (data, fsdp). Outside the
pipeline, the embedding and logits split the batch over (data, fsdp, stage), as Pax does.

With a `context` mesh axis the shard_map is manual over `stage` and `context`: each device runs
its stage's layers on its part of each microbatch's sequence (in the context-parallel layout,
with each slot's global position), and the attention kernels exchange keys and values over
`context` inside it (`equipax.core.nn.context_parallel`; docs/long_context.md).

Parameters are stored `[stage, repeat, layer, ...]` (`PipelinedStack.stages`);
`PipelinedStack.in_layer_order()` gives them in model order. Without a mesh that has a `stage`
axis the stack runs its layers one after another on the local devices (same numbers): that is
how it is checked against the unpipelined stack and how `generate` runs it.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

from equipax.core.config_checks import bubble_fraction, check_pipeline, check_pipeline_knobs, num_microbatches
from equipax.core.mesh import BATCH_AXES, CONTEXT, STAGE
from equipax.core.nn.context_parallel import slot_index
from equipax.core.nn.quantization import Quantization
from equipax.core.nn.self_attention import Rotary
from equipax.core.nn.transformer import (
    StackCache,
    TransformerBlock,
    TransformerConfig,
    TransformerStack,
    init_stack_cache,
    run_cached_layers,
    run_stacked_layers,
    stacked_init,
)
from equipax.core.partition import Axes

__all__ = [
    "bubble_fraction",
    "check_pipeline",
    "check_pipeline_knobs",
    "make_stack",
    "num_microbatches",
    "PipelinedStack",
]

_KNOB = "model.transformer"


class PipelinedStack(eqx.Module):
    """`num_layers` transformer blocks in `pipeline_stages` stages (module docstring).

    `stages` is ONE `TransformerBlock` whose arrays carry leading `[stage, repeat, layer]`
    axes: layer `(r x S + s) x L + j` of the model (L = layers per virtual stage) is at
    `[s, r, j]`. Built from the same key, it holds the same numbers as a `TransformerStack`.
    """

    stages: TransformerBlock
    cfg: TransformerConfig = eqx.field(static=True)

    def __init__(self, cfg: TransformerConfig, *, key: PRNGKeyArray, quantization: Quantization = "none") -> None:
        """Arguments:
        cfg: transformer config (`pipeline_stages` > 1 or not).
        key: PRNG key.
        quantization: how the blocks' projections compute (`TransformerBlock`).
        """
        self.cfg = cfg
        layers = stacked_init(
            lambda k: TransformerBlock(cfg, key=k, quantization=quantization), jr.split(key, cfg.num_layers)
        )
        s, r = cfg.pipeline_stages, cfg.pipeline_repeats
        per = cfg.num_layers // (s * r)
        # [layer] -> [repeat, stage, layer in stage] -> [stage, repeat, layer in stage].
        self.stages = jax.tree.map(lambda w: jnp.swapaxes(w.reshape(r, s, per, *w.shape[1:]), 0, 1), layers)

    def logical_axes(self) -> dict[str, Axes]:
        """Every stacked array: `stage` (split over the `stage` mesh axis), repeat, layer."""
        return {"stages": ("stage", "layers", "layers")}

    def in_layer_order(self) -> TransformerBlock:
        """The blocks stacked `[num_layers, ...]` in the order the model applies them."""
        return jax.tree.map(
            lambda w: jnp.swapaxes(w, 0, 1).reshape(-1, *w.shape[3:]) if eqx.is_array(w) else w, self.stages
        )

    def forward(
        self,
        x: Float[Array, "batch seq embed"],
        *,
        mesh: Mesh | None = None,
        segment_ids: Int[Array, "batch seq"] | None = None,
        rotary: Rotary | None = None,
        sequence_index: Int[Array, "batch seq"] | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], None]:
        """`(__call__'s outputs, None)`: `TransformerStack.forward`'s contract; a pipeline runs dense
        blocks only (the config refuses a mixture of experts in one), so it has no MoE stats."""
        return self(x, mesh=mesh, segment_ids=segment_ids, rotary=rotary, sequence_index=sequence_index), None

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        *,
        mesh: Mesh | None = None,
        segment_ids: Int[Array, "batch seq"] | None = None,
        rotary: Rotary | None = None,
        sequence_index: Int[Array, "batch seq"] | None = None,
    ) -> Float[Array, "batch seq embed"]:
        """Run all layers: pipelined over `mesh`'s `stage` axis, else one after another.

        Arguments:
            x: inputs.
            mesh: the device mesh; with a `stage` axis, it must have `pipeline_stages` slices.
            segment_ids: packed sequences: attention stays within each segment.
            rotary: `(sin, cos)` of each token's position (rotary positions), or None.
            sequence_index: each token's index in its unsplit row, for a context-parallel layout
                (zigzag); None = positions in order.

        Returns:
            Outputs of the same shape and dtype.
        """
        cfg = self.cfg
        if mesh is None or STAGE not in mesh.shape:
            params, static = eqx.partition(self.in_layer_order(), eqx.is_array)
            # Dense blocks only (the config refuses a mixture of experts in a pipeline): no stats.
            y, _ = run_stacked_layers(
                params,
                static,
                x,
                remat=cfg.remat,
                scan=cfg.scan_layers,
                mesh=mesh,
                segment_ids=segment_ids,
                rotary=rotary,
                sequence_index=sequence_index,
            )
            return y
        if mesh.shape[STAGE] != cfg.pipeline_stages:
            raise ValueError(
                f"The mesh's `stage` axis has {mesh.shape[STAGE]} devices but {_KNOB}.pipeline_stages="
                f"{cfg.pipeline_stages}; make them equal."
            )
        params, static = eqx.partition(self.stages, eqx.is_array)
        return _pipeline(params, static, x, segment_ids, rotary, sequence_index, cfg=cfg, mesh=mesh)

    def cached(
        self,
        x: Float[Array, "batch seq embed"],
        cache: StackCache,
        positions: Int[Array, "batch seq"],
        *,
        rotary: Rotary | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], StackCache]:
        """Run all layers with a KV cache, in model order on the local devices (not pipelined).

        Arguments:
            x: inputs.
            cache: the stack's cache (`init_cache`; stacked in model order).
            positions: each token's position (its cache slot).
            rotary: `(sin, cos)` of each token's position, or None.

        Returns:
            `(outputs, the updated cache)`.
        """
        return run_cached_layers(self.in_layer_order(), x, cache, positions, scan=self.cfg.scan_layers, rotary=rotary)

    def init_cache(self, batch_size: int, max_len: int, dtype: DTypeLike) -> StackCache:
        """A zero KV cache for `batch_size` rows of `max_len` tokens (layers in model order)."""
        return init_stack_cache(self.in_layer_order(), batch_size, max_len, dtype)


def make_stack(
    cfg: TransformerConfig, *, key: PRNGKeyArray, quantization: Quantization = "none"
) -> TransformerStack | PipelinedStack:
    """The transformer stack `cfg` asks for: pipelined when `pipeline_stages` > 1; its blocks'
    projections compute as `quantization` says (`TransformerBlock`)."""
    stack = PipelinedStack if cfg.pipeline_stages > 1 else TransformerStack
    return stack(cfg, key=key, quantization=quantization)


def _data_parallel(mesh: Mesh) -> int:
    """Devices a microbatch is split over inside a stage (data x fsdp)."""
    return math.prod(mesh.shape[a] for a in BATCH_AXES if a != STAGE and a in mesh.shape)


def _to_microbatches(x: Array, m: int, dp: int) -> Array:
    """[batch, ...] -> [m, batch / m, ...], each microbatch taking an equal share of every
    data-parallel device's rows (the batch is split over (data, fsdp, stage), stage fastest:
    viewed as [dp, m, rows], this needs no communication when S divides m)."""
    b = x.shape[0]
    x = x.reshape(dp, m, b // (dp * m), *x.shape[1:])
    return jnp.swapaxes(x, 0, 1).reshape(m, b // m, *x.shape[3:])


def _from_microbatches(x: Array, dp: int) -> Array:
    """The inverse of `_to_microbatches`."""
    m, mb = x.shape[:2]
    x = jnp.swapaxes(x.reshape(m, dp, mb // dp, *x.shape[2:]), 0, 1)
    return x.reshape(m * mb, *x.shape[3:])


def _pipeline(
    params: TransformerBlock,
    static: TransformerBlock,
    x: Array,
    segment_ids: Array | None,
    rotary: Rotary | None,
    sequence_index: Array | None,
    *,
    cfg: TransformerConfig,
    mesh: Mesh,
) -> Array:
    """The schedule of the module docstring, as a shard_map manual over `stage` only, or over
    `stage` and `context` where the mesh splits the sequence (module docstring)."""
    s_count, repeats = cfg.pipeline_stages, cfg.pipeline_repeats
    m_count = num_microbatches(cfg, x.shape[0])
    dp = _data_parallel(mesh)
    if x.shape[0] % (m_count * dp):
        raise ValueError(
            f"A batch of {x.shape[0]} does not split into {m_count} microbatches over {dp} data x fsdp "
            f"devices; set {_KNOB}.pipeline_microbatches (or _size) to fit the batch."
        )
    xs = _to_microbatches(x, m_count, dp)
    segs = None if segment_ids is None else _to_microbatches(segment_ids, m_count, dp)
    rots = (
        None if rotary is None else (_to_microbatches(rotary[0], m_count, dp), _to_microbatches(rotary[1], m_count, dp))
    )
    cp = mesh.shape.get(CONTEXT, 1)
    if cp > 1:  # each device's part of the row needs its global positions
        sequence_index = slot_index(x, sequence_index)
    poss = None if sequence_index is None else _to_microbatches(sequence_index, m_count, dp)
    # [microbatch, rows, seq, ...]: the sequence split over `context` (manual), or whole.
    seq = P(None, None, CONTEXT) if cp > 1 else P()
    # Forward to stage s + 1; circular also closes the ring (last stage -> stage 0).
    ring = [(i, (i + 1) % s_count) for i in range(s_count if repeats > 1 else s_count - 1)]
    # Item k of a stage = round k // M of microbatch k % M; stage s works on item t - s.
    num_items = m_count * repeats
    num_iterations = num_items + s_count - 1

    def one_stage(
        params: TransformerBlock, xs: Array, segs: Array | None, rots: tuple[Array, Array] | None, poss: Array | None
    ) -> Array:
        params = jax.tree.map(lambda w: w[0], params)  # this stage's [repeat, layer, ...]
        stage = jax.lax.axis_index(STAGE)
        # The two sums over `stage` (the outputs below, and the inputs' gradient: the transpose
        # of this cast to "varying") run in float32: XLA:CPU fails to compile a bf16 all-reduce
        # inside a partly manual shard_map ("Invalid binary instruction opcode copy").
        xs = jax.lax.pcast(xs.astype(jnp.float32), (STAGE,), to="varying").astype(x.dtype)

        def iteration(carry: tuple[Array, Array | None], t: Array) -> tuple[tuple[Array, Array | None], Array]:
            received, returned = carry
            item = t - stage
            micro, rnd = item % m_count, jnp.clip(item // m_count, 0, repeats - 1)
            # Stage 0 reads a new microbatch in round 0 and a returned one after; the others
            # continue what the previous stage sent.
            first = xs[micro] if returned is None else jnp.where(rnd == 0, xs[micro], returned[micro])
            h = jnp.where(stage == 0, first, received)
            layers = jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, rnd, 0, keepdims=False), params)
            y, _ = run_stacked_layers(
                layers,
                static,
                h,
                remat=cfg.remat,
                scan=cfg.scan_layers,
                mesh=mesh,
                segment_ids=None if segs is None else segs[micro],
                rotary=None if rots is None else (rots[0][micro], rots[1][micro]),
                sequence_index=None if poss is None else poss[micro],
            )
            sent = jax.lax.ppermute(y, STAGE, ring)
            if returned is not None:
                # What stage 0 just received is the last stage's item t - (S - 1): keep it for
                # that microbatch's next round (outputs of the final round are not needed).
                back = t - (s_count - 1)
                keep = (stage == 0) & (back >= 0) & (back < num_items - m_count)
                slot = back % m_count
                returned = returned.at[slot].set(jnp.where(keep, sent, returned[slot]))
            return (sent, returned), y

        zeros = jnp.zeros_like(xs[0])
        returned = None if repeats == 1 else jnp.zeros_like(xs)
        _, ys = jax.lax.scan(iteration, (zeros, returned), jnp.arange(num_iterations))
        # The last stage finishes microbatch i's final round in iteration T - M + i, so the
        # last M iterations of the last stage are the outputs; the sum over stages (zeros
        # elsewhere) hands them to every stage.
        ys = ys[num_iterations - m_count :]
        ys = jnp.where(stage == s_count - 1, ys, jnp.zeros_like(ys)).astype(jnp.float32)
        return jax.lax.psum(ys, STAGE).astype(x.dtype)

    manual = {STAGE, CONTEXT} if cp > 1 else {STAGE}
    out = jax.shard_map(
        one_stage, mesh=mesh, in_specs=(P(STAGE), seq, seq, seq, seq), out_specs=seq, axis_names=manual
    )(params, xs, segs, rots, poss)
    return _from_microbatches(out, dp)
