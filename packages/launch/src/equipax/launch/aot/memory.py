"""Per-device memory of a compiled step, from XLA's `memory_analysis()` or from its refusal to compile."""

import re
from typing import Any

__all__ = ["memory_figures", "MEMORY_NOTES", "out_of_memory_figures"]

MEMORY_NOTES = {
    "cpu": (
        "XLA:CPU's temporaries are an upper bound for an accelerator (no HBM-aware "
        "scheduling or fusion of the accelerator backend)."
    ),
    "tpu": (
        "XLA:TPU's buffer assignment for one chip; total = arguments + outputs - aliased + "
        "temporaries + generated code; peak = XLA:TPU's simulated heap peak (without code)."
    ),
}


def memory_figures(mem: Any) -> dict[str, int]:
    """Per-device bytes from a compiled program's `memory_analysis()` (missing fields count 0).

    `total_bytes` counts donated state once (its outputs alias the arguments) and adds the
    program's code, which also lives in device memory. `peak_bytes` is the backend's own heap
    peak where it reports one (XLA:TPU does; 0 otherwise).
    """

    def get(name: str) -> int:
        return int(getattr(mem, name, 0) or 0)

    memory = {
        "argument_bytes": get("argument_size_in_bytes"),
        "output_bytes": get("output_size_in_bytes"),
        "alias_bytes": get("alias_size_in_bytes"),
        "temp_bytes": get("temp_size_in_bytes"),
        "generated_code_bytes": get("generated_code_size_in_bytes"),
        "peak_bytes": get("peak_memory_in_bytes"),
    }
    memory["total_bytes"] = (
        memory["argument_bytes"]
        + memory["output_bytes"]
        - memory["alias_bytes"]
        + memory["temp_bytes"]
        + memory["generated_code_bytes"]
    )
    return memory


_OOM = re.compile(r"RESOURCE_EXHAUSTED.*(out of memory|exceeds available)", re.IGNORECASE | re.DOTALL)
_OOM_SIZES = re.compile(r"HLO temporaries \(([\d.]+)([KMGT]?)\) exceeds available HBM \(([\d.]+)([KMGT]?)\)")
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def out_of_memory_figures(message: str, state_bytes: int, batch_bytes: int) -> dict[str, Any] | None:
    """The memory figures of a compile that XLA refused for lack of device memory (None: another error).

    Arguments:
        message: the compiler's error.
        state_bytes: per-device bytes of the train state (the step's donated arguments).
        batch_bytes: per-device bytes of one batch.
    """
    if not _OOM.search(message):
        return None
    first = message.strip().splitlines()[0]
    sizes = _OOM_SIZES.search(message)
    temp = int(float(sizes.group(1)) * _UNITS[sizes.group(2)]) if sizes else 0
    memory: dict[str, Any] = {
        "argument_bytes": state_bytes + batch_bytes,
        "output_bytes": state_bytes,
        "alias_bytes": state_bytes,
        "temp_bytes": temp,
        "generated_code_bytes": 0,
        "peak_bytes": 0,
        "compiler_refused": first,
    }
    if sizes:
        memory["available_bytes"] = int(float(sizes.group(3)) * _UNITS[sizes.group(4)])
    memory["total_bytes"] = state_bytes + batch_bytes + temp
    return memory
