"""Sharded LM training on 8 simulated CPU devices: sharded == one device, shardings follow the
rules, shard_map blocks == GSPMD. The three checks run in one fresh process (one JAX start-up, not
three), each in its own namespace and passing or failing on its own (helpers.parts)."""

import json

import pytest

from helpers.multidevice import FAST_COMPILE
from helpers.parts import part_stdout, run_parts_with_devices

# Trains a small LM for 3 steps on one device and on a mesh; prints losses and max param diff.
TRAIN_COMPARE = """
import functools, json
import equinox as eqx, jax, numpy as np
from equipax.core.mesh import MeshConfig, build_mesh
from equipax.core.nn import TransformerConfig
from equipax.core.optim import LearnerConfig, make_learner, make_schedule
from equipax.core.partition import batch_sharding
from equipax.core.step import LossFnTask, init_sharded_train_state, make_train_step
from equipax.models import LMConfig, TransformerLM, lm_loss

def train(mesh_cfg, tp):
    cfg = LMConfig(vocab_size=64, max_seq_len=16, transformer=TransformerConfig(
        num_layers=2, model_dims=32, num_heads=4, head_dim=8, hidden_dims=64, tensor_parallel=tp))
    mesh = build_mesh(mesh_cfg, jax.devices()[: mesh_cfg.num_devices])
    learner = LearnerConfig()
    opt, sched = make_learner(learner)
    state, shard = init_sharded_train_state(lambda k: TransformerLM(cfg, key=k), opt, mesh, jax.random.key(0))
    bs = batch_sharding(mesh)
    task = LossFnTask(functools.partial(lm_loss, mesh=mesh))
    step = make_train_step(task, opt, sched, state_sharding=shard, batch_sharding=bs)
    rng, losses = np.random.default_rng(0), []
    for _ in range(3):
        ids = rng.integers(0, 64, (8, 17)).astype(np.int32)
        batch = jax.device_put({"ids": ids[:, :-1], "labels": ids[:, 1:], "weights": np.ones((8, 16), np.float32)}, bs)
        state, m = step(state, batch, jax.random.key(1))
        losses.append(float(m["loss"]))
    return losses, [np.asarray(x) for x in jax.tree.leaves(eqx.filter(state.model, eqx.is_array))]

ref_losses, ref_params = train(MeshConfig(), "gspmd")
out = {"ref": ref_losses}
for name, (ici, dcn, tp) in MESHES.items():
    losses, params = train(MeshConfig(ici_mesh_shape=ici, dcn_mesh_shape=dcn), tp)
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(ref_params, params))
    out[name] = {"losses": losses, "max_param_diff": diff}
print(json.dumps(out))
"""


# name: (ici, dcn, tensor_parallel).
MESHES = {
    "fsdp_2x": ((1, 4, 1), (2, 1, 1), "gspmd"),  # c4_22b_2x's pattern: DCN data x ICI fsdp
    "tensor": ((1, 2, 4), (1, 1, 1), "gspmd"),
    "tensor_shard_map": ((1, 2, 4), (1, 1, 1), "shard_map"),
    "all_axes_shard_map": ((1, 2, 2), (2, 1, 1), "shard_map"),
}


@pytest.fixture(scope="module")
def children():
    """Each test's child code, run in one 8-device process."""
    parts = {
        "train_compare": f"MESHES = {MESHES!r}\n" + TRAIN_COMPARE,
        "shardings": SHARDINGS,
        "shard_map_block": SHARD_MAP_BLOCK,
    }
    return run_parts_with_devices(parts, xla_flags=FAST_COMPILE)


@pytest.mark.slow
def test_sharded_training_equals_one_device(children):
    out = json.loads(part_stdout(children, "train_compare").splitlines()[-1])
    for name in MESHES:
        assert out[name]["losses"] == pytest.approx(out["ref"], rel=1e-5, abs=1e-5), name
        assert out[name]["max_param_diff"] < 1e-5, (name, out[name]["max_param_diff"])


SHARDINGS = """
    import jax
    from jax.sharding import PartitionSpec as P
    from equipax.core.mesh import MeshConfig, build_mesh
    from equipax.core.nn import TransformerConfig
    from equipax.core.optim import LearnerConfig, make_learner
    from equipax.core.step import init_sharded_train_state
    from equipax.models import LMConfig, TransformerLM

    cfg = LMConfig(vocab_size=64, max_seq_len=16, transformer=TransformerConfig(
        num_layers=2, model_dims=32, num_heads=4, head_dim=8, hidden_dims=64, scan_layers=True))
    mesh = build_mesh(MeshConfig(ici_mesh_shape=(1, 2, 2), dcn_mesh_shape=(2, 1, 1)))
    opt = make_learner(LearnerConfig(kind="pax_adam", clip_update_rms=1.0)).optimizer
    state, _ = init_sharded_train_state(lambda k: TransformerLM(cfg, key=k), opt, mesh, jax.random.key(0))
    m = state.model
    layers = m.stack.layers
    assert m.embedding.weight.sharding.spec == P("tensor", "fsdp"), m.embedding.weight.sharding
    assert layers.attention.qkv.sharding.spec == P(None, "fsdp", None, "tensor")  # [layer embed 3 heads hd]
    assert layers.attention.out.sharding.spec == P(None, "tensor", None, "fsdp")  # row split
    assert layers.ffn.up.weight.sharding.spec == P(None, "fsdp", "tensor")  # column split
    assert layers.ffn.down.weight.sharding.spec == P(None, "tensor", "fsdp")  # row split
    assert layers.atten_norm.scale.sharding.spec == P()  # small: replicated
    assert state.step.sharding.spec == P()
    # Adam's moments are sharded exactly like their parameters.
    adam = [s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda x: hasattr(x, "mu")) if hasattr(s, "mu")][0]
    assert adam.mu.stack.layers.attention.qkv.sharding.spec == P(None, "fsdp", None, "tensor")
    assert adam.nu.embedding.weight.sharding.spec == P("tensor", "fsdp")
    assert adam.count.sharding.spec == P()
    print("ok")
    """

SHARD_MAP_BLOCK = """
    import functools
    import equinox as eqx, jax, jax.numpy as jnp, numpy as np
    from equipax.core.mesh import MeshConfig, build_mesh
    from equipax.core.nn import TransformerConfig
    from equipax.core.partition import param_specs, named, batch_sharding
    from equipax.models import LMConfig, TransformerLM, lm_loss

    mesh = build_mesh(MeshConfig(ici_mesh_shape=(1, 2, 4)))
    def build(tp):
        cfg = LMConfig(vocab_size=64, max_seq_len=16, transformer=TransformerConfig(
            num_layers=2, model_dims=32, num_heads=4, head_dim=8, hidden_dims=64, gated=True,
            scan_layers=False, remat="full", tensor_parallel=tp))
        model = TransformerLM(cfg, key=jax.random.key(0))
        return eqx.filter_shard(model, named(param_specs(eqx.filter(model, eqx.is_array), mesh), mesh))
    ids = np.random.default_rng(0).integers(0, 64, (8, 17)).astype(np.int32)
    batch = {"ids": ids[:, :-1], "labels": ids[:, 1:], "weights": np.ones((8, 16), np.float32)}
    batch = jax.device_put(batch, batch_sharding(mesh))
    grads = {}
    for tp in ("gspmd", "shard_map"):
        f = eqx.filter_jit(eqx.filter_value_and_grad(functools.partial(lm_loss, mesh=mesh), has_aux=True))
        (loss, _), g = f(build(tp), batch)
        grads[tp] = (float(loss), [np.asarray(x) for x in jax.tree.leaves(eqx.filter(g, eqx.is_array))])
    (la, ga), (lb, gb) = grads["gspmd"], grads["shard_map"]
    assert abs(la - lb) < 1e-5, (la, lb)
    for a, b in zip(ga, gb):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    # The shard_map program really contains the written-out collectives.
    hlo = eqx.filter_jit(functools.partial(lm_loss, mesh=mesh)).lower(build("shard_map"), batch).as_text()
    assert "all_gather" in hlo or "all-gather" in hlo
    assert "psum" in hlo or "all_reduce" in hlo or "all-reduce" in hlo
    print("ok")
    """


@pytest.mark.slow
def test_shardings_follow_the_rules(children):
    assert part_stdout(children, "shardings").strip().endswith("ok")


@pytest.mark.slow
def test_shard_map_block_equals_gspmd_forward_and_gradients(children):
    assert part_stdout(children, "shard_map_block").strip().endswith("ok")
