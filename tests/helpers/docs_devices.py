"""`launch` commands in one long-lived process per simulated device count: the docs' `launch run
... --cpu-devices N` commands (tests/docs/test_docs.py) each need a process whose JAX started with
N CPU devices, but not one of their own: a fresh process per command paid Python's, JAX's and
equipax's start-up (about 2.5 s of CPU) each time. The server runs each command in-process through
the CLI, as the docs tests run the other commands, in the working directory the command names; it
answers with the exit code and the output, so each command still passes or fails on its own.

Run as a script, this module is the server: `python docs_devices.py N` reads one JSON request a
line on stdin (`{"args": [...], "cwd": ..., "reply": path}`), writes `{"code", "output"}` to the
`reply` file, then prints the `DONE` line on stdout."""

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["DeviceServers"]

DONE = "--docs-devices-request-done--"


class DeviceServers:
    """One server process per device count, started on first use; `close` ends them all."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self._servers: dict[int, tuple[subprocess.Popen, Path]] = {}
        self._dir = Path(tempfile.mkdtemp(prefix="docs-devices-"))

    def invoke(self, devices: int, args: list[str], cwd: Path) -> tuple[int, str]:
        """(exit code, output) of `launch *args` run in `cwd` on the server with `devices` devices."""
        if devices not in self._servers:
            log = self._dir / f"stderr-{devices}.txt"
            with log.open("w") as stderr:
                proc = subprocess.Popen(
                    [sys.executable, __file__, str(devices)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=stderr,
                    text=True,
                    env=self.env,
                )
            self._servers[devices] = (proc, log)
        proc, log = self._servers[devices]
        reply = self._dir / "reply.json"
        reply.unlink(missing_ok=True)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps({"args": args, "cwd": str(cwd), "reply": str(reply)}) + "\n")
        proc.stdin.flush()
        printed = []
        for line in proc.stdout:  # what the command printed straight to the file descriptor, then DONE
            if line.rstrip("\n") == DONE:
                answer = json.loads(reply.read_text())
                return answer["code"], "".join(printed) + answer["output"]
            printed.append(line)
        del self._servers[devices]
        _end(proc)
        ended = f"the server on {devices} devices exited ({proc.returncode})"
        return -1, f"{ended}:\n{''.join(printed)}\n{log.read_text()[-6000:]}"

    def close(self) -> None:
        for proc, _ in self._servers.values():
            _end(proc)
        self._servers.clear()
        shutil.rmtree(self._dir, ignore_errors=True)  # the servers' logs and replies


def _end(proc: subprocess.Popen) -> None:
    """Close a server's input (it exits at the end of its requests), wait for it, close its output."""
    assert proc.stdin is not None and proc.stdout is not None
    with contextlib.suppress(BrokenPipeError):  # it had exited already
        proc.stdin.close()
    proc.wait(timeout=60)
    proc.stdout.close()


def _serve(devices: int) -> None:
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", devices)
    assert jax.device_count() == devices, jax.devices()
    from typer.testing import CliRunner

    from equipax.launch.cli import app

    for request in sys.stdin:
        r = json.loads(request)
        os.chdir(r["cwd"])
        result = CliRunner().invoke(app, r["args"])
        answer = {"code": result.exit_code, "output": f"{result.output}\n{result.exception!r}"}
        Path(r["reply"]).write_text(json.dumps(answer))
        print(DONE, flush=True)


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
