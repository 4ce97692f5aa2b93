"""Does a job hold the experiment's mesh? The checks every launch path shares (exit 2, both numbers, the fix),
and the command each process of a job that `launch slurm` / `launch k8s` writes runs (`run_command`).

A job is processes x devices per process; the mesh is `ici_mesh_shape` x `dcn_mesh_shape`. The two
must have the same number of devices, and each DCN block (a slice, or a group of hosts) must be
whole processes, or one process must hold whole blocks (one process with 4 devices can stand in for
two 2-device hosts). `cluster.detect.check_job` runs them on a SLURM / Open MPI job before JAX
starts, `check_shape` on any job once it has started, `launch slurm` on the job it writes.
"""

import shlex
from collections.abc import Sequence

from equipax.core.knobs import ConfigError
from equipax.core.mesh_config import MeshConfig

__all__ = ["check_counts", "check_layout", "check_shape", "run_command"]


def run_command(launcher: str, *, exp: str, overrides: Sequence[str], job_log_dir: str) -> list[str]:
    """`launch run --distributed-auto` for `exp` (with its `--set` overrides, in order) in `job_log_dir`.

    Arguments:
        launcher: the shell words that run `launch` where the job runs (e.g. "launch", ".venv/bin/launch").
        exp: the experiment, as `launch run --exp` takes it.
        overrides: `--set` overrides.
        job_log_dir: the job directory, the same for every process and every restart (so a restart resumes).
    """
    sets = [a for o in overrides for a in ("--set", o)]
    return [*shlex.split(launcher), "run", "--distributed-auto", "--exp", exp, *sets, "--job-log-dir", job_log_dir]


def check_counts(*counts: tuple[str, int, int]) -> None:
    """Each `(flag, value, least)`: refuse `value < least`, naming the flag.

    Raises:
        ConfigError: the first count below its least value.
    """
    for flag, value, least in counts:
        if value < least:
            raise ConfigError(f"{flag} must be >= {least}; got {value}.")


def check_shape(mesh: MeshConfig, *, num_processes: int, local_devices: int) -> None:
    """The same checks once the job has started (every process runs them): Cloud TPU, GKE, GPUs.

    Raises:
        ConfigError: the numbers do not fit; the message names both and the fix.
    """
    text = f"{num_processes} process{'es' if num_processes != 1 else ''}"
    check_layout(mesh, processes=num_processes, devices_per_process=local_devices, processes_text=text)


def check_layout(
    mesh: MeshConfig,
    *,
    processes: int,
    devices_per_process: int | None,
    processes_text: str,
    unit: str = "processes",
    fix: str = "run {n} processes",
) -> None:
    """`processes` x `devices_per_process` must be the mesh's devices, in whole DCN blocks.

    Arguments:
        mesh: the experiment's mesh.
        processes: the job's process count.
        devices_per_process: each process's devices (None: check the DCN blocks only).
        processes_text: how the message names the process count, e.g. "3 tasks (SLURM_NTASKS=3)".
        unit: what the processes are called in the fix ("tasks", "ranks", "processes").
        fix: the fix that changes the process count, with `{n}` for the right one.

    Raises:
        ConfigError: they do not fit; the message names both numbers and the fix.
    """
    if devices_per_process is not None:
        total = processes * devices_per_process
        if not (total == mesh.num_devices or (mesh.flexible and total % mesh.num_devices == 0)):
            need = f"a multiple of {mesh.num_devices}" if mesh.flexible else str(mesh.num_devices)
            fixes = []
            if not mesh.flexible and mesh.num_devices % devices_per_process == 0:
                fixes.append(fix.format(n=mesh.num_devices // devices_per_process))
            if not mesh.flexible and mesh.num_devices % processes == 0:
                fixes.append(f"give each process {mesh.num_devices // processes} devices")
            fixes.append("change the mesh (`launch show --exp NAME` prints it)")
            raise ConfigError(
                f"The job has {processes_text} x {devices_per_process} device{'s' if devices_per_process != 1 else ''} "
                f"each = {total} devices, but the "
                f"experiment's mesh ({_mesh_text(mesh)}) needs {need}: {', or '.join(fixes)}."
            )
    # Each DCN block (a slice, or a group of hosts) is whole processes, or one process holds whole blocks.
    slices = mesh.num_slices
    if processes % slices and slices % processes:
        raise ConfigError(
            f"The job has {processes_text}, which do not split into the mesh's {slices} DCN blocks "
            f"(dcn_mesh_shape={mesh.dcn_mesh_shape}: each block is whole processes): use a multiple of {slices} "
            f"{unit}, or a dcn_mesh_shape whose product divides {processes}."
        )


def _mesh_text(mesh: MeshConfig) -> str:
    return f"ici_mesh_shape={mesh.ici_mesh_shape} x dcn_mesh_shape={mesh.dcn_mesh_shape}"
