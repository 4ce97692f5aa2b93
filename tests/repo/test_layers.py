"""launch in layers (docs/extending.md, "Layers"): each folder of `equipax.launch` (or top-level
module) sits in one layer, and imports only from its own layer or the layers below, never above.
Every import counts: at the top of a module, inside a function, under TYPE_CHECKING."""

import re

from helpers import REPO
from helpers.imports import cycles, import_graph, imports_of, modules

LAUNCH = "equipax.launch"

# Low to high. A unit is a folder of equipax.launch (`store` for `equipax.launch.store.*`) or a
# top-level module (`errors` for `equipax.launch.errors`); `__init__` is the package itself (its
# docstring: it imports nothing).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("__init__", "exit_codes", "failures", "store", "hardware"),  # 0: exit codes and failures, storage, machines
    ("configs", "cluster"),  # 1: config schemas; multi-process start-up
    ("tasks", "experiments", "jobdir"),  # 2: task families; the registry; the job directory itself
    ("program",),  # 3: the model of an experiment on a mesh
    ("aot", "inference", "bench"),  # 4: ahead-of-time compiles; offline use of a job; `launch bench`
    ("training",),  # 5: the loop, its hooks, resume
    ("translators",),  # 6: MaxText configs, Hugging Face checkpoints
    ("errors", "commands"),  # 7: what a failure prints; the CLI commands
    ("cli",),  # 8: the entry point
)
LAYER = {unit: i for i, units in enumerate(LAYERS) for unit in units}

# Imports between two units of the same layer: only these (importer -> what it may import), each
# for the reason given. Any other pair of one layer is kept apart: a folder that needs another of
# its layer belongs above it (move it, and say so here and in docs/extending.md).
SAME_LAYER: dict[str, set[str]] = {
    "failures": {"exit_codes"},  # each failure carries its exit code
    "hardware": {"store"},  # compiler flags known to work are remembered in the machine cache
    "inference": {"aot"},  # sampling keeps JAX's compile time (aot.compile_events) out of its timing
}

# KNOWN: imports that break the order today, `(importer, imported module)`, each until the code it
# needs moves down (empty: none). An entry that no longer breaks the order fails the test: delete it then.
KNOWN: set[tuple[str, str]] = set()


def _unit(module: str) -> str:
    rest = module.removeprefix(LAUNCH).removeprefix(".")
    return rest.split(".")[0] if rest else "__init__"


def _breaks(graph: dict[str, set[str]]) -> dict[tuple[str, str], str]:
    """The launch imports that go up a layer, or sideways where SAME_LAYER does not allow it."""
    found = {}
    for importer, targets in graph.items():
        if not importer.startswith(LAUNCH):
            continue
        src = _unit(importer)
        for target in targets:
            if not target.startswith(LAUNCH) or (dst := _unit(target)) == src:
                continue
            if LAYER[dst] > LAYER[src]:
                found[(importer, target)] = f"layer {LAYER[src]} ({src}) imports layer {LAYER[dst]} ({dst})"
            elif LAYER[dst] == LAYER[src] and dst not in SAME_LAYER.get(src, set()):
                found[(importer, target)] = f"{src} and {dst} are both layer {LAYER[src]}; SAME_LAYER allows no import"
    return found


def _where(importer: str, target: str) -> str:
    known = modules()
    lines = sorted({line for m, line in imports_of(known[importer], known) if m == target})
    return f"{known[importer].name}:{','.join(map(str, lines))}"


def test_every_launch_folder_has_a_layer():
    units = {_unit(m) for m in modules() if m == LAUNCH or m.startswith(LAUNCH + ".")}
    assert {"store", "hardware", "training", "cli"} <= units
    unplaced = sorted(units - set(LAYER))
    assert not unplaced, f"{unplaced}: give each a layer in LAYERS (and in docs/extending.md, 'Layers')"
    assert set(SAME_LAYER) | {d for ds in SAME_LAYER.values() for d in ds} <= set(LAYER)
    for src, dsts in SAME_LAYER.items():
        assert all(LAYER[d] == LAYER[src] for d in dsts), src


def test_launch_imports_only_its_own_layer_or_lower():
    graph = import_graph()
    broken = _breaks(graph)
    new = {edge: why for edge, why in broken.items() if edge not in KNOWN}
    assert not new, "imports against the layer order (docs/extending.md, 'Layers'):\n" + "\n".join(
        f"  {a} -> {b} ({_where(a, b)}): {why}" for (a, b), why in sorted(new.items())
    )
    fixed = sorted(KNOWN - set(broken))
    assert not fixed, f"no longer against the order, delete from KNOWN: {fixed}"


def test_launch_folders_import_each_other_in_no_cycle():
    """Folder by folder (a lazy import counts like any other), apart from KNOWN."""
    folders: dict[str, set[str]] = {}
    for importer, targets in import_graph().items():
        if importer.startswith(LAUNCH):
            folders.setdefault(_unit(importer), set()).update(
                _unit(t) for t in targets if t.startswith(LAUNCH) and (importer, t) not in KNOWN
            )
    assert not (found := cycles(folders)), "folder-level import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_layer_check_can_fail():
    store, loop = f"{LAUNCH}.store.storage", f"{LAUNCH}.training.loop"
    graph = {
        store: {loop},  # up
        loop: {store},  # down: allowed
        f"{LAUNCH}.tasks.lm_data": {f"{LAUNCH}.jobdir.plots"},  # sideways, not allowed
        f"{LAUNCH}.failures": {f"{LAUNCH}.exit_codes"},  # sideways, allowed
        f"{LAUNCH}.hardware.tpu": {"equipax.core.knobs"},  # another package
    }
    assert set(_breaks(graph)) == {(store, loop), (f"{LAUNCH}.tasks.lm_data", f"{LAUNCH}.jobdir.plots")}


def test_docs_show_the_same_layers():
    """docs/extending.md's picture ("Layers of equipax.launch") is this test's LAYERS."""
    page = (REPO / "docs" / "extending.md").read_text()
    picture = page.split("## Layers of `equipax.launch`", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    shown = {}
    for line in picture.splitlines():
        if m := re.match(r"(\d+)  ((?:\S+(?:/|\.py) +)+)", line + " "):
            shown[int(m[1])] = tuple(u.removesuffix("/").removesuffix(".py") for u in m[2].split())
    assert shown == {i: tuple(u for u in units if u != "__init__") for i, units in enumerate(LAYERS)}
