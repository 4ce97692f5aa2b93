"""A compiled program's roofline, read from its HLO text: FLOPs, HBM bytes and a projected time.

XLA's own `cost_analysis()` counts a `while` loop's body once (a scanned stack of N layers counts
as one layer) and a custom call (a Pallas kernel such as splash attention) as nothing, so it cannot
compare what remat policies recompute. `program_cost` walks the compiled HLO instead
(`equipax.launch.aot.hlo_text`): each kernel the program launches (a fusion, a matrix multiply, a
custom call, a copy, a collective) costs `max(FLOPs / peak, HBM bytes / bandwidth)`, plus its
host-memory bytes over the host link; a loop counts its body once per trip (the trip count from
its condition); a splash attention kernel counts the matrix multiplies it runs (half of them under
the causal mask). Only HBM traffic counts as bytes: operands in on-chip memory (XLA:TPU's VMEM and
SMEM) are free, and a slice or an in-place update of a buffer counts the slice, not the buffer.
Elementwise arithmetic counts as memory traffic only, and collectives as the bytes they read and
write (not the interconnect's time). A matrix multiply of two int8 operands runs at the device's
int8 rate where it has one (a TPU v5e: 394 TOP/s against 197 TFLOP/s in bf16).
"""

import dataclasses
import functools
import re
from typing import Any

from equipax.launch.aot.hlo_text import Array, Instruction, arrays, attr, conv_flops, dot_flops, parse_module

__all__ = ["NOMINAL_HOST", "program_cost", "ProgramCost", "Roofline"]

_DEVICE, _HOST = 0, 5  # XLA's memory spaces: device memory, pinned host memory (the others are on-chip)
# Instructions that launch nothing.
_FREE = {
    "parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "partition-id", "replica-id",
    "opt-barrier", "add-dependency", "domain", "copy-done", "slice-done", "send-done", "recv-done",
    "all-gather-done", "all-reduce-done", "collective-permute-done", "async-done", "async-update",
}  # fmt: skip
_SLICING = {"slice", "dynamic-slice", "gather", "slice-start"}
# Matrix multiplies per splash attention kernel (forward: QK^T and PV; dq: QK^T, dO V^T, dS K;
# dkv: QK^T, dO V^T, P^T dO, dS^T Q; the fused backward, a dkv kernel that also returns dq: the
# five of them, dS K as well).
_SPLASH_MATMULS = (("_dkv", 4), ("_dq", 3), ("_fwd", 2))
_FUSED_BACKWARD_MATMULS = 5
_NOTHING = (0.0, 0.0, 0.0, 0.0)
Cost = tuple[float, float, float, float]  # FLOPs, HBM bytes, host bytes, seconds


@dataclasses.dataclass(frozen=True)
class Roofline:
    """What a device does per second: `peak_flops` (dense matrix multiplies), `hbm_bytes_per_s`
    (its own memory) and `host_bytes_per_s` (its link to host memory); `name` says whose figures.
    `int8_peak_flops`: its rate for int8 x int8 matrix multiplies (None: `peak_flops`)."""

    name: str
    peak_flops: float
    hbm_bytes_per_s: float
    host_bytes_per_s: float
    int8_peak_flops: float | None = None

    @classmethod
    def of(cls, accelerator: Any, peak_tflops: float | None = None) -> "Roofline":
        """An `equipax.launch.hardware.accelerators.Accelerator`'s figures (`peak_tflops`: another peak)."""
        peak = peak_tflops if peak_tflops is not None else accelerator.peak_tflops
        int8 = getattr(accelerator, "int8_peak_tops", 0.0)
        return cls(
            accelerator.name,
            peak * 1e12,
            accelerator.hbm_gbytes_per_s * 1e9,
            accelerator.host_gbytes_per_s * 1e9,
            int8 * 1e12 if int8 else None,
        )


# A device without an entry in the accelerator table (a CPU): nominal figures of one server core
# (100 GFLOP/s, 20 GB/s), which rank programs by their work and traffic as an accelerator would.
NOMINAL_HOST = Roofline("nominal host", 100e9, 20e9, 20e9)


@dataclasses.dataclass(frozen=True)
class ProgramCost:
    """A program's roofline: `flops` (matrix multiplies, loops unrolled), `hbm_bytes` and
    `host_bytes` (device and host memory traffic), and `projected_s` (each kernel at its roofline)."""

    flops: float
    hbm_bytes: float
    host_bytes: float
    projected_s: float


def _splash_flops(op: Instruction, shapes: dict[str, str]) -> float:
    """A splash attention kernel's matrix multiplies, from its query and key operands `[b, h, s, d]`
    (which kernel: by its name and its op's, not its metadata, which names every kernel's blocks)."""
    op_name = re.search(r'op_name="([^"]*)"', op.attrs)
    text = f"{op.name} {op_name.group(1) if op_name else ''}"
    if "splash" not in text:
        return 0.0
    qk = [a for n in op.operands for a in arrays(shapes.get(n, ""))[:1] if len(a.dims) == 4]
    if len(qk) < 2:
        return 0.0
    (b, h, sq, d), sk = qk[0].dims, qk[1].dims[2]
    matmuls = next((n for key, n in _SPLASH_MATMULS if key in text), 2)
    if "_dkv" in text and sum(len(a.dims) >= 4 for a in arrays(op.shape)) >= 3:  # dq, dk and dv
        matmuls = _FUSED_BACKWARD_MATMULS
    return 2.0 * b * h * sq * sk * d * matmuls / 2


def _sum(costs: list[Cost], times: int = 1) -> Cost:
    return (
        times * sum(c[0] for c in costs),
        times * sum(c[1] for c in costs),
        times * sum(c[2] for c in costs),
        times * sum(c[3] for c in costs),
    )


class _Program:
    def __init__(self, hlo: str, roofline: Roofline) -> None:
        self.computations, self.entry = parse_module(hlo)
        self.shapes = {op.name: op.shape for ops in self.computations.values() for op in ops}
        self.roofline = roofline

    @functools.cache  # noqa: B019  # one per program
    def computation(self, name: str) -> Cost:
        """The cost of running computation `name` once."""
        return _sum([self.instruction(op) for op in self.computations.get(name, [])])

    @functools.cache  # noqa: B019
    def fused_flops(self, name: str) -> tuple[float, float]:
        """(the matrix FLOPs of computation `name`, of which int8 x int8)."""
        total, int8 = 0.0, 0.0
        for op in self.computations.get(name, []):
            if op.opcode == "fusion":
                t, i = self.fused_flops(attr(op.attrs, "calls") or "")
                total, int8 = total + t, int8 + i
            elif op.opcode in ("convolution", "dot"):
                f = (conv_flops if op.opcode == "convolution" else dot_flops)(op, self.shapes)
                total, int8 = total + f, int8 + (f if self.int8_operands(op) else 0.0)
        return total, int8

    def int8_operands(self, op: Instruction) -> bool:
        """Whether a matrix multiply's two operands are int8."""
        return len(op.operands) >= 2 and all(self.shapes.get(n, "").startswith("s8[") for n in op.operands[:2])

    def trip_count(self, condition: str) -> int:
        """A loop's trips from its condition `i < N`, the compare at its root or fused there (1 where
        it is not of that form; the counters of the loops JAX's scans become start at 0)."""
        ops = self.computations.get(condition, [])
        root = next((o for o in ops if o.root), None)
        bound, names = None, {o.name: o for o in ops}
        if root is not None and root.opcode == "fusion":
            inner = self.computations.get(attr(root.attrs, "calls") or "", [])
            compare = next((o for o in inner if o.root), None)
            params = {o.name: int(o.args) for o in inner if o.opcode == "parameter" and o.args.strip().isdigit()}
            if compare is not None and compare.opcode == "compare" and len(compare.operands) == 2:
                second = compare.operands[1]
                names |= {o.name: o for o in inner}
                bound = root.operands[params[second]] if second in params else second
                root = compare
        elif root is not None and root.opcode == "compare" and len(root.operands) == 2:
            bound = root.operands[1]
        constant = names.get(bound or "")
        if root is None or "direction=LT" not in root.attrs or constant is None or constant.opcode != "constant":
            return 1
        value = constant.args.strip()
        return max(int(value), 1) if value.isdigit() else 1

    def instruction(self, op: Instruction) -> Cost:
        code = op.opcode
        if code in _FREE:
            return _NOTHING
        if code == "while":
            body, condition = attr(op.attrs, "body") or "", attr(op.attrs, "condition") or ""
            return _sum([self.computation(body), self.computation(condition)], self.trip_count(condition))
        if code in ("call", "async-start"):
            return self.computation(attr(op.attrs, "to_apply") or attr(op.attrs, "calls") or "")
        if code == "conditional":  # the dearest branch
            branches = re.search(r"branch_computations=\{([^}]*)\}", op.attrs)
            names = re.findall(r"%?([\w.\-]+)", branches.group(1)) if branches else []
            names += [n for key in ("true_computation", "false_computation") if (n := attr(op.attrs, key))]
            return max((self.computation(n) for n in names), key=lambda c: c[3], default=_NOTHING)
        flops, int8 = 0.0, 0.0
        if code == "fusion":
            flops, int8 = self.fused_flops(attr(op.attrs, "calls") or "")
        elif code in ("convolution", "dot"):
            flops = (conv_flops if code == "convolution" else dot_flops)(op, self.shapes)
            int8 = flops if self.int8_operands(op) else 0.0
        elif code == "custom-call":
            flops = _splash_flops(op, self.shapes)
        moved = [*(self.read(op, i) for i in range(len(op.operands))), *self.written(op)]
        hbm = sum((b for b, space in moved if space == _DEVICE), 0.0)
        host = sum((b for b, space in moved if space == _HOST), 0.0)
        r = self.roofline
        compute = (flops - int8) / r.peak_flops + int8 / (r.int8_peak_flops or r.peak_flops)
        return flops, hbm, host, max(compute, hbm / r.hbm_bytes_per_s) + host / r.host_bytes_per_s

    def read(self, op: Instruction, index: int) -> tuple[float, int]:
        """(bytes, memory space) an instruction reads of its operand `index`."""
        operand = arrays(self.shapes.get(op.operands[index], ""))
        if not operand:
            return 0.0, _DEVICE
        full, space = sum((a.bytes for a in operand), 0.0), operand[0].space
        if op.opcode in _SLICING and index == 0:
            return min(full, sum((a.bytes for a in self.outputs(op)), 0.0)), space
        if op.opcode == "dynamic-update-slice" and index == 0:
            return 0.0, space  # updated in place
        if op.opcode == "fusion":
            return min(full, self.fused_read(op, index, full)), space
        return full, space

    def outputs(self, op: Instruction) -> list[Array]:
        out = arrays(op.shape)
        if op.opcode.endswith("-start") and op.shape.startswith("(") and len(out) > 1:
            # An asynchronous start's tuple holds its operand, then its result (and a context).
            return out[1:2] if op.opcode in ("copy-start", "slice-start") else out[-1:]
        return out

    def written(self, op: Instruction) -> list[tuple[float, int]]:
        """(bytes, memory space) an instruction writes, per output."""
        out = self.outputs(op)
        if op.opcode == "dynamic-update-slice" and len(op.operands) > 1:
            update = arrays(self.shapes.get(op.operands[1], ""))
            return [(sum((a.bytes for a in update), 0.0), out[0].space if out else _DEVICE)]
        if op.opcode != "fusion":
            return [(a.bytes, a.space) for a in out]
        ops = self.computations.get(attr(op.attrs, "calls") or "", [])
        by_name = {o.name: o for o in ops}
        root = next((o for o in ops if o.root), None)
        roots = [by_name.get(n) for n in root.operands] if root is not None and root.opcode == "tuple" else [root]
        written = []
        for i, a in enumerate(out):
            r = roots[i] if i < len(roots) else None
            while r is not None and r.opcode == "bitcast" and r.operands:
                r = by_name.get(r.operands[0])
            if r is not None and r.opcode == "dynamic-update-slice" and len(r.operands) > 1:
                update = arrays(self.shapes.get(r.operands[1], ""))
                written.append((sum((x.bytes for x in update), 0.0), a.space))  # in place: the update
            else:
                written.append((a.bytes, a.space))
        return written

    def in_place_copy(self, op: Instruction) -> bool:
        """A fusion that copies its operand into that operand's own buffer (its output aliased to
        operand 0, its root a copy): XLA:TPU wraps a loop's stacked buffer in one before slicing or
        updating it; it moves nothing."""
        if op.opcode != "fusion" or "output_to_operand_aliasing={{}: (0, {})}" not in op.attrs:
            return False
        root = next((o for o in self.computations.get(attr(op.attrs, "calls") or "", []) if o.root), None)
        return root is not None and root.opcode == "copy"

    def fused_read(self, op: Instruction, index: int, full: float) -> float:
        """Bytes a fusion reads of its operand `index`: the slices where it only slices it (through
        bitcasts and in-place copies), nothing where it only updates it in place, else all of it."""
        ops = self.computations.get(attr(op.attrs, "calls") or "", [])
        param = next((o.name for o in ops if o.opcode == "parameter" and o.args.strip() == str(index)), None)
        if param is None:
            return full
        names, read = {param}, 0.0
        for o in ops:
            used = [i for i, n in enumerate(o.operands) if n in names]
            if not used:
                continue
            if o.opcode == "bitcast" or (used == [0] and self.in_place_copy(o)):
                names.add(o.name)
            elif o.opcode in _SLICING and used == [0]:
                read += sum((a.bytes for a in arrays(o.shape)), 0.0)
            elif not (o.opcode == "dynamic-update-slice" and used == [0]):
                return full
        return read


def program_cost(hlo: str, roofline: Roofline) -> ProgramCost:
    """The roofline of a compiled program's HLO text (`compiled.as_text()`) on one device of
    `roofline`'s kind."""
    program = _Program(hlo, roofline)
    flops, hbm, host, seconds = program.computation(program.entry)
    return ProgramCost(float(flops), float(hbm), float(host), float(seconds))
