"""`launch k8s`: print or write the Kubernetes JobSet that runs an experiment on GKE TPU slices."""

from pathlib import Path
from typing import Annotated

import typer

from equipax.core.knobs import ConfigError
from equipax.launch.commands.common import ExpOption, SetOption, command_line, emit, fail, resolve_train

__all__ = ["k8s_cmd"]


def k8s_cmd(
    exp: ExpOption,
    topology: Annotated[str, typer.Option("--topology", help="The TPU slice type, e.g. v5p-128 or v5e-256.")],
    image: Annotated[str, typer.Option("--image", help="The container image with equipax installed.")],
    slices: Annotated[int, typer.Option("--slices", help="How many slices (the mesh's DCN axis).")] = 1,
    set_: SetOption = None,
    job_log_dir: Annotated[
        str | None,
        typer.Option("--job-log-dir", help="Job directory on storage every host shares (default: runs/<exp>)."),
    ] = None,
    name: Annotated[
        str | None, typer.Option("--name", help="The JobSet's name (default: from the experiment).")
    ] = None,
    max_restarts: Annotated[
        int, typer.Option("--max-restarts", help="JobSet restarts after failures (a graceful stop never counts).")
    ] = 3,
    grace_s: Annotated[int, typer.Option("--grace-s", help="Seconds a pod gets between SIGTERM and SIGKILL.")] = 120,
    launcher: Annotated[
        str, typer.Option("--launcher", help="The command that runs `launch` in the container.")
    ] = "launch",
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write the manifest to this file instead of printing it.")
    ] = None,
) -> None:
    """Print a JobSet for GKE TPU slices: `launch k8s --exp NAME --topology v5p-128 --slices 2 --image IMAGE`."""
    given = dict(locals())
    import yaml

    from equipax.launch.cluster.jobset import TpuJobSet, jobset_manifest

    _, cfg, _ = resolve_train(exp, set_, for_what="to run on Kubernetes")
    try:
        job = TpuJobSet(
            topology=topology,
            image=image,
            slices=slices,
            name=name,
            max_restarts=max_restarts,
            grace_s=grace_s,
            launcher=launcher,
        )
        manifest = jobset_manifest(
            job,
            exp=exp,
            overrides=list(set_ or []),
            job_log_dir=job_log_dir or f"runs/{cfg.name}",
            mesh=cfg.mesh,
            xla_flags=cfg.train.compiler.xla_flags,
            libtpu_init_args=cfg.train.compiler.libtpu_init_args,
        )
    except ConfigError as e:
        fail(str(e))
    text = (
        f"# Written by `{command_line('k8s', k8s_cmd, given)}`; start it with `kubectl apply -f FILE`.\n"
        + yaml.safe_dump(manifest, sort_keys=False, width=1000)
    )
    emit(text, output, then="start it with `kubectl apply -f {path}` (the JobSet controller installed)")
