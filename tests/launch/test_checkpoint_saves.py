"""What a checkpoint save costs: small replicated arrays compile no programs on many devices, arrays
are written uncompressed, and the final digest reuses the save's checksums."""

from helpers.multidevice import run_with_devices


def test_small_replicated_arrays_save_without_slice_programs_large_ones_still_split(tmp_path):
    """On 8 devices, saving replicated arrays of a few kilobytes compiles nothing (orbax's default
    would slice every one among its 8 replicas, one compiled program per shape and replica); an
    array whose per-replica part reaches `MIN_REPLICA_SLICE_BYTES` is still split among its
    replicas. Both read back exactly. The tuning logs nothing (orbax warns when a handler is
    registered over its default one)."""
    out = run_with_devices(
        f"""
        import logging
        import numpy as np, jax, jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec as P
        from equipax.launch.jobdir import checkpoints
        from equipax.launch.jobdir.checkpoints import Checkpointer
        from equipax.launch.jobdir.checksums import array_checksums

        mesh = jax.make_mesh((8,), ("data",))
        replicated = NamedSharding(mesh, P())
        def state(shapes):
            return {{f"w{{i}}": jax.device_put(jnp.arange(np.prod(s), dtype=jnp.float32).reshape(s) / 7, replicated)
                    for i, s in enumerate(shapes)}}

        absl = []  # what orbax logs (absl's logger), whatever its level
        class Keep(logging.Handler):
            def emit(self, record):
                absl.append(record.getMessage())
        logging.getLogger("absl").addHandler(Keep())

        compiles = []
        def on_event(name, secs, **kw):
            if name == "/jax/core/compile/backend_compile_duration":
                compiles.append(name)
        jax.monitoring.register_event_duration_secs_listener(on_event)

        def save(name, tree):
            ckpt = Checkpointer({str(tmp_path)!r} + "/" + name, keep=1)
            array_checksums(tree)  # (numpy on CPU devices: compiles nothing; warm either way)
            before = len(compiles)
            ckpt.save(1, tree, {{"cursor": 0}})
            ckpt.wait()
            n = len(compiles) - before
            back, data = ckpt.restore(1, jax.tree.map(jnp.zeros_like, tree))
            assert data == {{"cursor": 0}}
            for k in tree:
                np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(tree[k]))
            ckpt.close()
            return n

        small = save("small", state([(3,), (16, 8), (4, 4, 2), (64,), (7, 5)]))
        per_replica = checkpoints.MIN_REPLICA_SLICE_BYTES // 4  # float32 elements in a part
        large = save("large", state([(8 * per_replica,)]))
        print("COMPILES", small, large)
        print("OVERRIDES", [m for m in absl if "overriding" in m])
        """
    )
    assert "OVERRIDES []" in out, out
    small, large = map(int, out.split("COMPILES")[1].splitlines()[0].split())
    assert small == 0, out
    assert large > 0, out


def _bytes_on_disk(folder):
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def test_states_are_written_uncompressed_and_compressed_checkpoints_still_restore(tmp_path):
    """A checkpoint's arrays are written as they are (zstd saved ~8% of a float32 state's bytes
    for 1.7x the read time: benchmarks/README.md, "Start-up"), so 2 MiB of zeros take 2 MiB on
    disk; a checkpoint written compressed, as orbax writes by default and this project did before,
    still restores, verified."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp

    from equipax.core.trees import flat_arrays
    from equipax.launch.jobdir.checkpoints import Checkpointer

    state = {"w": jnp.zeros((512, 1024), jnp.float32), "b": jnp.arange(7.0)}
    ckpt = Checkpointer(tmp_path / "new", keep=1)
    ckpt.save(1, state, {"cursor": 3})
    ckpt.close()
    assert _bytes_on_disk(tmp_path / "new" / "1") >= 2 * 2**20

    old = ocp.CheckpointManager(
        tmp_path / "old",
        options=ocp.CheckpointManagerOptions(create=True),
        item_handlers={"state": ocp.StandardCheckpointHandler(), "data": ocp.JsonCheckpointHandler()},
    )
    old.save(
        1,
        args=ocp.args.Composite(state=ocp.args.StandardSave(flat_arrays(state)), data=ocp.args.JsonSave({"cursor": 3})),
    )  # pyright: ignore[reportCallIssue]
    old.wait_until_finished()
    old.close()
    assert _bytes_on_disk(tmp_path / "old" / "1") < 2**20  # compressed zeros
    back, data = Checkpointer(tmp_path / "old", keep=1).restore(1, jax.tree.map(jnp.zeros_like, state))
    assert data == {"cursor": 3}
    for k in state:
        np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(state[k]))


def test_the_state_digest_comes_from_the_checksums_of_the_last_save(monkeypatch, tmp_path):
    """The final state's digest hashes its arrays' checksums: nothing is copied to the host, and
    the arrays just saved are not summed a second time; one changed element changes it."""
    import jax
    import jax.numpy as jnp

    from equipax.launch.jobdir import checkpoints
    from equipax.launch.jobdir.checksums import tree_digest

    state = {"w": jax.random.normal(jax.random.key(0), (64, 8)), "step": jnp.asarray(3)}
    calls = []
    counted = checkpoints.array_checksums
    monkeypatch.setattr(checkpoints, "array_checksums", lambda flat: calls.append(1) or counted(flat))
    ckpt = checkpoints.Checkpointer(tmp_path / "ckpt", keep=1)
    ckpt.save(1, state, {"cursor": 0})
    assert len(calls) == 1
    sums = ckpt.checksums(state)
    assert len(calls) == 1 and tree_digest(state, sums) == tree_digest(state)
    changed = {**state, "w": state["w"].at[5, 3].add(1e-3)}
    assert tree_digest(changed, ckpt.checksums(changed)) != tree_digest(state) and len(calls) == 2
    ckpt.close()


def test_a_tpus_copy_to_the_host_goes_in_waves_that_fit_libtpus_buffer(monkeypatch, tmp_path):
    """On a TPU a save copies its arrays off the device in waves of at most half of libtpu's
    premapped buffer (`TPU_PREMAPPED_BUFFER_SIZE`), in order, each waited for: the same
    checkpoint, restored bit for bit. Off a TPU it is one copy of everything, as orbax does it."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from orbax.checkpoint._src.serialization import replica_slices

    from equipax.launch.jobdir import host_transfer
    from equipax.launch.jobdir.checkpoints import Checkpointer

    assert list(host_transfer.waves([3, 3, 5, 9, 1, 1], 6)) == [[0, 1], [2], [3], [4, 5]]
    assert host_transfer.wave_bytes({}) == 2 * 2**30
    assert host_transfer.wave_bytes({"TPU_PREMAPPED_BUFFER_SIZE": "1073741824"}) == 2**29
    assert host_transfer._local_bytes(np.zeros(3, np.float32)) == 12 == host_transfer._local_bytes(jnp.zeros(3))
    state = {f"w{i}": jnp.full((256, 1024), float(i), jnp.float32) for i in range(5)}  # 1 MiB each
    state["b"] = jnp.arange(7.0)
    ckpt = Checkpointer(tmp_path / "ckpt", keep=2)  # installs the waves
    wrapped = replica_slices.transfer_arrays_to_host
    assert getattr(wrapped, "equipax_waves", False)
    calls: list[list[int]] = []
    original = wrapped.__wrapped__  # pyright: ignore[reportFunctionMemberAccess]

    def spy(arrays, *args, **kwargs):
        calls.append([int(a.size) for a in arrays])
        return original(arrays, *args, **kwargs)

    monkeypatch.setattr(replica_slices, "transfer_arrays_to_host", host_transfer._in_waves(spy))
    ckpt.save(1, state, {"cursor": 1})
    ckpt.wait()
    assert len(calls) == 1 and sum(map(len, calls)) == 6  # CPU: one copy of everything
    calls.clear()
    monkeypatch.setattr(host_transfer, "_on_tpu", lambda arrays: True)
    monkeypatch.setenv("TPU_PREMAPPED_BUFFER_SIZE", str(4 * 2**20))  # waves of 2 MiB
    ckpt.save(2, state, {"cursor": 2})
    ckpt.close()
    assert len(calls) == 3 and sorted(n for wave in calls for n in wave) == sorted(int(a.size) for a in state.values())
    assert all(sum(wave) * 4 <= 2 * 2**20 for wave in calls if len(wave) > 1)
    back, data = Checkpointer(tmp_path / "ckpt", keep=2).restore(2, jax.tree.map(jnp.zeros_like, state))
    assert data == {"cursor": 2}
    for k in state:
        np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(state[k]))
