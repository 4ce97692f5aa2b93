"""`model.quantization="int8"` on 8 simulated CPU devices (docs/quantization.md, "What it works
with"): GSPMD's FSDP and tensor parallelism give one device's int8 loss and gradients (the scales
are over whole rows and columns there too); pipeline stages its loss, and gradients scaled per
microbatch; `tensor_parallel="shard_map"` scales each device's slice of a row-split projection on
its own, so its numbers are near, not equal. One fresh 8-device process (helpers.parts)."""

import json

import pytest

from helpers.multidevice import FAST_COMPILE
from helpers.parts import part_stdout, run_parts_with_devices

GRADS = """
import dataclasses, json
import equinox as eqx, jax, numpy as np
from equipax.core.mesh import MeshConfig, PIPELINE_AXES, build_mesh
from equipax.core.nn import TransformerConfig
from equipax.core.partition import batch_sharding, named, param_specs
from equipax.models.lm import LMConfig, TransformerLM, lm_loss

BASE = LMConfig(vocab_size=64, max_seq_len=16, quantization="int8", transformer=TransformerConfig(
    num_layers=4, model_dims=32, num_heads=4, head_dim=8, hidden_dims=64, remat="full"))
ids = np.asarray(jax.random.randint(jax.random.key(1), (8, 17), 0, 64))
BATCH = {"ids": ids[:, :-1], "labels": ids[:, 1:], "weights": np.ones((8, 16), np.float32)}

def grads(cfg, mesh):
    model = TransformerLM(cfg, key=jax.random.key(0))
    batch = BATCH
    if mesh is not None:
        arrays, static = eqx.partition(model, eqx.is_array)
        arrays = jax.device_put(jax.tree.map(np.asarray, arrays), named(param_specs(arrays, mesh), mesh))
        model, batch = eqx.combine(arrays, static), jax.device_put(BATCH, batch_sharding(mesh))

    @eqx.filter_jit
    def run(model, batch):
        loss, g = eqx.filter_value_and_grad(lambda m: lm_loss(m, batch, mesh=mesh)[0])(model)
        stack = g.stack
        layers = stack.in_layer_order() if hasattr(stack, "in_layer_order") else stack.layers
        return loss, jax.tree.leaves(eqx.filter(layers, eqx.is_array)) + [g.embedding.weight]

    loss, g = run(model, batch)
    return float(loss), [np.asarray(x) for x in g]

def block(**kw):
    return dataclasses.replace(BASE, transformer=dataclasses.replace(BASE.transformer, **kw))

ref_loss, ref = grads(BASE, None)
scale = max(float(np.max(np.abs(r))) for r in ref)
cases = {
    "fsdp_tensor": (BASE, build_mesh(MeshConfig(ici_mesh_shape=(2, 2, 2)))),
    "pipeline": (block(pipeline_stages=2, pipeline_microbatches=2), build_mesh(MeshConfig(
        ici_mesh_shape=(2, 1, 2, 2), dcn_mesh_shape=(1, 1, 1, 1), axis_names=PIPELINE_AXES))),
    "shard_map": (block(tensor_parallel="shard_map"), build_mesh(MeshConfig(ici_mesh_shape=(1, 2, 4)))),
}
out = {"ref_loss": ref_loss, "scale": scale}
for name, (cfg, mesh) in cases.items():
    loss, g = grads(cfg, mesh)
    diffs = [np.abs(a - b) for a, b in zip(g, ref)]
    out[name] = {"loss": loss, "max_diff": max(float(np.max(d)) for d in diffs),
                 "share_off": sum(int((d > 1e-4 * scale).sum()) for d in diffs) / sum(d.size for d in diffs)}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def report():
    results = run_parts_with_devices({"grads": GRADS}, xla_flags=FAST_COMPILE)
    return json.loads(part_stdout(results, "grads").strip().splitlines()[-1])


@pytest.mark.slow
def test_gspmd_fsdp_and_tensor_parallelism_give_one_devices_int8_numbers(report):
    """The loss to float32 rounding; the gradients to 1e-4 of their largest entry but where a sum
    in another order moved an int8 rounding by one step, which then flows down the backward pass.
    Measured: 3e-8 of the largest entry on the earlier hosts; on the AVX-512 host of 2026-12-07
    7.9% of the entries moved by more than 1e-4 of it, by at most 0.25%. Scales over each device's
    slice instead of whole rows and columns move almost every entry (shard_map's case below: 93.5%
    of them, by up to 1.8%)."""
    got = report["fsdp_tensor"]
    assert abs(got["loss"] - report["ref_loss"]) <= 1e-5 * abs(report["ref_loss"]), report
    assert got["share_off"] <= 0.25 and got["max_diff"] <= 1e-2 * report["scale"], report


@pytest.mark.slow
def test_pipeline_stages_give_one_devices_int8_loss_and_near_gradients(report):
    """The forward is the same (per-token scales); a weight gradient's per-column scales span one
    microbatch's tokens instead of the batch's, so the gradients are within 2% of their largest
    entry (measured 0.5%)."""
    got = report["pipeline"]
    assert abs(got["loss"] - report["ref_loss"]) <= 1e-5 * abs(report["ref_loss"]), report
    assert got["max_diff"] <= 2e-2 * report["scale"], report


@pytest.mark.slow
def test_shard_map_tensor_parallelism_quantizes_each_slice_and_stays_near(report):
    """Per-slice scales of the row-split projections: the gradients within 5% of the largest entry
    of one device's int8 gradients."""
    got = report["shard_map"]
    assert abs(got["loss"] - report["ref_loss"]) <= 1e-2 * abs(report["ref_loss"]), report
    assert got["max_diff"] <= 5e-2 * report["scale"], report
