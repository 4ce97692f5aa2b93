"""`launch slurm`: print or write the sbatch script that runs an experiment on a SLURM cluster."""

from pathlib import Path
from typing import Annotated

import typer

from equipax.core.knobs import ConfigError
from equipax.launch.commands.common import ExpOption, SetOption, command_line, emit, fail, resolve_train

__all__ = ["slurm_cmd"]


def slurm_cmd(
    exp: ExpOption,
    nodes: Annotated[int, typer.Option("--nodes", "-N", help="Nodes to allocate.")] = 1,
    gpus_per_node: Annotated[int, typer.Option("--gpus-per-node", help="GPUs on each node.")] = 0,
    tasks_per_node: Annotated[
        int, typer.Option("--tasks-per-node", help="Processes per node: 1 = all of a node's GPUs in one process.")
    ] = 1,
    cpu_devices: Annotated[
        int | None, typer.Option("--cpu-devices", help="Simulated CPU devices per task instead of GPUs.")
    ] = None,
    set_: SetOption = None,
    job_log_dir: Annotated[
        str | None,
        typer.Option("--job-log-dir", help="Job directory on storage all nodes share (default: runs/<exp>)."),
    ] = None,
    partition: Annotated[str | None, typer.Option("--partition", "-p", help="sbatch --partition.")] = None,
    account: Annotated[str | None, typer.Option("--account", "-A", help="sbatch --account.")] = None,
    time: Annotated[str | None, typer.Option("--time", "-t", help="sbatch --time, e.g. 24:00:00.")] = None,
    grace_s: Annotated[
        int,
        typer.Option("--grace-s", help="Seconds before the time limit that SLURM sends SIGTERM (save and requeue)."),
    ] = 120,
    setup: Annotated[
        list[str] | None,
        typer.Option("--setup", help="A shell line to run before srun (repeatable), e.g. 'source .venv/bin/activate'."),
    ] = None,
    launcher: Annotated[
        str, typer.Option("--launcher", help="The command that runs `launch` on the nodes.")
    ] = "launch",
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write the script to this file instead of printing it.")
    ] = None,
) -> None:
    """Print an sbatch script for an experiment: `launch slurm --exp NAME --nodes N --gpus-per-node G`."""
    given = dict(locals())
    from equipax.launch.cluster.slurm import SlurmJob, sbatch_script

    _, cfg, _ = resolve_train(exp, set_, for_what="to run on SLURM")
    try:
        job = SlurmJob(
            nodes=nodes,
            gpus_per_node=gpus_per_node,
            tasks_per_node=tasks_per_node,
            cpu_devices=cpu_devices,
            partition=partition,
            account=account,
            time=time,
            grace_s=grace_s,
            setup=tuple(setup or ()),
            launcher=launcher,
        )
        script = sbatch_script(
            job,
            exp=exp,
            overrides=list(set_ or []),
            job_log_dir=job_log_dir or f"runs/{cfg.name}",
            mesh=cfg.mesh,
            made_by=command_line("slurm", slurm_cmd, given),
        )
    except ConfigError as e:
        fail(str(e))
    emit(script, output, then="submit it with `sbatch {path}`", mode=0o755)
