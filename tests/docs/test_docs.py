"""Run the code blocks and commands of README.md and docs/*.md, so the docs cannot drift.

Fenced blocks are run by language: `python` blocks are executed, `bash` blocks run each
`uv run launch ...` line through the CLI in-process (`launch run` at toy size in a temporary job
directory). Markers after the language (```` ```bash no-run ````; docs_hooks.TEST_MARKERS, which
the site's build strips): `no-run` (not run: e.g. `uv run pytest` itself, external tools),
`needs-hardware` (needs accelerators or data we don't have), `expect-fail` (must exit with the
user-error code 2), `gcs-emulator` (run by tests/launch/test_object_storage.py against a GCS
emulator). Any other command in a runnable block is an error: mark it.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO
from helpers.docs_devices import DeviceServers
from helpers.toy import (
    CNN_SHORT,
    FAST_COMPILE,
    SMOKE_SHORT,
    TOY_SHORT,
    fast_compile_in_process,
    set_args,
    suite_compile_cache_env,
    with_xla_flags,
)

sys.path.insert(0, str(REPO))
from docs_hooks import TEST_MARKERS, code_blocks

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# One worker runs every block: one server per device count (`device_servers`) for the whole suite,
# and a block's first `launch run` reuses the job of the same command run before (`_FRESH_JOBS`).
pytestmark = pytest.mark.xdist_group("docs")
SKIP_MARKERS = {"no-run", "needs-hardware", "gcs-emulator"}


def blocks():
    for path in DOCS:
        for block in code_blocks(path.read_text()):
            if block.lang not in ("python", "bash") or SKIP_MARKERS & set(block.markers):
                continue
            yield pytest.param(block.lang, set(block.markers), block.body, id=f"{path.name}:{block.line}")


def test_fence_markers_are_known():
    """A misspelt marker (`no_run`) would run a block meant to be skipped, and break its fence on
    the site: every word after a fence's language is one of TEST_MARKERS."""
    unknown = [
        f"{path.name}:{block.line}: {word!r}"
        for path in DOCS
        for block in code_blocks(path.read_text())
        for word in block.markers
        if word not in TEST_MARKERS
    ]
    assert not unknown, f"unknown code-fence markers (known: {sorted(TEST_MARKERS)}): {unknown}"


def _split_option(arg: str) -> list[str]:
    """`--exp=X` as `--exp X` (the CLI takes both; the runner finds an option by its word)."""
    return arg.split("=", 1) if arg.startswith("--") and "=" in arg else [arg]


# {a block's first command, as run (its job directory left out): the job directory it wrote}, kept
# across the blocks of a run.
_FRESH_JOBS: dict[tuple[str, ...], Path] = {}


def run_command(
    words: list[str], expect_fail: bool, tmp_path: Path, devices: DeviceServers, first: bool = False
) -> None:
    from typer.testing import CliRunner

    from equipax.launch.cli import app
    from equipax.launch.experiments.registry import get_experiment

    assert words[:3] == ["uv", "run", "launch"], (
        f"documented command {' '.join(words)!r} is not run by the docs tests; mark its block no-run"
    )
    from equipax.launch.errors import pax_spellings

    # Pax's spellings (`--exp=X`, `--job_log_dir=X`; docs/coming_from_pax.md) as the runner reads options.
    args = [part for arg in pax_spellings(words[3:]) for part in _split_option(arg)]
    continues = (
        args[:1] == ["run"]
        and "--exp" not in args
        and "--job-log-dir" in args
        and not Path(job := args[args.index("--job-log-dir") + 1]).is_absolute()
        and (tmp_path / job / "config.json").exists()
    )
    if continues:
        pass  # `launch run --job-log-dir JOB` continues a job this block made (hf-import): as written
    elif args and args[0] == "run":
        if "--job-log-dir" in args:
            i = args.index("--job-log-dir")
            del args[i : i + 2]
        exp = args[args.index("--exp") + 1] if "--exp" in args else ""
        # _smoke experiments are already small (and their meshes fix the batch), and experiments
        # that start from a fixture checkpoint (model.init_from) keep its shape: only shorten.
        small = exp.endswith("_smoke") or bool(exp and getattr(get_experiment(exp).model, "init_from", None))
        toy = SMOKE_SHORT if small else CNN_SHORT if exp.startswith("cnn_") else TOY_SHORT
        if toy is TOY_SHORT and not any(arg.startswith("train.sample.") for arg in args):
            # No end-of-run sample (its decode program is a compile of its own, ~2 s of CPU per
            # run): only the exit code is checked here, and `launch run`'s sample is checked by
            # the CLI tests (TOY_SHORT's, tests/launch/test_reliability2.py) and
            # tests/launch/test_launch_decode.py; the docs' `launch decode` commands still decode.
            toy = [*toy, "train.sample.tokens=0"]
        args += ["--job-log-dir", str(tmp_path / "job"), *set_args(toy)]
    if args[:1] in (["decode"], ["eval"]) and "--job-log-dir" in args:
        i = args.index("--job-log-dir") + 1
        if not (tmp_path / args[i]).exists():
            args[i] = str(tmp_path / "job")  # the job the block's `launch run` wrote
    if "--cpu-devices" in args and args[:1] == ["run"]:
        # The device count is fixed when JAX starts: in a process that started with that many, one
        # per count for every block of this run (helpers.docs_devices), on the suite's compile cache
        # and with FAST_COMPILE (only the exit code is checked).
        code, output = devices.invoke(int(args[args.index("--cpu-devices") + 1]), args, tmp_path)
    elif "--cpu-devices" in args or args[:1] == ["compile"]:
        # The device count is fixed when JAX starts: run in a fresh process, as a user would.
        # Only the exit code is checked: XLA:CPU may compile runs with less optimisation (a smoke
        # run on 8 devices: ~30% less CPU). Not `compile`, whose report is the output.
        fast = FAST_COMPILE if args[:1] in (["run"], ["local-cluster"]) else ""
        env = with_xla_flags({**os.environ, **suite_compile_cache_env()}, fast)
        proc = subprocess.run(
            [sys.executable, "-m", "equipax.launch.cli", *args], capture_output=True, text=True, timeout=600, env=env
        )
        code, output = proc.returncode, proc.stdout + proc.stderr
    else:
        # A block's first command reads nothing the block wrote (only the repository): the same
        # fresh `launch run` again (the three blocks of docs/decoding.md that start with `launch run
        # --exp shakespeare_tiny`, README.md's and quickstart.md's `launch run`) writes the job the
        # first one wrote, so a later block in this process copies that job as the run left it (the
        # commands after it, which read it, still run); the first with each command line runs it.
        job = tmp_path / "job"
        key = (
            tuple(args[: args.index("--job-log-dir")] + args[args.index("--job-log-dir") + 2 :])
            if (first and args[:1] == ["run"] and not expect_fail and not job.exists())
            else None
        )
        if key is not None and key in _FRESH_JOBS:
            shutil.copytree(_FRESH_JOBS[key], job, symlinks=True)
            return
        # In-process: the cheaper compile options, as FAST_COMPILE gives the children above (only
        # the exit code is checked).
        with fast_compile_in_process():
            result = CliRunner().invoke(app, args)
        code, output = result.exit_code, f"{result.output}\n{result.exception!r}"
        if key is not None and code == 0:  # as the run left it (the block's later commands add to it)
            _FRESH_JOBS[key] = shutil.copytree(job, tmp_path.with_name(f"{tmp_path.name}-fresh-job"), symlinks=True)
    if expect_fail:
        assert code == 2, output
        assert "Traceback" not in output
    else:
        assert code == 0, f"{' '.join(words)}\n{output}"


@pytest.fixture(scope="session")
def device_servers():
    """The processes that run `launch run --cpu-devices N` commands, one per N (helpers.docs_devices)."""
    servers = DeviceServers(with_xla_flags({**os.environ, **suite_compile_cache_env()}, FAST_COMPILE))
    yield servers
    servers.close()


@pytest.mark.parametrize("lang, flags, code", list(blocks()))
def test_doc_block(lang, flags, code, tmp_path, monkeypatch, device_servers):
    # Every block's fresh jobs on the same plays train each vocabulary and encode each corpus once
    # in this suite: the machine's cache (`EQUIPAX_CACHE_DIR`, set in tests/conftest.py).
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tests").symlink_to(REPO / "tests")  # commands name the repository's fixtures
    if lang == "python":
        exec(compile(code, "<doc>", "exec"), {"__name__": "__doc__"})
        return
    commands = [cmd for cmd in (re.sub(r"\s+#.*$", "", line).strip() for line in code.splitlines()) if cmd]
    for i, line in enumerate(commands):
        run_command(shlex.split(line), "expect-fail" in flags, tmp_path, device_servers, first=i == 0)


def test_docs_exist():
    assert len(DOCS) >= 3 and all(p.exists() for p in DOCS)
