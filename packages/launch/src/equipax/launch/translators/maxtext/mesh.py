"""MaxText's parallelism keys <-> equipax's mesh and pipeline knobs (`{ici,dcn}_X_parallelism`,
`num_slices`, the pipeline microbatches and repeats) and the per-device batch over that mesh."""

import math
from collections.abc import Mapping
from typing import Any

from equipax.launch.translators.maxtext.values import (
    MAXTEXT_MESH_AXES,
    MESH_AXES,
    OTHER_AXES,
    TRANSFORMER,
    Skip,
    Values,
    batch_size,
)

__all__ = [
    "mesh_to_equipax",
    "mesh_to_maxtext",
    "per_device_batch_to_maxtext",
    "per_device_batch_to_equipax",
    "pipeline_stages",
    "pipeline_to_equipax",
    "pipeline_to_maxtext",
]


def _slices(v: Values) -> int:
    n = int(v.get("num_slices"))
    if n < 1:
        v.notes.append("num_slices=-1 (MaxText: the slices present): one slice assumed; give num_slices=N.")
        return 1
    return n


def mesh_to_equipax(v: Values) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for where in ("ici", "dcn"):
        for axis in (
            *OTHER_AXES,
            *(a for a in ("expert", "pipeline", "context") if a not in map(MAXTEXT_MESH_AXES.get, v.axes)),
        ):
            key = f"{where}_{axis}_parallelism"
            if v.given.get(key, 1) != 1:
                v.skipped[key] = (
                    f"{v.given[key]}: the mesh axes here are {', '.join(v.axes)} (docs/maxtext.md, "
                    f"'The table'); no {axis} axis"
                )
    keys = {w: [f"{w}_{MAXTEXT_MESH_AXES[a]}_parallelism" for a in v.axes] for w in ("ici", "dcn")}
    if not v.has(*keys["ici"], *keys["dcn"]):
        return out
    ici_default = {"fsdp": -1}  # base.yml: fsdp takes the devices of a slice, data the slices
    ici = tuple(int(v.given.get(k, ici_default.get(a, 1))) for k, a in zip(keys["ici"], v.axes))
    dcn = [int(v.given.get(k, -1 if a == "data" else 1)) for k, a in zip(keys["dcn"], v.axes)]
    if -1 in dcn:
        rest = math.prod(s for s in dcn if s != -1)
        slices = _slices(v)
        if slices % rest:
            raise ValueError(f"num_slices={slices} is not a multiple of the other DCN axes' {rest}")
        dcn[dcn.index(-1)] = slices // rest
    out["mesh.ici_mesh_shape"] = ici
    out["mesh.dcn_mesh_shape"] = tuple(dcn)
    if v.axes != MESH_AXES:
        out["mesh.axis_names"] = v.axes
    return out


def mesh_to_maxtext(k: Mapping[str, Any]) -> dict[str, Any]:
    axes = k.get("mesh.axis_names", MESH_AXES)
    out: dict[str, Any] = {}
    for where in ("ici", "dcn"):
        sizes = dict(zip(axes, k[f"mesh.{where}_mesh_shape"]))
        for axis, name in MAXTEXT_MESH_AXES.items():
            out[f"{where}_{name}_parallelism"] = sizes.get(axis, 1)
    out["num_slices"] = math.prod(k["mesh.dcn_mesh_shape"])  # MaxText checks the DCN axes against it
    return out


def pipeline_stages(v: Values) -> int:
    """Pipeline stages of a MaxText config: its ICI x DCN `pipeline` parallelism."""
    return int(v.given.get("ici_pipeline_parallelism", 1)) * int(v.given.get("dcn_pipeline_parallelism", 1))


def pipeline_to_equipax(v: Values) -> dict[str, Any]:
    stages = pipeline_stages(v)
    if stages == 1 or "stage" not in v.axes:
        return {}
    layers = int(v.get("base_num_decoder_layers"))
    repeats = int(v.given.get("num_pipeline_repeats", -1))
    if repeats <= 0:  # MaxText: num_layers_per_pipeline_stage (default 1) layers per stage and repeat
        repeats = max(1, layers // (stages * int(v.given.get("num_layers_per_pipeline_stage", 1))))
    micro = int(v.given.get("num_pipeline_microbatches", -1))
    return {
        TRANSFORMER + "pipeline_stages": stages,
        TRANSFORMER + "pipeline_schedule": "circular" if repeats > 1 else "gpipe",
        TRANSFORMER + "pipeline_repeats": repeats,
        TRANSFORMER + "pipeline_microbatches": micro if micro > 0 else stages,  # MaxText: one per stage
        TRANSFORMER + "pipeline_microbatch_size": None,
    }


def pipeline_to_maxtext(k: Mapping[str, Any]) -> dict[str, Any]:
    stages = k[TRANSFORMER + "pipeline_stages"]
    if stages == 1:
        return {}
    repeats = k[TRANSFORMER + "pipeline_repeats"]
    micro = k[TRANSFORMER + "pipeline_microbatches"]
    size = k[TRANSFORMER + "pipeline_microbatch_size"]
    if micro is None and size is not None:  # MaxText counts microbatches: the global batch / size
        per_device = k["data.per_device_batch"]
        devices = math.prod((*k["mesh.ici_mesh_shape"], *k["mesh.dcn_mesh_shape"]))
        micro = (k["data.batch_size"] if per_device is None else per_device * devices) // size
    return {
        "num_pipeline_repeats": repeats,
        "num_layers_per_pipeline_stage": k[TRANSFORMER + "num_layers"] // (stages * repeats),
        "num_pipeline_microbatches": micro,
    }


def _devices(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def per_device_batch_to_equipax(v: Values) -> dict[str, Any]:
    """MaxText's per_device_batch_size: whole examples per device (`data.per_device_batch`), or a
    fraction below 1 (MaxText's own docs allow 0 < x < 1, e.g. 0.25: one sequence per 4 devices,
    with context parallelism), read as the global `data.batch_size` over the config's mesh."""
    value = v.given["per_device_batch_size"]
    try:
        fraction = float(value)
    except (TypeError, ValueError):
        fraction = None
    if fraction is None or not 0 < fraction < 1:
        return {"data.per_device_batch": batch_size(value)}
    mesh = mesh_to_equipax(v)
    shape = (*mesh.get("mesh.ici_mesh_shape", (-1,)), *mesh.get("mesh.dcn_mesh_shape", (1,)))
    if min(shape) < 1:
        raise Skip(
            f"per_device_batch_size={value}: a fraction of a batch per device needs the device count; "
            "give every ici_*_parallelism (none -1)"
        )
    batch = fraction * _devices(shape)
    if batch != int(batch) or batch < 1:
        raise Skip(f"per_device_batch_size={value} over {_devices(shape)} devices is not a whole number of examples")
    return {"data.per_device_batch": None, "data.batch_size": int(batch)}


def per_device_batch_to_maxtext(k: Mapping[str, Any]) -> dict[str, Any]:
    if k["data.per_device_batch"] is not None:
        return {"per_device_batch_size": k["data.per_device_batch"]}
    devices = _devices((*k["mesh.ici_mesh_shape"], *k["mesh.dcn_mesh_shape"]))
    batch = k["data.batch_size"]
    if devices < 1 or batch < 1 or (batch % devices and (batch / devices) * devices != batch):
        raise Skip(f"data.batch_size={batch} over this mesh: give data.per_device_batch")
    if batch % devices:  # fewer examples than devices (context parallelism): MaxText takes a fraction
        return {"per_device_batch_size": batch / devices}
    return {"per_device_batch_size": batch // devices}
