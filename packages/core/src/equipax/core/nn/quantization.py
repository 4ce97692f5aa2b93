"""Quantized matmuls of the transformer block's projections (`model.quantization`, docs/quantization.md).

One function, `project(x, w, contract, quantization)`, is every projection of the block: the
attention's query/key/value and output projections and the feed-forward's matrices (`Linear`).
It contracts the last `contract` axes of the activations `x` with the first `contract` axes of the
weight `w` and computes, by `quantization`:

- "none": `x @ w` in `x.dtype`.
- "int8": dynamic-range int8 for the forward and both backward matmuls (AQT's and MaxText's
  `int8`): the activations get one scale per token (row), the weight one per output channel
  (column), both `max |.| / 127` (symmetric, absmax), the products are int8 x int8 summed in
  int32 and rescaled in float32. The backward reuses the int8 operands of the forward: for
  `dx = g w^T` the weight's column scales are moved onto the incoming gradient `g`, which is then
  quantized per token; for `dw = x^T g` the activations' row scales are moved onto `g`, which is
  then quantized per output channel over the tokens (the "scale shifting" of qwix's
  `dot_general_qt`). The gradient with respect to the float operands is the straight-through one
  (rounding counts as the identity; absmax scales never clip).
- "fp8": the same with float8 (e4m3 forward, e5m2 gradients; scales `max |.| / 448` and
  `/ 57344`), float32 accumulation: GPUs with FP8 units (`check_quantization_platform`).
- "int8w": the weight only, per output channel, rounded to int8 and scaled back (activations and
  gradients stay in `x.dtype`; straight-through to the float weight): training sees the weights a
  served model computes with (`QuantizedWeight`).

A `QuantizedWeight` (an int8 copy and its column scales, made once by `quantize_weights`) in place
of the float weight serves a model: with "int8w" the int8 weight is read and converted in the
matmul (half the bytes of bf16 from memory: what decoding at small batch waits on), with "int8" the
activations are quantized per token too and the matmul is int8 x int8. In training, a stack of
"int8" or "fp8" layers gets the same copy once per step, the float weight kept as its `source`
(`quantize_weights(..., keep_float=True)`, made by `equipax.core.nn.transformer.run_stacked_layers`
before the layer loop): the layers' passes read one byte per weight instead of rounding the
float32 weight in each, with the same numbers.

Checkpoints hold the float weights in every mode; the embedding, the output projection (logits)
and the attention scores are never quantized.
"""

import functools
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Shaped

from equipax.core.configs import QUANTIZATIONS
from equipax.core.knobs import ConfigError

__all__ = [
    "QUANTIZED_OUTPUT",
    "QUANTIZED_SCALE",
    "fake_quantized_weight",
    "makes_quantized_copy",
    "QUANTIZATIONS",
    "Quantization",
    "QuantizedWeight",
    "check_quantization_platform",
    "project",
    "quantize",
    "quantize_weights",
    "quantized_matmul",
    "reference_quantized_matmul",
]

Quantization = Literal["none", "int8", "int8w", "fp8"]  # the values of QUANTIZATIONS

# The name (`checkpoint_name`) of an int8 or fp8 projection's output: what remat="dots_saveable"
# keeps of it (`equipax.core.nn.remat`), in place of its dot's int32 sums.
QUANTIZED_OUTPUT = "quantized_projection"
# ... and of its activations' per-token scales, which that policy keeps too: the backward rounds the
# activations again from them, without another pass over the activations for their max.
QUANTIZED_SCALE = "quantized_scale"

# (storage dtype, largest magnitude it holds) of the forward operands and of the gradients.
_FORMATS: dict[str, tuple[tuple[Any, float], tuple[Any, float]]] = {
    "int8": ((jnp.int8, 127.0), (jnp.int8, 127.0)),
    "fp8": ((jnp.float8_e4m3fn, 448.0), (jnp.float8_e5m2, 57344.0)),
}


def _accumulator(dtype: Any) -> Any:
    return jnp.int32 if jnp.issubdtype(dtype, jnp.integer) else jnp.float32


def quantize(x: Float[Array, "..."], axes: tuple[int, ...], dtype: Any = jnp.int8) -> tuple[Array, Array]:
    """Symmetric absmax quantization with one scale per slice over `axes`.

    Arguments:
        x: the array.
        axes: the axes a scale covers (a matmul's contracted axes: one scale per row or column).
        dtype: int8 (values rounded to the nearest integer in [-127, 127]) or a float8 type
            (cast, which rounds to the nearest representable value).

    Returns:
        `(q, scale)`: `q` in `dtype` and the float32 `scale` (`max |x| / qmax` over `axes`, kept as
        size-1 axes; 1 where the slice is all zero), with `x ~= q * scale`.
    """
    return _quantize(x, axes, dtype)


def _quantize(x: Array, axes: tuple[int, ...], dtype: Any, name: str | None = None) -> tuple[Array, Array]:
    """`quantize`; with a `name`, the scale is named so (`checkpoint_name`) before it divides `x`:
    a remat policy that keeps the name recomputes the rounding from it, not from a new `max`."""
    qmax = _qmax(dtype)
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=axes, keepdims=True)
    scale = jnp.where(amax > 0, amax / qmax, 1.0)
    if name is not None:
        scale = checkpoint_name(scale, name)
    scaled = x / scale
    if jnp.issubdtype(dtype, jnp.integer):
        scaled = jnp.clip(jnp.round(scaled), -qmax, qmax)
    return scaled.astype(dtype), scale


def _qmax(dtype: Any) -> float:
    for fwd, grad in _FORMATS.values():
        for d, qmax in (fwd, grad):
            if jnp.dtype(d) == jnp.dtype(dtype):
                return qmax
    raise ValueError(f"no quantized format for dtype {jnp.dtype(dtype)}; use int8, float8_e4m3fn or float8_e5m2.")


def _dims(x_ndim: int, contract: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the contracted axes of x, the contracted axes of w)."""
    return tuple(range(x_ndim - contract, x_ndim)), tuple(range(contract))


def _rows(scale: Array, n_tok: int, n_rest: int) -> Array:
    """A per-row scale `[*tokens, 1...]` reshaped to broadcast against `[*tokens, n_rest axes]`."""
    return scale.reshape(scale.shape[:n_tok] + (1,) * n_rest)


def _cols(scale: Array, contract: int, n_lead: int) -> Array:
    """A per-column scale `[1..., *out]` (`contract` unit axes) reshaped to broadcast against
    `[n_lead axes, *out]`."""
    return scale.reshape((1,) * n_lead + scale.shape[contract:])


def _dot(a: Array, b: Array, dims: tuple[tuple[int, ...], tuple[int, ...]]) -> Array:
    return jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=_accumulator(a.dtype))


def quantized_matmul(
    x: Float[Array, "..."],
    w: Float[Array, "..."],
    contract: int,
    quantization: str = "int8",
    w_quantized: tuple[Array, Array] | None = None,
) -> Float[Array, "..."]:
    """`x @ w` over the last `contract` axes of `x` and the first of `w`, in int8 (or fp8) forward
    and backward (module docstring); the result in `x.dtype`.

    Arguments:
        x: activations `[*tokens, *in]`.
        w: weight `[*in, *out]`.
        contract: the number of `in` axes.
        quantization: "int8" or "fp8".
        w_quantized: `quantize(w, in axes, format)` made already (once per train step for every
            layer, `quantize_weights(..., keep_float=True)`), or None to make it here. `w` then
            only receives the gradient.

    Returns:
        `[*tokens, *out]` in `x.dtype`.
    """
    return _quantized_matmul(x, w, w_quantized, contract, quantization)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _quantized_matmul(x: Array, w: Array, w_quantized: Any, contract: int, quantization: str) -> Array:
    return _forward(x, w, w_quantized, contract, quantization)[0]


def _forward(x: Array, w: Array, w_quantized: Any, contract: int, quantization: str) -> tuple[Array, tuple[Array, ...]]:
    (fwd, _), _ = _FORMATS[quantization]
    x_axes, w_axes = _dims(x.ndim, contract)
    n_tok, n_out = x.ndim - contract, w.ndim - contract
    xq, sx = _quantize(x, x_axes, fwd, QUANTIZED_SCALE)
    wq, sw = quantize(w, w_axes, fwd) if w_quantized is None else w_quantized
    acc = _dot(xq, wq, (x_axes, w_axes)).astype(jnp.float32)
    y = acc * _rows(sx, n_tok, n_out) * _cols(sw, contract, n_tok)
    return y.astype(x.dtype), (xq, sx, wq, sw)


# (The rules are annotated `Any`: JAX may hand them numpy constants and tracers of other kinds.)
def _fwd_rule(x: Any, w: Any, w_quantized: Any, contract: int, quantization: str) -> tuple[Any, tuple[Any, ...]]:
    y, res = _forward(x, w, w_quantized, contract, quantization)
    # Empty slices of x and w: their dtypes and, inside a shard_map, the mesh axes they vary over.
    return y, (*res, x.reshape(-1)[:0], w.reshape(-1)[:0])


def _bwd_rule(contract: int, quantization: str, res: tuple[Any, ...], g: Any) -> tuple[Any, Any, None]:
    xq, sx, wq, sw, x_like, w_like = res
    _, (grad, _) = _FORMATS[quantization]
    n_tok, n_out = xq.ndim - contract, wq.ndim - contract
    tok_axes, out_axes = tuple(range(n_tok)), tuple(range(n_tok, n_tok + n_out))
    g = g.astype(jnp.float32)
    # dx = (g * sw) @ wq^T: the weight's column scales move onto g, which is quantized per token.
    gq, sg = quantize(g * _cols(sw, contract, n_tok), out_axes, grad)
    dx = _dot(gq, wq, (out_axes, tuple(range(contract, wq.ndim)))).astype(jnp.float32)
    dx = dx * _rows(sg, n_tok, contract)
    # dw = xq^T @ (g * sx): the activations' row scales move onto g, quantized per output column.
    gq, sg = quantize(g * _rows(sx, n_tok, n_out), tok_axes, grad)
    dw = _dot(xq, gq, (tok_axes, tok_axes)).astype(jnp.float32)
    dw = dw * _cols(sg, n_tok, contract)
    # (A weight quantized ahead gets its gradient through `w`: none through its int8 copy.)
    return _sum_to(dx.astype(x_like.dtype), x_like), _sum_to(dw.astype(w_like.dtype), w_like), None


def _vma(a: Any) -> frozenset[str]:
    """The shard_map axes `a` varies over (`aval.mat.varying`; `aval.vma` before JAX 0.11)."""
    aval = jax.typeof(a)
    mat = getattr(aval, "mat", None)
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def _sum_to(grad: Array, like: Array) -> Array:
    """Inside a shard_map: `grad` summed over the mesh axes it varies over and its operand does not
    (the batch axes for a weight's gradient, `tensor` for a column-split projection's input), as
    JAX's own transpose of a matmul sums them."""
    extra = tuple(sorted(_vma(grad) - _vma(like)))
    return jax.lax.psum(grad, extra) if extra else grad


_quantized_matmul.defvjp(_fwd_rule, _bwd_rule)


def reference_quantized_matmul(
    x: Float[Array, "..."], w: Float[Array, "..."], contract: int, quantization: str = "int8"
) -> Float[Array, "..."]:
    """The forward of `quantized_matmul` written as quantize, dequantize and a float32 matmul: the
    slow, obvious reference (equal to it while the float32 sums of the integer products are exact).
    """
    (fwd, _), _ = _FORMATS[quantization]
    x_axes, w_axes = _dims(x.ndim, contract)
    xq, sx = quantize(x, x_axes, fwd)
    wq, sw = quantize(w, w_axes, fwd)
    acc = jax.lax.dot_general(
        xq.astype(jnp.float32), wq.astype(jnp.float32), ((x_axes, w_axes), ((), ())), precision="highest"
    )
    y = acc * _rows(sx, x.ndim - contract, w.ndim - contract) * _cols(sw, contract, x.ndim - contract)
    return y.astype(x.dtype)


def fake_quantized_weight(w: Float[Array, "..."], contract: int, dtype: Any) -> Float[Array, "..."]:
    """`w` rounded to int8 per output column and scaled back, in `dtype`; the gradient passes
    straight through to `w` ("int8w" training)."""
    wq, sw = quantize(w, tuple(range(contract)))
    w32 = w.astype(jnp.float32)
    return (w32 + jax.lax.stop_gradient(wq.astype(jnp.float32) * sw - w32)).astype(dtype)


class QuantizedWeight(eqx.Module):
    """A projection's weight as served: int8 values and one float32 scale per output column; or,
    in training, its int8 (fp8) copy made once per step beside the float weight.

    Made from the float weight (`quantize_weights`); `values * scale` is the weight. Any leading
    stacked-layer axes are kept on both (a scan over layers slices them as it slices the float
    weights).

    Attributes:
        values: `[*stack, *in, *out]` int8 (fp8's forward format in an "fp8" training copy).
        scale: `[*stack, 1..., *out]` float32 (the `in` axes kept as size 1).
        source: the float weight `[*stack, *in, *out]` in a training copy, which the gradient
            reaches (straight through, as when the matmul rounds it itself); None when served.
    """

    values: Shaped[Array, "..."]
    scale: Float[Array, "..."]
    source: Float[Array, "..."] | None = None

    @classmethod
    def of(
        cls, w: Float[Array, "..."], *, stack: int, contract: int, quantization: str = "int8", keep_float: bool = False
    ) -> "QuantizedWeight":
        """Quantize `w` `[*stack, *in, *out]` over its `contract` input axes: to int8, or with
        `keep_float` (training) to `quantization`'s forward format, keeping `w` as `source`."""
        axes = tuple(range(stack, stack + contract))
        if not keep_float:
            values, scale = quantize(w, axes)
            return cls(values=values, scale=scale)
        (fwd, _), _ = _FORMATS[quantization]
        values, scale = quantize(jax.lax.stop_gradient(w), axes, fwd)
        return cls(values=values, scale=scale, source=w)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape


def makes_quantized_copy(quantization: str, keep_float: bool) -> bool:
    """Whether a layer computing as `quantization` gets a `QuantizedWeight` from
    `quantize_weights(..., keep_float)`: served (False), every mode but "none"; in training (True),
    "int8" and "fp8", whose matmuls round the weight (an "int8w" matmul rounds its float weight
    itself, in the weight's own dtype, and gains nothing from a copy)."""
    return quantization in _FORMATS if keep_float else quantization != "none"


def project(
    x: Float[Array, "..."], w: Float[Array, "..."] | QuantizedWeight, contract: int, quantization: str
) -> Float[Array, "..."]:
    """A projection of the transformer block: `x @ w` over the last `contract` axes of `x` and the
    first of `w`, computed as `quantization` says (module docstring); the result in `x.dtype`.

    Arguments:
        x: activations `[*tokens, *in]`.
        w: the float weight `[*in, *out]`, or its `QuantizedWeight` (serving; or in training, the
            copy made once per step, with the float weight as its `source`).
        contract: the number of `in` axes.
        quantization: "none", "int8", "int8w" or "fp8".

    Returns:
        `[*tokens, *out]` in `x.dtype`.
    """
    dims = _dims(x.ndim, contract)
    n_tok = x.ndim - contract
    if isinstance(w, QuantizedWeight) and w.source is not None:  # training, the weight quantized ahead
        if quantization in _FORMATS:
            y = quantized_matmul(x, w.source, contract, quantization, (w.values, w.scale))
            return checkpoint_name(y, QUANTIZED_OUTPUT)
        w = w.source
    if isinstance(w, QuantizedWeight):
        scale = _cols(w.scale, contract, n_tok)
        if quantization == "int8":
            xq, sx = quantize(x, dims[0])
            acc = _dot(xq, w.values, dims).astype(jnp.float32)
            return (acc * _rows(sx, n_tok, w.values.ndim - contract) * scale).astype(x.dtype)
        acc = jax.lax.dot_general(x, w.values.astype(x.dtype), (dims, ((), ())), preferred_element_type=jnp.float32)
        return (acc * scale).astype(x.dtype)
    if quantization in _FORMATS:
        return checkpoint_name(quantized_matmul(x, w, contract, quantization), QUANTIZED_OUTPUT)
    if quantization == "int8w":
        return jax.lax.dot_general(x, fake_quantized_weight(w, contract, x.dtype), (dims, ((), ())))
    return jax.lax.dot_general(x, w.astype(x.dtype), (dims, ((), ())))


def quantize_weights(tree: Any, keep_float: bool = False) -> Any:
    """`tree` with every quantized projection's float weight replaced by its `QuantizedWeight`.

    Served (`keep_float=False`): the int8 copy a served model computes with (made once, after
    loading). In training (`keep_float=True`): the copy each "int8" or "fp8" projection's forward
    and backward matmuls read, made once per step for every layer of a stack (a stacked weight's
    scales are per layer, the numbers those of the matmul quantizing it itself), beside the float
    weight, which gets the gradient (`equipax.core.nn.transformer.run_stacked_layers`). Layers whose
    `quantization` is "none" (and the embedding and output projection) keep their weights.

    Arguments:
        tree: a model, or any pytree holding one.
        keep_float: make the training copy.

    Returns:
        The same tree; each module with a `with_quantized_weights` method replaced by its result.
    """

    def quantizable(m: Any) -> bool:
        return isinstance(m, eqx.Module) and callable(getattr(m, "with_quantized_weights", None))

    def replace(m: Any) -> Any:
        return m.with_quantized_weights(keep_float) if quantizable(m) else m

    return jax.tree.map(replace, tree, is_leaf=quantizable)


def check_quantization_platform(quantization: str, platform: str) -> None:
    """Raise ConfigError unless `quantization` runs on `platform` ("cpu", "gpu" or "tpu"): "fp8"
    needs a GPU with FP8 matrix units; the other modes run everywhere."""
    if quantization == "fp8" and platform != "gpu":
        raise ConfigError(
            f"model.quantization='fp8' needs a GPU with FP8 matrix units (H100, L40, B200), but this program "
            f"runs on {platform}. On a TPU set model.quantization='int8' (int8 matmuls forward and backward; "
            "a v5e's int8 rate is twice its bfloat16 rate), or 'none'."
        )
