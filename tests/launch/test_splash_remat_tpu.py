"""The transformer stack with splash attention under remat, traced for a TPU v5e mesh (compile-only
devices from libtpu; nothing is compiled or run): the policies that keep the attention's context
run the splash forward kernel once per layer ("full" twice), and keep the context once, as the
kernel's output (the block does not name it again), on one device and on a `context` axis of 2
(all-gather: the kernel per chunk; ring: the kernel per pair, the merged output kept). The
gradients' numbers are tests/core/test_splash_remat.py's, in the Pallas interpreter. Skipped where
libtpu is missing.
"""

import contextlib
import io
import re

import pytest

from equipax.launch.hardware.tpu import libtpu_available
from helpers.jaxprs import splash_forward_kernels

pytestmark = pytest.mark.skipif(not libtpu_available(), reason="libtpu (XLA:TPU) is not installed")

L, B, S, E, H, D = 2, 1, 512, 96, 2, 64  # E differs from H * D and D: a residual's shape says what it is


def _traced(remat: str, strategy: str | None) -> tuple[int, int]:
    """`(splash forward kernels the value-and-gradient program runs, elements of the residuals
    it computes and saves whose last axis is head_dim)` of a scanned stack of L layers."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import jax.random as jr
    import numpy as np
    from jax.sharding import Mesh

    from equipax.core.mesh_config import AXES, CONTEXT_AXES
    from equipax.core.nn import TransformerConfig
    from equipax.core.nn.transformer import TransformerStack
    from equipax.launch.hardware.tpu import lookup_slice, topology_devices

    if strategy is None:
        mesh = Mesh(np.array(topology_devices(lookup_slice("v5e-1"))).reshape(1, 1, 1), AXES)
    else:
        devices = topology_devices(lookup_slice("v5e-4"))[:2]
        mesh = Mesh(np.array(devices).reshape(1, 1, 2, 1), CONTEXT_AXES)
    cfg = TransformerConfig(
        num_layers=L,
        model_dims=E,
        num_heads=H,
        head_dim=D,
        hidden_dims=2 * E,
        attention_impl="splash",
        remat=remat,  # pyright: ignore[reportArgumentType]
        context_parallel_strategy=strategy or "all_gather",
    )
    stack = eqx.filter_eval_shape(TransformerStack, cfg, key=jr.key(0))
    params, static = eqx.partition(stack, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    x = jax.ShapeDtypeStruct((B, S, E), jnp.float32)

    def loss(params, x):
        return jnp.sum(eqx.combine(params, static)(x, mesh=mesh))

    kernels = splash_forward_kernels(jax.make_jaxpr(jax.value_and_grad(loss))(params, x).jaxpr)
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        jax.ad_checkpoint.print_saved_residuals(loss, params, x)
    # Computed residuals (not the parameters or inputs, which the backward pass has anyway).
    computed = [line for line in text.getvalue().splitlines() if " output of " in line]
    shapes = [
        [int(n) for n in m.group(1).split(",")] for m in map(re.compile(r"^\w+\[([\d,]+)\]").match, computed) if m
    ]
    return kernels, sum(int(np.prod(s)) for s in shapes if s[-1] == D)


@pytest.mark.parametrize("strategy", [None, "all_gather", "ring"])
def test_the_stack_keeps_the_context_once_and_runs_the_forward_kernel_once(strategy):
    full_kernels, full_saved = _traced("full", strategy)
    assert full_saved == 0  # full remat keeps only each layer's input
    context = L * B * S * H * D
    for remat in ("save_context", "save_attention_out"):
        kernels, saved = _traced(remat, strategy)
        assert 2 * kernels == full_kernels, remat
        assert saved == context, remat
