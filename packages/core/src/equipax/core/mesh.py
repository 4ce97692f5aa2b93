"""Device meshes from Pax-style ICI x DCN shapes over the axes (data, fsdp, tensor).

Pipelined experiments add a leading `stage` axis: (stage, data, fsdp, tensor), Pax's pipeline
order (stage, replica, data, mdl); each `stage` slice of the mesh holds one pipeline stage's
layers (docs/pipeline.md). Expert parallelism adds an `expert` axis: (data, fsdp, expert, tensor)
(docs/moe.md); context parallelism a `context` axis: (data, fsdp, context, tensor), the sequence of
every activation split over it (docs/long_context.md).

`ici_mesh_shape` is the mesh within a slice (fast interconnect), `dcn_mesh_shape` across slices
or hosts (data-centre network); the device mesh is their elementwise product. Building the
config is pure; only `build_mesh` looks at devices.
"""

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from equipax.core.knobs import ConfigError
from equipax.core.mesh_config import (
    AXES,
    BATCH_AXES,
    CONTEXT,
    CONTEXT_AXES,
    DATA,
    EXPERT,
    EXPERT_AXES,
    FSDP,
    PIPELINE_AXES,
    STAGE,
    TENSOR,
    MeshConfig,
)

__all__ = [
    "AXES",
    "CONTEXT",
    "CONTEXT_AXES",
    "DATA",
    "EXPERT",
    "EXPERT_AXES",
    "FSDP",
    "TENSOR",
    "BATCH_AXES",
    "build_mesh",
    "check_device_count",
    "MeshConfig",
    "PIPELINE_AXES",
    "STAGE",
]


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
