"""Several `launch` command lines in ONE fresh process, one after another: one Python, JAX and
equipax start-up (about 2 s of CPU) for all of them, and programs compiled for one line are read
back from the persistent compile cache by the next (in-process runs build fresh jitted functions).
The lines must ask for the same simulated device count (JAX starts once)."""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["launch_in_one_process"]

# Each line starts in the environment the process started with, as a line typed into a shell does:
# a run sets its compiler flags in the environment (c4_22b_2x's LIBTPU_INIT_ARGS), and JAX hashes
# those variables into its cache key, so left set they made the lines after it miss the programs
# the lines before it compiled.
_RUNNER = """
import json, os, sys
from typer.testing import CliRunner
from equipax.launch.cli import app
results, shell = [], dict(os.environ)
for args in json.loads(sys.argv[2]):
    r = CliRunner().invoke(app, args)
    results.append((r.exit_code, r.output + (repr(r.exception) if r.exit_code else "")))
    os.environ.clear()
    os.environ.update(shell)
with open(sys.argv[1], "w") as f:
    json.dump(results, f)
"""


def launch_in_one_process(commands: list[list[str]], env: dict[str, str], timeout: float = 900) -> list:
    """Run each of `commands` (`launch`'s arguments, e.g. `["run", "--exp", ...]`) in turn in one
    child with environment `env`; return [(exit code, output), ...], one per command. Fails the
    calling test with the child's output if the child itself fails."""
    with tempfile.TemporaryDirectory() as tmp:
        results = Path(tmp) / "results.json"
        proc = subprocess.run(
            [sys.executable, "-c", _RUNNER, str(results), json.dumps([[str(a) for a in c] for c in commands])],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return [tuple(r) for r in json.loads(results.read_text())]
