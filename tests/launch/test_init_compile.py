"""The state's initialisation is compiled at XLA's lowest effort (`INIT_COMPILER_OPTIONS`; on the
TPU v5e's host its compile was the longest of a first job, and halves so): the initial state is
the one a default compile gives, bit for bit, and XLA:TPU takes the option (an offline compile for
a v5e, where libtpu is installed; the chip's figures: benchmarks/README.md, "On a real TPU,
seventh session")."""

import dataclasses

import pytest

from equipax.launch.hardware.tpu import libtpu_available
from helpers.toy import TOY


def _training(devices=None):
    from equipax.core.knobs import apply_overrides
    from equipax.core.mesh import build_mesh
    from equipax.launch.experiments.registry import get_experiment
    from equipax.launch.program.training import build_training

    cfg, _ = apply_overrides(get_experiment("shakespeare_llama_tiny"), TOY)
    if devices is not None:
        cfg = dataclasses.replace(cfg, mesh=cfg.mesh.fit(len(devices)))
    return build_training(cfg, build_mesh(cfg.mesh, devices), feeds_batches=False)


def test_the_initial_state_is_the_default_compiles_bit_for_bit():
    import equinox as eqx
    import jax
    import numpy as np

    training = _training()
    state = eqx.filter(training.init_state(), eqx.is_array)
    default = eqx.filter(training.lower_init().compile()(training.keys.init), eqx.is_array)
    leaves, expected = jax.tree.leaves(state), jax.tree.leaves(default)
    assert len(leaves) == len(expected) > 10
    for a, b in zip(leaves, expected, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.skipif(not libtpu_available(), reason="libtpu (XLA:TPU) is not installed")
def test_xla_tpu_compiles_the_initialisation_with_its_options():
    from equipax.launch.hardware.tpu import lookup_slice, topology_devices

    compiled = _training(topology_devices(lookup_slice("v5e-1"))).compile_init()
    # (an option XLA does not know fails the compile: "No such compile option")
    assert compiled.compiled.memory_analysis().output_size_in_bytes > 0
