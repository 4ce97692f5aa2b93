"""The architecture diagram (docs/figures/architecture.svg), drawn from the code itself.

Every name on it is read from the installed packages, so it cannot drift from them:
- the four packages and their public top-level modules and subpackages (`pkgutil`);
- the arrows between packages: which package's modules import which (parsed with `ast`);
- the path of a run, each step labelled with the module that defines it: the CLI's `app`,
  the registry's `get_experiment`, `ExperimentConfig`, the Task contract (`AbstractTask`),
  `build_training`, the loop (`run_experiment`), the hooks (`Hook` and its subclasses) and the
  job directory (`prepare_job_dir`).

`uv run python docs/figures/make_figures.py architecture` rewrites the SVG; tests/docs/test_docs_site.py
fails when the committed one differs from what the code draws now.
"""

import ast
import importlib
import pkgutil
from html import escape
from pathlib import Path

PACKAGES = ("launch", "models", "data", "core")
# The run's path: (concept, the name that defines it, what it does).
ANCHORS = (
    ("CLI", "app", "launch run --exp NAME [--set knob=value]"),
    ("registry", "get_experiment", "short or dotted name -> registered experiment"),
    ("config", "ExperimentConfig", "frozen dataclasses, validated before any device"),
    ("Task", "AbstractTask", "init, loss, eval sums, abstract batch"),
    ("build_training", "build_training", "mesh + model + learner + input -> jitted steps"),
    ("loop", "run_experiment", "fetch batch, step, every N steps read metrics"),
    ("hooks", "Hook", ""),
    ("job dir", "prepare_job_dir", "config.json knobs.txt metrics.jsonl checkpoints/ summaries/ plots/"),
)

CHAR_W, LINE_H, FONT = 7.4, 16, 12  # monospace 12 px: ~7.2 px a character, and a margin
PAD = 10


def package_modules(package: str) -> list[str]:
    """Public top-level modules of `equipax.<package>`; subpackages end with `/`."""
    pkg = importlib.import_module(f"equipax.{package}")
    return sorted(
        m.name + ("/" if m.ispkg else "") for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_")
    )


def _all_modules(package: str) -> list[str]:
    pkg = importlib.import_module(f"equipax.{package}")
    return [pkg.__name__, *(m.name for m in pkgutil.walk_packages(pkg.__path__, f"{pkg.__name__}."))]


def package_imports() -> set[tuple[str, str]]:
    """`(importer, imported)` package pairs, from every module's import statements."""
    edges = set()
    for package in PACKAGES:
        for name in _all_modules(package):
            module = importlib.import_module(name)
            path = getattr(module, "__file__", None)
            if not path:
                continue
            for node in ast.walk(ast.parse(Path(path).read_text())):
                targets = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom) and node.level == 0
                    else []
                )
                for target in targets:
                    parts = target.split(".")
                    if parts[0] == "equipax" and len(parts) > 1 and parts[1] in PACKAGES and parts[1] != package:
                        edges.add((package, parts[1]))
    return edges


def defining_module(name: str) -> str:
    """The module of the four packages whose code defines `name`."""
    found = []
    for package in PACKAGES:
        for mod_name in _all_modules(package):
            module = importlib.import_module(mod_name)
            obj = getattr(module, name, None)
            if obj is None:
                continue
            if isinstance(obj, type) or (callable(obj) and hasattr(obj, "__code__")):
                defined = obj.__module__ == mod_name
            else:  # a value (the CLI's typer app): assigned at the module's top level
                tree = ast.parse(Path(module.__file__ or "").read_text())
                defined = any(
                    isinstance(n, (ast.Assign, ast.AnnAssign))
                    and name
                    in [
                        t.id
                        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                        if isinstance(t, ast.Name)
                    ]
                    for n in tree.body
                )
            if defined:
                found.append(mod_name)
    if len(found) != 1:
        raise SystemExit(
            f"architecture diagram: {name!r} is defined in {found or 'no module'}; "
            f"update ANCHORS in {Path(__file__).name}"
        )
    return found[0]


def hook_names() -> list[str]:
    """The names of every public subclass of the loop's `Hook`, sorted."""
    module = importlib.import_module(defining_module("Hook"))
    for package in PACKAGES:  # subclasses register on import
        for mod_name in _all_modules(package):
            importlib.import_module(mod_name)
    base = module.Hook
    seen, todo = [], list(base.__subclasses__())
    while todo:
        cls = todo.pop(0)
        if cls.__name__.startswith("_") or cls in seen:
            continue
        seen.append(cls)
        todo += cls.__subclasses__()
    return sorted(c.__name__ for c in seen)


def _wrap(words: list[str], width: int) -> list[str]:
    lines, line = [], ""
    for w in words:
        if line and len(line) + 1 + len(w) > width:
            lines.append(line)
            line = w
        else:
            line = f"{line} {w}".strip()
    return lines + ([line] if line else [])


class _Svg:
    def __init__(self):
        self.parts: list[str] = []

    def box(self, x: float, y: float, w: float, h: float, fill: str, stroke: str = "#444") -> None:
        self.parts.append(
            f'<rect x="{x:.0f}" y="{y:.0f}" width="{w:.0f}" height="{h:.0f}" rx="6" fill="{fill}" stroke="{stroke}"/>'
        )

    def text(
        self,
        x: float,
        y: float,
        s: str,
        *,
        bold: bool = False,
        size: int = FONT,
        color: str = "#111",
        anchor: str = "start",
    ) -> None:
        weight = ' font-weight="bold"' if bold else ""
        self.parts.append(
            f'<text x="{x:.0f}" y="{y:.0f}" font-size="{size}"{weight} fill="{color}" '
            f'text-anchor="{anchor}">{escape(s)}</text>'
        )

    def arrow(self, x1: float, y1: float, x2: float, y2: float, color: str = "#555") -> None:
        self.parts.append(
            f'<line x1="{x1:.0f}" y1="{y1:.0f}" x2="{x2:.0f}" y2="{y2:.0f}" stroke="{color}" '
            f'stroke-width="1.5" marker-end="url(#head)"/>'
        )


def architecture_svg() -> str:
    """The diagram as SVG text (deterministic: the same code gives the same bytes)."""
    svg = _Svg()
    left_w, gap, right_w = 470, 40, 450
    x0, y = 10, 40
    svg.text(x0, 22, "packages (an arrow: imports from; red: a forbidden direction)", bold=True, size=13)
    boxes: dict[str, tuple[float, float, float, float]] = {}
    fills = {"launch": "#e8f0fe", "models": "#e6f4ea", "data": "#fef7e0", "core": "#fce8e6"}
    # models and data leave a lane on the right for launch's arrow to core.
    half = (left_w - 20 - 36) / 2
    layout = {"launch": (x0, left_w), "models": (x0, half), "data": (x0 + half + 20, half), "core": (x0, left_w)}
    row_y = y
    for row in (("launch",), ("models", "data"), ("core",)):
        lines = {pkg: _wrap(package_modules(pkg), int((layout[pkg][1] - 2 * PAD) / CHAR_W)) for pkg in row}
        height = 2 * PAD + LINE_H * (max(len(v) for v in lines.values()) + 1)
        for pkg in row:
            bx, bw = layout[pkg]
            svg.box(bx, row_y, bw, height, fills[pkg])
            svg.text(bx + PAD, row_y + PAD + 12, f"equipax.{pkg}", bold=True)
            for i, line in enumerate(lines[pkg]):
                svg.text(bx + PAD, row_y + PAD + 12 + LINE_H * (i + 1), line, color="#333")
            boxes[pkg] = (bx, row_y, bw, height)
        row_y += height + 36
    left_h = row_y - 36
    edges = package_imports()
    for src, dst in sorted(edges):
        sx, sy, sw, sh = boxes[src]
        dx, dy, dw, dh = boxes[dst]
        allowed = (src == "launch") or (dst == "core" and src in ("models", "data"))
        color = "#555" if allowed else "#d93025"
        if src == "launch" and dst == "core":
            svg.arrow(sx + sw - 18, sy + sh, dx + dw - 18, dy - 2, color)
        elif dy > sy:
            cx = (max(sx, dx) + min(sx + sw, dx + dw)) / 2
            svg.arrow(cx, sy + sh, cx, dy - 2, color)
        else:
            svg.arrow(sx + sw / 2, sy, dx + dw / 2, dy + dh + 2, color)
    # The run's path.
    rx = x0 + left_w + gap
    svg.text(rx, 22, "a run, and the module that defines each step", bold=True, size=13)
    ry = 40.0
    hooks = hook_names()
    for i, (concept, name, what) in enumerate(ANCHORS):
        module = defining_module(name)
        detail = ", ".join(hooks) if concept == "hooks" else what
        lines = _wrap(detail.split(), int((right_w - 2 * PAD) / CHAR_W))
        h = 2 * PAD + LINE_H * (1 + len(lines)) + 2
        svg.box(rx, ry, right_w, h, "#f1f3f4" if concept != "Task" else "#fce8e6")
        svg.text(rx + PAD, ry + PAD + 12, f"{concept}: {name}", bold=True)
        svg.text(rx + right_w - PAD, ry + PAD + 12, module, color="#1a73e8", anchor="end", size=11)
        for j, line in enumerate(lines):
            svg.text(rx + PAD, ry + PAD + 12 + LINE_H * (j + 1), line, color="#333")
        if i + 1 < len(ANCHORS):
            svg.arrow(rx + right_w / 2, ry + h, rx + right_w / 2, ry + h + 14)
        ry += h + 16
    width, height = rx + right_w + 10, max(left_h, ry - 16) + 10
    head = (
        '<defs><marker id="head" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
        'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="#555"/></marker></defs>'
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="DejaVu Sans Mono, Menlo, Consolas, monospace">\n'
        f"<title>equipax architecture: packages, modules and the path of a run</title>\n{head}\n"
        f'<rect width="100%" height="100%" fill="white"/>\n' + "\n".join(svg.parts) + "\n</svg>\n"
    )


if __name__ == "__main__":
    print(architecture_svg())
