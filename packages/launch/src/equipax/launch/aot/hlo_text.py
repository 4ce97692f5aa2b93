"""A compiled HLO module as XLA prints it (`compiled.as_text()`), read into computations of
instructions, with the FLOPs of its matrix multiplies (`dot`, and the `convolution`s XLA:TPU
writes them as). What `equipax.launch.aot.hlo_cost` prices."""

import dataclasses
import math
import re

__all__ = ["Array", "arrays", "attr", "conv_flops", "dot_flops", "Instruction", "parse_module"]

_DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
    "f8e4m3fn": 1, "f8e5m2": 1, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16, "token": 0,
}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\](?:\{([^}]*)\})?")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_MEMORY_SPACE = re.compile(r"S\((\d+)\)")


@dataclasses.dataclass(frozen=True)
class Array:
    """One array of a shape: its dimensions, bytes and memory space (the layout's `S(n)`; 0 when
    none is written: device memory)."""

    dims: tuple[int, ...]
    bytes: float
    space: int


@dataclasses.dataclass(frozen=True)
class Instruction:
    """`name = shape opcode(args), attrs`: `operands` are the names in `args`."""

    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    args: str
    attrs: str
    root: bool


def arrays(shape: str) -> list[Array]:
    """The arrays of a shape (a tuple's in order)."""
    out = []
    for dtype, dims, layout in _ARRAY.findall(shape):
        if dtype in _DTYPE_BYTES:
            d = tuple(int(x) for x in dims.split(",") if x)
            space = _MEMORY_SPACE.search(layout or "")
            out.append(Array(d, float(math.prod(d) * _DTYPE_BYTES[dtype]), int(space.group(1)) if space else 0))
    return out


def _closing(text: str, start: int) -> int:
    """The index of the parenthesis closing the one opened just before `start` (len(text) if none)."""
    depth = 1
    for i in range(start, len(text)):
        depth += text[i] == "("
        depth -= text[i] == ")"
        if depth == 0:
            return i
    return len(text)


def _instruction(line: str) -> Instruction | None:
    m = _INSTRUCTION.match(line)
    if m is None:
        return None
    root, name, rest = m.groups()
    if rest.startswith("("):
        end = _closing(rest, 1) + 1
        shape, tail = rest[:end], rest[end:].lstrip()
    else:
        shape, _, tail = rest.partition(" ")
    opcode, paren, after = tail.partition("(")
    if not paren:
        return None
    end = _closing(after, 0)
    args = after[:end]
    operands = tuple(re.findall(r"%([\w.\-]+)", args))
    return Instruction(name, shape, opcode.strip(), operands, args, after[end + 1 :], bool(root))


def parse_module(hlo: str) -> tuple[dict[str, list[Instruction]], str]:
    """The computations of a module (name -> instructions, in order) and the entry's name. An
    instruction printed over several lines (a kernel's metadata) is read as one."""
    computations: dict[str, list[Instruction]] = {}
    entry, current, lines = "", "", []

    def flush() -> None:
        if current and lines:
            op = _instruction(" ".join(lines))
            if op is not None:
                computations[current].append(op)
        lines.clear()

    for line in hlo.splitlines():
        if not current:
            header = _HEADER.match(line)
            if header:
                current = header.group(2)
                computations[current] = []
                entry = current if header.group(1) else entry
        elif line.strip() == "}":
            flush()
            current = ""
        elif re.match(r"\s+(ROOT\s+)?%", line):
            flush()
            lines.append(line)
        elif lines:
            lines.append(line)
    return computations, entry


def attr(attrs: str, key: str) -> str | None:
    """An attribute's value (`key=value`), a computation's name without its `%`."""
    m = re.search(rf"\b{key}=%?([^,\s]+)", attrs)
    return m.group(1) if m else None


def _valid_pairs(out: int, window: int, size: int, stride: int, pad_low: int, lhs_dil: int, rhs_dil: int) -> int:
    """The (output position, window position) pairs of one spatial dimension that read the input,
    not its padding: XLA's own count for a convolution's FLOPs (XLA:TPU writes a batched matrix
    multiply as a convolution whose padded window meets the input once per output)."""
    last = (size - 1) * lhs_dil
    total = 0
    for o in range(out):
        start = o * stride - pad_low
        if lhs_dil == 1:
            lo = -(start // rhs_dil) if start < 0 else 0  # the first k with start + k * rhs_dil >= 0
            hi = min(window - 1, (last - start) // rhs_dil) if last >= start else -1
            total += max(0, hi - lo + 1)
        else:
            positions = (start + k * rhs_dil for k in range(window))
            total += sum(1 for p in positions if 0 <= p <= last and p % lhs_dil == 0)
    return total


def conv_flops(op: Instruction, shapes: dict[str, str]) -> float:
    """2 x outputs x input features x the window positions that meet the input."""
    labels = attr(op.attrs, "dim_labels")
    out = arrays(op.shape)
    if labels is None or not out or len(op.operands) < 2:
        return 0.0
    lhs_l, _, rest = labels.partition("_")
    rhs_l, _, out_l = rest.partition("->")
    lhs, rhs = (arrays(shapes.get(n, "")) for n in op.operands[:2])
    if not lhs or not rhs:
        return 0.0
    lhs_d, rhs_d, out_d = lhs[0].dims, rhs[0].dims, out[0].dims
    if (len(lhs_l), len(rhs_l), len(out_l)) != (len(lhs_d), len(rhs_d), len(out_d)):
        return 0.0
    window = re.search(r"window=\{([^}]*)\}", op.attrs)
    fields = dict(kv.split("=", 1) for kv in window.group(1).split() if "=" in kv) if window else {}

    def per_dim(key: str, i: int, default: str) -> str:
        values = fields[key].split("x") if key in fields else []
        return values[i] if i < len(values) else default

    flops = 2.0 * out_d[out_l.index("b")] * out_d[out_l.index("f")] * rhs_d[rhs_l.index("i")]
    for i, c in enumerate(sorted(c for c in out_l if c.isdigit())):
        flops *= _valid_pairs(
            out_d[out_l.index(c)],
            int(per_dim("size", i, str(rhs_d[rhs_l.index(c)]))),
            lhs_d[lhs_l.index(c)],
            int(per_dim("stride", i, "1")),
            int(per_dim("pad", i, "0_0").split("_")[0]),
            int(per_dim("lhs_dilate", i, "1")),
            int(per_dim("rhs_dilate", i, "1")),
        )
    return flops


def dot_flops(op: Instruction, shapes: dict[str, str]) -> float:
    """2 x outputs x the contracted size."""
    out = arrays(op.shape)
    lhs = arrays(shapes.get(op.operands[0], "")) if op.operands else []
    if not out or not lhs:
        return 0.0
    m = re.search(r"\blhs_contracting_dims=\{([0-9,]*)\}", op.attrs)
    contracted = math.prod(lhs[0].dims[int(i)] for i in m.group(1).split(",") if i) if m else 1
    return 2.0 * math.prod(out[0].dims) * contracted
