"""What the quantized programs move through HBM: c4_1b's train step in bf16 and with `int8`
projections, and its decode step in bf16 and with `int8w` weights, compiled for a TPU offline.

XLA:TPU (libtpu, the `aot` group: no chip needed) compiles for `--topology`:

- `step`: c4_1b at 6 layers as `benchmarks/tpu/user_runs.py` runs it on the chip
  (`c4_1b_6l_adamw_dots` and `c4_1b_6l_adamw_dots_int8`: batch 8 x 1024, AdamW, no caps,
  `remat=dots_saveable`), the whole train step (`launch run`'s, built as `launch compile` builds it).
- `decode`: one token of c4_1b at 6 layers (`decode_step`, `--decode-batch` rows, a cache of
  `--cache-len` slots), its weights as the decode loop holds them (`for_decoding`): float ones in
  the compute dtype (bf16), and with `int8w` the projections' int8 `QuantizedWeight`s.

For each: XLA's cost analysis (FLOPs and bytes accessed; a loop's body counted once: one layer of
the scanned stack), and the roofline of `equipax.launch.aot.hlo_cost` (every kernel the program
launches, each loop body once per trip: the HBM bytes per step or token, and the projected time,
each kernel at `max(FLOPs / peak, bytes / bandwidth)` with int8 x int8 matmuls at the int8 rate),
the temporaries and the int8 matmuls.

    uv run python benchmarks/quantized_step.py --topology v5e-1                  # 4 compiles, ~4 min
    uv run python benchmarks/quantized_step.py --topology v5e-1 --programs decode --decode-batch 8
"""

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax

STEP_RUNS = {"bf16": "c4_1b_6l_adamw_dots", "int8": "c4_1b_6l_adamw_dots_int8"}
DECODE_MODES = {"bf16": "none", "int8w": "int8w"}


def _figures(compiled: Any, roofline: Any) -> dict[str, Any]:
    from equipax.launch.aot.hlo_cost import program_cost
    from equipax.launch.aot.memory import memory_figures
    from equipax.launch.aot.report import count_matmuls

    hlo = compiled.as_text() or ""
    xla = compiled.cost_analysis()
    xla = xla[0] if isinstance(xla, list) else xla
    cost = program_cost(hlo, roofline)
    return {
        "xla_flops": float(xla.get("flops", 0.0)),
        "xla_bytes_accessed": float(xla.get("bytes accessed", 0.0)),
        "hbm_bytes": cost.hbm_bytes,
        "flops": cost.flops,
        "projected_s": cost.projected_s,
        "temp_bytes": memory_figures(compiled.memory_analysis())["temp_bytes"],
        "matmuls": count_matmuls(hlo),
    }


def _config(experiment: str, overrides: list[str], devices: list[Any]) -> Any:
    from equipax.launch.commands.common import resolve_train

    _, cfg, _ = resolve_train(experiment, overrides, for_what="to compile")
    return dataclasses.replace(cfg, mesh=cfg.mesh.fit(len(devices)))


def train_step(run: str, devices: list[Any], roofline: Any, exp: str, sets: list[str]) -> dict[str, Any]:
    """The figures of `user_runs.RUNS[run]`'s train step (of `exp`, `sets` after its knobs) compiled
    for `devices`."""
    from benchmarks.tpu.user_runs import RUNS
    from equipax.core.mesh import build_mesh
    from equipax.launch.aot.compile_step import compile_step
    from equipax.launch.program.training import build_training

    _, knobs = RUNS[run]
    cfg = _config(exp, [*knobs, *sets], devices)
    step = compile_step(build_training(cfg, build_mesh(cfg.mesh, devices), feeds_batches=False))
    return {"run": run, "knobs": [*knobs, *sets], **_figures(step.compiled, roofline)}


def decode_step(
    quantization: str, devices: list[Any], roofline: Any, *, batch: int, cache_len: int, exp: str, sets: list[str]
) -> dict[str, Any]:
    """The figures of one decode step of `exp` at 6 layers (`sets` after) with
    `model.quantization=quantization`, and how many arrays of an int8 weight's shape it writes to
    device memory in a float dtype (`float_weight_copies`: a dequantized copy; 0 when each int8
    weight is converted inside its matmul)."""
    import equinox as eqx
    import jax.numpy as jnp

    from equipax.core.nn.quantization import QuantizedWeight
    from equipax.launch.configs.experiment import as_lm
    from equipax.models import TransformerLM
    from equipax.models.decode import TPU_DECODE_COMPILER_OPTIONS, decode_step, for_decoding, init_cache

    knobs = ["model.transformer.num_layers=6", *sets, f"model.quantization={quantization}"]
    lm = as_lm(_config(exp, knobs, devices)).model
    dtype = jnp.dtype(lm.dtype)
    placed = jax.sharding.SingleDeviceSharding(devices[0])

    def held(a: Any) -> Any:  # a float weight in the compute dtype, as the decode loop holds it
        floating = jnp.issubdtype(a.dtype, jnp.floating)
        return jax.ShapeDtypeStruct(a.shape, dtype if floating else a.dtype, sharding=placed)

    model = eqx.filter_eval_shape(lambda: for_decoding(TransformerLM(lm, key=jax.random.key(0))))
    is_int8 = lambda x: isinstance(x, QuantizedWeight)  # noqa: E731
    model = jax.tree.map(
        lambda x: (
            jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed), x)
            if is_int8(x)
            else held(x)
        ),
        model,
        is_leaf=is_int8,
    )
    params, static = eqx.partition(model, lambda a: isinstance(a, jax.ShapeDtypeStruct))
    cache = jax.eval_shape(lambda p: init_cache(eqx.combine(p, static), batch, cache_len), params)
    cache = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed), cache)
    rows = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=placed)

    def step(params: Any, tokens: Any, positions: Any, cache: Any) -> Any:
        return decode_step(eqx.combine(params, static), tokens, positions, cache)

    options = TPU_DECODE_COMPILER_OPTIONS if devices[0].platform == "tpu" else None
    compiled = jax.jit(step, donate_argnums=3).lower(params, rows, rows, cache).compile(options)
    int8 = {w.values.shape for w in jax.tree.leaves(model, is_leaf=is_int8) if is_int8(w)}
    int8 |= {shape[1:] for shape in int8}  # one layer's, sliced from the stack
    return {
        "quantization": quantization,
        "batch": batch,
        "cache_len": cache_len,
        **_figures(compiled, roofline),
        "float_weight_copies": float_weight_copies(compiled.as_text() or "", int8),
    }


def float_weight_copies(hlo: str, shapes: set[tuple[int, ...]]) -> int:
    """The kernels of a compiled program (`hlo`) that write an array of one of `shapes` to device
    memory in a float dtype (two or more bytes an element)."""
    from equipax.launch.aot.hlo_text import arrays, attr, parse_module

    computations, _ = parse_module(hlo)
    fused = {attr(op.attrs, "calls") for ops in computations.values() for op in ops if op.opcode == "fusion"}
    moves_nothing = ("parameter", "get-tuple-element", "tuple", "bitcast", "constant")
    return sum(
        1
        for name, ops in computations.items()
        if name not in fused
        for op in ops
        if op.opcode not in moves_nothing
        for a in arrays(op.shape)
        if a.space == 0 and a.dims in shapes and a.bytes >= 2 * math.prod(a.dims)
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--topology", default="v5e-1", help="the TPU slice to compile for (default v5e-1)")
    p.add_argument("--programs", default="step,decode", help="comma-separated: step, decode")
    p.add_argument("--decode-batch", type=int, default=1)
    p.add_argument("--cache-len", type=int, default=192, help="decode cache slots (a 64-token prompt + 128)")
    p.add_argument("--exp", default="c4_1b", help="the experiment (default c4_1b)")
    p.add_argument("--set", dest="sets", action="append", default=[], help="a knob for every program (repeatable)")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    jax.config.update("jax_platforms", "cpu")  # JAX's own backend: the compiles are for --topology
    from equipax.launch.aot.hlo_cost import Roofline
    from equipax.launch.hardware.accelerators import ACCELERATORS
    from equipax.launch.hardware.tpu import lookup_slice, topology_devices

    tpu = lookup_slice(args.topology)
    devices = list(topology_devices(tpu))
    roofline = Roofline.of(ACCELERATORS[tpu.target_name])
    programs = {p.strip() for p in args.programs.split(",") if p.strip()}
    results: dict[str, Any] = {"topology": args.topology, "roofline": dataclasses.asdict(roofline)}
    if "step" in programs:
        for name, run in STEP_RUNS.items():
            results[f"step_{name}"] = train_step(run, devices, roofline, args.exp, args.sets)
            _print(f"step_{name}", results[f"step_{name}"])
    if "decode" in programs:
        for name, mode in DECODE_MODES.items():
            row = decode_step(
                mode, devices, roofline, batch=args.decode_batch, cache_len=args.cache_len, exp=args.exp, sets=args.sets
            )
            results[f"decode_{name}"] = row
            _print(f"decode_{name}", row)
    for kind, base, other in (("step", "bf16", "int8"), ("decode", "bf16", "int8w")):
        a, b = results.get(f"{kind}_{base}"), results.get(f"{kind}_{other}")
        if a and b:
            results[f"{kind}_projected_speedup"] = a["projected_s"] / b["projected_s"]
            print(f"{kind}: {other} projected {a['projected_s'] / b['projected_s']:.3f}x {base}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return results


def _print(name: str, row: dict[str, Any]) -> None:
    print(
        f"{name}: HBM {row['hbm_bytes'] / 1e9:.2f} GB, projected {row['projected_s'] * 1e3:.2f} ms, "
        f"XLA bytes accessed {row['xla_bytes_accessed'] / 1e9:.2f} GB (loop bodies once), temporaries "
        f"{row['temp_bytes'] / 2**30:.2f} GiB"
        + (f", matmuls (XLA:TPU's convolutions) {row['matmuls']}" if row["matmuls"]["total"] else "")
        + (f", float copies of int8 weights {row['float_weight_copies']}" if "float_weight_copies" in row else ""),
        flush=True,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
