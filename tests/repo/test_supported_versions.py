"""The supported Python and JAX range (README, docs/install.md): Python >= 3.11, JAX 0.10.2 to 0.12.
Every package says so in its pyproject, no module uses syntax newer than the oldest Python, and the
compatibility job's environment (.ci/compat, run by .ci/run) pins the oldest pair it claims."""

import ast
import re
import tomllib

from helpers import REPO

PACKAGES = ("core", "models", "data", "launch")
OLDEST_PYTHON = (3, 11)
OLDEST_JAX = "0.10.2"


def test_no_module_uses_syntax_newer_than_the_oldest_python():
    """`def f[T]`, `class C[T]` and `type X = ...` (PEP 695) need Python 3.12: a Cloud TPU image
    with Python 3.11 could not import equipax (what the compatibility job found first)."""
    files = [
        p
        for folder in ("packages", "benchmarks", "examples", "tests")
        for p in sorted((REPO / folder).rglob("*.py"))
        if ".venv" not in p.parts
    ]
    assert len(files) > 200
    problems = []
    for path in files:
        try:
            ast.parse(path.read_text(), filename=str(path), feature_version=OLDEST_PYTHON)
        except SyntaxError as e:
            problems.append(f"{path.relative_to(REPO)}:{e.lineno}: {e.msg}")
    assert not problems, problems


def test_every_package_states_the_supported_range():
    for name in PACKAGES:
        project = tomllib.loads((REPO / "packages" / name / "pyproject.toml").read_text())["project"]
        assert project["requires-python"] == ">=3.11", name
        assert "Programming Language :: Python :: 3.11" in project["classifiers"], name
    deps = tomllib.loads((REPO / "packages" / "core" / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"jax>={OLDEST_JAX},<0.13" in deps and f"jaxlib>={OLDEST_JAX},<0.13" in deps, deps


def test_the_compatibility_job_pins_the_oldest_pair():
    pins = (REPO / ".ci" / "compat" / "requirements.txt").read_text()
    assert re.search(rf"^jax=={re.escape(OLDEST_JAX)}$", pins, re.M) and re.search(
        rf"^jaxlib=={re.escape(OLDEST_JAX)}$", pins, re.M
    )
    assert "--python-version 3.11" in pins  # the command that made it, at its top
    run = (REPO / ".ci" / "run").read_text()
    assert ".ci/compat/requirements.txt" in run and ".ci/compat/tests.txt" in run
    for line in (REPO / ".ci" / "compat" / "tests.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            assert (REPO / line.split("::")[0]).is_file(), line
