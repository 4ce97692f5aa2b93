"""`launch k8s`: a Kubernetes JobSet that runs an experiment on GKE TPU slices.

One replicated Job of `--slices` replicas, one Job per slice, each an Indexed Job of one pod per
TPU host. Every pod runs `launch run --distributed-auto`: JAX reads the slice's hosts and this
host's index from the variables GKE gives TPU pods (TPU_WORKER_HOSTNAMES, TPU_WORKER_ID), and for
several slices the manifest adds the multislice ones (MEGASCALE_NUM_SLICES, MEGASCALE_SLICE_ID from
the pod's Job index, MEGASCALE_COORDINATOR_ADDRESS from the JobSet's coordinator pod, slice 0 host 0).
The experiment's compiler flags (`train.compiler.xla_flags`, `train.compiler.libtpu_init_args`) are set as
XLA_FLAGS / LIBTPU_INIT_ARGS in every container.

Node selectors pick the node pools of the slice type and topology (`cloud.google.com/gke-tpu-
accelerator`, `cloud.google.com/gke-tpu-topology`), each pod asks for its host's chips
(`google.com/tpu`), and the exclusive-topology annotation keeps each slice's Job on one node pool.
A pod that stops on SIGTERM saves a checkpoint and exits 75: the pod failure policy fails its Job,
and the JobSet failure policy then recreates every Job (without counting against `maxRestarts`),
which resume from that checkpoint; other failures restart the JobSet up to `max_restarts` times.
"""

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

from equipax.core.knobs import ConfigError
from equipax.core.mesh_config import MeshConfig
from equipax.launch.cluster.shape import check_counts, run_command
from equipax.launch.hardware.compiler_flags import apply_compiler_flags
from equipax.launch.hardware.tpu import TPU_SLICES, TpuSlice, lookup_slice

__all__ = ["GKE_ACCELERATORS", "jobset_manifest", "REPLICATED_JOB", "TpuJobSet"]

# GKE's node label value for each TPU generation (cloud.google.com/gke-tpu-accelerator).
GKE_ACCELERATORS = {
    "v4": "tpu-v4-podslice",
    "v5e": "tpu-v5-lite-podslice",
    "v5p": "tpu-v5p-slice",
    "v6e": "tpu-v6e-slice",
}
REPLICATED_JOB = "slice"
CONTAINER = "train"
_PORTS = (8471, 8080, 8482)  # the TPU runtime, multislice (megascale), jax.distributed's coordinator
_DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


@dataclasses.dataclass(frozen=True)
class TpuJobSet:
    """The TPU slices a JobSet asks for and the options around it.

    Attributes:
        topology: the Cloud TPU slice type, e.g. "v5p-128" (`launch compile --topology` takes the same).
        slices: how many such slices (the DCN axis of the mesh).
        image: the container image with equipax installed (`launch` on its PATH).
        name: the JobSet's name (a DNS label); None: the experiment's name with `-` for `_`.
        max_restarts: JobSet restarts after failures other than a graceful stop (exit 75).
        grace_s: seconds between SIGTERM and SIGKILL for a pod (`terminationGracePeriodSeconds`):
            long enough to save a checkpoint.
        launcher: the command that runs `launch` in the container.
    """

    topology: str
    image: str
    slices: int = 1
    name: str | None = None
    max_restarts: int = 3
    grace_s: int = 120
    launcher: str = "launch"

    def __post_init__(self) -> None:
        check_counts(
            ("--slices", self.slices, 1), ("--max-restarts", self.max_restarts, 0), ("--grace-s", self.grace_s, 1)
        )
        if not self.image.strip():
            raise ConfigError("--image is empty: give the container image that has equipax installed.")

    @property
    def tpu(self) -> TpuSlice:
        return lookup_slice(self.topology)

    @property
    def chips_per_host(self) -> int:
        return min(math.prod(self.tpu.chips_per_host), self.tpu.chips)

    @property
    def hosts_per_slice(self) -> int:
        return self.tpu.chips // self.chips_per_host

    def check(self, mesh: MeshConfig) -> None:
        """Refuse slices that cannot hold `mesh` (one device per chip), naming both numbers and the fix.

        Raises:
            ConfigError: the ICI mesh does not fill a slice, or the DCN mesh is not the slice count.
        """
        tpu = self.tpu
        ici = math.prod(mesh.ici_mesh_shape)
        fits = tpu.chips == ici or (mesh.flexible and tpu.chips % -ici == 0)
        if not fits:
            same = [s.name for s in TPU_SLICES.values() if s.generation == tpu.generation and s.chips == abs(ici)]
            fix = f"use --topology {same[0]}, or " if same and not mesh.flexible else ""
            raise ConfigError(
                f"--topology {tpu.name} has {tpu.chips} chips ({tpu.topology}, one device each), but the experiment's "
                f"ici_mesh_shape={mesh.ici_mesh_shape} needs {'a multiple of ' if mesh.flexible else ''}{abs(ici)} "
                f"in each slice: {fix}change mesh.ici_mesh_shape (`launch show --exp NAME` prints it)."
            )
        if mesh.num_slices != self.slices:
            raise ConfigError(
                f"--slices {self.slices}, but the experiment's dcn_mesh_shape={mesh.dcn_mesh_shape} spans "
                f"{mesh.num_slices} slice(s): use --slices {mesh.num_slices}, or change mesh.dcn_mesh_shape."
            )


def jobset_manifest(
    job: TpuJobSet,
    *,
    exp: str,
    overrides: Sequence[str],
    job_log_dir: str,
    mesh: MeshConfig,
    xla_flags: str,
    libtpu_init_args: str,
) -> dict[str, Any]:
    """The JobSet for `exp` (with `overrides`) on `job`'s slices; `job.check(mesh)` first.

    Arguments:
        job: the slices and options.
        exp: the experiment, as `launch run --exp` takes it.
        overrides: `--set` overrides, in order.
        job_log_dir: the job directory: storage every host shares (a bucket or filestore mount).
        mesh: the experiment's mesh, after the overrides.
        xla_flags: the experiment's `train.compiler.xla_flags`.
        libtpu_init_args: the experiment's `train.compiler.libtpu_init_args`.

    Returns:
        The manifest, as the YAML/JSON object `kubectl apply -f` takes.

    Raises:
        ConfigError: the slices cannot hold the mesh, or the name is not a valid JobSet name.
    """
    job.check(mesh)
    name = job.name or exp.lower().replace("_", "-").replace(".", "-")
    _check_name(name, job.slices, job.hosts_per_slice)
    tpu = job.tpu
    command = run_command(job.launcher, exp=exp, overrides=overrides, job_log_dir=job_log_dir)
    env: list[dict[str, Any]] = [
        {"name": k, "value": v} for k, v in apply_compiler_flags(xla_flags, libtpu_init_args, environ={}).items()
    ]
    if job.slices > 1:
        env += [
            {"name": "MEGASCALE_NUM_SLICES", "value": str(job.slices)},
            {"name": "MEGASCALE_SLICE_ID", "valueFrom": _field("labels", "jobset.sigs.k8s.io/job-index")},
            {
                "name": "MEGASCALE_COORDINATOR_ADDRESS",
                "valueFrom": _field("annotations", "jobset.sigs.k8s.io/coordinator"),
            },
        ]
    chips = str(job.chips_per_host)
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": job.image,
        "command": command,
        "env": env,
        "ports": [{"containerPort": p} for p in _PORTS],
        "resources": {"limits": {"google.com/tpu": chips}, "requests": {"google.com/tpu": chips}},
    }
    pod = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": job.grace_s,
        "nodeSelector": {
            "cloud.google.com/gke-tpu-accelerator": GKE_ACCELERATORS[tpu.generation],
            "cloud.google.com/gke-tpu-topology": tpu.topology.split(":", 1)[1],
        },
        "containers": [container],
    }
    hosts = job.hosts_per_slice
    slice_job = {
        "parallelism": hosts,
        "completions": hosts,
        "completionMode": "Indexed",
        "backoffLimit": 0,
        # A graceful stop (exit 75) or a node taken away fails the Job at once, for the JobSet to recreate.
        "podFailurePolicy": {
            "rules": [
                {"action": "FailJob", "onExitCodes": {"containerName": CONTAINER, "operator": "In", "values": [75]}},
                {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            ]
        },
        "template": {"spec": pod},
    }
    shape = "x".join(str(n) for n in mesh.shape)
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {
            "name": name,
            "labels": {"app.kubernetes.io/name": "equipax", "app.kubernetes.io/component": "train"},
            "annotations": {
                "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool",
                "equipax/experiment": exp,
                "equipax/mesh": f"{shape} = {job.slices} x {tpu.name} ({hosts} hosts x {chips} chips each)",
            },
        },
        "spec": {
            "failurePolicy": {
                "maxRestarts": job.max_restarts,
                "rules": [
                    {
                        "name": "resumeAfterGracefulStop",
                        "action": "RestartJobSetAndIgnoreMaxRestarts",
                        "onJobFailureReasons": ["PodFailurePolicy"],
                    }
                ],
            },
            "network": {"enableDNSHostnames": True},
            "coordinator": {"replicatedJob": REPLICATED_JOB, "jobIndex": 0, "podIndex": 0},
            "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": job.slices, "template": {"spec": slice_job}}],
        },
    }


def _field(kind: str, key: str) -> dict[str, Any]:
    return {"fieldRef": {"fieldPath": f"metadata.{kind}['{key}']"}}


def _check_name(name: str, slices: int, hosts: int) -> None:
    # The JobSet controller names Jobs <name>-<replicatedJob>-<job index> and pods
    # <job>-<pod index>-<5 random characters>; each must be a DNS label of at most 63 characters.
    longest = f"{name}-{REPLICATED_JOB}-{slices - 1}-{hosts - 1}-abcde"
    if not _DNS_LABEL.fullmatch(name) or len(longest) > 63:
        raise ConfigError(
            f"The JobSet name {name!r} is not usable: it must be lowercase letters, digits and '-', start with a "
            f"letter, and be short enough that its pods' names ({longest!r}: {len(longest)} characters) stay within "
            "63. Give --name NAME."
        )
