"""The launch CLI in-process: invoke a command, run the toy experiment, snapshot a job directory,
check a one-paragraph error."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from helpers.toy import TOY, fast_compile_in_process, set_args, suite_compile_cache_env

FAST = [
    *TOY,
    "data.tokenizer=byte",
    "train.sample.tokens=0",
    "train.log_every=1",
    "train.eval_every=4",
    "train.checkpoint_every=2",
    "train.keep_checkpoints=3",
]


def invoke(*args):
    from typer.testing import CliRunner

    from equipax.launch.cli import app

    with fast_compile_in_process():  # behaviour, not numbers recorded at XLA's default level
        result = CliRunner().invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


def run(job, *overrides, exp="shakespeare_tiny"):
    return invoke("run", "--exp", exp, "--job-log-dir", job, *set_args([*FAST, *overrides]))


def snapshot(root: Path) -> dict[str, str]:
    """Every file of a job directory and its digest, but JAX's compilation cache (`compile_cache/`,
    `train.compiler.cache_dir`): a refused run may add a compiled program there, no record of the job."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.relative_to(root).parts[0] != "compile_cache"
    }


def assert_one_paragraph(output: str, *needles: str):
    assert "Traceback" not in output, output
    assert "error:" in output, output
    for n in needles:
        assert n in output, output


def launch_process(*args, file_size_limit: int | None = None) -> subprocess.CompletedProcess:
    """`launch ...` as its own process; `file_size_limit`: no file it writes grows past this many
    bytes (EFBIG: what a full disk does to a write), set inside the child. On the suite's compile
    cache, but under a file-size limit (a truncated entry would stay there for every later test)."""
    limit = (
        f"import resource; resource.setrlimit(resource.RLIMIT_FSIZE, ({file_size_limit}, {file_size_limit})); "
        if file_size_limit
        else ""
    )
    entry = (
        f"import runpy, sys; {limit}sys.argv[0] = 'launch'; runpy.run_module('equipax.launch.cli', run_name='__main__')"
    )
    return subprocess.run(
        [sys.executable, "-c", entry, *map(str, args)],
        capture_output=True,
        text=True,
        # Under the limit, no bytecode written either: a `.pyc` cut short would stay for every later
        # process (tests/helpers/bytecode.py).
        env={
            **os.environ,
            **({"PYTHONDONTWRITEBYTECODE": "1"} if file_size_limit else suite_compile_cache_env()),
            "JAX_PLATFORMS": "cpu",
        },
        timeout=300,
    )
