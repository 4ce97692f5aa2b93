"""Several `launch` commands in ONE fresh process with N simulated CPU devices (helpers.parts): one
Python, JAX and equipax start-up (about 2 s of CPU) for a module's `launch compile`s on the same
device count, not one per command. Each command runs through the CLI as the console script runs it
(typer's CliRunner: exit code, stdout and stderr kept apart), and fails or passes on its own."""

import json
import subprocess

from helpers.parts import part_stdout, run_parts_with_devices

__all__ = ["launch_with_devices"]

_COMMAND = """
import json, traceback
from typer.testing import CliRunner
from equipax.launch.cli import app

result = CliRunner().invoke(app, ARGS)
stderr = result.stderr
if result.exc_info is not None and not isinstance(result.exception, SystemExit):  # a crash: its traceback
    stderr += "".join(traceback.format_exception(*result.exc_info))
print(json.dumps({"returncode": result.exit_code, "stdout": result.stdout, "stderr": stderr}))
"""


def launch_with_devices(commands: dict[str, list[str]], devices: int = 8) -> dict[str, subprocess.CompletedProcess]:
    """Run each of `commands` ({name: launch arguments}) in turn, in one child with `devices` CPU
    devices, on the suite's compile cache (`run_with_devices`); return {name: the command's exit
    code, stdout and stderr}, as `subprocess.run` gives them for `launch ...` on its own."""
    parts = {name: f"ARGS = {json.dumps([str(a) for a in args])}\n{_COMMAND}" for name, args in commands.items()}
    results = run_parts_with_devices(parts, devices=devices)
    out = {}
    for name, args in commands.items():
        r = json.loads(part_stdout(results, name).splitlines()[-1])
        out[name] = subprocess.CompletedProcess(["launch", *args], r["returncode"], r["stdout"], r["stderr"])
    return out
