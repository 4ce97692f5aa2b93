"""Shared layers (`model.transformer.num_hidden_groups`, ALBERT's): a stack of G blocks over L
layers equals an unshared stack whose layer i holds block i // (L / G) (a cyclic assignment
would not), its gradient is the sum of those layers' gradients, scanned == unrolled, and the
knob's errors name it (the language model's parameter count and decoding:
tests/models/test_shared_layers_lm.py)."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

from equipax.core.nn import TransformerConfig, TransformerStack

BLOCK = TransformerConfig(num_layers=4, model_dims=16, num_heads=2, head_dim=8, hidden_dims=32)
X = jr.normal(jr.key(1), (2, 6, 16))
apply = eqx.filter_jit(lambda s: s(X))
grad = eqx.filter_jit(eqx.filter_grad(lambda s: jnp.sum(jnp.sin(s(X)))))


def _unshared_with(shared: TransformerStack, order):
    """An unshared scanned stack of len(order) layers whose layer i is shared block order[i]."""
    cfg = dataclasses.replace(shared.cfg, num_hidden_groups=None, scan_layers=True)
    plain = TransformerStack(cfg, key=jr.key(9))
    idx = jnp.asarray(order)
    return eqx.tree_at(
        lambda s: s.layers, plain, jax.tree.map(lambda w: w[idx] if eqx.is_array(w) else w, shared.layers)
    )


@pytest.mark.parametrize("groups", [1, 2])
def test_a_shared_stack_equals_the_unshared_stack_of_its_blocks_and_sums_their_gradients(groups):
    shared = TransformerStack(dataclasses.replace(BLOCK, num_hidden_groups=groups), key=jr.key(0))
    assert jax.tree.leaves(eqx.filter(shared.layers, eqx.is_array))[0].shape[0] == groups
    order = [i // (4 // groups) for i in range(4)]  # ALBERT's contiguous groups
    plain = _unshared_with(shared, order)
    np.testing.assert_allclose(apply(shared), apply(plain), rtol=1e-5, atol=1e-6)
    if groups == 2:  # the check tells the assignments apart: a cyclic one gives other numbers
        assert not np.allclose(apply(shared), apply(_unshared_with(shared, [0, 1, 0, 1])), rtol=1e-3, atol=1e-4)

    g_shared = grad(shared).layers
    g_plain = grad(plain).layers
    want = jax.tree.map(
        lambda g: None if g is None else jnp.stack([g[np.asarray(order) == b].sum(0) for b in range(groups)]),
        g_plain,
        is_leaf=lambda x: x is None,
    )
    for a, b in zip(jax.tree.leaves(g_shared), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_scanned_and_unrolled_shared_stacks_agree():
    cfg = dataclasses.replace(BLOCK, num_hidden_groups=2)
    scanned = TransformerStack(cfg, key=jr.key(0))
    unrolled = TransformerStack(dataclasses.replace(cfg, scan_layers=False), key=jr.key(0))
    assert len(unrolled.layers) == 2
    # Two programs (a scan, two inlined blocks) fused and vectorised differently: float32 rounding at
    # outputs of magnitude ~7 (an ulp is 5e-7) leaves ~1e-6 on the small ones, by CPU model (an element
    # of 0.0047 was 1.3e-6 off on one AMD EPYC host); the two blocks swapped in the unrolled stack: 10.
    np.testing.assert_allclose(apply(scanned), apply(unrolled), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"num_hidden_groups": 3}, "num_hidden_groups=3 must be a positive divisor of num_layers=4"),
        ({"num_hidden_groups": 0}, "must be a positive divisor"),
        ({"num_hidden_groups": 2, "pipeline_stages": 2}, "pipeline_stages=2 splits the layers' weights"),
        (
            {"num_hidden_groups": 1, "num_experts": 4, "gated": True, "use_bias": False},
            "shared mixture-of-experts blocks are not supported",
        ),
    ],
)
def test_groups_the_stack_cannot_build_name_the_knob(knobs, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(BLOCK, **knobs)
