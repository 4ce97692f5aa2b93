"""A pytest plugin that writes each test's CPU time to a file, for finding where the suite's time
goes (benchmarks/README.md, "The suite's time"); never loaded by default:

    EQUIPAX_TEST_CPU=/tmp/cpu uv run pytest -p helpers.cputime tests/launch

Each process that runs tests (the controller under `-n 0`, or each xdist worker) appends to
`$EQUIPAX_TEST_CPU.<worker>.tsv` one line per test: its CPU seconds (user + system of this process
and of the child processes it waited for, `resource.getrusage` before and after the test's setup,
call and teardown), its wall seconds, when it started (Unix time) and its node id. Sort the
files' lines together to rank the tests. A child that is still running when the test ends (a
server a module fixture keeps) is counted in the test whose teardown waits for it; a fixture
shared by a module's tests is counted in the first test that uses it."""

import os
import resource
import time

import pytest


def _cpu() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    prefix = os.environ.get("EQUIPAX_TEST_CPU")
    if not prefix:
        yield
        return
    start, cpu = time.time(), _cpu()
    yield
    cpu, wall = _cpu() - cpu, time.time() - start
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(f"{prefix}.{worker}.tsv", "a") as out:
        out.write(f"{cpu:.2f}\t{wall:.2f}\t{start:.1f}\t{item.nodeid}\n")
