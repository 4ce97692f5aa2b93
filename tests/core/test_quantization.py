"""Quantized projections (`equipax.core.nn.quantization`, docs/quantization.md): the int8 matmul
against a quantize-dequantize reference, forward and backward, its straight-through gradients, the
served int8 weights, and the layers that use it."""

import typing

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from equipax.core.configs import QUANTIZATIONS
from equipax.core.knobs import ConfigError
from equipax.core.nn import Attention, FeedForward, Linear
from equipax.core.nn.quantization import (
    Quantization,
    QuantizedWeight,
    check_quantization_platform,
    project,
    quantize,
    quantize_weights,
    quantized_matmul,
    reference_quantized_matmul,
)

# (x shape, w shape, contracted axes): a Linear, the fused QKV projection, the output projection.
SHAPES = [((3, 5, 16), (16, 24), 1), ((2, 7, 16), (16, 3, 2, 8), 1), ((2, 7, 4, 8), (4, 8, 16), 2)]


def _operands(key, x_shape, w_shape, dtype=jnp.float32):
    kx, kw, kg = jax.random.split(key, 3)
    # Heavy-tailed activations (a few large entries per row), as a transformer's are.
    x = jax.random.t(kx, 3.0, x_shape).astype(dtype)
    w = jax.random.normal(kw, w_shape) / 4.0
    return x, w, kg


def test_the_modes_are_the_configs_values():
    assert typing.get_args(Quantization) == QUANTIZATIONS


def test_quantize_rounds_to_int8_with_absmax_scales(key):
    x = jax.random.normal(key, (4, 6)) * jnp.arange(1.0, 5.0)[:, None]
    q, scale = quantize(x, (1,))
    assert q.dtype == jnp.int8 and scale.shape == (4, 1)
    np.testing.assert_array_equal(jnp.max(jnp.abs(q), axis=1), 127)  # the largest entry of each row
    np.testing.assert_allclose(q * scale, x, atol=float(jnp.max(scale)) / 2 + 1e-7)
    q0, s0 = quantize(jnp.zeros((2, 3)), (1,))  # an all-zero row: scale 1, not a division by zero
    np.testing.assert_array_equal(q0, 0) and np.testing.assert_array_equal(s0, 1.0)


@pytest.mark.parametrize("x_shape, w_shape, contract", SHAPES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_int8_forward_equals_the_quantize_dequantize_reference_bit_for_bit(key, x_shape, w_shape, contract, dtype):
    x, w, _ = _operands(key, x_shape, w_shape, dtype)
    y = quantized_matmul(x, w, contract, "int8")
    assert y.dtype == dtype and y.shape == x_shape[: len(x_shape) - contract] + w_shape[contract:]
    np.testing.assert_array_equal(y, reference_quantized_matmul(x, w, contract))
    # ... and is the float matmul to within int8 rounding (about 1% of the output's scale here).
    exact = jax.lax.dot_general(
        x.astype(jnp.float32), w, ((tuple(range(x.ndim - contract, x.ndim)), tuple(range(contract))), ((), ()))
    )
    assert float(jnp.max(jnp.abs(y - exact))) < 0.03 * float(jnp.max(jnp.abs(exact)))


def _reference_grads(x, w, g, contract):
    """The backward `quantized_matmul` documents, written with `quantize` and float32 matmuls of the
    integer values (exact at these sizes): dx = Q_rows(g * sw) wq^T, dw = xq^T Q_cols(g * sx)."""
    n_tok = x.ndim - contract
    xq, sx = quantize(x, tuple(range(n_tok, x.ndim)))
    wq, sw = quantize(w, tuple(range(contract)))
    g = g.astype(jnp.float32)
    sw_cols = sw.reshape((1,) * n_tok + sw.shape[contract:])
    gq, sg = quantize(g * sw_cols, tuple(range(n_tok, g.ndim)))
    dims = ((tuple(range(n_tok, g.ndim)), tuple(range(contract, w.ndim))), ((), ()))
    dx = jax.lax.dot_general(gq.astype(jnp.float32), wq.astype(jnp.float32), dims, precision="highest")
    dx = dx * sg.reshape(sg.shape[:n_tok] + (1,) * contract)
    sx_rows = sx.reshape(sx.shape[:n_tok] + (1,) * (w.ndim - contract))
    gq, sg = quantize(g * sx_rows, tuple(range(n_tok)))
    dims = ((tuple(range(n_tok)), tuple(range(n_tok))), ((), ()))
    dw = jax.lax.dot_general(xq.astype(jnp.float32), gq.astype(jnp.float32), dims, precision="highest")
    dw = dw * sg.reshape((1,) * contract + sg.shape[n_tok:])
    return dx.astype(x.dtype), dw.astype(w.dtype)


@pytest.mark.parametrize("x_shape, w_shape, contract", SHAPES)
def test_int8_backward_equals_the_quantize_dequantize_reference_bit_for_bit(key, x_shape, w_shape, contract):
    x, w, kg = _operands(key, x_shape, w_shape)
    y, vjp = jax.vjp(lambda x, w: quantized_matmul(x, w, contract, "int8"), x, w)
    g = jax.random.normal(kg, y.shape)
    dx, dw = vjp(g)
    ref_dx, ref_dw = _reference_grads(x, w, g, contract)
    np.testing.assert_array_equal(dx, ref_dx)
    np.testing.assert_array_equal(dw, ref_dw)


def _straight_through(x, w, contract):
    """`Q(x) Q(w)` in float with the straight-through estimator (rounding as the identity)."""
    n_tok = x.ndim - contract

    def fake(a, axes):
        q, s = quantize(a, axes)
        return a + jax.lax.stop_gradient(q * s - a)

    xf, wf = fake(x, tuple(range(n_tok, x.ndim))), fake(w, tuple(range(contract)))
    return jax.lax.dot_general(xf, wf, ((tuple(range(n_tok, x.ndim)), tuple(range(contract))), ((), ())))


@pytest.mark.parametrize("x_shape, w_shape, contract", SHAPES)
def test_int8_gradients_are_the_straight_through_ones_to_int8_rounding(key, x_shape, w_shape, contract):
    """The gradient flows through the rounding as the identity; the int8 backward differs from the
    float straight-through gradient only by the rounding of the incoming gradient: within 3% of the
    largest entry (0.4-1.5% measured at these shapes)."""
    x, w, kg = _operands(key, x_shape, w_shape)
    probe = jax.random.normal(kg, x_shape[: len(x_shape) - contract] + w_shape[contract:])

    def loss(f):
        return lambda x, w: jnp.sum(jnp.sin(f(x, w)) * probe)

    got = jax.grad(loss(lambda x, w: quantized_matmul(x, w, contract, "int8")), (0, 1))(x, w)
    want = jax.grad(loss(lambda x, w: _straight_through(x, w, contract)), (0, 1))(x, w)
    for a, b in zip(got, want, strict=True):
        assert float(jnp.max(jnp.abs(b))) > 0
        assert float(jnp.max(jnp.abs(a - b))) < 0.03 * float(jnp.max(jnp.abs(b)))


def test_fp8_computes_in_float8_with_float_gradients(key):
    x, w, _ = _operands(key, (4, 16), (16, 8), jnp.bfloat16)
    y, vjp = jax.vjp(lambda x, w: quantized_matmul(x, w, 1, "fp8"), x, w)
    np.testing.assert_array_equal(y, reference_quantized_matmul(x, w, 1, "fp8"))
    dx, dw = vjp(jnp.ones_like(y))
    assert (dx.dtype, dw.dtype) == (jnp.bfloat16, jnp.float32)
    exact = x.astype(jnp.float32) @ w
    assert float(jnp.max(jnp.abs(y - exact))) < 0.1 * float(jnp.max(jnp.abs(exact)))


def test_fp8_is_refused_off_a_gpu():
    for platform in ("cpu", "tpu"):
        with pytest.raises(ConfigError, match=r"model.quantization='fp8' needs a GPU.*'int8'"):
            check_quantization_platform("fp8", platform)
    check_quantization_platform("fp8", "gpu")
    for mode in ("none", "int8", "int8w"):
        check_quantization_platform(mode, "tpu")


def test_int8w_rounds_the_weight_only_and_passes_its_gradient_straight_through(key):
    x, w, _ = _operands(key, (3, 16), (16, 8))
    wq, sw = quantize(w, (0,))
    np.testing.assert_array_equal(project(x, w, 1, "int8w"), x @ (wq * sw))
    dw = jax.grad(lambda w: jnp.sum(project(x, w, 1, "int8w")))(w)
    np.testing.assert_allclose(dw, jax.grad(lambda w: jnp.sum(x @ w))(w), rtol=1e-6)


@pytest.mark.parametrize("mode", ["int8", "int8w"])
def test_a_served_weight_is_int8_and_computes_as_the_float_one(key, mode):
    """`quantize_weights` replaces each quantized projection's weight by its int8 copy (stacked layer
    axes kept); a layer computes the same outputs from it: bit for bit in int8 (the same operands),
    to float rounding in int8w (scale applied after the matmul instead of before)."""
    ks = jax.random.split(key, 4)
    x = jax.random.normal(ks[0], (2, 5, 16))
    layers = {
        "linear": Linear(16, 24, use_bias=True, quantization=mode, key=ks[1]),
        "mlp": FeedForward(16, 32, activation="silu", gated=True, quantization=mode, key=ks[2]),
        "attention": Attention(16, 2, 8, quantization=mode, key=ks[3]),
        "gqa": Attention(16, 4, 8, num_kv_heads=2, fused_qkv=False, quantization=mode, key=ks[3]),
    }
    for name, layer in layers.items():
        served = quantize_weights(layer)
        weights = [a for a in jax.tree.leaves(served) if a.dtype == jnp.int8]
        assert len(weights) == {"linear": 1, "mlp": 3, "attention": 2, "gqa": 3}[name]
        run = (lambda m: m(x)[0]) if "attention" in name or name == "gqa" else (lambda m: m(x))
        if mode == "int8":
            np.testing.assert_array_equal(run(served), run(layer), err_msg=name)
        else:
            np.testing.assert_allclose(run(served), run(layer), atol=1e-5, err_msg=name)
        assert quantize_weights(served) is not None and jax.tree.structure(quantize_weights(served)) == (
            jax.tree.structure(served)
        )
    plain = Linear(16, 24, key=ks[1])  # quantization "none": kept float
    assert quantize_weights(plain).weight is plain.weight


def test_a_stacked_weight_gets_one_scale_per_layer(key):
    w = jax.random.normal(key, (3, 16, 8)) * jnp.array([1.0, 10.0, 100.0])[:, None, None]
    q = QuantizedWeight.of(w, stack=1, contract=1)
    assert q.values.shape == (3, 16, 8) and q.scale.shape == (3, 1, 8)
    for i in range(3):
        one = QuantizedWeight.of(w[i], stack=0, contract=1)
        np.testing.assert_array_equal(q.values[i], one.values)
        np.testing.assert_array_equal(q.scale[i], one.scale)


@pytest.mark.parametrize("x_shape, w_shape, contract", SHAPES)
def test_a_weight_quantized_ahead_computes_and_trains_as_the_float_one_bit_for_bit(key, x_shape, w_shape, contract):
    """A train step quantizes each weight once (`quantize_weights(..., keep_float=True)`, outside the
    layer loop): the projection from that copy gives the outputs and gradients of the one that
    rounds the float weight itself, bit for bit, and the gradient reaches the float weight."""
    x, w, kg = _operands(key, x_shape, w_shape, jnp.bfloat16)
    ahead = QuantizedWeight.of(w, stack=0, contract=contract, quantization="int8", keep_float=True)
    assert ahead.values.dtype == jnp.int8 and ahead.source is w
    probe = jax.random.normal(kg, x_shape[: len(x_shape) - contract] + w_shape[contract:])

    def loss(x, w, ahead):
        y = (
            project(
                x,
                QuantizedWeight.of(w, stack=0, contract=contract, quantization="int8", keep_float=True),
                contract,
                "int8",
            )
            if ahead
            else project(x, w, contract, "int8")
        )
        return jnp.sum(y.astype(jnp.float32) * probe), y

    (_, y), (dx, dw) = jax.value_and_grad(loss, (0, 1), has_aux=True)(x, w, True)
    (_, y0), (dx0, dw0) = jax.value_and_grad(loss, (0, 1), has_aux=True)(x, w, False)
    np.testing.assert_array_equal(y, y0)
    np.testing.assert_array_equal(dx, dx0)
    np.testing.assert_array_equal(dw, dw0)
    assert float(jnp.max(jnp.abs(dw))) > 0


def test_a_train_steps_copy_is_made_only_for_int8_and_fp8(key):
    """`keep_float=True` copies the weights of "int8" and "fp8" layers (fp8: in its forward format);
    "int8w" and "none" layers round or use the float weight themselves and keep it."""
    ks = jax.random.split(key, 3)
    for mode, dtype in (("int8", jnp.int8), ("fp8", jnp.float8_e4m3fn)):
        ahead = quantize_weights(
            FeedForward(16, 32, activation="silu", gated=True, quantization=mode, key=ks[0]), keep_float=True
        )
        assert isinstance(ahead.up.weight, QuantizedWeight) and ahead.up.weight.values.dtype == dtype
        assert ahead.up.weight.source is not None
        attention = quantize_weights(Attention(16, 2, 8, quantization=mode, key=ks[1]), keep_float=True)
        assert isinstance(attention.out, QuantizedWeight) and attention.out.source is not None
    for mode in ("int8w", "none"):
        layer = Linear(16, 24, quantization=mode, key=ks[2])
        assert quantize_weights(layer, keep_float=True).weight is layer.weight


def test_dots_saveable_keeps_each_projections_output_and_its_inputs_scales(key, capsys):
    """remat="dots_saveable" keeps a quantized projection's output (not its int32 sums) and its
    activations' per-token scales, so the backward rounds the activations again without another
    pass for their max; it keeps no int8 or int32 array."""
    from jax.ad_checkpoint import print_saved_residuals

    from equipax.core.nn.remat import remat_policy

    ks = jax.random.split(key, 3)
    x = jax.random.normal(ks[0], (8, 16)).astype(jnp.bfloat16)
    w1, w2 = jax.random.normal(ks[1], (16, 64)), jax.random.normal(ks[2], (64, 16))

    def mlp(x, w1, w2):
        return jnp.sum(project(jax.nn.gelu(project(x, w1, 1, "int8")), w2, 1, "int8").astype(jnp.float32))

    print_saved_residuals(jax.checkpoint(mlp, policy=remat_policy("dots_saveable")), x, w1, w2)
    kept = [line.split(" from ")[0] for line in capsys.readouterr().out.splitlines() if "argument" not in line]
    named = ["bf16[8,64] named 'quantized_projection'", *["f32[8,1] named 'quantized_scale'"] * 2]
    assert sorted(kept) == sorted(named), kept


def test_none_is_the_float_matmul(key):
    x, w, _ = _operands(key, (2, 7, 16), (16, 3, 2, 8))
    np.testing.assert_array_equal(project(x, w, 1, "none"), jnp.einsum("bse,ethd->bsthd", x, w))


def test_int8_projections_are_s8_dots(key):
    """The quantized forward and both backward matmuls are int8 x int8 dots summing in int32."""
    x, w, _ = _operands(key, (4, 16), (16, 8), jnp.bfloat16)
    step = jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(quantized_matmul(x, w, 1, "int8")), (0, 1)))
    hlo = step.lower(x, w).as_text()
    dots = [line for line in hlo.splitlines() if "dot_general" in line]
    assert len(dots) == 3 and all("xi8>" in d and "-> tensor<" in d and "xi32>" in d.split("->")[-1] for d in dots), (
        dots
    )


def test_layers_built_quantized_train(key):
    """A gradient reaches every weight of a quantized layer (and is finite)."""
    ffn = FeedForward(16, 32, activation="gelu", gated=True, quantization="int8", key=key)
    x = jax.random.normal(key, (2, 5, 16))
    grads = eqx.filter_grad(lambda m: jnp.sum(m(x) ** 2))(ffn)
    for g in jax.tree.leaves(grads):
        assert bool(jnp.all(jnp.isfinite(g))) and float(jnp.max(jnp.abs(g))) > 0
