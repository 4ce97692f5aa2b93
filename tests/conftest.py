"""Shared fixtures. No top-level imports of equipax: the jaxtyping import hook
(pytest --jaxtyping-packages, see pyproject.toml) must install before they load."""

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

# Tests run on the CPU in float32, whatever else is installed.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Every compile in the suite, in its processes and (through the environment) their children, takes
# JAX's cheaper compile options (`jax_disable_most_optimizations`: XLA:CPU's LLVM at level 0, no
# expensive LLVM passes; XLA's HLO passes, the partitioner and buffer assignment run as always, so
# collective counts, shardings and memory analyses are the ones a default compile gives). Most of
# the suite's time is XLA compiling toy programs: tests/models/test_lm.py took 46.3 s of CPU at the
# default level and 24.4-25.9 s this way (one run each, 2026-12-04). A test that needs the default
# takes it back with the `xla_default_level` marker; `EQUIPAX_TEST_XLA_DEFAULT=1` runs the whole
# suite at the default (the golden values of tests/launch/test_golden_lm.py, recorded at the
# default, hold at both: see LOGITS_TOL there).
if os.environ.get("EQUIPAX_TEST_XLA_DEFAULT") != "1":
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

if "PYTEST_XDIST_WORKER" not in os.environ and sys.flags.dont_write_bytecode:
    # Before any of the suite's processes (this one included) imports jax, where they may not write
    # bytecode themselves (PYTHONDONTWRITEBYTECODE): see helpers.bytecode.
    from helpers.bytecode import compile_bytecode

    compile_bytecode()

import jax
import numpy as np
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def key():
    return jax.random.key(0)


def assert_trees_close(a, b, *, rtol=1e-5, atol=1e-6):
    """Assert two pytrees have equal structure and numerically close leaves."""
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb, f"tree structures differ:\n{ta}\n{tb}"
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


@pytest.fixture
def trees_close():
    return assert_trees_close


@pytest.fixture(scope="module")
def one_step():
    """(initial state, state after one train step, metrics, batch, optimizer) of a tiny CNN."""
    from helpers import cnn

    return cnn.one_step()


# The suite's own directory (a new one per run, removed at the end): the controller names it
# before it starts the workers (they inherit the variable). It holds the file through which the
# workers tell the controller which tests form one group (see below), and the suite's compile cache.
_SUITE = "EQUIPAX_TEST_DIR"
if "PYTEST_XDIST_WORKER" not in os.environ:
    os.environ[_SUITE] = tempfile.mkdtemp(prefix="equipax-tests-")
_GROUPS = Path(os.environ[_SUITE]) / "groups.json"
# The machine's cache (vocabularies, encoded corpora, checked compiler flags:
# equipax.launch.store.machine_cache) of this run, for the workers and every process they start:
# the suite neither reads nor fills the user's ~/.cache/equipax, and its many fresh jobs on the
# same plays train each vocabulary and encode each corpus once (1.9 -> 0.2 CPU-s of a toy job's
# inputs, measured in-process on shakespeare_tiny).
if "PYTEST_XDIST_WORKER" not in os.environ:
    os.environ["EQUIPAX_CACHE_DIR"] = str(Path(os.environ[_SUITE]) / "machine_cache")


def _share_compiled_programs(cache: Path) -> None:
    """JAX's persistent compilation cache in `cache`, shared by every test of this run, on both
    workers (and by the child processes of the helpers that pass `suite_compile_cache_env()` on):
    an in-process `launch run` (a docs block, a CLI test) builds fresh jitted functions, so without
    it each one compiles the same toy programs again. A hit loads the executable that a compile of
    the same program wrote (the key covers the program, compile options, devices and versions),
    so results are the bits they would be. Safe under concurrent processes: see
    helpers.toy.shared_compile_cache. Set in JAX's config, not the environment, so only the
    children that are never killed mid-write share it. A `launch run` here uses it instead of its
    job's `train.compiler.cache_dir`, as it would under a user's own `JAX_COMPILATION_CACHE_DIR`."""
    from helpers.toy import shared_compile_cache

    for name, value in shared_compile_cache(cache).items():
        jax.config.update(name, value)


_share_compiled_programs(Path(os.environ[_SUITE]) / "compile_cache")


def pytest_collection_modifyitems(config, items):
    """The suite runs on pytest-xdist workers (`-n` in pyproject.toml's addopts, `--dist loadgroup`):
    tests sharing a module-scoped fixture (a trained job, a built venv) stay on one worker, so the
    fixture is built once; every other test goes to whichever worker is free.

    The groups reach the scheduler through a file, not through xdist's own route (an `@group`
    suffix xdist writes into each test's id, which pytest 9 ignores: there each worker built every
    module fixture again). Each worker writes the groups of its collection (all workers collect the
    same tests); `pytest_xdist_make_scheduler` below reads them. Under xdist the `slow` tests are
    handed out first (the groups go first anyway: xdist orders work units by size), so long units
    start early and the short tests fill the end instead of one long test running alone."""
    groups = {}
    for item in items:
        fixturedefs = getattr(item, "_fixtureinfo", None)
        if fixturedefs is not None and any(
            defs and defs[-1].scope == "module" for defs in fixturedefs.name2fixturedefs.values()
        ):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
        marks = sorted({str(m.args[0] if m.args else m.kwargs.get("name")) for m in item.iter_markers("xdist_group")})
        if marks:
            groups[item.nodeid] = "group:" + "_".join(marks)
    if "PYTEST_XDIST_WORKER" in os.environ:
        items.sort(key=lambda i: i.get_closest_marker("slow") is None)
        mine = _GROUPS.with_name(f"{_GROUPS.name}.{os.environ['PYTEST_XDIST_WORKER']}")
        mine.write_text(json.dumps(groups))
        mine.replace(_GROUPS)


class _ModuleFixtureGroups:
    """`--dist loadgroup` with the groups the workers wrote (see pytest_collection_modifyitems);
    a plugin registered only where xdist runs (pytest refuses a conftest hook it does not know)."""

    @staticmethod
    def pytest_xdist_make_scheduler(config, log):
        if config.getvalue("dist") != "loadgroup":
            return None
        from xdist.scheduler import LoadGroupScheduling

        class Scheduling(LoadGroupScheduling):
            groups: dict[str, str] | None = None

            def _split_scope(self, nodeid: str) -> str:
                if self.groups is None:  # read once, after every worker's collection
                    self.groups = json.loads(_GROUPS.read_text())
                return self.groups.get(nodeid) or super()._split_scope(nodeid)

        return Scheduling(config, log)


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist") and "PYTEST_XDIST_WORKER" not in os.environ:
        config.pluginmanager.register(_ModuleFixtureGroups(), "equipax-module-fixture-groups")


def pytest_unconfigure(config):
    if "PYTEST_XDIST_WORKER" not in os.environ:
        shutil.rmtree(os.environ[_SUITE], ignore_errors=True)


@pytest.fixture(autouse=True)
def _xla_default_level(request):
    """A test marked `xla_default_level` compiles at JAX's default options in this process (see the
    top of this file), the suite's setting restored after."""
    if request.node.get_closest_marker("xla_default_level") is None:
        yield
        return
    from helpers.toy import most_optimizations_disabled

    with most_optimizations_disabled(False):
        yield


@pytest.fixture(autouse=True)
def _compiler_flags_restored():
    """In-process `launch run` / `pgle collect` set XLA_FLAGS and LIBTPU_INIT_ARGS (and, on a host
    without TPUs, libtpu's TPU_* variables) in this process's environment (as they must, before JAX
    starts), and a run into a gs:// job TensorStore's endpoint from STORAGE_EMULATOR_HOST
    (`equipax.launch.store.storage.configure_endpoints`); each test gets back the values it started
    with, so one test's settings never reach another's child processes. (A run against a port where
    nothing listens, tests/launch/test_pax_experiments.py, left TensorStore's endpoint pointing
    there: a later GCS test's child on the same worker then waited for ever in its checkpoint save.)"""
    saved = {
        var: os.environ.get(var)
        for var in (
            "XLA_FLAGS",
            "LIBTPU_INIT_ARGS",
            "TPU_ACCELERATOR_TYPE",
            "TPU_WORKER_HOSTNAMES",
            "TPU_WORKER_ID",
            "EQUIPAX_QUIETED_LIBTPU",
            "TENSORSTORE_GCS_HTTP_URL",
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT",
        )
    }
    yield
    for var, value in saved.items():
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value


def _max_map_count() -> int:
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return 65530  # Linux's default


def _mapped_regions() -> int:
    """How many memory mappings this process has (0 where /proc is not Linux's)."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return maps.read().count(b"\n")
    except OSError:
        return 0


# A third of the kernel's limit: a test adds at most a few thousand mappings.
_MAPPINGS_BEFORE_RELEASE = _max_map_count() // 3


@pytest.fixture(autouse=True)
def _compiled_programs_released():
    """Each program XLA:CPU compiles keeps its machine code in three memory mappings (code,
    constants, data) for as long as JAX's in-memory caches hold the executable, and a test worker
    runs hundreds of tests that compile fresh functions (every in-process `launch run` builds new
    jitted steps). The mappings only add up: measured on tests/models alone, about 18,000 after 130
    tests in one process. Past Linux's `vm.max_map_count` (65,530 by default) every further mmap
    fails, and LLVM segfaults inside a compile (`backend_compile_and_load`) or a thread cannot
    start: a worker crashed that way near the end of a full suite run. So once this process holds
    more than a third of the limit, JAX's caches are cleared (`jax.clear_caches()`, which unmaps
    them: 2,658 -> 528 after tests/models/test_lm.py). Later tests recompile what they need, or
    load it from the suite's persistent compile cache."""
    yield
    if _mapped_regions() > _MAPPINGS_BEFORE_RELEASE:
        import gc

        jax.clear_caches()
        gc.collect()
