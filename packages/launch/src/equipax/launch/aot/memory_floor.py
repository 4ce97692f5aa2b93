"""A floor under a traced train step's device memory: what `model.transformer.remat="auto"` reads
from each candidate before compiling any (`equipax.launch.aot.remat_search`), so that a policy that
cannot fit is never compiled.

While the backward pass of a scanned layer stack runs, three things are live at once on every
device: the step's arguments (the parameters, optimizer state and batch, read again by the update
after the backward pass), the residuals the forward scan saved for it (its stacked outputs that the
backward scan reads: what the remat policy chooses to keep), and the backward scan's own outputs
(the stacked layers' gradients). `memory_floor` is their bytes summed over the traced program (the
largest such backward scan, at any depth: under microbatches, the scans inside the accumulation
loop's body), divided by the mesh's device count (an array cannot be split finer than that;
replication only adds). A compiled program needs at least that much more than nothing, whatever
XLA fuses or schedules: c4_1b at 6 layers for a TPU v5e (benchmarks/README.md, "On a real TPU,
sixth session"): `none` 18.0 GiB floor against 25.6 compiled, `full` 8.2 against 11.0,
`dots_with_context` 10.3 against 14.9. A step with no scanned stack (layers unrolled) has only its
arguments as floor.
"""

import math
from typing import Any

import numpy as np

from equipax.launch.aot.matrix_work import _jaxprs, _live

__all__ = ["memory_floor"]


def _bytes(var: Any) -> int:
    aval = getattr(var, "aval", None)
    shape, dtype = getattr(aval, "shape", None), getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    try:
        return math.prod(shape) * np.dtype(dtype).itemsize
    except TypeError:  # an extended dtype (a PRNG key's): its few bytes do not matter here
        return 0


def _backward_scan_bytes(jaxpr: Any) -> int:
    """The largest (residuals read + outputs) of a scan in `jaxpr` or below that reads another
    scan's outputs of the same jaxpr."""
    best, made_by_scan = 0, set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            residuals = sum(_bytes(v) for v in eqn.invars if id(v) in made_by_scan)
            if residuals:
                best = max(best, residuals + sum(_bytes(v) for v in eqn.outvars))
            made_by_scan.update(id(v) for v in eqn.outvars)
        for value in eqn.params.values():
            for inner in _jaxprs(value):
                best = max(best, _backward_scan_bytes(inner))
    return best


def memory_floor(jaxpr: Any, devices: int) -> float:
    """Bytes per device that `jaxpr` (a traced train step's `Jaxpr` or `ClosedJaxpr`) needs at
    least: its arguments and constants, and the largest backward scan's residuals and outputs
    (what no output needs left out, as XLA leaves it out), over `devices`."""
    live = _live(next(_jaxprs(jaxpr)))
    arguments = sum(_bytes(v) for v in (*live.constvars, *live.invars))
    return (arguments + _backward_scan_bytes(live)) / max(1, devices)
