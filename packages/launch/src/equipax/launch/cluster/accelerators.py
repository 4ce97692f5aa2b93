"""The accelerators equipax knows: dense bfloat16 peak and HBM per chip.

One table for both uses: `launch compile --target NAME` projects step times and checks memory
against a target, and a run's MFU divides by its devices' peak (matched by JAX's `device_kind`).
"""

import dataclasses

__all__ = ["Accelerator", "ACCELERATORS", "peak_tflops_of"]


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """An accelerator: its `--target` name, dense bf16 peak and HBM per chip, and the substrings of
    JAX's `device_kind` that name it."""

    name: str
    peak_tflops: float
    hbm_gib: float
    device_kinds: tuple[str, ...] = ()


# Order matters for `device_kind` matching: "TPU v5 lite" (v5e) is tried before "TPU v5" (v5p).
ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        Accelerator("tpu-v4", 275.0, 32.0, ("TPU v4",)),
        Accelerator("tpu-v5e", 197.0, 16.0, ("TPU v5 lite", "TPU v5e")),
        Accelerator("tpu-v5p", 459.0, 95.0, ("TPU v5p", "TPU v5")),
        Accelerator("tpu-v6e", 918.0, 32.0, ("TPU v6",)),
        Accelerator("h100", 989.0, 80.0, ("H100",)),
        Accelerator("h200", 989.0, 141.0, ("H200",)),
        Accelerator("a100", 312.0, 80.0, ("A100",)),
    )
}


def peak_tflops_of(device_kind: str) -> float | None:
    """The per-chip peak of the accelerator JAX calls `device_kind`, or None (a CPU, or unknown)."""
    kind = device_kind.lower()
    return next((a.peak_tflops for a in ACCELERATORS.values() if any(k.lower() in kind for k in a.device_kinds)), None)
