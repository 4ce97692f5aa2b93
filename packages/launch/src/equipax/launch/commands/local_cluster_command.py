"""`launch local-cluster`: try a multi-host run as N processes on this machine."""

from typing import Annotated

import typer

from equipax.launch.commands.common import CpuDevicesOption, fail

__all__ = ["local_cluster"]


def local_cluster(
    command: Annotated[list[str] | None, typer.Argument(help="The command to run: -- run --exp NAME ...")] = None,
    processes: Annotated[int, typer.Option("--processes", "-n", help="How many processes (hosts).")] = 2,
    cpu_devices: CpuDevicesOption = None,
    grace_s: Annotated[float, typer.Option("--grace-s", help="Seconds stopped processes get before SIGKILL.")] = 20.0,
) -> None:
    """Run `launch run ...` as N processes on this machine: `launch local-cluster -n 2 -- run --exp X`."""
    from equipax.launch.cluster.local_cluster import run_local_cluster

    args = list(command or [])
    if args[:1] == ["--"]:
        args = args[1:]
    if args[:1] != ["run"]:
        fail("local-cluster runs a `run` command: launch local-cluster --processes 2 -- run --exp NAME ...")
    if processes < 1:
        fail(f"--processes must be >= 1; got {processes}.")
    code = run_local_cluster(
        processes, args, cpu_devices=cpu_devices, grace_s=grace_s, write=lambda line: print(line, flush=True)
    )
    raise typer.Exit(code)
