"""The run's keys are derived on the host's CPU backend beside an accelerator (`Keys.from_seed`,
`equipax.launch.program.program.host_device`: on the TPU v5e's host the four eager programs of
the derivation compiled for 1.5-1.7 s before anything else of a run could start). A CPU-only host
cannot have an accelerator beside its CPU, so two simulated CPU devices stand in: the keys are
made on the second, the model lives on the first. The keys are the same, left uncommitted, and the
initial state and a train step on them are the same bit for bit."""

from helpers.multidevice import run_with_devices
from helpers.toy import TOY

CHILD = """
import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from equipax.core.knobs import apply_overrides
from equipax.core.mesh import build_mesh
from equipax.launch.experiments.registry import get_experiment
from equipax.launch.program import program
from equipax.launch.program.training import build_training

first, second = jax.devices()
assert program.host_device() is None  # the default backend is the CPU: nothing to move
cfg, _ = apply_overrides(get_experiment("shakespeare_llama_tiny"), TOY)
cfg = dataclasses.replace(cfg, mesh=cfg.mesh.fit(1))
mesh = build_mesh(cfg.mesh, [first])


def run():
    training = build_training(cfg, mesh, feeds_batches=False)
    state = training.init_state()
    batch = jax.tree.map(lambda s: jax.device_put(jnp.ones(s.shape, s.dtype), s.sharding), training.abstract_batch())
    state, metrics = training.train_step(state, batch, training.keys.step)
    return training.keys, jax.tree.leaves(eqx.filter(state, eqx.is_array)), jax.tree.leaves(metrics)


keys, state, metrics = run()
assert {d for k in (keys.init, keys.step) for d in k.devices()} == {first}
program.host_device = lambda: second  # as on an accelerator's host: the keys made on the "CPU"
moved, moved_state, moved_metrics = run()
assert all(k.devices() == {second} and not k.committed for k in (moved.init, moved.step, moved.sample))
for a, b in zip((keys.init, keys.step, keys.sample), (moved.init, moved.step, moved.sample), strict=True):
    np.testing.assert_array_equal(jax.random.key_data(a), jax.random.key_data(b))
assert len(state) == len(moved_state) > 10 and len(metrics) == len(moved_metrics) > 0
for a, b in zip(state + metrics, moved_state + moved_metrics, strict=True):
    assert a.devices() == b.devices() == {first}
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
print("OK")
"""


def test_keys_derived_on_the_host_device_are_the_same_and_follow_the_model():
    out = run_with_devices(f"TOY = {TOY!r}\n" + CHILD, devices=2)
    assert out.strip().endswith("OK"), out
