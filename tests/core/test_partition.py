"""Sharding annotations: an undeclared weight is an error naming its path, declared axes must fit the
array, and the logical-to-mesh rules are a knob of the mesh config."""

import re

import pytest

from helpers.partition import flat_specs, mesh


def test_an_undeclared_weight_is_an_error_naming_its_path(key):
    import equinox as eqx
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    from jaxtyping import Array

    from equipax.core.nn import Linear

    blocks = {"blocks": [Linear(4, 8, axes=("embed", "hidden"), key=key), Linear(4, 8, key=key)]}
    with pytest.raises(
        ValueError, match=re.escape("Parameter ['blocks'][1].weight of shape (4, 8) has no logical axes")
    ) as e:
        flat_specs(blocks, mesh())
    assert "Linear(..., axes=" in str(e.value)

    class Custom(eqx.Module):
        table: Array
        vector: Array

        def __init__(self):
            self.table = jnp.zeros((4, 8))
            self.vector = jnp.zeros((8,))

    with pytest.raises(
        ValueError,
        match=r"Parameter \.table .*Declare its logical axes in the "
        r"layer that owns it: give Custom a method",
    ):
        flat_specs(Custom(), mesh())

    class Declared(eqx.Module):
        table: Array
        vector: Array

        def __init__(self):
            self.table = jnp.zeros((4, 8))
            self.vector = jnp.zeros((8,))

        def logical_axes(self):
            return {"table": ("embed", "hidden")}

    specs = flat_specs(Declared(), mesh())
    assert specs[".table"] == P("fsdp", "tensor")
    assert specs[".vector"] == P(None)  # an undeclared vector is replicated


def test_declared_axes_must_fit_the_array(key):
    import equinox as eqx
    import jax

    from equipax.core.nn import Linear

    class Stacked(eqx.Module):  # vmapped Linears, but no {"layers": ("layers",)} declared
        layers: Linear

        def __init__(self, *, key):
            make = lambda k: Linear(4, 8, axes=("embed", "hidden"), key=k)  # noqa: E731
            self.layers = eqx.filter_vmap(make)(jax.random.split(key, 3))

    with pytest.raises(ValueError, match=re.escape("Parameter .layers.weight of shape (3, 4, 8) has 3")):
        flat_specs(Stacked(key=key), mesh())

    class Typo(eqx.Module):
        weight: jax.Array

        def __init__(self):
            self.weight = jax.numpy.zeros((4, 8))

        def logical_axes(self):
            return {"weight": ("embd", "hidden")}

    with pytest.raises(ValueError, match=r"Parameter \.weight declares unknown logical axes \['embd'\]"):
        flat_specs(Typo(), mesh())


def test_logical_axis_rules_are_the_mesh_configs_knob(key):
    """The rules decide the specs (FSDP off: nothing on `fsdp`), and an axis they do not map is an
    error that names the knob, not a file to edit."""
    from jax.sharding import PartitionSpec as P

    from equipax.core.mesh_config import DEFAULT_LOGICAL_AXIS_RULES, MeshConfig
    from equipax.core.nn import Linear

    layer = {"up": Linear(8, 16, axes=("embed", "hidden"), key=key)}
    assert flat_specs(layer, mesh())["['up'].weight"] == P("fsdp", "tensor")
    no_fsdp = tuple((logical, None if axis == "fsdp" else axis) for logical, axis in DEFAULT_LOGICAL_AXIS_RULES)
    rules = dict(MeshConfig(logical_axis_rules=no_fsdp).logical_axis_rules)
    assert flat_specs(layer, mesh(), rules)["['up'].weight"] == P(None, "tensor")
    swapped = dict(DEFAULT_LOGICAL_AXIS_RULES) | {"embed": "tensor", "hidden": "fsdp"}
    assert flat_specs(layer, mesh(), swapped)["['up'].weight"] == P("tensor", "fsdp")

    without_hidden = {k: v for k, v in DEFAULT_LOGICAL_AXIS_RULES if k != "hidden"}
    unmapped = r"unknown logical axes \['hidden'\] \(the mesh's rules do not map them\)"
    with pytest.raises(ValueError, match=unmapped) as e:
        flat_specs(layer, mesh(), without_hidden)
    assert "mesh.logical_axis_rules" in str(e.value) and "equipax.core.partition" not in str(e.value)


@pytest.mark.parametrize(
    "rules, message",
    [
        ((("embed", "fsdp"), ("embed", None)), "maps 'embed' more than once"),
        ((("embed", "fdsp"),), "names the mesh axis 'fdsp', which is not one of"),
    ],
)
def test_bad_logical_axis_rules_are_refused_when_the_config_is_built(rules, message):
    from equipax.core.mesh_config import MeshConfig

    with pytest.raises(ValueError, match=message):
        MeshConfig(logical_axis_rules=rules)


def test_the_train_state_shardings_trace_the_optimizers_init(key):
    """`train_state_shardings` of an abstract state traces optax's `init` (it makes the step counts
    with `jnp.zeros`) instead of running it: on a TPU that eager op was the process's first compile,
    0.5 s on the v5e's host before the train step's tracing could start (benchmarks/README.md,
    "ninth session")."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from equipax.core.nn import Linear
    from equipax.core.partition import train_state_shardings
    from equipax.core.step import init_train_state

    model = {"up": Linear(8, 16, axes=("embed", "hidden"), key=key)}
    adamw, concrete = optax.adamw(1e-3), []

    def init(params):  # adamw's, noting whether its arrays are made or traced
        concrete.append(not isinstance(jnp.zeros([], jnp.int32), jax.core.Tracer))
        return adamw.init(params)

    optimizer = optax.GradientTransformation(init, adamw.update)
    state = eqx.filter_eval_shape(init_train_state, model, optimizer)
    one_device = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    shardings = train_state_shardings(state, optimizer, one_device)
    assert concrete == [False, False]  # the state's abstract init, then the shardings' (traced too)
    # One sharding per array: the step, the weight (no bias), its two moments, the count.
    leaves = jax.tree.leaves(shardings)
    assert len(leaves) == len(jax.tree.leaves(state)) == 5
    assert all(isinstance(s, jax.sharding.NamedSharding) and s.mesh == one_device for s in leaves)
