"""Bytecode for every installed module, compiled once, before the suite starts its processes.

Where `PYTHONDONTWRITEBYTECODE` is set (this machine's shells set it) and the environment was
installed without bytecode (`uv sync`'s default), every Python process the suite starts (the
xdist workers, each `launch` subprocess, each multi-host rank, each simulated-devices child)
compiles the sources of jax, orbax, matplotlib and equipax again: measured on a `launch run` of
`c4_22b_2x_smoke` on 8 simulated devices, 17.5-18.1 s of CPU without `.pyc` files, 13.7-14.1 s
with them (py-spy: ~35% of its samples were in `source_to_code`).

Python reads a `.pyc` beside its source whatever `PYTHONDONTWRITEBYTECODE` says; that variable
only stops processes writing them. So the controller writes them all, in one process, before any
other starts (`compileall` writes each file atomically); the suite's processes only read them.
Letting every process write them instead failed: a suite whose processes shared one writable
bytecode cache failed 22 tests with 'EOFError: marshal data too short' (processes killed mid-write,
or under a file-size limit as in the disk-full tests, can leave truncated files).

The installed packages are compiled when their set changes (a stamp in the environment names
them); the workspace's sources (edited between runs) every time, a few seconds when they are
up to date. A `.pyc` whose source changed is ignored by Python (its timestamp no longer matches),
so stale bytecode is never run.

A run of a few tests in one process, none of which limits a file's size (`.ci/run`'s
compatibility jobs, each in a new environment), skips this with `EQUIPAX_TEST_PRECOMPILE=0` and
`PYTHONDONTWRITEBYTECODE` unset: Python then writes the bytecode of only what its processes import
(atomically, through a temporary file), where compiling every installed module first took 21 of
172 CPU-s of the Python 3.11 job (2026-12-06: 151 CPU-s that way).
"""

import contextlib
import hashlib
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from helpers import REPO

_STAMP = Path(sys.prefix) / "equipax-tests-bytecode"


def _installed() -> tuple[list[str], str]:
    """The installed-packages directories and a key of what is installed there."""
    dirs = sorted({sysconfig.get_paths()[k] for k in ("purelib", "platlib")})
    names = sorted(n for d in dirs if os.path.isdir(d) for n in os.listdir(d) if n.endswith(".dist-info"))
    return dirs, hashlib.sha256("\n".join([sys.version, *dirs, *names]).encode()).hexdigest()


# Installed files no process of the suite imports: other projects' own test suites, and the
# packages only cfn-lint needs (moto's CloudFormation linter, which the S3 emulator never loads).
# Together 35% of the compile: 8.9 of 25.5 CPU-s for the default environment (measured by
# compiling every installed file in one process, 2026-12-06).
_NEVER_IMPORTED = r"/site-packages/(sympy|networkx|cfnlint)/|/site-packages/.*/tests/"


def _compileall(dirs: list[str]) -> None:
    # Best effort: a few installed files (test data of other projects) are not valid Python; those
    # are skipped, and everything else is compiled.
    subprocess.run(
        [sys.executable, "-m", "compileall", "-qq", "-j", "0", "-x", _NEVER_IMPORTED, *dirs],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=False,
    )


def compile_bytecode() -> None:
    """Write `.pyc` files for the installed packages (when they changed) and the workspace."""
    dirs, key = _installed()
    try:
        current = _STAMP.read_text() == key
    except OSError:
        current = False
    workspace = [str(p) for p in sorted((REPO / "packages").glob("*/src"))]
    _compileall(workspace if current else [*dirs, *workspace])
    if not current:
        with contextlib.suppress(OSError):  # a read-only environment: compiled again next time
            _STAMP.write_text(key)
