"""The state's initialisation compiled with less compiler effort: its compile time, and whether the
initial state is the same, bit for bit.

A first `launch run` on a TPU compiles its initialisation beside its train step, and on the v5e's
host that compile is the longer one (benchmarks/README.md, "On a real TPU, seventh session"). The
program runs once, so its speed hardly matters. This compiles `Training.lower_init()` of `--exp`
(with `--set`) on the attached devices with XLA's default options and with each variant
(`jax.stages.Lowered.compile(compiler_options=...)`), in the order given, after one untimed
compile, runs each, and compares every array of its state with the default's (`jnp.array_equal`,
on the device).

    uv run python benchmarks/init_effort.py --exp shakespeare_tiny --out /tmp/init_effort.json
"""

import argparse
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file, `python benchmarks/init_effort.py`: the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.records import header, write_json

# Per-program compiler options (jax.stages.Lowered.compile): XLA's effort levels (9 = O0).
VARIANTS: dict[str, dict[str, Any]] = {
    "optimization_level=O0": {"optimization_level": 9},
    "exec_time_optimization_effort=-1": {"exec_time_optimization_effort": -1.0},
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--exp", default="shakespeare_tiny")
    p.add_argument("--set", dest="sets", action="append", default=[], help="KNOB=VALUE (repeatable)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {list(VARIANTS)}")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from equipax.core.mesh import build_mesh
    from equipax.launch.commands.common import resolve
    from equipax.launch.program.training import build_training

    jax.config.update("jax_enable_compilation_cache", False)
    _, cfg, _ = resolve(args.exp, args.sets)
    cfg = cfg.for_devices(jax.device_count())
    training = build_training(cfg, build_mesh(cfg.mesh), feeds_batches=False)

    def compiled(options: dict[str, Any] | None) -> tuple[Any, float]:
        jax.clear_caches()
        lowered = training.lower_init()
        t = time.perf_counter()
        program = lowered.compile() if options is None else lowered.compile(compiler_options=options)
        return program, time.perf_counter() - t

    same = jax.jit(lambda a, b: jnp.array_equal(a, b, equal_nan=True))
    results: dict[str, Any] = {}
    # A process's first XLA:TPU compile pays a start-up of its own (the v5e's host: the same program
    # 15.2 s as the first compile, 7.5 s again): one untimed compile first, so the default's figure
    # is a compile like the variants'.
    compiled(None)
    program, seconds = compiled(None)
    reference = eqx.filter(program(training.keys.init), eqx.is_array)
    jax.block_until_ready(reference)
    results["default"] = {"compile_s": seconds}
    print(f"default: compile {seconds:.1f} s", flush=True)
    for name in args.variants.split(","):
        try:
            program, seconds = compiled(VARIANTS[name])
        except Exception as e:  # an option this XLA does not take
            results[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            print(f"{name}: {results[name]['error']}", flush=True)
            continue
        state = eqx.filter(program(training.keys.init), eqx.is_array)
        leaves, ref_leaves = jax.tree.leaves(state), jax.tree.leaves(reference)
        equal = all(bool(same(a, b)) for a, b in zip(leaves, ref_leaves, strict=True))
        del state, leaves
        results[name] = {"compile_s": seconds, "bitwise_equal": equal}
        print(f"{name}: compile {seconds:.1f} s, the same state bit for bit: {equal}", flush=True)
    device = jax.devices()[0]
    out = {**header(), "device_kind": device.device_kind, "exp": args.exp, "sets": args.sets, "results": results}
    return write_json(args.out, out)


if __name__ == "__main__":
    main()
