"""The public API's shape: every public module declares __all__ (and defines what it lists),
equipax.core reaches its submodules, one Batch type."""

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO

PACKAGES = ("core", "models", "data", "launch")


def test_equipax_core_reaches_its_submodules():
    code = "import equipax.core as c; print(c.optim.make_learner.__name__, c.step.TrainState.__name__, c.nn.Linear)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.startswith("make_learner TrainState")


def _modules(pkg: str) -> list[Path]:
    src = REPO / "packages" / pkg / "src"
    return sorted(
        p
        for p in src.rglob("*.py")
        if not any(part.startswith("_") and part != "__init__.py" for part in p.relative_to(src).parts)
    )


@pytest.mark.parametrize("pkg", PACKAGES)
def test_every_public_module_declares_all(pkg):
    missing, unknown = [], []
    for path in _modules(pkg):
        tree = ast.parse(path.read_text())
        names = next(
            (
                n.value
                for n in tree.body
                if isinstance(n, (ast.Assign, ast.AnnAssign))
                and any(
                    getattr(t, "id", None) == "__all__"
                    for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                )
            ),
            None,
        )
        if names is None:
            missing.append(str(path.relative_to(REPO)))
            continue
        defined = (
            {getattr(n, "name", None) for n in ast.walk(tree)}
            | {
                a.asname or a.name
                for n in ast.walk(tree)
                if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names
            }
            | {t.id for n in ast.walk(tree) if isinstance(n, ast.Name) for t in [n]}
        )
        for elt in ast.literal_eval(names):
            if elt not in defined:
                unknown.append(f"{path.relative_to(REPO)}: {elt}")
    assert not missing, f"modules without __all__: {missing}"
    assert not unknown, f"__all__ names not defined: {unknown}"


def test_one_batch_type():
    from equipax.core.task import Batch
    from equipax.data import Batch as DataBatch

    assert DataBatch is Batch
    assert importlib.import_module("equipax.data.base").Batch is Batch
