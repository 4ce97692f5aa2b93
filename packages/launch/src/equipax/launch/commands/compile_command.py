"""`launch compile`: AOT-compile an experiment's exact train step for its full mesh on this host."""

import contextlib
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from equipax.core.knobs import ConfigError
from equipax.launch.commands.common import (
    DEFAULT_EXPERIMENT,
    ExpOption,
    SetOption,
    check_output,
    err,
    fail,
    out,
    path_option,
    resolve_train,
)
from equipax.launch.exit_codes import EXIT_DOES_NOT_FIT

__all__ = ["compile_cmd"]


def compile_cmd(
    exp: ExpOption = DEFAULT_EXPERIMENT,
    set_: SetOption = None,
    topology: Annotated[
        str | None,
        typer.Option(
            "--topology",
            help="Compile with XLA:TPU for this TPU slice (v4-128, v5e-16, v5p-64, "
            "v6e-256, ...) instead of simulated CPU devices.",
        ),
    ] = None,
    slices: Annotated[
        int | None, typer.Option("--slices", help="Slices of --topology (default: the mesh's DCN size).")
    ] = None,
    target: Annotated[
        str | None,
        typer.Option(
            "--target",
            help="tpu-v4, tpu-v5e, tpu-v5p, tpu-v6e, h100 or h200 (default: the --topology's chip, else tpu-v4).",
        ),
    ] = None,
    hbm_gib: Annotated[
        float | None,
        typer.Option(
            "--hbm-gib",
            help="Memory budget per device in GiB, > 0 (default: what the target's allocator lets a "
            "program hold where measured, 15.748 on a v5e; else its HBM).",
        ),
    ] = None,
    assumed_mfu: Annotated[
        float, typer.Option("--assumed-mfu", help="MFU for the realistic step-time projection, in (0, 1].")
    ] = 0.5,
    strict: Annotated[bool, typer.Option("--strict", help="Exit 3 if the step does not fit the budget.")] = False,
    compare_context: Annotated[
        bool,
        typer.Option(
            "--compare-context",
            help="Also compile the step with the mesh's context axis folded into fsdp (no context "
            "parallelism, same devices and global batch) and report both programs' memory per device.",
        ),
    ] = False,
    job_log_dir: Annotated[
        Path | None,
        typer.Option("--job-log-dir", parser=path_option, help="Where compile.json goes (default: runs/<exp>)."),
    ] = None,
) -> None:
    """Compile the experiment's exact train step for its full mesh on this host (AOT).

    With --topology, for a real TPU slice with libtpu's XLA:TPU, the programs written into the
    compilation cache a run on that slice loads them from (train.compiler.cache_dir); without, on
    simulated CPU devices.
    """
    from equipax.launch.hardware.accelerators import ACCELERATORS

    # Options first: a bad number is a usage error before anything is built or compiled.
    if hbm_gib is not None and not (math.isfinite(hbm_gib) and hbm_gib > 0):
        fail(f"--hbm-gib must be a number of GiB > 0 (e.g. 32); got {hbm_gib}.")
    if not (math.isfinite(assumed_mfu) and 0 < assumed_mfu <= 1):
        fail(f"--assumed-mfu must be in (0, 1] (e.g. 0.5 for 50%); got {assumed_mfu}.")
    if slices is not None and slices < 1:
        fail(f"--slices must be >= 1; got {slices}.")
    if slices is not None and topology is None:
        fail("--slices needs --topology (e.g. --topology v4-128 --slices 2).")
    if target is not None and target not in ACCELERATORS:
        fail(f"Unknown --target {target!r}; choose one of {', '.join(ACCELERATORS)}.")
    if topology is not None:
        from equipax.launch.hardware.tpu import lookup_slice

        try:
            lookup_slice(topology)
        except ConfigError as e:
            fail(str(e))

    _, cfg, _ = resolve_train(exp, set_, for_what="to compile")
    from equipax.launch.aot.context_report import context_size

    if compare_context and context_size(cfg) == 1:
        fail(
            f"--compare-context compares context parallelism with none, but {cfg.name}'s mesh has no `context` "
            f"axis of more than one device (axes {cfg.mesh.axis_names}, shape {cfg.mesh.shape}). Add one (e.g. "
            "--set \"mesh.axis_names=('data', 'fsdp', 'context', 'tensor')\" with mesh.ici_mesh_shape and "
            "mesh.dcn_mesh_shape of four entries), or drop --compare-context."
        )
    job_dir = job_log_dir or Path("runs") / cfg.name
    check_output(job_dir, "--job-log-dir", kind="directory")
    check_output(job_dir / "compile.json", "--job-log-dir", kind="file")
    from equipax.launch.aot.remat import CACHE_FILE

    cache = job_dir / CACHE_FILE  # model.transformer.remat="auto" keeps its choice there
    if cfg.train.pgle.mode == "auto":  # JAX recompiles an auto-PGLE step after profiling it: no AOT
        from equipax.launch.training.pgle import PGLE_AUTO_AOT

        fail(PGLE_AUTO_AOT)
    from equipax.launch.hardware.compiler_flags import apply_compiler_flags, check_compiler_flags

    # Before JAX starts its backend and libtpu loads: both read their flags once.
    compiler = cfg.train.compiler
    flags = apply_compiler_flags(compiler.xla_flags, compiler.libtpu_init_args)
    for var, value in flags.items():
        _log(f"{var}={value}")
    try:
        check_compiler_flags(flags, xla_flags=compiler.xla_flags, libtpu_init_args=compiler.libtpu_init_args)

        def compile_(cfg, cache: Path | None, fill: Path | None = None) -> dict:
            if topology is None:
                return _compile_simulated(cfg, target or "tpu-v4", hbm_gib, assumed_mfu, cache)
            return _compile_topology(cfg, topology, slices, target, hbm_gib, assumed_mfu, cache, fill)

        report = compile_(cfg, cache, fill=job_dir)
        if compare_context:
            report["without_context"] = _without_context(cfg, report, compile_)
    except ConfigError as e:
        fail(str(e))
        return
    report["compiler_flags"] = {
        "train.compiler.xla_flags": cfg.train.compiler.xla_flags,
        "train.compiler.libtpu_init_args": cfg.train.compiler.libtpu_init_args,
        "environment": flags,
    }
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / "compile.json").write_text(json.dumps(report, indent=2) + "\n")
    out.print(_format(report), highlight=False, markup=False)
    out.print(f"Wrote {job_dir / 'compile.json'}", highlight=False)
    if not report["memory_per_device"]["fits"]:
        err.print(
            f"warning: {cfg.name} needs {report['memory_per_device']['total_bytes'] / 2**30:.1f} GiB per "
            f"device, over the {report['memory_per_device']['budget_gib']:g} GiB budget: use more "
            "devices (a larger fsdp axis), full remat, or a smaller per-device batch.",
            highlight=False,
        )
        if strict:
            raise typer.Exit(EXIT_DOES_NOT_FIT)


def _without_context(cfg, report: dict, compile_) -> dict:
    """`--compare-context`: the same step with the context axis folded into fsdp, compiled."""
    from equipax.launch.aot.context_report import comparison_section, fold_context

    try:
        folded = fold_context(cfg)
    except ConfigError as e:
        return comparison_section(report, None, str(e))
    _log(f"--compare-context: compiling {cfg.name} again without context parallelism, mesh {folded.mesh.shape}...")
    # No remat cache: remat="auto" chooses again for this program.
    return comparison_section(report, compile_(folded, None), None)


def _log(message: str) -> None:
    err.print(message, highlight=False)


def _format(report: dict) -> str:
    from equipax.launch.aot.report import format_report

    return format_report(report)


def _compile_simulated(cfg, target: str, hbm_gib: float | None, assumed_mfu: float, cache: Path | None) -> dict:
    from equipax.launch.aot.report import check_compile_devices, compile_report
    from equipax.launch.cluster.devices import use_cpu_devices
    from equipax.launch.hardware.accelerators import ACCELERATORS

    # The mesh is simulated with CPU devices; this must happen before JAX starts.
    use_cpu_devices(cfg.mesh.num_devices)
    check_compile_devices(cfg)
    return compile_report(
        cfg, target=ACCELERATORS[target], hbm_gib=hbm_gib, assumed_mfu=assumed_mfu, log=_log, cache=cache
    )


def _compile_topology(
    cfg,
    topology: str,
    slices: int | None,
    target: str | None,
    hbm_gib: float | None,
    assumed_mfu: float,
    cache: Path | None,
    fill: Path | None = None,
) -> dict:
    """`compile_report` for `topology`; with `fill` (the job directory), into the persistent
    compilation cache that a run's `train.compiler.cache_dir` names (`_filling_cache`)."""
    from equipax.launch.aot.report import compile_report
    from equipax.launch.hardware.accelerators import ACCELERATORS
    from equipax.launch.hardware.tpu import lookup_slice, topology_devices

    tpu = lookup_slice(topology)
    if target is not None and target != tpu.target_name:
        raise ConfigError(
            f"--target {target} does not match --topology {tpu.name} (a {tpu.target_name} "
            "slice); drop --target, the topology sets it."
        )
    num_slices = slices if slices is not None else cfg.mesh.num_slices
    _host_only_jax()
    devices = topology_devices(tpu, num_slices=num_slices)
    mesh_cfg = cfg.mesh.fit(len(devices))
    if mesh_cfg.num_devices != len(devices):
        raise ConfigError(
            f"{cfg.name}'s mesh needs {mesh_cfg.num_devices} devices (ici_mesh_shape={mesh_cfg.ici_mesh_shape} x "
            f"dcn_mesh_shape={mesh_cfg.dcn_mesh_shape}) but {num_slices} x {tpu.name} has {len(devices)} "
            "chips. Pick a topology of that size, or change the mesh with "
            "--set mesh.ici_mesh_shape=... / mesh.dcn_mesh_shape=..."
        )
    if mesh_cfg.num_slices not in (1, num_slices):
        raise ConfigError(
            f"{cfg.name}'s dcn_mesh_shape={mesh_cfg.dcn_mesh_shape} spans {mesh_cfg.num_slices} slices but "
            f"--slices is {num_slices}; the DCN axes must run across the slices."
        )
    import dataclasses

    from equipax.core.mesh import build_mesh

    cfg = dataclasses.replace(cfg, mesh=mesh_cfg)
    mesh = build_mesh(cfg.mesh, devices)
    info = {
        "slice": tpu.name,
        "topology": tpu.topology,
        "chip_config": tpu.chip_config,
        "num_slices": num_slices,
        "chips_per_slice": tpu.chips,
    }

    def compile_(init: bool) -> dict:
        return compile_report(
            cfg,
            target=ACCELERATORS[tpu.target_name],
            hbm_gib=hbm_gib,
            assumed_mfu=assumed_mfu,
            mesh=mesh,
            topology=info,
            log=_log,
            cache=cache,
            init=init,
        )

    return compile_(False) if fill is None else _filling_cache(cfg, fill, compile_)


def _filling_cache(cfg, job_dir: Path, compile_: Callable[[bool], dict]) -> dict:
    """`compile_(init)` with JAX's persistent compilation cache where `launch run` of `cfg` in
    `job_dir` would have it (`train.compiler.cache_dir`, by default the machine's; off where that is
    ''), every program written whatever its compile time (a cache chosen outside the command,
    `JAX_COMPILATION_CACHE_DIR`, keeps its own settings), the initialisation compiled too (`init`).
    XLA:TPU's program for a topology is the chip's own program under the chip's own cache key (on
    the v5e, benchmarks/README.md "On a real TPU, ninth session"), so a run on such a slice with the
    same JAX, jaxlib and libtpu loads these instead of compiling them. libtpu's compile-only client
    cannot load a program: one already in the cache is compiled and written again. The report's
    `cache`: the directory and the programs added (None where the cache is off)."""
    import jax

    from equipax.launch.training.startup import compile_cache

    with compile_cache(cfg.train.compiler.cache_dir, job_dir, reads=False) as ours:
        where = jax.config.jax_compilation_cache_dir  # also one chosen outside (JAX_COMPILATION_CACHE_DIR)
        if not where:
            return compile_(False) | {"cache": None}
        before = _cache_entries(where)
        least = jax.config.jax_persistent_cache_min_compile_time_secs
        if ours is not None:  # a cache chosen outside keeps its own settings
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        try:
            report = compile_(True)
        finally:
            jax.config.update("jax_persistent_cache_min_compile_time_secs", least)
        after = _cache_entries(where)
    written = None if before is None or after is None else len(after - before)
    return report | {"cache": {"dir": str(where), "programs_written": written}}


def _cache_entries(where: str) -> set[str] | None:
    """The programs in a local compilation cache directory (JAX's `<name>-<key>-cache` files, not
    their `-atime` records or its `.lockfile`); None for a remote one, not counted."""
    from equipax.launch.store.storage import is_remote

    if is_remote(where):
        return None
    path = Path(where)
    return (
        {p.name for p in path.iterdir() if not p.name.startswith(".") and not p.name.endswith("-atime")}
        if path.is_dir()
        else set()
    )


def _host_only_jax() -> None:
    """Keep JAX's own backend on the CPU: an AOT compile needs no attached accelerator (and on a
    TPU VM must not take its chips from a running job)."""
    import jax

    with contextlib.suppress(RuntimeError):  # JAX already started (in-process tests): its backend is not used here
        jax.config.update("jax_platforms", "cpu")
