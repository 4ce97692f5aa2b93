"""The supported Python and JAX range (README and docs/library.md, "Supported versions"): Python
3.11-3.13 and JAX 0.10.2-0.12, JAX 0.11 and later only from Python 3.12. Every package says so in
its pyproject, no module uses syntax newer than the oldest Python, and the version matrix the
README and docs/library.md state is the one CI proves: the lock's default pair runs the whole suite,
and each other pair is a compatibility job of `.ci/run` in the environment the matrix names (the
lock's for that Python, or a pinned file of `.ci/compat/`)."""

import ast
import re
import tomllib

from packaging.markers import Marker

from helpers import REPO

PACKAGES = ("core", "models", "data", "launch")
OLDEST_PYTHON = (3, 11)
OLDEST_JAX = "0.10.2"
PYTHONS = ("3.11", "3.12", "3.13")
DEFAULT_PYTHON = "3.12"


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


def test_every_package_and_the_workspace_state_the_supported_range():
    for name in PACKAGES:
        project = tomllib.loads((REPO / "packages" / name / "pyproject.toml").read_text())["project"]
        assert project["requires-python"] == ">=3.11", name
        for python in PYTHONS:
            assert f"Programming Language :: Python :: {python}" in project["classifiers"], (name, python)
    deps = tomllib.loads((REPO / "packages" / "core" / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"jax>={OLDEST_JAX},<0.13" in deps and f"jaxlib>={OLDEST_JAX},<0.13" in deps, deps
    # The lock covers every supported Python; `uv sync` without --python takes the default one.
    workspace = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert workspace["requires-python"] == ">=3.11,<3.14"
    assert _lock()["requires-python"] == ">=3.11, <3.14"
    assert (REPO / ".python-version").read_text().strip() == DEFAULT_PYTHON


def _lock() -> dict:
    return tomllib.loads((REPO / "uv.lock").read_text())


def locked_version(package: str, python: str) -> str:
    """The version of `package` that `uv sync --locked` installs on Python `python` (e.g. "3.11")."""
    found = set()
    for entry in _lock()["package"]:
        if entry["name"] != package:
            continue
        markers = entry.get("resolution-markers")
        for patch in (0, 99):
            env = {"python_version": python, "python_full_version": f"{python}.{patch}"}
            if markers is None or any(Marker(m).evaluate(env) for m in markers):
                found.add(entry["version"])
    assert len(found) == 1, (package, python, found)
    return found.pop()


def pinned_version(path: str, package: str) -> tuple[str, str]:
    """(the Python a `uv pip compile` output was made for, the version it pins `package` at)."""
    text = (REPO / path).read_text()
    python = re.search(r"--python-version (3\.\d+)", text)
    pin = re.search(rf"^{re.escape(package)}==(\S+)$", text, re.M)
    assert python and pin, path
    return python.group(1), pin.group(1)


def ci_matrix() -> set[tuple[str, str, str, str]]:
    """(Python, JAX, environment, tests) of each pair `.ci/run` runs, read from the script and the
    files that pin each environment."""
    run = (REPO / ".ci" / "run").read_text()
    # The suite: the README's command, in the lock's environment on the default Python.
    assert "uv sync --locked\n" in run and "\nuv run pytest\n" in run
    assert f"sys.version_info[:2] != ({DEFAULT_PYTHON.replace('.', ', ')})" in run
    pairs = {(DEFAULT_PYTHON, locked_version("jax", DEFAULT_PYTHON), "uv.lock", "the whole suite")}
    # The compatibility jobs: `compat_job VENV LIST` runs LIST's tests in VENV, made for its Python.
    jobs = re.findall(r"^compat_job (\.venv-compat-(3\.\d+)) (\.ci/compat/[\w-]+\.txt)$", run, re.M)
    assert jobs, "no compatibility job in .ci/run"
    for venv, python, tests in jobs:
        assert (REPO / tests).is_file(), tests
        interpreter = re.search(rf'^(\w+)="\$\(find_python {re.escape(python)}\)"$', run, re.M)
        assert interpreter, (venv, python)
        made_for = f'--python "${interpreter.group(1)}"'
        sync = rf"^UV_PROJECT_ENVIRONMENT={re.escape(venv)} uv sync --locked .*{re.escape(made_for)}"
        if re.search(sync, run, re.M):
            pairs.add((python, locked_version("jax", python), "uv.lock", tests))
            continue
        assert re.search(rf"^uv venv .*{re.escape(made_for)} {re.escape(venv)}$", run, re.M), venv
        pins = re.search(rf"^uv pip install .*--python {re.escape(venv)}/bin/python -r (\S+)$", run, re.M)
        assert pins, venv
        compiled_for, jax = pinned_version(pins.group(1), "jax")
        assert compiled_for == python and pinned_version(pins.group(1), "jaxlib")[1] == jax, pins.group(1)
        pairs.add((python, jax, pins.group(1), tests))
    return pairs


def stated_matrix(doc: str) -> set[tuple[str, str, str, str]]:
    """The rows of the version table in `doc`: (Python, JAX, the file its environment comes from,
    what CI runs there)."""
    text = (REPO / doc).read_text()
    table = text[text.index("| Python | JAX |") :].split("\n\n")[0].splitlines()[2:]
    rows = set()
    for line in table:
        python, jax, environment, runs = (cell.strip() for cell in line.strip("|").split("|"))
        source = re.search(r"\.ci/compat/[\w-]+\.txt", environment)
        ci = re.search(r"\.ci/compat/[\w-]+\.txt|the whole suite", runs)
        assert ci, (doc, line)
        rows.add((python, jax, source.group(0) if source else "uv.lock", ci.group(0)))
    return rows


def test_the_stated_version_matrix_is_what_ci_runs():
    """Each (Python, JAX) pair in README's and docs/library.md's table is run by `.ci/run` in the
    environment the row names, the pairs cover every supported Python, and on Python 3.11 the lock
    holds JAX 0.10 (JAX 0.11 and later need Python 3.12)."""
    proven = ci_matrix()
    assert {p[0] for p in proven} == set(PYTHONS), proven
    assert locked_version("jax", "3.11").startswith("0.10.") and locked_version("jaxlib", "3.11") == OLDEST_JAX
    for doc in ("README.md", "docs/library.md"):
        assert stated_matrix(doc) == proven, doc
    # The range the README states in words spans the table.
    stated = re.search(r"supports Python (3\.\d+)-(3\.\d+) and JAX ([\d.]+)-([\d.]+)", (REPO / "README.md").read_text())
    assert stated, "README: the sentence stating the supported range"
    assert (stated[1], stated[2]) == (PYTHONS[0], PYTHONS[-1])
    jaxes = sorted((p[1] for p in proven), key=lambda v: tuple(map(int, v.split("."))))
    assert stated[3] == jaxes[0] == OLDEST_JAX and jaxes[-1].startswith(stated[4] + "."), (stated.groups(), jaxes)


def test_the_compatibility_jobs_list_existing_tests():
    """Every line of each job's list names a test module that exists (and, with `::`, a test in it)."""
    for tests in ("tests.txt", "newest-tests.txt"):
        for line in (REPO / ".ci" / "compat" / tests).read_text().splitlines():
            if line and not line.startswith("#"):
                path, *names = line.split("::")
                assert (REPO / path).is_file(), (tests, line)
                if names:
                    name = names[0].split("[")[0]
                    assert re.search(rf"^def {re.escape(name)}\(", (REPO / path).read_text(), re.M), (tests, line)
