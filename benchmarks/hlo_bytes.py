"""The HBM bytes an optimized XLA program moves, op by op, read from its text (no device needed).

For a program compiled ahead of time (`launch compile --topology v5e-1` with
`XLA_FLAGS=--xla_dump_to=DIR`: the `*after_optimizations.txt` file; or `compiled.as_text()`), each
top-level op's reads and writes are summed from the shapes: a fusion reads each operand whole
unless it only slices or gathers it (then the pieces), and writes its outputs (only the update of
an in-place dynamic-update-slice or scatter); arrays in on-chip memory (`S(1)` layouts) cost
nothing; a while loop's body counts once per trip (XLA's `known_trip_count`, or the bound its
condition compares the counter with, else `--trips`). What it does not see: what a fusion
re-reads internally, and how the passes overlap with compute.

    uv run python benchmarks/hlo_bytes.py DUMP/module_0000.jit_train_step.*.after_optimizations.txt --top 20
"""

import argparse
import re
from dataclasses import dataclass

DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
}  # fmt: skip
_ARRAY = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([0-9,]*)\](\{[^}]*\})?")
_INSTR = re.compile(r"\s*(?:ROOT )?%(\S+) = (.+?) ([a-z][a-z0-9-]*)\((.*)$")
_FREE = {"parameter", "tuple", "get-tuple-element", "bitcast", "constant", "after-all", "partition-id", "replica-id"}
_SLICING = {"dynamic-slice", "slice", "gather"}
_IN_PLACE = {"dynamic-update-slice", "scatter"}  # operand 0 is updated in place


@dataclass
class Instr:
    name: str
    shape: str
    op: str
    operands: list[tuple[str, int | None]]
    args: str
    attrs: str


def _arrays(shape: str) -> list[int]:
    """HBM bytes of each array in a (tuple) shape; 0 for one in on-chip memory (`S(n)`, n > 0)."""
    out = []
    for dtype, dims, layout in _ARRAY.findall(shape):
        n = DTYPE_BYTES[dtype]
        for d in dims.split(","):
            n *= int(d) if d else 1
        on_chip = bool(layout) and re.search(r"S\([1-9]\)", layout) is not None
        out.append(0 if on_chip else n)
    return out


def parse(text: str) -> tuple[dict[str, list[Instr]], str]:
    """`({computation: instructions}, the entry computation's name)`."""
    comps: dict[str, list[Instr]] = {}
    entry, current = "", None
    for line in text.splitlines():
        head = re.match(r"(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if head and not line.startswith(" "):
            current = head.group(2)
            comps[current] = []
            if head.group(1):
                entry = current
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTR.match(line) if current else None
        if not m:
            continue
        name, shape, op, rest = m.groups()
        depth, args = 0, ""
        for ch in rest:  # the operand list ends at the first unmatched ')'
            if ch == "(":
                depth += 1
            elif ch == ")":
                if depth == 0:
                    break
                depth -= 1
            args += ch
        operands = [(a, int(i) if i else None) for a, i in re.findall(r"%([\w.\-]+)(?:#(\d+))?", args)]
        comps[current].append(Instr(name, shape, op, operands, args, rest[len(args) :]))
    return comps, entry


def _attr(instr: Instr, key: str) -> str | None:
    m = re.search(key + r"=%?([\w.\-]+)", instr.attrs)
    return m.group(1) if m else None


def _param_read(body: list[Instr], param: str, full: int, comps: dict[str, list[Instr]]) -> int:
    """Bytes a fused computation reads of its parameter `param` (`full` bytes): the pieces when
    every use slices or gathers it (through nested fusions), else all of it."""
    total = 0
    for use in (i for i in body if any(a == param for a, _ in i.operands)):
        if use.op in _SLICING:
            total += sum(_arrays(use.shape))
        elif use.op in _IN_PLACE and use.operands[0][0] == param:
            continue  # updated in place: only the update is touched
        elif use.op == "fusion":
            inner = comps.get(_attr(use, "calls") or "", [])
            names = {int(i.args): i.name for i in inner if i.op == "parameter"}
            for pos, (a, _) in enumerate(use.operands):
                if a == param and pos in names:
                    total += _param_read(inner, names[pos], full, comps)
        else:
            return full
    return min(total, full)


def _fusion_bytes(instr: Instr, comps: dict[str, list[Instr]], sizes: dict[str, list[int]]) -> tuple[int, int]:
    body = comps.get(_attr(instr, "calls") or "", [])
    by_index = {int(i.args): i.name for i in body if i.op == "parameter"}
    reads = 0
    for pos, (a, idx) in enumerate(instr.operands):
        full = sizes.get(a, [0])
        nbytes = full[idx] if idx is not None and idx < len(full) else sum(full)
        reads += _param_read(body, by_index[pos], nbytes, comps) if pos in by_index else nbytes
    root = body[-1] if body else None
    writes = sum(_arrays(instr.shape))
    if root is not None and root.op in _IN_PLACE:
        update = root.operands[1 if root.op == "dynamic-update-slice" else -1][0]
        upd = next((i for i in body if i.name == update), None)
        writes = sum(_arrays(upd.shape)) if upd else writes
    return reads, writes


def _trip_count(loop: Instr, comps: dict[str, list[Instr]]) -> int | None:
    """A while loop's trips: XLA's `known_trip_count`, else the `i < N` its condition compares."""
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', loop.attrs)
    if m:
        return int(m.group(1))
    cond = comps.get(_attr(loop, "condition") or "", [])
    consts = {i.name: i.args for i in cond if i.op == "constant"}
    for i in cond:
        if i.op == "compare" and "direction=LT" in i.attrs:
            for a, _ in i.operands:
                if consts.get(a, "").isdigit():
                    return int(consts[a])
    return None


def program_bytes(text: str, trips: int | None = None) -> tuple[int, list[tuple[int, int, int, str, str]]]:
    """Total HBM bytes of the program and `(reads, writes, times, op, description)` per op."""
    comps, entry = parse(text)
    rows: list[tuple[int, int, int, str, str]] = []

    def walk(comp: str, times: int) -> None:
        sizes: dict[str, list[int]] = {}
        for instr in comps.get(comp, []):
            sizes[instr.name] = _arrays(instr.shape)
        for instr in comps.get(comp, []):
            if instr.op in _FREE or "AllocateBuffer" in instr.attrs:
                continue
            if instr.op == "while":
                n = _trip_count(instr, comps) or trips or 1
                walk(_attr(instr, "body") or "", times * n)
                continue
            if instr.op == "fusion":
                reads, writes = _fusion_bytes(instr, comps, sizes)
            else:
                writes = sum(_arrays(instr.shape))
                reads = 0
                for a, idx in instr.operands:
                    full = sizes.get(a, [0])
                    reads += full[idx] if idx is not None and idx < len(full) else sum(full)
                if instr.op in _SLICING:
                    reads = writes
            meta = re.search(r'op_name="([^"]*)"', instr.attrs)
            desc = f"{instr.name} {instr.shape[:70]} {meta.group(1)[-50:] if meta else ''}"
            rows.append((reads, writes, times, instr.op, desc))

    walk(entry, 1)
    return sum((r + w) * t for r, w, t, _, _ in rows), rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("hlo", help="an optimized HLO text file")
    parser.add_argument("--top", type=int, default=15, help="list the ops that move the most bytes")
    parser.add_argument("--trips", type=int, default=None, help="trip count of loops XLA gives none for")
    args = parser.parse_args()
    with open(args.hlo) as f:
        total, rows = program_bytes(f.read(), args.trips)
    for r, w, t, op, desc in sorted(rows, key=lambda x: -(x[0] + x[1]) * x[2])[: args.top]:
        print(f"{r / 2**20:9.1f} MiB read {w / 2**20:9.1f} MiB written x{t:<3d} {op:12s} {desc}")
    print(f"total: {total / 2**30:.2f} GiB moved")


if __name__ == "__main__":
    main()
