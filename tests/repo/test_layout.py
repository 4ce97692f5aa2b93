"""The repository's layout rules: the dependency direction between the packages, launch's own
rules, and the test folders grouped by package."""

import re
import subprocess
import sys

from helpers import REPO
from helpers.imports import cycles, import_graph


def test_launch_keeps_its_layout_rules():
    """`equipax.launch`'s rules: no branching on experiment or model
    config classes outside the experiment definitions and the config schemas (families dispatch on
    `cfg.kind`, configs answer for themselves), and no exit code written as a number
    (`equipax.launch.exit_codes` holds them all)."""
    root = REPO / "packages" / "launch" / "src" / "equipax" / "launch"
    modules = sorted(root.rglob("*.py"))
    assert len(modules) > 40
    config_types = r"(ExperimentConfig|LMConfig|CNNConfig|DataConfig|ImageDataConfig)"
    problems = []
    for path in modules:
        text, rel = path.read_text(), path.relative_to(root)
        if rel.parts[0] not in ("experiments", "configs") and re.search(rf"isinstance\([^)]*\b{config_types}\b", text):
            problems.append(f"{rel}: isinstance on a config class")
        if rel.name != "exit_codes.py" and re.search(r"(typer\.Exit|sys\.exit|os\._exit|SystemExit)\(\s*\d", text):
            problems.append(f"{rel}: a literal exit code")
    assert not problems, problems


def test_no_module_over_500_lines():
    """STYLE's ceiling in all four packages: a file is one concept, split before 500 lines (by idea,
    never to fit a count)."""
    long = []
    for path in sorted((REPO / "packages").glob("*/src/equipax/**/*.py")):
        if (n := path.read_text().count("\n")) > 500:
            long.append(f"{path.relative_to(REPO)}: {n} lines")
    assert not long, long


def test_models_and_data_do_not_import_launch():
    code = (
        "import sys; import equipax.models, equipax.data, equipax.core.step; "
        "bad = [m for m in sys.modules if m.startswith('equipax.launch')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# What each test folder may import: a package's tests run with that package and what it depends on
# (`uv run pytest tests/core` tests core alone); models tests may feed a model from equipax.data.
TEST_FOLDER_IMPORTS = {"core": {"core"}, "data": {"core", "data"}, "models": {"core", "models", "data"}}


def test_each_test_folder_tests_its_package():
    problems = []
    for folder, allowed in TEST_FOLDER_IMPORTS.items():
        for path in sorted((REPO / "tests" / folder).rglob("*.py")):
            used = set(re.findall(r"\bequipax\.(core|models|data|launch)\b", path.read_text()))
            if used - allowed:
                problems.append(f"tests/{folder}/{path.name} uses equipax.{', equipax.'.join(sorted(used - allowed))}")
    helpers = {p.stem for p in (REPO / "tests" / "helpers").glob("*.py")}
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        imported = re.findall(r"^\s*(?:from|import) (test_\w+|conftest)\b", path.read_text(), re.M)
        if imported:
            problems.append(
                f"{path.relative_to(REPO)} imports the test module(s) {imported}: move what they "
                f"share to tests/helpers ({', '.join(sorted(helpers))})"
            )
    names = sorted(p.name for p in (REPO / "tests").rglob("test_*.py"))
    problems += [f"two test modules named {n}" for n in {n for n in names if names.count(n) > 1}]
    assert not problems, problems


def test_no_import_cycles():
    """No two modules of packages/ import each other, directly or through others (lazy and
    TYPE_CHECKING imports included: each is a dependency a reader has to untangle)."""
    graph = import_graph()
    assert len(graph) > 100 and "equipax.launch.training.loop" in graph["equipax.launch.commands.train_command"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the check can fail
    assert not (found := cycles(graph)), "import cycles: " + "; ".join(" <-> ".join(c) for c in found)
