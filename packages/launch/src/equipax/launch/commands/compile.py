"""`launch compile`: AOT-compile an experiment's exact train step for its full mesh on this host."""

import json
from pathlib import Path
from typing import Annotated

import typer

from equipax.core.config import ConfigError
from equipax.launch.commands.common import DEFAULT_EXPERIMENT, ExpOption, SetOption, err, fail, out, resolve
from equipax.launch.errors import EXIT_DOES_NOT_FIT


def compile_cmd(
    exp: ExpOption = DEFAULT_EXPERIMENT,
    set_: SetOption = None,
    target: Annotated[str, typer.Option("--target", help="tpu-v4, tpu-v5e, tpu-v5p, tpu-v6e, h100 or h200.")] = "tpu-v4",
    hbm_gib: Annotated[float | None, typer.Option("--hbm-gib", help="Memory budget per device (default: the target's HBM).")] = None,
    assumed_mfu: Annotated[float, typer.Option("--assumed-mfu", help="MFU for the realistic step-time projection.")] = 0.5,
    strict: Annotated[bool, typer.Option("--strict", help="Exit 3 if the step does not fit the budget.")] = False,
    job_log_dir: Annotated[
        Path | None, typer.Option("--job-log-dir", help="Where compile.json goes (default: runs/<exp>).")
    ] = None,
) -> None:
    """Compile the experiment's exact train step for its full mesh on this CPU host (AOT)."""
    from equipax.launch.aot.report import TARGETS, check_compile_devices, compile_report, format_report
    from equipax.launch.cluster.devices import use_cpu_devices

    entry, cfg, _ = resolve(exp, set_)
    if entry.kind != "train":
        fail(f"{cfg.name} is a benchmark, not a training experiment; there is no train step to compile.")
    if target not in TARGETS:
        fail(f"Unknown --target {target!r}; choose one of {', '.join(TARGETS)}.")
    try:
        # The mesh is simulated with CPU devices; this must happen before JAX starts.
        use_cpu_devices(cfg.mesh.num_devices)
        check_compile_devices(cfg)
        report = compile_report(cfg, target=TARGETS[target], hbm_gib=hbm_gib, assumed_mfu=assumed_mfu,
                                log=lambda m: err.print(m, highlight=False))
    except ConfigError as e:
        fail(str(e))
        return
    job_dir = job_log_dir or Path("runs") / cfg.name
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / "compile.json").write_text(json.dumps(report, indent=2) + "\n")
    out.print(format_report(report), highlight=False, markup=False)
    out.print(f"Wrote {job_dir / 'compile.json'}", highlight=False)
    if not report["memory_per_device"]["fits"]:
        err.print(
            f"warning: {cfg.name} needs {report['memory_per_device']['total_bytes'] / 2**30:.1f} GiB per "
            f"device, over the {report['memory_per_device']['budget_gib']:.0f} GiB budget: use more "
            "devices (a larger fsdp axis), full remat, or a smaller per-device batch.", highlight=False)
        if strict:
            raise typer.Exit(EXIT_DOES_NOT_FIT)
