"""`launch slurm`: the sbatch script that runs an experiment on its real mesh.

The script asks for the nodes, tasks and GPUs the experiment's mesh needs (checked here, before
anything is submitted), starts one `launch run --distributed-auto` per task with `srun` (each
process reads its rank and the coordinator from SLURM's environment: `cluster.detect`), and turns
a graceful stop into a requeue: `launch run` exits 75 after saving a checkpoint when it receives
SIGTERM (`scancel --signal=TERM`, the `--signal=TERM@GRACE` warning before the time limit, a
preemption), the script then calls `scontrol requeue`, and the requeued job resumes from that
checkpoint, because it runs the same command in the same job directory.
"""

import dataclasses
import shlex
from collections.abc import Sequence

from equipax.core.knobs import ConfigError
from equipax.core.mesh_config import MeshConfig
from equipax.launch.cluster.shape import check_counts, check_layout, run_command

__all__ = ["sbatch_script", "SlurmJob"]


@dataclasses.dataclass(frozen=True)
class SlurmJob:
    """The shape of a SLURM job and the sbatch options around it.

    Attributes:
        nodes: nodes to allocate (`--nodes`).
        gpus_per_node: GPUs on each node (`--gpus-per-node`); 0 with `cpu_devices`.
        tasks_per_node: processes per node (`--ntasks-per-node`): 1 gives each process all of its
            node's GPUs; `gpus_per_node` gives one GPU each.
        cpu_devices: simulated CPU devices per task instead of GPUs (trying a job on CPU nodes).
        partition: `--partition`, or None for the cluster's default.
        account: `--account`, or None.
        time: `--time` (e.g. "24:00:00"), or None for the partition's limit.
        grace_s: seconds between SLURM's SIGTERM and the time limit (`--signal=TERM@GRACE`): long
            enough to save a checkpoint.
        setup: shell lines run before `srun` (module loads, activating the environment).
        launcher: the command that runs `launch` on the nodes.
    """

    nodes: int
    gpus_per_node: int = 0
    tasks_per_node: int = 1
    cpu_devices: int | None = None
    partition: str | None = None
    account: str | None = None
    time: str | None = None
    grace_s: int = 120
    setup: tuple[str, ...] = ()
    launcher: str = "launch"

    def __post_init__(self) -> None:
        check_counts(
            ("--nodes", self.nodes, 1),
            ("--tasks-per-node", self.tasks_per_node, 1),
            ("--gpus-per-node", self.gpus_per_node, 0),
            ("--grace-s", self.grace_s, 1),
        )
        if self.cpu_devices is not None:
            if self.cpu_devices < 1:
                raise ConfigError(f"--cpu-devices must be >= 1; got {self.cpu_devices}.")
            if self.gpus_per_node:
                raise ConfigError(
                    f"--cpu-devices {self.cpu_devices} and --gpus-per-node {self.gpus_per_node} both give the "
                    "devices of a task: use --gpus-per-node on GPU nodes, --cpu-devices to simulate devices."
                )
        elif not self.gpus_per_node:
            raise ConfigError(
                "Give the devices of each node: --gpus-per-node G (GPU nodes), or --cpu-devices N (N simulated "
                "CPU devices per task)."
            )
        elif self.gpus_per_node % self.tasks_per_node:
            raise ConfigError(
                f"--gpus-per-node {self.gpus_per_node} does not split evenly into --tasks-per-node "
                f"{self.tasks_per_node}: use --tasks-per-node 1 (one process per node, all its GPUs) or "
                f"{self.gpus_per_node} (one process per GPU)."
            )

    @property
    def processes(self) -> int:
        return self.nodes * self.tasks_per_node

    @property
    def devices_per_task(self) -> int:
        return self.cpu_devices if self.cpu_devices is not None else self.gpus_per_node // self.tasks_per_node

    def check(self, mesh: MeshConfig) -> None:
        """Refuse a job shape that cannot hold `mesh`, naming both numbers and the fix.

        Raises:
            ConfigError: the devices or the DCN blocks do not fit.
        """
        per_node = self.tasks_per_node * self.devices_per_task
        total = self.nodes * per_node
        what = "CPU devices" if self.cpu_devices is not None else "GPUs"
        if total != mesh.num_devices and not (mesh.flexible and total % mesh.num_devices == 0):
            need = f"a multiple of {mesh.num_devices}" if mesh.flexible else str(mesh.num_devices)
            fix = (
                f"use --nodes {mesh.num_devices // per_node}, or "
                if not mesh.flexible and mesh.num_devices % per_node == 0
                else ""
            )
            raise ConfigError(
                f"--nodes {self.nodes} x {per_node} {what} per node = {total} devices, but the experiment's mesh "
                f"(ici_mesh_shape={mesh.ici_mesh_shape} x dcn_mesh_shape={mesh.dcn_mesh_shape}) needs {need}: "
                f"{fix}change the mesh (--set mesh.ici_mesh_shape=... / mesh.dcn_mesh_shape=...)."
            )
        check_layout(
            mesh,
            processes=self.processes,
            devices_per_process=None,
            processes_text=f"{self.processes} tasks (--nodes {self.nodes} x --tasks-per-node {self.tasks_per_node})",
            unit="tasks",
        )


def sbatch_script(
    job: SlurmJob, *, exp: str, overrides: Sequence[str], job_log_dir: str, mesh: MeshConfig, made_by: str = ""
) -> str:
    """The sbatch script for `exp` (with `overrides`) on `job`; `job.check(mesh)` first.

    Arguments:
        job: the job's shape and options.
        exp: the experiment, as `launch run --exp` takes it.
        overrides: `--set` overrides, in order.
        job_log_dir: the job directory (relative paths are from the directory sbatch is run in).
        mesh: the experiment's mesh, after the overrides.
        made_by: the command that wrote the script, for its first comment.

    Returns:
        The script's text.

    Raises:
        ConfigError: the job cannot hold the mesh.
    """
    job.check(mesh)
    run = run_command(job.launcher, exp=exp, overrides=overrides, job_log_dir=job_log_dir)
    if job.cpu_devices is not None:
        run += ["--cpu-devices", str(job.cpu_devices)]
    unit = "CPU device" if job.cpu_devices is not None else "GPU"
    shape = "x".join(str(n) for n in mesh.shape)
    options = [
        f"--job-name={exp}",
        f"--nodes={job.nodes}",
        f"--ntasks-per-node={job.tasks_per_node}",
        *([f"--gpus-per-node={job.gpus_per_node}"] if job.gpus_per_node else []),
        *([f"--partition={job.partition}"] if job.partition else []),
        *([f"--account={job.account}"] if job.account else []),
        *([f"--time={job.time}"] if job.time else []),
        "--exclusive",
        "--requeue",
        f"--signal=TERM@{job.grace_s}",
        "--open-mode=append",
        "--output=%x-%j.out",
    ]
    lines = [
        "#!/bin/bash",
        f"# Written by `{made_by or 'launch slurm'}`; submit it with `sbatch FILE`.",
        f"# {exp}: {_count(job.nodes, 'node')} x {_count(job.tasks_per_node, 'task')} x "
        f"{_count(job.devices_per_task, unit)} "
        f"= {job.processes * job.devices_per_task} devices, mesh {shape} (ici_mesh_shape={mesh.ici_mesh_shape} x "
        f"dcn_mesh_shape={mesh.dcn_mesh_shape}).",
        f"# On SIGTERM (scancel --signal=TERM, {job.grace_s} s before the time limit, a preemption) `launch run` saves",
        "# a checkpoint and exits 75; the job is then requeued and resumes from that checkpoint.",
        *[f"#SBATCH {o}" for o in options],
        "",
        *job.setup,
        # srun waits for every task (no --kill-on-bad-exit): stopping processes save together.
        shlex.join(["srun", *run]),
        "code=$?",
        'if [ "$code" -eq 75 ]; then',
        '    echo "launch run saved a checkpoint and stopped (exit 75): requeueing job $SLURM_JOB_ID to resume"',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "    exit 0",
        "fi",
        'exit "$code"',
    ]
    return "\n".join(lines) + "\n"


def _count(n: int, unit: str) -> str:
    return f"{n} {unit}{'s' if n != 1 else ''}"
