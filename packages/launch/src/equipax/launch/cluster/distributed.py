"""Multi-host runs on JAX's own multi-controller runtime (`jax.distributed`).

One process per host runs the same command. Process 0 writes the job directory's files;
every process feeds its own input shard and takes part in checkpoints. An input with a global
data order saves one state for all hosts; the states of per-host inputs are gathered into one
JSON object so a resumed run gives every host its own.
Joining the job (`DistributedArgs`, `initialize`) is `cluster.join`'s.
"""

import json
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from rich.console import Console

from equipax.core.knobs import ConfigError

__all__ = [
    "any_process",
    "barrier",
    "gather_host_states",
    "host_state",
    "HostConsole",
    "is_primary",
    "sum_over_processes",
    "to_host",
]


def is_primary() -> bool:
    """True on the process that writes the job directory's files."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process reaches this point (no-op for one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def gather_host_states(state: dict[str, Any], *, global_state: bool = False) -> dict[str, Any]:
    """The input state to checkpoint: `{"global": state}` for an input whose state is the same on
    every host (`BaseInput.global_state`: written once, resumable on any number of hosts), else
    every host's state collected into `{"hosts": [state_0, ...]}`.

    Raises:
        RuntimeError: a global state differs between hosts (the hosts would read different orders).
    """
    if jax.process_count() == 1:
        return {"global": state} if global_state else {"hosts": [state]}
    data = np.frombuffer(json.dumps(state).encode(), dtype=np.uint8)
    lengths = multihost_utils.process_allgather(np.array([data.size], np.int32))
    width = int(np.max(lengths))
    padded = np.zeros((width,), np.uint8)
    padded[: data.size] = data
    rows = multihost_utils.process_allgather(padded)
    states = [json.loads(bytes(rows[i, : int(lengths[i, 0])]).decode()) for i in range(rows.shape[0])]
    if not global_state:
        return {"hosts": states}
    if any(s != states[0] for s in states):
        raise RuntimeError(f"The hosts' data states differ, but the input's order is global: {states}.")
    return {"global": state}


def host_state(saved: dict[str, Any]) -> dict[str, Any]:
    """This host's iterator state from a checkpoint entry of `gather_host_states`.

    Raises:
        ConfigError: the checkpoint holds per-host states of a different number of hosts.
    """
    if "global" in saved:
        return saved["global"]
    hosts = saved.get("hosts")
    if hosts is None:  # written by a single-process run before host states were gathered
        hosts = [saved]
    if len(hosts) != jax.process_count():
        raise ConfigError(
            f"The checkpoint holds the input state of {len(hosts)} host(s) but this run has "
            f"{jax.process_count()} processes, and this input keeps a position per host. Resume with "
            f'the same number of processes, or start a new --job-log-dir (docs/data.md, "Resuming on '
            'another mesh").'
        )
    return hosts[jax.process_index()]


class HostConsole(Console):
    """A console whose lines start with `[pI]` when the job has several processes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
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


def sum_over_processes(counts: dict[str, int]) -> dict[str, int]:
    """`counts` (the same keys on every process) summed over the processes (a host sync when there
    are several)."""
    if jax.process_count() == 1 or not counts:
        return counts
    keys = sorted(counts)
    rows = multihost_utils.process_allgather(np.array([counts[k] for k in keys], np.int64))
    return {k: int(v) for k, v in zip(keys, np.sum(rows, axis=0), strict=True)}


def to_host(tree: Any) -> Any:
    """Device values -> numpy on this host; replicated global arrays read their local copy."""

    def one(x: Any) -> Any:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(x.addressable_data(0))
        return np.asarray(x)

    return jax.tree.map(one, tree)
