"""The import graph of packages/ as the layout tests read it: every equipax module -> the equipax
modules it imports anywhere in its text (at the top, inside functions, under TYPE_CHECKING, and
`importlib.import_module("equipax...")` with a literal name), parsed with `ast`, never imported."""

import ast
from pathlib import Path

from helpers import REPO

__all__ = ["cycles", "import_graph", "imports_of", "modules"]


def modules() -> dict[str, Path]:
    """Every module of the four packages by dotted name (a package by its own name)."""
    found = {}
    for src in sorted((REPO / "packages").glob("*/src")):
        for path in src.rglob("*.py"):
            parts = path.relative_to(src).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _targets(node: ast.AST) -> list[str]:
    """The dotted names an import statement (or a literal `import_module` call) may load."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        # `from a.b import c`: c is a module of a.b or a name defined in it (resolved below)
        return [f"{node.module}.{a.name}" for a in node.names]
    if (
        isinstance(node, ast.Call)
        and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return [node.args[0].value]
    return []


def imports_of(path: Path, known: dict[str, Path]) -> list[tuple[str, int]]:
    """`(module, line)` for each equipax module `path` imports (the longest known prefix of each name)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        for target in _targets(node):
            name = target
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and target.startswith("equipax."):
                found.append((name, getattr(node, "lineno", 0)))
    return found


def import_graph() -> dict[str, set[str]]:
    """Every module of packages/ -> the other equipax modules it imports anywhere in its text."""
    known = modules()
    return {name: {m for m, _ in imports_of(path, known) if m != name} for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found
