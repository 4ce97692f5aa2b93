"""The MoE feed-forward against its dense reference (a loop over experts), forward and gradients
in float32, every expert's gradient checked on its own; exact zeros for experts no token reaches;
the auxiliary losses on a hand-computed case; mutations show the checks fail."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

from equipax.core.nn import moe
from equipax.core.nn.moe import (
    MoEFeedForward,
    expert_capacity,
    load_balancing_loss,
    moe_feed_forward,
    reference_moe_feed_forward,
    route,
    router_z_loss,
)

B, S, D, H, E, K = 2, 8, 8, 16, 6, 2


def _params(key, num_experts=E):
    kr, kg, ku, kd = jr.split(key, 4)
    return (
        jr.normal(kr, (D, num_experts)),
        jr.normal(kg, (num_experts, D, H)) / np.sqrt(D),
        jr.normal(ku, (num_experts, D, H)) / np.sqrt(D),
        jr.normal(kd, (num_experts, H, D)) / np.sqrt(H),
    )


def _loss_and_grads(fn, x, params, **kw):
    """Loss = a nonlinear readout of the output + both auxiliary losses; grads of x and params."""

    def loss(x, params):
        y, stats = fn(x, *params, top_k=K, **kw)
        return jnp.sum(jnp.sin(3.0 * y)) + 0.1 * stats.aux_loss + 0.01 * stats.z_loss, (y, stats)

    (value, (y, stats)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, params)
    return value, y, stats, grads


def assert_per_expert_close(got, want, *, rtol=2e-5, scaled_atol=2e-5):
    """Each expert's slice of each expert-stacked gradient (gate, up, down) on its own, with an
    absolute tolerance scaled by that expert's own largest entry (0 for an expert no token
    reaches: its gradient must then be exactly 0 too)."""
    for name, g, w in zip(("gate", "up", "down"), got, want, strict=True):
        for e in range(w.shape[0]):
            atol = scaled_atol * float(jnp.max(jnp.abs(w[e])))
            np.testing.assert_allclose(g[e], w[e], rtol=rtol, atol=atol, err_msg=f"{name}[expert {e}]")


def _check_parity(key, **kw):
    kx, kp = jr.split(key)
    x, params = jr.normal(kx, (B, S, D)), _params(kp)
    v_ref, y_ref, s_ref, (gx_ref, gp_ref) = _loss_and_grads(reference_moe_feed_forward, x, params, **kw)
    v, y, s, (gx, gp) = _loss_and_grads(moe_feed_forward, x, params, **kw)
    assert y.shape == x.shape and y.dtype == x.dtype
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(v, v_ref, rtol=1e-5)
    np.testing.assert_allclose(s.tokens_per_expert, s_ref.tokens_per_expert)
    np.testing.assert_allclose(s.dropped, s_ref.dropped)
    np.testing.assert_allclose(s.aux_loss, s_ref.aux_loss, rtol=1e-6)
    np.testing.assert_allclose(s.z_loss, s_ref.z_loss, rtol=1e-6)
    np.testing.assert_allclose(gx, gx_ref, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(gp[0], gp_ref[0], rtol=2e-5, atol=2e-6)  # router
    assert_per_expert_close(gp[1:], gp_ref[1:])
    return s


@pytest.mark.parametrize("capacity_factor", [None, 2.0, 0.5])
def test_matches_dense_reference(key, capacity_factor):
    stats = _check_parity(key, capacity_factor=capacity_factor)
    assert float(jnp.sum(stats.tokens_per_expert)) == B * S * K
    if capacity_factor == 0.5:  # capacity 2 per expert and sequence, 16 assignments over 6 experts
        assert expert_capacity(S, E, K, 0.5) == 2 and float(stats.dropped) > 0
    else:
        assert float(stats.dropped) == 0


def test_unnormalised_weights_match_reference(key):
    _check_parity(key, norm_topk_prob=False)


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_experts_without_tokens_get_exactly_zero_gradient(key, capacity_factor):
    kx, kp = jr.split(key)
    x = jnp.abs(jr.normal(kx, (B, S, D)))  # positive inputs ...
    router, gate, up, down = _params(kp)
    empty = (0, 3)
    router = router.at[:, empty].set(-10.0)  # ... so these experts' logits are always the lowest
    _, _, stats, (_, grads) = _loss_and_grads(
        moe_feed_forward, x, (router, gate, up, down), capacity_factor=capacity_factor
    )
    counts = np.asarray(stats.tokens_per_expert)
    assert all(counts[e] == 0 for e in empty) and np.count_nonzero(counts) >= K
    for name, g in zip(("gate", "up", "down"), grads[1:], strict=True):
        for e in range(E):
            zero = bool(jnp.all(g[e] == 0))
            assert zero == (counts[e] == 0), f"{name}[expert {e}]: exactly zero {zero}, routed {counts[e]:.0f}"


def test_auxiliary_losses_on_a_hand_computed_case():
    probs = jnp.array([[0.7, 0.3], [0.6, 0.4], [0.2, 0.8], [0.9, 0.1]])
    weights, experts, _ = route(jnp.log(probs), 1, norm_topk_prob=True)
    np.testing.assert_array_equal(experts[:, 0], [0, 0, 1, 0])
    np.testing.assert_allclose(weights, 1.0)
    # f = (3/4, 1/4) of the tokens, P = (0.6, 0.4) mean probabilities: 2 * (0.45 + 0.1).
    np.testing.assert_allclose(load_balancing_loss(probs, experts), 1.1, rtol=1e-6)
    # Two tokens routed to both of two experts with equal probability: f = (1, 1), P = (1/2, 1/2).
    np.testing.assert_allclose(load_balancing_loss(jnp.full((2, 2), 0.5), jnp.array([[0, 1], [1, 0]])), 2.0)
    # logsumexp of (0, 0) is log 2 and of (log 3, 0) is log 4: z = (log 2^2 + log 4^2) / 2.
    logits = jnp.array([[0.0, 0.0], [np.log(3.0), 0.0]])
    np.testing.assert_allclose(router_z_loss(logits), (np.log(2) ** 2 + np.log(4) ** 2) / 2, rtol=1e-6)


def test_route_normalises_the_top_k(key):
    weights, experts, probs = route(jr.normal(key, (5, E)), 3, norm_topk_prob=True)
    np.testing.assert_allclose(jnp.sum(weights, -1), 1.0, rtol=1e-6)
    order = jnp.argsort(-probs, axis=-1)[:, :3]
    np.testing.assert_array_equal(experts, order)


# Mutations: each check above must fail on a kernel or gradient that is wrong in one way.


def test_mutation_unnormalised_kernel_fails_parity(key):
    x, params = jr.normal(key, (B, S, D)), _params(jr.fold_in(key, 1))
    y_ref, _ = reference_moe_feed_forward(x, *params, top_k=K)
    y, _ = moe_feed_forward(x, *params, top_k=K, norm_topk_prob=False)
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)


def test_mutation_wrong_drop_order_fails_capacity_parity(key, monkeypatch):
    real = moe._sort_by_expert

    def latest_first(flat, num_experts):
        # Ranks counted from the end: the capacity then keeps the latest tokens instead.
        order, sizes, rank = real(flat, num_experts)
        return order, sizes, sizes[flat] - 1 - rank

    monkeypatch.setattr(moe, "_sort_by_expert", latest_first)
    with pytest.raises(AssertionError):
        _check_parity(key, capacity_factor=0.5)


def test_mutation_one_expert_off_fails_the_per_expert_check(key):
    """A 1e-4 error in one expert's gradient passes a global-norm comparison at 1e-3 but not
    the per-expert one."""
    _, gate, up, down = _params(key)
    wrong = gate.at[2].multiply(1 + 1e-4)
    assert float(jnp.linalg.norm(wrong - gate) / jnp.linalg.norm(gate)) < 1e-3
    with pytest.raises(AssertionError, match=r"gate\[expert 2\]"):
        assert_per_expert_close((wrong, up, down), (gate, up, down))


def test_mutation_tiny_gradient_is_not_exactly_zero():
    """A residue far below any allclose tolerance is still caught by the exact-zero check."""
    g = jnp.zeros((E, D, H)).at[3, 0, 0].set(1e-30)
    np.testing.assert_allclose(g, 0.0, atol=1e-12)
    assert not bool(jnp.all(g[3] == 0))


def test_module_shapes_axes_and_shared_experts(key, trees_close):
    layer = MoEFeedForward(D, H, E, K, shared_hidden_dims=12, key=key)
    x = jr.normal(jr.fold_in(key, 1), (B, S, D))
    y, stats = eqx.filter_jit(lambda m, x: m(x))(layer, x)
    assert y.shape == x.shape and stats.tokens_per_expert.shape == (E,)
    routed, _ = moe_feed_forward(x, layer.router, layer.gate, layer.up, layer.down, top_k=K)
    assert layer.shared is not None
    trees_close(y, routed + layer.shared(x), rtol=1e-5, atol=1e-6)
    assert layer.logical_axes()["down"] == ("expert", "hidden", "embed")


@pytest.mark.parametrize(
    "kwargs, match", [({"top_k": 7}, "top_k"), ({"top_k": 0}, "top_k"), ({"capacity_factor": 0.0}, "capacity_factor")]
)
def test_module_rejects_bad_values(key, kwargs, match):
    args = {"top_k": K} | kwargs
    with pytest.raises(ValueError, match=match):
        MoEFeedForward(D, H, E, args.pop("top_k"), key=key, **args)


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_routing_biases_match_the_reference(key, capacity_factor):
    """Biases of the size of the probabilities' spread change which experts are chosen; the fast
    path equals the reference with the same biases, forward and gradients (the biases get none)."""
    bias = jnp.array([0.3, -0.2, 0.0, 0.25, -0.1, 0.05])
    stats = _check_parity(key, capacity_factor=capacity_factor, router_bias=bias)
    unbiased = _check_parity(key, capacity_factor=capacity_factor)
    assert not np.array_equal(stats.tokens_per_expert, unbiased.tokens_per_expert)


def test_routing_biases_choose_the_experts_but_do_not_weight_them():
    probs = jnp.array([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]])
    weights, experts, _ = route(jnp.log(probs), 1, norm_topk_prob=False, bias=jnp.array([0.0, 0.0, 0.35]))
    np.testing.assert_array_equal(experts[:, 0], [2, 2])  # 0.2 + 0.35 > 0.5; 0.3 + 0.35 > 0.6
    np.testing.assert_allclose(weights[:, 0], [0.2, 0.3], rtol=1e-6)  # the unbiased probabilities
    weights, experts, _ = route(jnp.log(probs), 2, norm_topk_prob=True, bias=jnp.array([0.0, 0.0, 0.35]))
    np.testing.assert_array_equal(experts, [[2, 0], [2, 1]])
    np.testing.assert_allclose(weights, [[0.2 / 0.7, 0.5 / 0.7], [0.3 / 0.9, 0.6 / 0.9]], rtol=1e-6)


def test_bias_update_moves_towards_balance():
    load = jnp.array([[6.0, 2.0, 4.0], [4.0, 4.0, 4.0]])  # layer 0: mean 4; layer 1: balanced
    new = moe.update_router_bias(jnp.array([[0.5, 0.0, -0.5], [0.0, 0.1, 0.0]]), load, 0.01)
    np.testing.assert_allclose(new, [[0.49, 0.01, -0.5], [0.0, 0.1, 0.0]], rtol=1e-6)
