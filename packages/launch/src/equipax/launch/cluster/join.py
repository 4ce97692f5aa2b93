"""Joining a multi-process job: the flags, `jax.distributed.initialize`, and a watchdog while it assembles.

`launch run` gives every process the same job: explicit `--coordinator/--num-processes/--process-id`,
a SLURM / Open MPI job that `cluster.detect` read from the environment, or `--distributed-auto` left
to JAX (Cloud TPU). While the processes find each other a line is logged every `WAIT_LOG_EVERY_S`
seconds, and a job that has not started after `--coordinator-timeout` ends with exit 2 and a message
naming the coordinator, instead of JAX's C++ abort.
"""

import dataclasses
import os
import socket
import sys
import threading
import time
from collections.abc import Callable

import jax

from equipax.core.knobs import ConfigError
from equipax.launch.cluster.detect import ClusterJob
from equipax.launch.exit_codes import EXIT_USER_ERROR

__all__ = ["DistributedArgs", "initialize", "parse_coordinator", "WAIT_LOG_EVERY_S"]


@dataclasses.dataclass(frozen=True)
class DistributedArgs:
    """How to join a multi-process job (all None/False: a single process).

    `auto` leaves the detection to JAX (Cloud TPU); a job equipax detected itself (SLURM, Open MPI:
    `cluster.detect`) arrives as explicit values with `scheduler` naming where they came from.
    """

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    auto: bool = False
    heartbeat_timeout_s: int = 60
    coordinator_timeout_s: float = 300.0  # --coordinator-timeout: the wait for the job to start
    local_device_ids: tuple[int, ...] | None = None  # None: every device of the host
    scheduler: str | None = None

    def joining(self, job: ClusterJob) -> "DistributedArgs":
        """These flags with the detected job's coordinator, process count and index."""
        return dataclasses.replace(
            self,
            auto=False,
            coordinator=job.coordinator,
            num_processes=job.num_processes,
            process_id=job.process_id,
            local_device_ids=job.local_device_ids,
            scheduler=job.scheduler,
        )

    @property
    def requested(self) -> bool:
        return self.auto or self.coordinator is not None or (self.num_processes or 1) > 1


def initialize(args: DistributedArgs, *, log: Callable[[str], object] | None = None) -> None:
    """Join the job (no-op for a single process). Must run before any JAX computation.

    With explicit `coordinator`/`num_processes`/`process_id` these are used (and JAX's own cluster
    detection is off, so it cannot restrict a process to one GPU behind them); with `auto`, JAX
    detects the job (Cloud TPU). On CPUs, collectives use gloo.
    A peer that disappears is detected by the coordination service's heartbeat after
    `heartbeat_timeout_s`, which stops the others with an error instead of hanging.

    While the job assembles, a line is logged every `WAIT_LOG_EVERY_S` seconds; if it has not
    started after `coordinator_timeout_s`, the process exits 2 naming the coordinator (JAX itself
    would abort with a C++ stack trace, exit 134).

    Arguments:
        args: the flags.
        log: where the waiting lines go (default: stderr).

    Raises:
        ConfigError: incomplete or malformed flags, or the job could not be joined (message says why).
    """
    if not args.requested:
        return
    if not args.auto:
        missing = [
            n
            for n, v in (
                ("--coordinator", args.coordinator),
                ("--num-processes", args.num_processes),
                ("--process-id", args.process_id),
            )
            if v is None
        ]
        if missing:
            raise ConfigError(
                f"Multi-process run: {', '.join(missing)} missing. Give all of --coordinator HOST:PORT "
                "--num-processes N --process-id I, or --distributed-auto on Cloud TPU / SLURM / Open MPI, "
                "or use `launch local-cluster` to start N processes on this machine."
            )
        assert args.num_processes is not None and args.process_id is not None and args.coordinator is not None
        if args.num_processes < 1:
            raise ConfigError(f"--num-processes must be >= 1; got {args.num_processes}.")
        if not 0 <= args.process_id < args.num_processes:
            raise ConfigError(
                f"--process-id {args.process_id} is outside 0..{args.num_processes - 1} (--num-processes)."
            )
        parse_coordinator(args.coordinator)
    if not args.coordinator_timeout_s > 0:
        raise ConfigError(f"--coordinator-timeout must be > 0 seconds; got {args.coordinator_timeout_s}.")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    started = threading.Event()
    watchdog = threading.Thread(target=_watch_start, args=(args, started, log or _stderr), daemon=True)
    watchdog.start()
    try:
        jax.distributed.initialize(
            coordinator_address=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
            local_device_ids=list(args.local_device_ids) if args.local_device_ids is not None else None,
            cluster_detection_method=None if args.auto else "deactivate",
            # Ours fires first and exits cleanly; JAX's own timeout aborts the process.
            initialization_timeout=int(args.coordinator_timeout_s) + 60,
            heartbeat_timeout_seconds=args.heartbeat_timeout_s,
        )
    except (RuntimeError, ValueError) as e:
        if args.auto and args.coordinator is None:
            raise ConfigError(
                f"--distributed-auto found no multi-host job to join ({e}): this process was not started by "
                "srun (SLURM), by mpirun (Open MPI), nor on a Cloud TPU VM. Start it with one of these, give "
                "--coordinator HOST:PORT --num-processes N --process-id I, or drop --distributed-auto for a "
                "single process."
            ) from None
        raise ConfigError(
            f"Could not join the distributed job (coordinator {args.coordinator or 'auto-detected'}, "
            f"process {args.process_id} of {args.num_processes}{_source(args)}): {e}. Check that every process "
            f"was started with the same --coordinator and --num-processes, and that the coordinator "
            f"(process 0) is reachable."
        ) from None
    finally:
        started.set()


WAIT_LOG_EVERY_S = 15.0


def parse_coordinator(address: str) -> tuple[str, int]:
    """`HOST:PORT` -> (host, port); ConfigError naming the expected form otherwise."""
    host, sep, port = address.strip().rpartition(":")
    host = host.strip("[]")  # [::1]:1234
    if not sep or not host or any(c.isspace() for c in host) or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"--coordinator {address!r} is not HOST:PORT (e.g. 10.0.0.2:1234 or node0:1234): the address "
            "and a free TCP port of process 0's machine, the same for every process."
        )
    return host, int(port)


def _source(args: DistributedArgs) -> str:
    return f", from {args.scheduler}'s environment" if args.scheduler else ""


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _watch_start(args: DistributedArgs, started: threading.Event, log: Callable[[str], object]) -> None:
    """Log while the job assembles; exit 2 with a message when it has not started in time."""
    who = (
        f"process {args.process_id} of {args.num_processes}{_source(args)}"
        if args.process_id is not None
        else "this process (auto-detected job)"
    )
    where = args.coordinator or "auto-detected"
    timeout = args.coordinator_timeout_s
    log(
        f"Joining the distributed job as {who}: coordinator {where}; waiting up to {timeout:.0f} s "
        "(--coordinator-timeout)."
    )
    t0 = time.monotonic()
    while not started.wait(min(WAIT_LOG_EVERY_S, max(timeout - (time.monotonic() - t0), 0.0))):
        waited = time.monotonic() - t0
        if waited >= timeout:
            break
        log(
            f"Still waiting for the distributed job to start ({who}, coordinator {where}): "
            f"{waited:.0f} s of {timeout:.0f} s."
        )
    if started.is_set():
        return
    reachable = _reachable(args.coordinator) if args.coordinator else None
    if args.scheduler:
        why = (
            f"not all {args.num_processes} processes of the {args.scheduler} job reached the coordinator "
            f"{where} (process 0's node, port from the job id; JAX_COORDINATOR_PORT sets another): check "
            "that every task runs the same command and that the port is open between the nodes"
        )
    elif reachable is False:
        why = (
            f"nothing accepts connections at {where}: check that process 0 was started with "
            f"--coordinator {where} on that machine, and that the host name resolves and the port "
            "is open between the machines"
        )
    else:
        why = (
            f"the coordinator {where} is reachable but not all {args.num_processes or 'the'} processes "
            "joined: check that each was started with the same --coordinator and --num-processes "
            "and a distinct --process-id"
        )
    message = (
        f"The distributed job did not start within {timeout:.0f} s ({who}): {why}. "
        "--coordinator-timeout SECONDS sets how long to wait."
    )
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    os._exit(EXIT_USER_ERROR)  # JAX's join blocks in C++ and would abort the process later


def _reachable(address: str) -> bool:
    try:
        host, port = parse_coordinator(address)
        with socket.create_connection((host, port), timeout=2.0):
            return True
    except (OSError, ConfigError):
        return False
