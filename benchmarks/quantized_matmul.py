"""The quantized projection (`equipax.core.nn.quantization`) against bfloat16, and against qwix's
`dot_general_qt` where qwix is installed: compiled for a TPU offline, or timed on one.

One projection of c4_1b's MLP by default (`[tokens, 2048] @ [2048, 8192]`, 8 x 2048 tokens: a
6-layer c4_1b step's per-chip batch), forward and backward as a layer of a train step runs it
(`jax.vjp`: the output written in bfloat16, then the input's and the weight's gradients from an
incoming gradient): "bf16" (the float matmul in bfloat16), "int8" (`quantized_matmul`:
int8 forward and both backward matmuls), "qwix_int8" (qwix's `dot_general_qt` configured as
MaxText's int8: the same three matmuls in int8, absmax per channel; only when `import qwix`
works: equipax does not depend on it), and the serving forward alone at decode shapes
(`--decode-tokens` rows): "bf16_serve" and "int8w_serve" (`project` of an int8 `QuantizedWeight`).

For each: XLA's cost analysis of the compiled program (FLOPs, bytes accessed), the HBM bytes and
projected time of `equipax.launch.aot.hlo_cost` (each kernel at its roofline, int8 matmuls at the
int8 rate; arrays XLA keeps in on-chip memory cost nothing), its temporaries, how many of its
matmuls (XLA:TPU's convolutions) are int8 x int8 -> s32, and, on a real device, the median of
`--repeats` timed calls. (The whole train step and decode step: benchmarks/quantized_step.py.)

    uv run python benchmarks/quantized_matmul.py --topology v5e-1     # offline, any Linux host
    python benchmarks/quantized_matmul.py                              # on the chip: times too
    uv run --with qwix --with flax python benchmarks/quantized_matmul.py --topology v5e-1
"""

import argparse
import json
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp

from equipax.launch.aot.hlo_cost import NOMINAL_HOST, Roofline, program_cost
from equipax.launch.aot.report import count_matmuls
from equipax.launch.hardware.accelerators import accelerator_of


def _qwix_int8() -> Any:
    """qwix's quantized-training dot_general as MaxText's `int8` configures it, or None."""
    try:
        from qwix._src.core import dot_general_qt  # pyright: ignore[reportMissingImports]
    except ImportError:
        return None
    cfg = dot_general_qt.DotGeneralQtConfig(
        lhs_qtype=jnp.int8, rhs_qtype=jnp.int8, dlhs_grad_qtype=jnp.int8, drhs_grad_qtype=jnp.int8
    )

    def matmul(x, w):
        return dot_general_qt.dot_general_qt(x, w, (((1,), (0,)), ((), ())), cfg).astype(x.dtype)

    return matmul


def programs(tokens: int, d_in: int, d_out: int, decode_tokens: int) -> dict[str, tuple[Any, tuple[Any, ...]]]:
    """{name: (function, abstract arguments)}."""
    from equipax.core.nn.quantization import QuantizedWeight, project, quantized_matmul

    x = jax.ShapeDtypeStruct((tokens, d_in), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((d_in, d_out), jnp.float32)
    g = jax.ShapeDtypeStruct((tokens, d_out), jnp.bfloat16)  # the output's incoming gradient

    def train(matmul):
        def step(x, w, g):
            y, vjp = jax.vjp(matmul, x, w)
            return (y, *vjp(g))

        return step

    out = {
        "bf16": (train(lambda x, w: x @ w.astype(x.dtype)), (x, w, g)),
        "int8": (train(lambda x, w: quantized_matmul(x, w, 1, "int8")), (x, w, g)),
    }
    qwix = _qwix_int8()
    if qwix is not None:
        out["qwix_int8"] = (train(qwix), (x, w, g))
    xd = jax.ShapeDtypeStruct((decode_tokens, d_in), jnp.bfloat16)
    wb = jax.ShapeDtypeStruct((d_in, d_out), jnp.bfloat16)
    served = jax.eval_shape(lambda w: QuantizedWeight.of(w, stack=0, contract=1), w)
    out["bf16_serve"] = (lambda x, w: x @ w, (xd, wb))
    out["int8w_serve"] = (lambda x, w: project(x, w, 1, "int8w"), (xd, served))
    return out


def measure(fn: Any, args: tuple[Any, ...], devices: Any, repeats: int) -> dict[str, Any]:
    sharding = jax.sharding.SingleDeviceSharding(devices[0])
    placed = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args)
    compiled = jax.jit(fn).lower(*placed).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    hlo = compiled.as_text()
    matmuls = count_matmuls(hlo)
    mem = compiled.memory_analysis()
    accelerator = accelerator_of(devices[0].device_kind)
    roofline = program_cost(hlo, Roofline.of(accelerator) if accelerator is not None else NOMINAL_HOST)
    row: dict[str, Any] = {
        "flops": float(cost.get("flops", 0.0)),
        "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
        "hbm_bytes": roofline.hbm_bytes,
        "projected_s": roofline.projected_s,
        "temp_bytes": int(getattr(mem, "temp_size_in_bytes", 0)),
        "matmuls": matmuls["total"],
        "int8_matmuls": matmuls["int8"],
    }
    if devices[0].platform != "tpu" or getattr(devices[0], "client", None) is None or repeats <= 0:
        return row
    keys = jax.random.split(jax.random.key(0), len(args))
    real = [
        jax.device_put(
            jax.random.randint(k, a.shape, -100, 100).astype(a.dtype)
            if jnp.issubdtype(a.dtype, jnp.integer)
            else jax.random.normal(k, a.shape, a.dtype),
            sharding,
        )
        for k, a in zip(keys, jax.tree.leaves(args), strict=True)
    ]
    real = jax.tree.unflatten(jax.tree.structure(args), real)
    jax.block_until_ready(compiled(*real))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*real))
        times.append(time.perf_counter() - start)
    row["median_s"] = statistics.median(times)
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--topology", help="compile for this TPU slice offline (e.g. v5e-1); default: this host's device")
    p.add_argument("--tokens", type=int, default=8 * 2048)
    p.add_argument("--d-in", type=int, default=2048)
    p.add_argument("--d-out", type=int, default=8192)
    p.add_argument("--decode-tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.topology:
        from equipax.launch.hardware.tpu import lookup_slice, topology_devices

        devices = topology_devices(lookup_slice(args.topology))
    else:
        devices = jax.devices()
    results: dict[str, Any] = {"device": devices[0].device_kind, "shape": [args.tokens, args.d_in, args.d_out]}
    for name, (fn, abstract) in programs(args.tokens, args.d_in, args.d_out, args.decode_tokens).items():
        results[name] = measure(fn, abstract, devices, args.repeats if not args.topology else 0)
        print(name, json.dumps(results[name]), flush=True)
    for base, name in (("bf16", "int8"), ("bf16", "qwix_int8"), ("bf16_serve", "int8w_serve")):
        if name in results and "median_s" in results[name]:
            results[f"{name}_speedup"] = results[base]["median_s"] / results[name]["median_s"]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
