"""Compiles at once: how a run's programs slow each other when they compile side by side.

`launch run` compiles several programs at the same time: the initialisation beside the train step
(`equipax.launch.training.ahead`), and with `model.transformer.remat="auto"` two candidates' train
steps beside the initialisation (`equipax.launch.aot.remat_search`). This times each program's
compile on the attached devices alone, then in the groups given, each group's programs started
together on threads (as the run starts them), after every program was traced and lowered. The
programs are those of `--exp` with `--set` applied: `init` (the state's initialisation, compiled
with `INIT_COMPILER_OPTIONS` as a run compiles it) and `step:<policy>` (the train step with
`model.transformer.remat=<policy>`).

    uv run python benchmarks/compile_overlap.py --exp shakespeare_tiny \\
        --groups "step:none+init" "step:none+step:full" --out /tmp/compile_overlap.json

Each compile is a fresh one: JAX's persistent compilation cache is off here, and its in-memory
caches are cleared before each group lowers its programs again.
"""

import argparse
import concurrent.futures
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file, `python benchmarks/compile_overlap.py`: the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.records import header, write_json


def lowerings(exp: str, sets: list[str], names: set[str], topology: str | None = None) -> dict[str, Any]:
    """`{name: () -> Lowered}` for each program named (`init`, `step:<policy>`), for the attached
    devices or, with `topology`, for a TPU slice compiled on this host (as `launch compile --topology`)."""
    import dataclasses

    import jax

    from equipax.core.mesh import build_mesh
    from equipax.launch.commands.common import resolve
    from equipax.launch.program.training import build_training

    devices = None
    if topology is not None:
        from equipax.launch.commands.compile_command import _host_only_jax
        from equipax.launch.hardware.tpu import lookup_slice, topology_devices

        _host_only_jax()
        devices = topology_devices(lookup_slice(topology))
    out: dict[str, Any] = {}
    for name in sorted(names):
        policy = name.split(":", 1)[1] if name.startswith("step:") else None
        _, cfg, _ = resolve(exp, [*sets, *([f"model.transformer.remat={policy}"] if policy else [])])
        if devices is None:
            cfg = cfg.for_devices(jax.device_count())  # a -1 mesh axis takes the devices present
        else:
            cfg = dataclasses.replace(cfg, mesh=cfg.mesh.fit(len(devices)))
        training = build_training(cfg, build_mesh(cfg.mesh, devices), feeds_batches=policy is None)
        out[name] = training.lower_init if policy is None else training.lower
    return out


def compile_group(names: list[str], lower: dict[str, Any]) -> dict[str, float]:
    """Each program's compile seconds when the group's compiles start together."""
    import jax

    jax.clear_caches()  # JAX's in-memory caches would hand back a program compiled before
    lowered = {name: lower[name]() for name in names}

    def one(name: str) -> float:
        from equipax.launch.program.training import INIT_COMPILER_OPTIONS

        t = time.perf_counter()
        lowered[name].compile(**({"compiler_options": INIT_COMPILER_OPTIONS} if name == "init" else {}))
        return time.perf_counter() - t

    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        t = time.perf_counter()
        futures = {name: pool.submit(one, name) for name in names}
        times = {name: f.result() for name, f in futures.items()}
    times["(group wall)"] = time.perf_counter() - t
    return times


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--exp", default="shakespeare_tiny")
    p.add_argument("--set", dest="sets", action="append", default=[], help="KNOB=VALUE (repeatable)")
    p.add_argument("--groups", nargs="+", required=True, help="programs compiled together, joined by '+'")
    p.add_argument("--topology", default=None, help="compile for this TPU slice on this host (e.g. v5e-1)")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)
    import jax

    jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_enable_compilation_cache", False)
    groups = [g.split("+") for g in args.groups]
    names = {n for g in groups for n in g}
    lower = lowerings(args.exp, args.sets, names, args.topology)
    results: dict[str, Any] = {"alone": {}, "groups": {}}
    for name in sorted(names):
        results["alone"][name] = compile_group([name], lower)[name]
        print(f"alone  {name:<28} {results['alone'][name]:6.1f} s", flush=True)
    for group in groups:
        times = compile_group(group, lower)
        results["groups"]["+".join(group)] = times
        print("group  " + ", ".join(f"{n} {s:.1f} s" for n, s in times.items()), flush=True)
    device = jax.devices()[0]
    results |= {
        **header(),
        "topology": args.topology,
        "device_kind": device.device_kind if args.topology is None else f"(compiled on the host for {args.topology})",
        "exp": args.exp,
        "sets": args.sets,
    }
    return write_json(args.out, results)


if __name__ == "__main__":
    main()
