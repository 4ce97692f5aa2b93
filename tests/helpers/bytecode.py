"""Bytecode for every installed module, compiled once, before the suite starts its processes.

Where `PYTHONDONTWRITEBYTECODE` is set (this machine's shells set it) and the environment was
installed without bytecode (`uv sync`'s default), every Python process the suite starts (the
xdist workers, each `launch` subprocess, each multi-host rank, each simulated-devices child)
compiles the sources of jax, orbax, matplotlib and equipax again: measured on a `launch run` of
`c4_22b_2x_smoke` on 8 simulated devices, 17.5-18.1 s of CPU without `.pyc` files, 13.7-14.1 s
with them (py-spy: ~35% of its samples were in `source_to_code`).

Python reads a `.pyc` beside its source whatever `PYTHONDONTWRITEBYTECODE` says; that variable
only stops processes writing them. So where it is set, the controller writes them all, in one
process, before any other starts (`compileall` writes each file atomically); the suite's processes
only read them. A suite whose processes shared one writable bytecode cache once failed 22 tests
with 'EOFError: marshal data too short': Python writes a `.pyc` to a temporary file and renames it
into place, but does not check that the write was whole, and a process under a file-size limit
(the disk-full tests) writes a short one.

The installed packages are compiled when their set changes (a stamp in the environment names
them); the workspace's sources (edited between runs) every time, a few seconds when they are
up to date. A `.pyc` whose source changed is ignored by Python (its timestamp no longer matches),
so stale bytecode is never run.

Where processes may write bytecode (PYTHONDONTWRITEBYTECODE unset: a user's machine, and `.ci/run`,
which unsets it), the suite compiles nothing first: each module is compiled by the first process
that imports it, which writes its `.pyc` through a temporary file renamed into place (a killed
process leaves no half-written one), and only what the suite's processes import is compiled:
compiling every installed module first took 17.4 CPU-s of the default environment, the imports of
a `launch run` and the suite's tools 4.1 (2026-12-06, a copy of the environment without bytecode).
A process the suite runs under a file-size limit (a full disk's EFBIG, `launch_process`) gets
PYTHONDONTWRITEBYTECODE back: a write cut short by the limit would be renamed into place whole.
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
