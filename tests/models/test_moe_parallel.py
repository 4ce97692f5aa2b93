"""Expert parallelism equals one device: the loss, the router metrics and every gradient of a
mixture-of-experts LM over `expert` axes of 2, 4 and 8 (and expert x fsdp x tensor), dropless and
with a capacity factor, on 8 simulated CPU devices in one fresh process (one compile per case).

A mutation (the dropless path reading the wrong shard's experts, `first` reversed) fails it (the
ep2 loss moved in its second decimal)."""

import json

import pytest

from helpers.multidevice import FAST_COMPILE, run_with_devices

COMPARE = """
import dataclasses, json
import equinox as eqx, jax, numpy as np
from equipax.core.mesh import EXPERT_AXES, MeshConfig, build_mesh
from equipax.core.nn import TransformerConfig
from equipax.core.partition import named, param_specs
from equipax.models import LMConfig, TransformerLM, lm_loss

block = TransformerConfig(
    num_layers=1, model_dims=16, num_heads=2, head_dim=8, hidden_dims=16, activation="silu", gated=True,
    norm="rmsnorm", fused_qkv=False, atten_logit_cap=None, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=8, shared_expert_intermediate_size=8, router_aux_loss_coef=0.1, router_z_loss_coef=0.01)
rng = np.random.default_rng(0)
ids = rng.integers(0, 64, (8, 9)).astype(np.int32)
batch = {"ids": ids[:, :-1], "labels": ids[:, 1:], "weights": np.ones((8, 8), np.float32)}

def run(capacity_factor, ici):
    cfg = LMConfig(vocab_size=64, max_seq_len=8, position="rope",
                   transformer=dataclasses.replace(block, capacity_factor=capacity_factor))
    model = TransformerLM(cfg, key=jax.random.key(0))
    mesh = None
    if ici is not None:
        mesh = build_mesh(MeshConfig(ici_mesh_shape=ici, dcn_mesh_shape=(1, 1, 1, 1), axis_names=EXPERT_AXES))
        # Placed from host copies: no eager program compiled per (shape, sharding) to slice them.
        arrays, static = eqx.partition(model, eqx.is_array)
        shardings = named(param_specs(arrays, mesh), mesh)
        model = eqx.combine(jax.device_put(jax.tree.map(np.asarray, arrays), shardings), static)
    fn = eqx.filter_jit(eqx.filter_value_and_grad(lambda m: lm_loss(m, batch, mesh=mesh), has_aux=True))
    (loss, aux), grads = fn(model)
    if mesh is not None:
        sharded = model.stack.layers.ffn.gate.sharding.spec
        assert sharded[1] == "expert", sharded  # [layers experts embed hidden]
    leaves = jax.tree_util.tree_leaves_with_path(eqx.filter(grads, eqx.is_array))
    return {"loss": float(loss), "aux": {k: float(v) for k, v in aux.items()},
            "grads": {jax.tree_util.keystr(p): np.asarray(g).tolist() for p, g in leaves}}

out = {}
for cf in CASES:
    out[str(cf)] = {"ref": run(cf, None)}
    for name, ici in CASES[cf].items():
        out[str(cf)][name] = run(cf, tuple(ici))
print(json.dumps(out))
"""

# (data, fsdp, expert, tensor) per case.
CASES = {
    None: {"ep2": (4, 1, 2, 1), "ep8": (1, 1, 8, 1), "fsdp2_ep2_tp2": (1, 2, 2, 2)},
    1.0: {"ep4": (2, 1, 4, 1), "fsdp2_ep2_tp2": (1, 2, 2, 2)},
}


@pytest.fixture(scope="module")
def results():
    out = run_with_devices(f"CASES = {CASES!r}\n" + COMPARE, timeout=600, xla_flags=FAST_COMPILE)
    return json.loads(out.splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("cf, name", [(cf, name) for cf in CASES for name in CASES[cf]])
def test_expert_parallel_equals_one_device(results, cf, name):
    import numpy as np

    ref, got = results[str(cf)]["ref"], results[str(cf)][name]
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert got["aux"].keys() == ref["aux"].keys()
    for key, want in ref["aux"].items():
        assert got["aux"][key] == pytest.approx(want, rel=1e-5, abs=1e-6), key
    if cf is not None:
        assert ref["aux"]["moe_dropped_fraction"] > 0  # the capacity case drops tokens
    for path, want in ref["grads"].items():
        np.testing.assert_allclose(got["grads"][path], want, rtol=1e-4, atol=1e-6, err_msg=f"{name} {path}")
