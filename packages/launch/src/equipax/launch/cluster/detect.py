"""The multi-host job a process was started in, read from its scheduler's environment.

`launch run --distributed-auto` reads SLURM's (`srun`) and Open MPI's (`mpirun`) variables itself,
before JAX starts, so a job that cannot run the experiment is refused at once with both numbers
(`check_job`), and every process joins with explicit values. The coordinator is found as JAX's own
cluster detection finds it: the first node of the SLURM step, or the host `mpirun` runs on, with
the port derived from the job id (`JAX_COORDINATOR_PORT` overrides it). Cloud TPU VMs and GKE TPU
pods are left to JAX, which reads the TPU metadata; their process and device counts are checked
once the job has started (`cluster.shape.check_shape`).

Which devices a process sees (`ClusterJob.local_device_ids`): with one process per node it sees
all of the node's devices; with several, each takes its share of the node's GPUs (SLURM's
`SLURM_GPUS_ON_NODE`), or one GPU each when the count is unknown, as JAX's own detection does.
"""

import dataclasses
import importlib.util
import os
import re
from collections.abc import Mapping

from equipax.core.knobs import ConfigError
from equipax.core.mesh_config import MeshConfig
from equipax.launch.cluster.shape import check_layout

__all__ = ["check_job", "ClusterJob", "detect_job", "find_job", "first_host", "tasks_on_node"]

# JAX's choice (jax._src.clusters): a port in the top 4096 of the range, from the job id, so two
# jobs on one node rarely collide and every process of a job computes the same one.
_PORT_BASE = 65536 - 4096


@dataclasses.dataclass(frozen=True)
class ClusterJob:
    """A multi-process job found in the environment.

    Attributes:
        scheduler: "SLURM" or "Open MPI".
        num_processes: processes in the job (SLURM tasks, MPI ranks).
        process_id: this process, 0..num_processes-1.
        local_process_id: this process among those on its node.
        processes_on_node: processes on this process's node.
        coordinator: HOST:PORT of process 0's coordination service.
        local_device_ids: the accelerators this process uses (None: all of the node's).
        devices_per_process: how many devices each process has, when the scheduler says before JAX
            starts (the node's GPUs shared among its tasks); None otherwise.
        count_var: the variable that gave `num_processes`, for messages.
    """

    scheduler: str
    num_processes: int
    process_id: int
    local_process_id: int
    processes_on_node: int
    coordinator: str
    local_device_ids: tuple[int, ...] | None
    devices_per_process: int | None
    count_var: str

    @property
    def processes_text(self) -> str:
        unit = ("task" if self.scheduler == "SLURM" else "rank") + ("s" if self.num_processes != 1 else "")
        return f"{self.num_processes} {unit} ({self.count_var}={self.num_processes})"


def detect_job(environ: Mapping[str, str]) -> ClusterJob | None:
    """The SLURM step or Open MPI job described by `environ`, or None when there is neither.

    Raises:
        ConfigError: a SLURM allocation outside a job step (the batch script itself, not `srun`),
            an Open MPI 5 job without mpi4py, or malformed variables.

    An Open MPI 5 job with mpi4py installed is left to JAX (None), as Cloud TPU is.
    """
    try:
        if "SLURM_JOB_ID" in environ and ("SLURM_STEP_NODELIST" in environ or "SLURM_NTASKS" in environ):
            return _slurm(environ)
        if "OMPI_COMM_WORLD_SIZE" in environ:
            return _open_mpi(environ)
    except (KeyError, ValueError) as e:
        raise ConfigError(
            f"--distributed-auto could not read the scheduler's environment ({type(e).__name__}: {e}). "
            "Start every process with the scheduler's launcher (srun, mpirun), or give --coordinator "
            "HOST:PORT --num-processes N --process-id I explicitly."
        ) from None
    return None


def find_job(
    mesh: MeshConfig | None, *, cpu_devices: int | None, environ: Mapping[str, str] = os.environ
) -> ClusterJob | None:
    """`--distributed-auto`: the SLURM / Open MPI job of this process, checked against `mesh`.

    None when there is no such job (JAX then detects Cloud TPU). Reads only the environment:
    call it before JAX starts.

    Arguments:
        mesh: the experiment's mesh (None: nothing to check, e.g. a benchmark).
        cpu_devices: `--cpu-devices`, the devices of each process when given.
        environ: the environment.

    Raises:
        ConfigError: the job cannot hold the mesh (`check_job`), or its variables cannot be read.
    """
    job = detect_job(environ)
    if job is not None and mesh is not None:
        check_job(job, mesh, devices_per_process=cpu_devices or job.devices_per_process)
    return job


def _slurm(env: Mapping[str, str]) -> ClusterJob:
    if "SLURM_STEP_NODELIST" not in env:
        tasks = env.get("SLURM_NTASKS", "?")
        raise ConfigError(
            f"--distributed-auto found a SLURM allocation of {tasks} task(s) (job {env['SLURM_JOB_ID']}) but "
            "this process is not one of its tasks: it runs in the batch script itself. Start the command "
            "with srun (`srun launch run --distributed-auto ...`; `launch slurm` writes such a script), "
            "which starts one process per task."
        )
    num = int(env["SLURM_NTASKS"])
    local = int(env.get("SLURM_LOCALID", "0"))
    on_node = tasks_on_node(
        env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", "1")), int(env.get("SLURM_NODEID", "0"))
    )
    port = env.get("JAX_COORDINATOR_PORT") or str(int(env["SLURM_JOB_ID"]) % 4096 + _PORT_BASE)
    gpus_text = env.get("SLURM_GPUS_ON_NODE", "")
    gpus = int(gpus_text) if gpus_text.isdigit() and int(gpus_text) > 0 else None
    return ClusterJob(
        scheduler="SLURM",
        num_processes=num,
        process_id=int(env["SLURM_PROCID"]),
        local_process_id=local,
        processes_on_node=on_node,
        coordinator=f"{first_host(env['SLURM_STEP_NODELIST'])}:{port}",
        local_device_ids=_share(local, on_node, gpus),
        devices_per_process=gpus // on_node if gpus is not None and gpus % on_node == 0 else None,
        count_var="SLURM_NTASKS",
    )


def _open_mpi(env: Mapping[str, str]) -> ClusterJob | None:
    uri = env.get("OMPI_MCA_orte_hnp_uri")
    if uri is None:
        # Open MPI 5 (PRRTE) publishes no launcher address: JAX asks MPI itself, through mpi4py.
        if importlib.util.find_spec("mpi4py") is not None:
            return None
        raise ConfigError(
            "--distributed-auto found an Open MPI 5 job (OMPI_COMM_WORLD_SIZE without OMPI_MCA_orte_hnp_uri), "
            "whose coordinator address only MPI itself can tell: install mpi4py in this environment "
            "(`uv pip install mpi4py`; JAX then reads it from MPI), or give --coordinator HOST:PORT "
            "--num-processes $OMPI_COMM_WORLD_SIZE --process-id $OMPI_COMM_WORLD_RANK."
        )
    # "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911;tcp6://[...]:43370": the launcher's addresses.
    match = re.search(r"tcp://([^,:;]+)", uri) or re.search(r"tcp6://\[([^,\]]+)", uri)
    if match is None:
        raise ValueError(f"no launcher address in OMPI_MCA_orte_hnp_uri={uri!r}")
    host = match.group(1)
    host = f"[{host}]" if ":" in host else host
    port = env.get("JAX_COORDINATOR_PORT") or str(int(uri.split(".", 1)[0]) // 4096 % 4096 + _PORT_BASE)
    local = int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"))
    on_node = int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1"))
    return ClusterJob(
        scheduler="Open MPI",
        num_processes=int(env["OMPI_COMM_WORLD_SIZE"]),
        process_id=int(env["OMPI_COMM_WORLD_RANK"]),
        local_process_id=local,
        processes_on_node=on_node,
        coordinator=f"{host}:{port}",
        local_device_ids=_share(local, on_node, None),
        devices_per_process=None,
        count_var="OMPI_COMM_WORLD_SIZE",
    )


def _share(local: int, on_node: int, node_devices: int | None) -> tuple[int, ...] | None:
    """The devices of the `local`-th of `on_node` processes on a node with `node_devices`."""
    if on_node == 1:
        return None
    if node_devices is None or node_devices % on_node:
        return (local,)
    k = node_devices // on_node
    return tuple(range(local * k, (local + 1) * k))


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list: "node[007-015,20],login1" -> "node007"."""
    head = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?", nodelist.strip())
    if head is None or (not head.group(1) and not head.group(2)):
        raise ValueError(f"cannot read the host list {nodelist!r}")
    prefix, ranges = head.group(1), head.group(2)
    return prefix if ranges is None else prefix + re.split(r"[,-]", ranges)[0]


def tasks_on_node(tasks_per_node: str, node_index: int) -> int:
    """This node's task count from SLURM's compressed list: "2(x3),1", node 3 -> 1."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            raise ValueError(f"cannot read the tasks per node {tasks_per_node!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[min(node_index, len(counts) - 1)]


def check_job(job: ClusterJob, mesh: MeshConfig, *, devices_per_process: int | None) -> None:
    """Refuse, before JAX starts, a job whose processes cannot hold the experiment's mesh.

    Arguments:
        job: the detected job.
        mesh: the experiment's mesh.
        devices_per_process: the devices each process will have, when known before JAX starts
            (`--cpu-devices`, or the node's GPUs shared among its tasks); None to check the
            process count alone.

    Raises:
        ConfigError: the numbers do not fit; the message names both and the fix.
    """
    unit = "tasks" if job.scheduler == "SLURM" else "ranks"
    fix = (
        "submit {n} tasks (sbatch --ntasks={n}; `launch slurm` writes the script for the experiment)"
        if job.scheduler == "SLURM"
        else "start {n} ranks (mpirun -np {n})"
    )
    check_layout(
        mesh,
        processes=job.num_processes,
        devices_per_process=devices_per_process,
        processes_text=job.processes_text,
        unit=unit,
        fix=fix,
    )
