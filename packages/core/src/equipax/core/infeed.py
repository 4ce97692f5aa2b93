"""Which part of each global batch a process reads and places: Pax's `infeed_host_index` contract,
extended to a `context` axis across processes.

A global batch `[batch seq ...]` is split over the mesh as `equipax.core.partition.batch_sharding`
says: its rows over the batch axes (`BATCH_AXES`, in that order), its sequence over `context`.
Each process reads whole rows from its input and places the part of them that its devices hold.
Processes whose devices hold the same rows (the hosts of one context group, or replicas over an
axis that does not split the batch) read the same rows: they share one infeed host index, and
there are `process count / processes per index` infeed hosts. A pure function of the mesh's
devices (only their `process_index` is read) and axis names.
"""

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from equipax.core.knobs import ConfigError
from equipax.core.mesh_config import BATCH_AXES, CONTEXT

__all__ = ["HostInfeed", "host_infeed", "host_infeeds"]


@dataclasses.dataclass(frozen=True)
class HostInfeed:
    """What one process reads and places of each global batch.

    Attributes:
        num_infeed_hosts: how many disjoint blocks of rows the processes read (the input's
            `num_infeed_hosts`: the process count over `hosts_per_index`).
        infeed_host_index: the block this process reads (the input's `infeed_host_index`): rows
            `[index * B / n, (index + 1) * B / n)` of a global batch of B rows.
        hosts_per_index: how many processes read this block (more than 1 where the `context` axis,
            or an axis that does not split the batch, spans processes).
        leads_index: whether this process is the first of those (what the hosts read is counted
            once: from the first of each block's processes).
        seq_blocks: `(first, stop)`: the blocks of the sequence this process's devices hold, of
            `num_seq_blocks` equal blocks in order.
        num_seq_blocks: the `context` axis's size (1 without one).
    """

    num_infeed_hosts: int
    infeed_host_index: int
    hosts_per_index: int = 1
    leads_index: bool = True
    seq_blocks: tuple[int, int] = (0, 1)
    num_seq_blocks: int = 1

    def seq_slice(self, seq_len: int) -> slice:
        """The positions of a row of `seq_len` tokens that this process places."""
        block = seq_len // self.num_seq_blocks
        return slice(self.seq_blocks[0] * block, self.seq_blocks[1] * block)


def _block(values: set[int], process: int, what: str, mesh_shape: dict[str, int]) -> tuple[int, int]:
    """`values` as a `(first, stop)` range, or a ConfigError when they leave a gap."""
    first, stop = min(values), max(values) + 1
    if len(values) != stop - first:
        raise ConfigError(
            f"Process {process}'s devices hold the {what} blocks {sorted(values)} of each global batch on "
            f"mesh {mesh_shape}: not one contiguous block, but each host reads whole rows and places one "
            "contiguous part of them. Order the mesh so that each process holds one contiguous block of the "
            "batch and of the sequence: give the axes across hosts in mesh.dcn_mesh_shape (each process "
            "one DCN block) and those within a host in mesh.ici_mesh_shape."
        )
    return first, stop


def host_infeeds(devices: Any, axis_names: Sequence[str]) -> dict[int, HostInfeed]:
    """Every process's `HostInfeed` on a mesh.

    Arguments:
        devices: the mesh's device array (`Mesh.devices`); each device needs only `process_index`.
        axis_names: the mesh's axis names.

    Returns:
        `{process_index: HostInfeed}` for every process that holds a device of the mesh.

    Raises:
        ConfigError: a process's devices hold rows, or parts of the sequence, that are not one
            contiguous block, or the processes' blocks of rows overlap without being the same.
    """
    devices = np.asarray(devices, dtype=object)
    names = tuple(axis_names)
    mesh_shape = dict(zip(names, devices.shape, strict=True))
    row_axes = [names.index(a) for a in BATCH_AXES if a in names]
    seq_axis = names.index(CONTEXT) if CONTEXT in names else None
    held: dict[int, tuple[set[int], set[int]]] = {}
    for position in np.ndindex(devices.shape):
        # The device's block of rows: its position over the batch axes, the first one outermost (as
        # `batch_sharding`'s spec splits the rows); its block of the sequence: its `context` position.
        row = 0
        for axis in row_axes:
            row = row * devices.shape[axis] + position[axis]
        row_set, seq_set = held.setdefault(int(devices[position].process_index), (set(), set()))
        row_set.add(row)
        seq_set.add(0 if seq_axis is None else position[seq_axis])
    blocks = {p: (_block(r, p, "row", mesh_shape), _block(s, p, "sequence", mesh_shape)) for p, (r, s) in held.items()}
    row_blocks = sorted({r for r, _ in blocks.values()})
    sizes = {stop - first for first, stop in row_blocks}
    overlap = any(a[1] > b[0] for a, b in itertools.pairwise(row_blocks))
    if len(sizes) > 1 or overlap:
        shown = {p: f"row blocks {r[0]}..{r[1] - 1}" for p, (r, _) in sorted(blocks.items())}
        raise ConfigError(
            f"The processes hold overlapping or unequal blocks of each global batch's rows on mesh {mesh_shape} "
            f"({shown}), but the hosts must split the rows into equal disjoint blocks, each read by the processes "
            "that hold it. Order the mesh so that each process holds whole DCN blocks (mesh.dcn_mesh_shape for "
            "the axes across hosts, mesh.ici_mesh_shape for those within a host)."
        )
    readers = {r: sorted(p for p, (pr, _) in blocks.items() if pr == r) for r in row_blocks}
    num_seq = 1 if seq_axis is None else devices.shape[seq_axis]
    return {
        p: HostInfeed(
            num_infeed_hosts=len(row_blocks),
            infeed_host_index=row_blocks.index(r),
            hosts_per_index=len(readers[r]),
            leads_index=readers[r][0] == p,
            seq_blocks=s,
            num_seq_blocks=num_seq,
        )
        for p, (r, s) in blocks.items()
    }


def host_infeed(mesh: Mesh) -> HostInfeed:
    """This process's `HostInfeed` on `mesh` (see `host_infeeds`).

    Raises:
        ConfigError: as `host_infeeds`, or this process holds no device of `mesh`.
    """
    infeeds = host_infeeds(mesh.devices, mesh.axis_names)
    if jax.process_index() not in infeeds:
        raise ConfigError(
            f"Process {jax.process_index()} holds no device of the mesh {dict(mesh.shape)} (its processes: "
            f"{sorted(infeeds)}), so it has no part of the batch to read. Build the mesh over every process's "
            "devices (equipax.core.mesh.build_mesh with the default devices)."
        )
    return infeeds[jax.process_index()]
