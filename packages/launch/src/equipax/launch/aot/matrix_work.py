"""The matrix work of a traced program: what `model.transformer.remat="auto"` reads from each
candidate's train step before compiling any (`equipax.launch.aot.remat_search`).

`matrix_flops` walks a jaxpr (`jax.jit(f).trace(...).jaxpr`, the program JAX hands to XLA, the
backward pass and what remat recomputes in it included, less what nothing reads, which XLA drops
too): every `dot_general`, grouped matrix
multiply (`ragged_dot`) and convolution, a
scanned body once per trip, a conditional's dearest branch, a `shard_map` body once per shard, and
a splash attention kernel's matrix multiplies (by `equipax.launch.aot.hlo_cost`'s convention for
the compiled programs). `matrix_seconds` is that work at a device's peak, the int8 x int8
products at its int8 rate: a lower bound on any compile of the program, and what a policy that
recomputes less can save at most where what it skips is matrix work.
"""

import math
from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp
import numpy as np

from equipax.launch.aot.hlo_cost import _FUSED_BACKWARD_MATMULS, _SPLASH_MATMULS, Roofline

__all__ = ["matrix_flops", "matrix_seconds"]


def _jaxprs(value: Any) -> Iterator[Any]:
    """The jaxprs a primitive's parameter holds (a closed jaxpr's own; a tuple's, in order). A closed
    jaxpr is unwrapped first: JAX 0.10's also has `eqns`, but its dead-code elimination takes only
    the open one."""
    if hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
        yield value.jaxpr
    elif hasattr(value, "eqns"):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _jaxprs(v)


def _shape(var: Any) -> tuple[int, ...]:
    return tuple(getattr(getattr(var, "aval", None), "shape", ()) or ())


def _is_int8(var: Any) -> bool:
    dtype = getattr(getattr(var, "aval", None), "dtype", None)
    return dtype is not None and np.dtype(dtype) == np.int8


def _dot(eqn: Any) -> float:
    (contracting, _), _ = eqn.params["dimension_numbers"]
    lhs = _shape(eqn.invars[0])
    return 2.0 * math.prod(_shape(eqn.outvars[0])) * math.prod(lhs[i] for i in contracting)


def _ragged_dot(eqn: Any) -> float:
    """A grouped matrix multiply (`jax.lax.ragged_dot`, a mixture of experts' and its transposes):
    each row of the left operand meets one group of the right one: 2 x the left operand x the
    right one's free dimensions (not contracted, batched or grouped)."""
    numbers = eqn.params["ragged_dot_dimension_numbers"]
    (_, contracting), (_, batch) = numbers.dot_dimension_numbers
    rhs, skip = _shape(eqn.invars[1]), {*contracting, *batch, *numbers.rhs_group_dimensions}
    return 2.0 * math.prod(_shape(eqn.invars[0])) * math.prod(d for i, d in enumerate(rhs) if i not in skip)


def _conv(eqn: Any) -> float:
    """2 x outputs x the kernel's size per output feature (padding not discounted)."""
    rhs, out = _shape(eqn.invars[1]), _shape(eqn.outvars[0])
    features = rhs[eqn.params["dimension_numbers"].rhs_spec[0]] if rhs else 1
    return 2.0 * math.prod(out) * math.prod(rhs) / max(features, 1)


def _pallas(eqn: Any) -> float:
    """A Pallas kernel's matrix FLOPs: a splash attention kernel's by its name and its query and key
    operands `[b, h, s, d]` (`[h, s, d]`: batch 1), as `equipax.launch.aot.hlo_cost` prices it in a
    compiled program (forward 2 matrix multiplies, dq 3, dkv 4, the fused backward 5, half of them
    under the causal mask); another's from its cost estimate (0 without one)."""
    params = eqn.params
    name = params.get("name") or getattr(params.get("name_and_src_info"), "name", None) or ""
    if "splash" in name:
        floats = [_shape(v) for v in eqn.invars if jnp.issubdtype(v.aval.dtype, jnp.floating)]  # bf16 too
        qk = [s for s in floats if len(s) in (3, 4)]
        if len(qk) < 2:
            return 0.0
        (b, h, sq, d), sk = (1, *qk[0])[-4:], qk[1][-2]
        matmuls = next((n for key, n in _SPLASH_MATMULS if key in name), 2)
        # dq, dk and dv: outputs of the queries' rank or more (its scratch sums have one axis less).
        if "_dkv" in name and sum(len(_shape(v)) >= len(qk[0]) for v in eqn.outvars) >= 3:
            matmuls = _FUSED_BACKWARD_MATMULS
        return 2.0 * b * h * sq * sk * d * matmuls / 2
    estimate = params.get("cost_estimate")
    return float(getattr(estimate, "flops", 0) or 0)


def _shards(params: dict[str, Any]) -> int:
    """How many shards a `shard_map` body runs as: the sizes of its manual mesh axes."""
    mesh = params.get("mesh")
    shape = dict(getattr(mesh, "shape", {}) or {})
    axes = params.get("newly_manual_axes") or params.get("manual_axes") or params.get("axis_names") or shape
    return math.prod(shape.get(a, 1) for a in axes)


def matrix_flops(jaxpr: Any) -> tuple[float, float]:
    """(the matrix FLOPs of `jaxpr`, a `Jaxpr` or `ClosedJaxpr`, of which int8 x int8), of what its
    outputs need: as XLA does, what nothing reads is not counted (under a policy that saves splash's
    residuals, the forward kernel that remat traces again in the backward pass)."""
    return _flops(_live(next(_jaxprs(jaxpr))))


def _live(jaxpr: Any) -> Any:
    """`jaxpr` without what its outputs do not need (JAX's dead-code elimination, where it has it)."""
    try:
        from jax._src.interpreters.partial_eval import dce_jaxpr
    except ImportError:
        return jaxpr
    return dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))[0]


def _flops(jaxpr: Any) -> tuple[float, float]:
    total, int8 = 0.0, 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            f = _dot(eqn)
            total, int8 = total + f, int8 + (f if all(_is_int8(v) for v in eqn.invars[:2]) else 0.0)
            continue
        if name in ("conv_general_dilated", "ragged_dot_general"):
            total += _conv(eqn) if name == "conv_general_dilated" else _ragged_dot(eqn)
            continue
        if name == "pallas_call":  # its body runs per block of its grid: priced as a whole
            total += _pallas(eqn)
            continue
        inner = [_flops(j) for key, v in eqn.params.items() for j in _jaxprs(v) if key != "cond_jaxpr"]
        if not inner:
            continue
        if name == "cond":  # the dearest branch
            t, i = max(inner)
        else:
            times = eqn.params.get("length", 1) if name == "scan" else _shards(eqn.params) if "shard_map" in name else 1
            t, i = times * sum(x[0] for x in inner), times * sum(x[1] for x in inner)
        total, int8 = total + t, int8 + i
    return total, int8


def matrix_seconds(jaxpr: Any, roofline: Roofline) -> float:
    """`jaxpr`'s matrix work at `roofline`'s peak (int8 x int8 products at its int8 rate)."""
    total, int8 = matrix_flops(jaxpr)
    return (total - int8) / roofline.peak_flops + int8 / (roofline.int8_peak_flops or roofline.peak_flops)
