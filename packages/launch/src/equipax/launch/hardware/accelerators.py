"""The accelerators equipax knows: dense bfloat16 peak, HBM and its bandwidth per chip.

One table for all uses: `launch compile --target NAME` projects step times and checks memory
against a target, a run's MFU divides by its devices' peak (matched by JAX's `device_kind`), and
`model.transformer.remat="auto"` prices each candidate's compiled program at the peak and the
bandwidths (`equipax.launch.aot.hlo_cost`).
"""

import dataclasses

__all__ = ["Accelerator", "accelerator_of", "ACCELERATORS", "peak_tflops_of"]


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """An accelerator: its `--target` name, dense bf16 peak, HBM and HBM bandwidth per chip, the
    substrings of JAX's `device_kind` that name it, and its link to host memory (PCIe 4.0 x16,
    32 GB/s, unless given; what offloaded tensors travel over)."""

    name: str
    peak_tflops: float
    hbm_gib: float
    device_kinds: tuple[str, ...] = ()
    hbm_gbytes_per_s: float = 0.0
    host_gbytes_per_s: float = 32.0
    int8_peak_tops: float = 0.0  # dense int8 x int8 matrix multiplies (0: not faster than bf16)
    # What the chip's allocator lets a program hold (JAX's `memory_stats()["bytes_limit"]`), where
    # measured on the chip: `launch compile`'s default budget, the one `launch run` has there.
    allocatable_gib: float | None = None


# Order matters for `device_kind` matching: "TPU v5 lite" (v5e) is tried before "TPU v5" (v5p).
# HBM bandwidths and int8 rates are the datasheets' (Cloud TPU system architecture pages; NVIDIA's SXM
# parts; no int8 rate is given for the GPUs here).
ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        Accelerator("tpu-v4", 275.0, 32.0, ("TPU v4",), hbm_gbytes_per_s=1200.0),
        Accelerator(
            "tpu-v5e",
            197.0,
            16.0,
            ("TPU v5 lite", "TPU v5e"),
            hbm_gbytes_per_s=819.0,
            int8_peak_tops=394.0,
            # 15.748 GiB: the lent v5e's bytes_limit, 16,909,336,064 (benchmarks/README.md, "tenth session")
            allocatable_gib=16_909_336_064 / 2**30,
        ),
        Accelerator("tpu-v5p", 459.0, 95.0, ("TPU v5p", "TPU v5"), hbm_gbytes_per_s=2765.0, int8_peak_tops=918.0),
        Accelerator("tpu-v6e", 918.0, 32.0, ("TPU v6",), hbm_gbytes_per_s=1640.0, int8_peak_tops=1836.0),
        Accelerator("h100", 989.0, 80.0, ("H100",), hbm_gbytes_per_s=3350.0, host_gbytes_per_s=64.0),
        Accelerator("h200", 989.0, 141.0, ("H200",), hbm_gbytes_per_s=4800.0, host_gbytes_per_s=64.0),
        Accelerator("a100", 312.0, 80.0, ("A100",), hbm_gbytes_per_s=2039.0),
    )
}


def accelerator_of(device_kind: str) -> Accelerator | None:
    """The accelerator JAX calls `device_kind`, or None (a CPU, or unknown)."""
    kind = device_kind.lower()
    return next((a for a in ACCELERATORS.values() if any(k.lower() in kind for k in a.device_kinds)), None)


def peak_tflops_of(device_kind: str) -> float | None:
    """The per-chip peak of the accelerator JAX calls `device_kind`, or None (a CPU, or unknown)."""
    accelerator = accelerator_of(device_kind)
    return accelerator.peak_tflops if accelerator is not None else None
