"""Multi-host runs on JAX's own multi-controller runtime (`jax.distributed`).

One process per host runs the same command. Process 0 writes the job directory's files;
every process feeds its own input shard and takes part in checkpoints. The per-host data
iterator states are gathered into one JSON object so a resumed run gives every host its own.
"""

import dataclasses
import json
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from rich.console import Console

from equipax.core.config import ConfigError


@dataclasses.dataclass(frozen=True)
class DistributedArgs:
    """How to join a multi-process job (all None/False: a single process)."""

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    auto: bool = False
    heartbeat_timeout_s: int = 60
    init_timeout_s: int = 120

    @property
    def requested(self) -> bool:
        return self.auto or self.coordinator is not None or (self.num_processes or 1) > 1


def initialize(args: DistributedArgs) -> None:
    """Join the job (no-op for a single process). Must run before any JAX computation.

    With explicit `coordinator`/`num_processes`/`process_id` these are used; with `auto`, JAX
    detects Cloud TPU, SLURM or Open MPI from the environment. On CPUs, collectives use gloo.
    A peer that disappears is detected by the coordination service's heartbeat after
    `heartbeat_timeout_s`, which stops the others with an error instead of hanging.

    Raises:
        ConfigError: incomplete flags, or the job could not be joined (message says why).
    """
    if not args.requested:
        return
    if not args.auto:
        missing = [n for n, v in (("--coordinator", args.coordinator), ("--num-processes", args.num_processes),
                                  ("--process-id", args.process_id)) if v is None]
        if missing:
            raise ConfigError(
                f"Multi-process run: {', '.join(missing)} missing. Give all of --coordinator HOST:PORT "
                "--num-processes N --process-id I, or --distributed-auto on Cloud TPU / SLURM / Open MPI, "
                "or use `launch local-cluster` to start N processes on this machine."
            )
        assert args.num_processes is not None and args.process_id is not None
        if not 0 <= args.process_id < args.num_processes:
            raise ConfigError(
                f"--process-id {args.process_id} is outside 0..{args.num_processes - 1} (--num-processes)."
            )
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            coordinator_address=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
            initialization_timeout=args.init_timeout_s,
            heartbeat_timeout_seconds=args.heartbeat_timeout_s,
        )
    except (RuntimeError, ValueError) as e:
        raise ConfigError(
            f"Could not join the distributed job (coordinator {args.coordinator or 'auto-detected'}, "
            f"process {args.process_id} of {args.num_processes}): {e}. Check that every process "
            f"was started with the same --coordinator and --num-processes, and that the coordinator "
            f"(process 0) is reachable."
        ) from None


def is_primary() -> bool:
    """True on the process that writes the job directory's files."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process reaches this point (no-op for one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def gather_host_states(state: dict[str, Any]) -> dict[str, Any]:
    """Collect every host's JSON-able iterator state into `{"hosts": [state_0, ...]}`."""
    if jax.process_count() == 1:
        return {"hosts": [state]}
    data = np.frombuffer(json.dumps(state).encode(), dtype=np.uint8)
    lengths = multihost_utils.process_allgather(np.array([data.size], np.int32))
    width = int(np.max(lengths))
    padded = np.zeros((width,), np.uint8)
    padded[: data.size] = data
    rows = multihost_utils.process_allgather(padded)
    states = [json.loads(bytes(rows[i, : int(lengths[i, 0])]).decode()) for i in range(rows.shape[0])]
    return {"hosts": states}


def host_state(saved: dict[str, Any]) -> dict[str, Any]:
    """This host's iterator state from a gathered checkpoint entry.

    Raises:
        ConfigError: the checkpoint was written by a different number of hosts.
    """
    hosts = saved.get("hosts")
    if hosts is None:  # written by a single-process run before host states were gathered
        hosts = [saved]
    if len(hosts) != jax.process_count():
        raise ConfigError(
            f"The checkpoint holds the input state of {len(hosts)} host(s) but this run has "
            f"{jax.process_count()} processes. Resume with the same number of processes, or start "
            "a new --job-log-dir."
        )
    return hosts[jax.process_index()]


class HostConsole(Console):
    """A console whose lines start with `[pI]` when the job has several processes."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._prefix = f"[p{jax.process_index()}] " if jax.process_count() > 1 else ""

    def print(self, *objects: Any, **kwargs: Any) -> None:  # type: ignore[override]
        if self._prefix and objects and isinstance(objects[0], str):
            # Escape the bracket so rich markup does not read "[p0]" as a style.
            prefix = self._prefix if kwargs.get("markup") is False else "\\" + self._prefix
            objects = (prefix + objects[0], *objects[1:])
        super().print(*objects, **kwargs)


def any_process(flag: bool) -> bool:
    """True if `flag` is set on any process (a host sync when there are several)."""
    if jax.process_count() == 1:
        return flag
    return bool(np.any(multihost_utils.process_allgather(np.array([flag]))))


def to_host(tree: Any) -> Any:
    """Device values -> numpy on this host; replicated global arrays read their local copy."""

    def one(x: Any) -> Any:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(x.addressable_data(0))
        return np.asarray(x)

    return jax.tree.map(one, tree)
