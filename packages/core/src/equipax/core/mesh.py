"""Device meshes from Pax-style ICI x DCN shapes over the axes (data, fsdp, tensor).

Pipelined experiments add a leading `stage` axis: (stage, data, fsdp, tensor), Pax's pipeline
order (stage, replica, data, mdl); each `stage` slice of the mesh holds one pipeline stage's
layers (docs/pipeline.md).

`ici_mesh_shape` is the mesh within a slice (fast interconnect), `dcn_mesh_shape` across slices
or hosts (data-centre network); the device mesh is their elementwise product. Building the
config is pure; only `build_mesh` looks at devices.
"""

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from equipax.core.config import ConfigError

__all__ = [
    "AXES",
    "DATA",
    "FSDP",
    "TENSOR",
    "BATCH_AXES",
    "build_mesh",
    "check_device_count",
    "MeshConfig",
    "PIPELINE_AXES",
    "STAGE",
]

# Axis vocabulary (docs/sharding.md). Pax: replica -> data, data -> fsdp, mdl -> tensor.
DATA = "data"
FSDP = "fsdp"
TENSOR = "tensor"
AXES = (DATA, FSDP, TENSOR)
# Pipeline parallelism (Pax's `stage`): layers split into consecutive stages along this axis.
STAGE = "stage"
PIPELINE_AXES = (STAGE, DATA, FSDP, TENSOR)
# Axes the batch is split over. As in Pax, a pipelined mesh also splits the batch over `stage`
# outside the pipeline (embedding, logits); `stage` comes last so that each microbatch keeps an
# even share on every (data, fsdp) device (equipax.core.nn.pipeline). Absent axes count 1.
BATCH_AXES = (DATA, FSDP, STAGE)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """The device mesh of an experiment.

    ici_mesh_shape: devices per slice along `axis_names`. One entry may be -1 (as
        MaxText's `ici_*_parallelism=-1`): that axis takes all devices the others leave, fixed
        when the run starts (`fit`); until then it counts as 1.
    dcn_mesh_shape: slices (or hosts, on GPU clusters) along the same axes.
    axis_names: (data, fsdp, tensor), or `PIPELINE_AXES` (stage, data, fsdp, tensor) for a
        pipelined model (`model.transformer.pipeline_stages` > 1).
    """

    ici_mesh_shape: tuple[int, ...] = (1, 1, 1)
    dcn_mesh_shape: tuple[int, ...] = (1, 1, 1)
    axis_names: tuple[str, ...] = AXES

    def __post_init__(self) -> None:
        n = len(self.axis_names)
        for name in ("ici_mesh_shape", "dcn_mesh_shape"):
            shape = getattr(self, name)
            if len(shape) != n:
                raise ValueError(
                    f"mesh.{name}={shape} has {len(shape)} entries but mesh.axis_names="
                    f"{self.axis_names} has {n}; give one size per axis."
                )
            if any(s < 1 for s in shape) and (name == "dcn_mesh_shape" or any(s < -1 or s == 0 for s in shape)
                                              or list(shape).count(-1) > 1):
                raise ValueError(f"mesh.{name}={shape}: every size must be >= 1"
                                 + (" (or one -1: all devices left)." if name == "ici_mesh_shape" else "."))
        if len(set(self.axis_names)) != n:
            raise ValueError(f"mesh.axis_names={self.axis_names} repeats a name.")

    @property
    def shape(self) -> tuple[int, ...]:
        """The device mesh shape (ICI x DCN, elementwise; an unfitted -1 counts as 1)."""
        return tuple(max(i, 1) * d for i, d in zip(self.ici_mesh_shape, self.dcn_mesh_shape))

    @property
    def flexible(self) -> bool:
        """True while an ICI axis is -1 (sized by `fit` from the devices present)."""
        return -1 in self.ici_mesh_shape

    def fit(self, num_devices: int) -> "MeshConfig":
        """This mesh with its -1 axis sized to use `num_devices` devices (unchanged if none is -1).

        Raises:
            ConfigError: the fixed axes do not divide `num_devices`.
        """
        if not self.flexible:
            return self
        fixed = math.prod(self.shape)
        if num_devices % fixed:
            raise ConfigError(
                f"mesh.ici_mesh_shape={self.ici_mesh_shape} x dcn_mesh_shape={self.dcn_mesh_shape} needs a "
                f"multiple of {fixed} devices for its -1 axis; {num_devices} are available.")
        ici = tuple(num_devices // fixed if s == -1 else s for s in self.ici_mesh_shape)
        return dataclasses.replace(self, ici_mesh_shape=ici)

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)

    @property
    def num_slices(self) -> int:
        return math.prod(self.dcn_mesh_shape)

    def axis_size(self, *names: str) -> int:
        """Product of the sizes of the named axes (missing names count 1)."""
        sizes = dict(zip(self.axis_names, self.shape))
        return math.prod(sizes.get(n, 1) for n in names)

    @property
    def batch_parallelism(self) -> int:
        """How many ways the global batch is split (data x fsdp, x stage when pipelined)."""
        return self.axis_size(*BATCH_AXES)

    @property
    def num_stages(self) -> int:
        """Size of the `stage` axis (1 when the mesh has none)."""
        return self.axis_size(STAGE)


def check_device_count(cfg: MeshConfig, num_devices: int, *, hint: str = "") -> None:
    """Raise ConfigError unless the mesh uses exactly `num_devices` devices."""
    if cfg.num_devices != num_devices:
        raise ConfigError(
            f"The mesh needs {cfg.num_devices} devices (ici_mesh_shape={cfg.ici_mesh_shape} x "
            f"dcn_mesh_shape={cfg.dcn_mesh_shape} over {cfg.axis_names}) but {num_devices} "
            f"are available. Either give this job {cfg.num_devices} devices, or change the mesh to "
            f"use {num_devices}: the product of all entries of mesh.ici_mesh_shape and "
            f"mesh.dcn_mesh_shape is the device count (one -1 entry takes whatever is present){hint}."
        )


def build_mesh(cfg: MeshConfig, devices: Sequence[Any] | None = None) -> Mesh:
    """Build the device mesh.

    Multi-slice TPUs (devices with `slice_index`) get a hybrid ICI x DCN mesh from
    `mesh_utils.create_hybrid_device_mesh`; TPU/GPU single slices get a topology-aware
    `create_device_mesh`; CPUs are reshaped in (process, id) order, so DCN axes run across
    processes. Axis types are set explicitly to Auto (GSPMD propagation).

    Arguments:
        cfg: the mesh config.
        devices: devices to use (default: all of `jax.devices()`).

    Returns:
        A `jax.sharding.Mesh` with `cfg.axis_names`.
    """
    devices = list(jax.devices() if devices is None else devices)
    check_device_count(cfg, len(devices))
    axis_types = (AxisType.Auto,) * len(cfg.axis_names)
    platform = devices[0].platform
    if platform == "cpu" or len(devices) == 1:
        ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
        # DCN outermost: device index = dcn block * ici size + position in the block.
        dev_array = _cpu_hybrid(np.array(ordered, dtype=object), cfg)
    elif hasattr(devices[0], "slice_index") and cfg.num_slices > 1:
        dev_array = mesh_utils.create_hybrid_device_mesh(
            cfg.ici_mesh_shape, cfg.dcn_mesh_shape, devices, allow_split_physical_axes=True
        )
    elif cfg.num_slices > 1:
        # GPU clusters: one DCN block per process group, processes in order.
        ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
        dev_array = _cpu_hybrid(np.array(ordered, dtype=object), cfg)
    else:
        dev_array = mesh_utils.create_device_mesh(cfg.shape, devices, allow_split_physical_axes=True)
    return Mesh(dev_array, cfg.axis_names, axis_types=axis_types)


def _cpu_hybrid(flat: np.ndarray, cfg: MeshConfig) -> np.ndarray:
    """Arrange devices so each DCN block holds consecutive devices (one host or slice)."""
    n = len(cfg.axis_names)
    # [dcn..., ici...] then interleave to [dcn0, ici0, dcn1, ici1, ...] and merge pairs.
    arr = flat.reshape(*cfg.dcn_mesh_shape, *cfg.ici_mesh_shape)
    order = [i for pair in zip(range(n), range(n, 2 * n)) for i in pair]
    return arr.transpose(order).reshape(cfg.shape)
