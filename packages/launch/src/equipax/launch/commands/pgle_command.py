"""`launch pgle collect`: the first half of manual PGLE (docs/pgle.md).

Runs an experiment for a few warm-up steps and `--steps` profiled ones, turns the trace into the
`profile.pb` XLA's latency-hiding scheduler reads (`get_profiled_instructions_proto`), and prints
the knobs that pass it to a later `launch run`.
"""

from pathlib import Path
from typing import Annotated

import typer

from equipax.core.knobs import ConfigError
from equipax.launch.commands.common import (
    DEFAULT_EXPERIMENT,
    CpuDevicesOption,
    ExpOption,
    SetOption,
    check_output,
    err,
    fail,
    out,
    path_option,
    resolve_train,
)
from equipax.launch.exit_codes import EXIT_USER_ERROR

__all__ = ["collect", "pgle_app", "PROFILE_FILE"]

pgle_app: typer.Typer = typer.Typer(
    help="Profile-guided latency estimation (XLA:GPU): collect a profile for manual PGLE.", no_args_is_help=True
)

PROFILE_FILE = "profile.pb"


@pgle_app.command("collect")
def collect(
    exp: ExpOption = DEFAULT_EXPERIMENT,
    set_: SetOption = None,
    steps: Annotated[int, typer.Option("--steps", min=1, help="Steps to profile.")] = 5,
    warmup: Annotated[
        int, typer.Option("--warmup", min=1, help="Steps run before the profile (the first one compiles).")
    ] = 2,
    job_log_dir: Annotated[
        Path | None,
        typer.Option("--job-log-dir", parser=path_option, help="A new job directory (default: runs/<exp>_pgle)."),
    ] = None,
    cpu_devices: CpuDevicesOption = None,
) -> None:
    """Profile STEPS train steps after WARMUP and write <job>/profile.pb for train.pgle.mode=manual."""
    from equipax.launch.cluster.devices import check_cpu_devices, use_cpu_devices

    overrides = [
        *(set_ or []),
        "train.pgle.mode=off",
        f"train.num_steps={warmup + steps}",
        f"train.profile.start_step={warmup + 1}",
        f"train.profile.steps={steps}",
        f"train.checkpoint_every={warmup + steps}",
        f"train.eval_every={warmup + steps}",
        "train.eval_batches=1",
    ]
    _, cfg, sources = resolve_train(exp, overrides, for_what="to profile")
    job_dir = job_log_dir or Path("runs") / f"{cfg.name}_pgle"
    check_output(job_dir, "--job-log-dir", kind="directory")
    if job_dir.exists() and any(job_dir.iterdir()):
        fail(
            f"{job_dir} is not empty: a profile must come from a fresh run (a resumed one would start past "
            "its window). Pass a new --job-log-dir or remove that directory."
        )
    from equipax.launch.hardware.compiler_flags import apply_compiler_flags, check_compiler_flags, merge_flags
    from equipax.launch.training.pgle import COLLECT_XLA_FLAGS

    try:
        check_cpu_devices(cpu_devices, cfg.mesh)
        # The run's own compiler flags plus the collection's (command buffers off: see
        # COLLECT_XLA_FLAGS), set before JAX starts its backend, as `launch run` does.
        flags = merge_flags(cfg.train.compiler.xla_flags, " ".join(COLLECT_XLA_FLAGS))
        changed = apply_compiler_flags(flags, cfg.train.compiler.libtpu_init_args)
        for var, value in changed.items():
            err.print(f"{var}={value}", highlight=False, markup=False)
        check_compiler_flags(changed, xla_flags=flags, libtpu_init_args=cfg.train.compiler.libtpu_init_args)
        use_cpu_devices(cpu_devices)
    except ConfigError as e:
        fail(str(e))

    import jax
    from jax.experimental.profiler import get_profiled_instructions_proto

    from equipax.launch.training.loop import run_experiment
    from equipax.launch.training.pgle import profiled_instructions
    from equipax.launch.training.profiling import PROFILE_DIR, latest_trace

    run_experiment(cfg, job_dir=job_dir, sources=sources, console=out)
    trace = latest_trace(job_dir / PROFILE_DIR)
    if trace is None:
        fail(f"No trace was written under {job_dir / PROFILE_DIR}; see the run's messages above.")
        return
    proto = get_profiled_instructions_proto(str(trace))
    path = (job_dir / PROFILE_FILE).resolve()
    path.write_bytes(proto)
    platform = jax.devices()[0].platform
    costs = profiled_instructions(proto)
    instructions = [name for name in costs if not name.startswith("command_buffer")]
    if not instructions:
        message = (
            f"Wrote {path}, but it names no instruction ({len(proto):,} bytes"
            + (f", only {len(costs)} command buffers" if costs else "")
            + "): XLA records "
            f"per-instruction latencies for PGLE only on NVIDIA GPUs (this host runs on {platform})."
        )
        if platform == "gpu":
            fail(
                message + " On a GPU the usual causes are another tool holding CUPTI (e.g. Nsight Systems; run "
                "without it) or XLA_FLAGS turning command buffers back on (--xla_gpu_enable_command_buffer, "
                "which collect turns off).",
                EXIT_USER_ERROR,
            )
        out.print(message + " Collect on the GPU host that will train.", highlight=False)
    else:
        out.print(
            f"Wrote the PGLE profile ({len(instructions):,} instructions, {len(proto):,} bytes) to {path}.",
            highlight=False,
        )
    out.print(
        f"Use it: launch run --exp {cfg.name} --set train.pgle.mode=manual --set train.pgle.profile_path={path}\n"
        'XLA logs at INFO level what it matched (shown with TF_CPP_MIN_LOG_LEVEL=0): "Found profile for '
        'module jit_train_step, using profile guided latency estimator" then, if some instructions are not in the '
        'profile, "Found N instructions from the profile".',
        highlight=False,
        markup=False,
    )
