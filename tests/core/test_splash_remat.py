"""The splash kernel under remat: the policies that keep the attention's context
("save_attention_out", "save_context", "dots_with_context") keep the kernel's output and log-sum-exp, so the backward
pass runs its backward kernel without running the forward kernel again ("full" and
"dots_saveable" do run it again), and the gradients equal those without remat. A block of
projections around `splash_attention` and around ring attention with the splash kernel per pair
(`splash_ring_attention`, one device), in the Pallas interpreter. The whole stack, on a TPU
mesh, is tests/launch/test_splash_remat_tpu.py.
"""

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

from equipax.core.nn.context_parallel import splash_ring_attention
from equipax.core.nn.fused_attention import splash_attention
from equipax.core.nn.remat import remat_policy
from helpers.jaxprs import splash_forward_kernels

B, S, E, H, D = 1, 128, 32, 2, 16  # splash blocks are multiples of 128, in the interpreter too

KERNELS = {
    "splash": lambda q, k, v: splash_attention(q, k, v, causal=True, interpret=True),
    "ring": lambda q, k, v: splash_ring_attention(q, k, v, zigzag=False, causal=True, interpret=True),
}


def _block(attend):
    def block(w, x):
        q, k, v = (jnp.einsum("bse,ehd->bshd", x, w[i]) for i in range(3))
        return jnp.einsum("bshd,ehd->bse", attend(q, k, v), w[3])

    return block


def _loss(kernel, remat):
    block = _block(KERNELS[kernel])
    if remat != "none":
        block = jax.checkpoint(block, policy=remat_policy(remat))
    return lambda w, x: jnp.sum(jnp.sin(block(w, x)))


def _inputs():
    kw, kx = jr.split(jr.key(0))
    return jr.normal(kw, (4, E, H, D)) / np.sqrt(E), jr.normal(kx, (B, S, E))


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_policies_that_keep_the_context_do_not_run_the_forward_kernel_again(kernel):
    w, x = _inputs()
    runs = {}
    for remat in ("none", "full", "dots_saveable", "dots_with_context", "save_attention_out", "save_context"):
        jaxpr = jax.make_jaxpr(jax.value_and_grad(_loss(kernel, remat)))(w, x).jaxpr
        runs[remat] = splash_forward_kernels(jaxpr)
    once = runs["none"]
    assert once >= 1
    assert runs == {
        "none": once,
        "full": 2 * once,
        "dots_saveable": 2 * once,
        "dots_with_context": once,
        "save_attention_out": once,
        "save_context": once,
    }


@pytest.mark.parametrize(
    ("kernel", "remat"),
    [
        ("splash", "save_context"),
        ("splash", "save_attention_out"),
        ("splash", "dots_with_context"),
        ("ring", "save_context"),
    ],
)
def test_gradients_under_the_saving_policies_equal_no_remat(kernel, remat):
    w, x = _inputs()
    want = jax.jit(jax.grad(_loss(kernel, "none")))(w, x)
    got = jax.jit(jax.grad(_loss(kernel, remat)))(w, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
