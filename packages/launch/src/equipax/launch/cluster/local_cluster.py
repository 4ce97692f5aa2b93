"""`launch local-cluster`: N `launch run` processes on this machine, as N hosts would run.

Each child joins one `jax.distributed` job through a coordinator on a free localhost port,
with CPU collectives (gloo). Output is forwarded line by line with each process's `[pI]`
prefix. If any process fails, the others are stopped (SIGTERM, then SIGKILL after a grace
period) and the command says which process failed and how; the exit code is the failed
process's, or 0 when all succeed.
"""

import collections
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

__all__ = ["describe_exit", "free_port", "run_local_cluster"]


def free_port() -> int:
    """A TCP port on localhost that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def describe_exit(code: int) -> str:
    """'exit code 2' or 'killed by SIGKILL'."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def run_local_cluster(
    num_processes: int,
    args: Sequence[str],
    *,
    cpu_devices: int | None = None,
    grace_s: float = 20.0,
    write: Callable[[str], None] = print,
) -> int:
    """Start `num_processes` copies of `launch <args>` joined into one distributed job.

    Arguments:
        num_processes: how many processes ("hosts").
        args: the `launch` subcommand and its arguments, e.g. `["run", "--exp", "x"]`.
        cpu_devices: simulated CPU devices per process.
        grace_s: how long stopped processes get to exit after SIGTERM before SIGKILL.
        write: where output lines go.

    Returns:
        The combined exit code.
    """
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
    procs: list[subprocess.Popen[str]] = []
    tails: list[collections.deque[str]] = []
    lock = threading.Lock()

    def forward(i: int, stream) -> None:
        for line in stream:
            line = line.rstrip("\n")
            tails[i].append(line)
            with lock:
                write(line if line.startswith(f"[p{i}]") else f"[p{i}] {line}")

    for i in range(num_processes):
        cmd = [
            sys.executable,
            "-m",
            "equipax.launch.cli",
            *args,
            "--coordinator",
            f"127.0.0.1:{port}",
            "--num-processes",
            str(num_processes),
            "--process-id",
            str(i),
        ]
        if cpu_devices is not None:
            cmd += ["--cpu-devices", str(cpu_devices)]
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env, start_new_session=True
        )
        procs.append(proc)
        tails.append(collections.deque(maxlen=15))
    threads = [threading.Thread(target=forward, args=(i, p.stdout), daemon=True) for i, p in enumerate(procs)]
    for t in threads:
        t.start()

    def stop_all(sig: int) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(sig)

    interrupted = {"n": 0}

    def on_signal(signum, frame):  # forward a user's Ctrl-C / SIGTERM: graceful stop
        interrupted["n"] += 1
        stop_all(signal.SIGKILL if interrupted["n"] > 1 else signal.SIGTERM)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    failed: tuple[int, int] | None = None
    try:
        while any(p.poll() is None for p in procs):
            for i, p in enumerate(procs):
                code = p.poll()
                if code not in (None, 0) and failed is None and not interrupted["n"]:
                    failed = (i, code)
                    stop_all(signal.SIGTERM)
                    deadline = time.monotonic() + grace_s
                    while any(q.poll() is None for q in procs) and time.monotonic() < deadline:
                        time.sleep(0.1)
                    stop_all(signal.SIGKILL)
            time.sleep(0.1)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        for t in threads:
            t.join(timeout=5)
    codes = [p.wait() for p in procs]
    if failed is not None:
        i, code = failed
        write(
            f"local-cluster: process {i} (pid {procs[i].pid}) failed: {describe_exit(code)}; "
            f"stopped the other {num_processes - 1}. Its last lines:"
        )
        for line in tails[i]:
            write(f"    {line}")
        return code if code > 0 else 1
    nonzero = [c for c in codes if c != 0]
    return nonzero[0] if nonzero and nonzero[0] > 0 else (1 if nonzero else 0)
