"""Sharding annotations: an undeclared weight is an error naming its path, and declared axes must fit the array."""

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
