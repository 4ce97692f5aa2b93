"""`launch compile --compare-context`: the experiment's step compiled again without context
parallelism, so the report shows what the `context` axis saves per device.

The program without context parallelism runs on the same devices with the same global batch: the
`context` axis is folded into `fsdp` (the mesh (data, fsdp x context, tensor)), so each device
holds the same number of tokens, as whole sequences instead of a 1/N share of each. Where the
experiment has fewer sequences than that mesh's data x fsdp devices (one sequence split over a
context group, e.g. `llama3_1_8b_32k`'s 16 sequences on 64 chips), no program without context
parallelism holds so few tokens per device: the folded batch rises to the next multiple of
data x fsdp (one whole sequence per device), and the report says so (`global_batch`,
`tokens_per_device` of both programs). What changes
is attention (each device attends its whole sequences: `[S, S]` logits per head instead of the
context kernel's blocks) and the weights' split (no weight is split over `context`, so the folded
mesh splits them N times finer: the report shows both programs' parameter bytes).
"""

import dataclasses
from typing import Any

from equipax.core.knobs import ConfigError
from equipax.core.mesh_config import AXES, CONTEXT, FSDP, MeshConfig
from equipax.launch.configs.experiment import ExperimentConfig

__all__ = ["comparison_section", "comparison_lines", "context_size", "fold_context"]


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**28 else f"{n / 2**20:.1f} MiB"


def context_size(cfg: ExperimentConfig) -> int:
    """The size of the experiment's `context` mesh axis (1 without one)."""
    return cfg.mesh.axis_size(CONTEXT)


def fold_context(cfg: ExperimentConfig) -> ExperimentConfig:
    """`cfg` on the same devices with its `context` axis folded into `fsdp`: mesh axes (data, fsdp,
    tensor), ICI and DCN alike, the global batch unchanged (`data.per_device_batch` counts devices)
    where the folded mesh splits it, else raised to the next multiple of its data x fsdp devices
    (`data.batch_size`: whole sequences per device, the least a program without the axis holds).

    Raises:
        ConfigError: the folded experiment is invalid (e.g. a `data.batch_size` the larger fsdp axis
            does not divide).
    """
    mesh = cfg.mesh
    names = mesh.axis_names

    def fold(shape: tuple[int, ...]) -> tuple[int, ...]:
        size = dict(zip(names, shape))
        return tuple(size[FSDP] * size[CONTEXT] if axis == FSDP else size.get(axis, 1) for axis in AXES)

    folded = MeshConfig(
        ici_mesh_shape=fold(mesh.ici_mesh_shape),
        dcn_mesh_shape=fold(mesh.dcn_mesh_shape),
        axis_names=AXES,
        logical_axis_rules=mesh.logical_axis_rules,
    )
    data = cfg.data
    split = folded.batch_parallelism
    if cfg.global_batch_size % split:
        data = dataclasses.replace(data, per_device_batch=None, batch_size=-(-cfg.global_batch_size // split) * split)
    try:
        return dataclasses.replace(cfg, mesh=folded, data=data)
    except (ConfigError, ValueError) as e:
        raise ConfigError(
            f"--compare-context folds {cfg.name}'s `context` axis into `fsdp` (mesh {folded.shape} over "
            f"{AXES}), and that experiment is invalid: {e}"
        ) from None


def _tokens_per_device(report: dict[str, Any]) -> int:
    return report["flops"]["tokens_per_step"] // report["devices"]


def comparison_section(with_cp: dict[str, Any], without: dict[str, Any] | None, error: str | None) -> dict[str, Any]:
    """The report's `without_context` entry: the folded program's mesh, memory, parameter bytes
    and collectives (or why it could not be built), and the per-device saving."""
    if without is None:
        return {"error": error}
    m, w = with_cp["memory_per_device"], without["memory_per_device"]
    return {
        "folded_into": FSDP,
        "mesh": without["mesh"],
        "tokens_per_device": _tokens_per_device(without),
        "tokens_per_device_with_context": _tokens_per_device(with_cp),
        "memory_per_device": w,
        "per_device_param_bytes": without["params"]["per_device_param_bytes"],
        "per_device_optimizer_bytes": without["params"]["per_device_optimizer_bytes"],
        "collectives": without["collectives"],
        "custom_calls": without["custom_calls"],  # e.g. a fused attention kernel (splash) the context kernels forgo
        "stablehlo_sha256": without["stablehlo_sha256"],
        "compile": without["compile"],
        "total_bytes_saved_by_context": w["total_bytes"] - m["total_bytes"],
        "temp_bytes_saved_by_context": w["temp_bytes"] - m["temp_bytes"],
    }


def comparison_lines(with_cp: dict[str, Any], section: dict[str, Any]) -> list[str]:
    """The report's text lines for a `comparison_section`."""
    if "error" in section:
        return [f"  without CP    not compiled: {section['error']}"]
    m, w = with_cp["memory_per_device"], section["memory_per_device"]
    refused = " (the compiler refused it: over the memory)" if "compiler_refused" in w else ""
    return [
        f"  without CP    the context axis folded into fsdp, mesh {section['mesh']}: total "
        f"{_size(w['total_bytes'])} per device (temporaries {_size(w['temp_bytes'])}, params "
        f"{_size(section['per_device_param_bytes'])}), " + ("fits" if w["fits"] else "DOES NOT FIT") + refused,
        f"                {section['tokens_per_device']:,} tokens per device (with CP "
        f"{section['tokens_per_device_with_context']:,})",
        "                its custom calls "
        + (", ".join(f"{k} {v}" for k, v in section["custom_calls"].items()) or "none"),
        f"                with CP {_size(m['total_bytes'])} (temporaries {_size(m['temp_bytes'])}, params "
        f"{_size(with_cp['params']['per_device_param_bytes'])}): context parallelism saves "
        f"{_size(section['total_bytes_saved_by_context'])} per device",
    ]
