"""Which rows each process reads and which part of the sequence it places (equipax.core.infeed), on
fake devices: only their `process_index` is read, so no process or device is started."""

from types import SimpleNamespace

import numpy as np
import pytest

CONTEXT_AXES = ("data", "fsdp", "context", "tensor")


def layout(processes_of, shape):
    """A device array whose device at each position belongs to the process given there."""
    return np.array([SimpleNamespace(process_index=p) for p in processes_of], dtype=object).reshape(shape)


def built(ici, dcn, devices_per_process, names=CONTEXT_AXES):
    """The device array `build_mesh` makes on CPU hosts (processes in order, DCN blocks outermost)."""
    from equipax.core.mesh import MeshConfig, _cpu_hybrid

    cfg = MeshConfig(ici_mesh_shape=ici, dcn_mesh_shape=dcn, axis_names=names)
    flat = [SimpleNamespace(process_index=i // devices_per_process) for i in range(cfg.num_devices)]
    return _cpu_hybrid(np.array(flat, dtype=object), cfg)


def summary(infeeds):
    """{process: (index, of hosts, sequence blocks)}."""
    return {p: (f.infeed_host_index, f.num_infeed_hosts, f.seq_blocks) for p, f in sorted(infeeds.items())}


def test_hosts_of_one_context_group_share_an_index_and_split_the_sequence():
    from equipax.core.infeed import host_infeeds

    # Context across two processes, each within-host device on data: both read every row.
    infeeds = host_infeeds(built((2, 1, 1, 1), (1, 1, 2, 1), 2), CONTEXT_AXES)
    assert summary(infeeds) == {0: (0, 1, (0, 1)), 1: (0, 1, (1, 2))}
    assert [infeeds[p].hosts_per_index for p in (0, 1)] == [2, 2]
    assert [infeeds[p].leads_index for p in (0, 1)] == [True, False]
    # Context 4 over two processes: each places two blocks, in order.
    infeeds = host_infeeds(built((1, 1, 2, 1), (1, 1, 2, 1), 2), CONTEXT_AXES)
    assert summary(infeeds) == {0: (0, 1, (0, 2)), 1: (0, 1, (2, 4))}
    assert infeeds[1].seq_slice(32) == slice(16, 32)
    # Four processes of two devices: context across DCN, data x fsdp within; each context group's
    # two hosts read the same half of the rows.
    infeeds = host_infeeds(built((2, 2, 1, 1), (1, 1, 2, 1), 2), CONTEXT_AXES)
    assert summary(infeeds) == {0: (0, 2, (0, 1)), 1: (1, 2, (0, 1)), 2: (0, 2, (1, 2)), 3: (1, 2, (1, 2))}
    assert [infeeds[p].leads_index for p in range(4)] == [True, True, False, False]


def test_without_a_context_axis_across_hosts_the_index_is_the_process_index():
    from equipax.core.infeed import host_infeeds

    # The 22B's two slices: data across DCN, fsdp within.
    infeeds = host_infeeds(built((1, 4, 1), (2, 1, 1), 4, ("data", "fsdp", "tensor")), ("data", "fsdp", "tensor"))
    assert summary(infeeds) == {0: (0, 2, (0, 1)), 1: (1, 2, (0, 1))}
    # Four hosts over data x fsdp, a context axis within each host.
    infeeds = host_infeeds(built((1, 1, 2, 1), (2, 2, 1, 1), 2), CONTEXT_AXES)
    assert summary(infeeds) == {p: (p, 4, (0, 2)) for p in range(4)}
    assert all(f.hosts_per_index == 1 and f.leads_index for f in infeeds.values())
    # One process holds everything.
    assert summary(host_infeeds(built((2, 1, 4, 1), (1, 1, 1, 1), 8), CONTEXT_AXES)) == {0: (0, 1, (0, 4))}
    # A replicating axis (tensor) across processes: its hosts read the same rows, as a context group's do.
    infeeds = host_infeeds(layout([0, 1, 2, 3], (2, 2)), ("data", "tensor"))
    assert summary(infeeds) == {0: (0, 2, (0, 1)), 1: (0, 2, (0, 1)), 2: (1, 2, (0, 1)), 3: (1, 2, (0, 1))}


def test_a_process_with_a_non_contiguous_part_is_a_config_error():
    from equipax.core.infeed import host_infeeds
    from equipax.core.knobs import ConfigError

    with pytest.raises(ConfigError, match=r"Process 0's devices hold the row blocks \[0, 2\].*mesh.dcn_mesh_shape"):
        host_infeeds(layout([0, 1, 0, 1], (4,)), ("data",))
    with pytest.raises(ConfigError, match=r"Process 0's devices hold the sequence blocks \[0, 3\]"):
        host_infeeds(layout([0, 1, 1, 0], (1, 4)), ("data", "context"))
    with pytest.raises(ConfigError, match=r"overlapping or unequal blocks.*row blocks 0\.\.1.*row blocks 1\.\.1"):
        host_infeeds(layout([0, 0, 0, 1], (2, 2)), ("data", "context"))
