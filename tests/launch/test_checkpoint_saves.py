"""What a checkpoint save costs on many devices: small replicated arrays compile no programs."""

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
