"""Sharding annotations live with the layers: every registered experiment's weights declare their
logical axes, an undeclared weight is an error naming it, scanned stacks get `layers`."""

import re

import pytest


def mesh(data=2, fsdp=4, tensor=2):
    from jax.sharding import AbstractMesh

    return AbstractMesh((data, fsdp, tensor), ("data", "fsdp", "tensor"))


def flat_specs(model, m):
    """`{path: PartitionSpec}` for every array leaf of `model` on mesh `m`."""
    import jax
    from jax.sharding import PartitionSpec as P

    from equipax.core.partition import param_specs

    specs = param_specs(model, m)
    leaves = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0]
    return {jax.tree_util.keystr(path): spec for path, spec in leaves}


def abstract_model(cfg):
    """(model class name, the abstract model) of a registered training experiment, built the way a
    run builds it: the family's Task, `init` under `eval_shape`. Any family registered with
    `register_family` is covered; one that cannot build its model fails the test."""
    import equinox as eqx
    import jax

    from equipax.launch.tasks import family

    task = family(cfg).make_task(cfg, None)
    model, _ = eqx.filter_eval_shape(task.init, jax.random.key(0))
    return type(model).__name__, model


def tiny_lm(**transformer):
    import jax

    from equipax.core.nn import TransformerConfig
    from equipax.models import LMConfig, TransformerLM

    cfg = LMConfig(vocab_size=64, max_seq_len=16, transformer=TransformerConfig(
        num_layers=2, model_dims=32, num_heads=4, head_dim=8, hidden_dims=64, **transformer))
    return TransformerLM(cfg, key=jax.random.key(0))


def test_every_registered_experiment_declares_the_axes_of_its_weights():
    from jax.sharding import PartitionSpec as P

    from equipax.launch.experiments.registry import entries

    kinds = {"TransformerLM": [], "LlamaLM": [], "AdvancedCNN": []}
    for entry in entries():
        if getattr(entry, "kind", "train") != "train":
            continue
        kind, model = abstract_model(entry.fn())
        for m in (mesh(), mesh(2, 64, 1), mesh(1, 1, 8)):
            specs = flat_specs(model, m)  # raises, naming the weight, if one is undeclared
            assert specs, entry.name
        kinds.setdefault(kind, []).append(entry.name)
        if kind in ("TransformerLM", "LlamaLM"):  # the big weights really are sharded, not replicated
            specs = flat_specs(model, mesh())
            assert specs[".embedding.weight"] == P("tensor", "fsdp"), entry.name
        if kind == "LlamaLM":
            assert specs[".unembed.weight"] == P("fsdp", "tensor"), entry.name
    assert kinds["TransformerLM"] and kinds["AdvancedCNN"], kinds
    assert {"shakespeare_llama_tiny", "llama2_7b", "llama3_8b", "llama2_7b_smoke",
            "llama3_8b_smoke"} <= set(kinds["LlamaLM"]), kinds


def test_pax_lm_specs_match_the_megatron_fsdp_layout():
    from jax.sharding import PartitionSpec as P

    specs = flat_specs(tiny_lm(scan_layers=True, gated=True, use_bias=True), mesh())
    assert specs[".embedding.weight"] == P("tensor", "fsdp")
    assert specs[".stack.layers.attention.qkv"] == P(None, "fsdp", None, "tensor", None)
    assert specs[".stack.layers.attention.qkv_bias"] == P(None, None, "tensor", None)
    assert specs[".stack.layers.attention.out"] == P(None, "tensor", None, "fsdp")
    assert specs[".stack.layers.ffn.up.weight"] == P(None, "fsdp", "tensor")
    assert specs[".stack.layers.ffn.gate.weight"] == P(None, "fsdp", "tensor")
    assert specs[".stack.layers.ffn.up.bias"] == P(None, "tensor")
    assert specs[".stack.layers.ffn.down.weight"] == P(None, "tensor", "fsdp")
    assert specs[".stack.layers.atten_norm.scale"] == P(None, None)
    assert specs[".final_norm.scale"] == P(None)


def declared_axes(model):
    """`{path: logical axes}` of every array leaf, each axis named by the layer that owns it."""
    import jax

    from equipax.core.partition import leaf_axes

    return {jax.tree_util.keystr(p): leaf_axes(model, p, leaf)
            for p, leaf in jax.tree_util.tree_flatten_with_path(model)[0]}


@pytest.mark.parametrize("name", ["shakespeare_llama_tiny", "llama2_7b", "llama3_8b", "llama3_8b_smoke"])
def test_every_llama_weight_declares_logical_axes_the_rules_map(name):
    """No LlamaLM array falls back to "undeclared, replicated": every dimension of every weight
    (norm scales included) names a logical axis that `LOGICAL_TO_MESH` maps."""
    from equipax.core.partition import LOGICAL_TO_MESH
    from equipax.launch.experiments.registry import get_experiment

    kind, model = abstract_model(get_experiment(name))
    assert kind == "LlamaLM"
    axes = declared_axes(model)
    # embedding, final norm, unembedding + 8 arrays per block (one stacked block when scanned)
    blocks = 1 if model.cfg.scan_layers else model.cfg.num_layers
    assert len(axes) == 3 + 8 * blocks, sorted(axes)
    for path, names in axes.items():
        assert None not in names and set(names) <= set(LOGICAL_TO_MESH), (path, names)


def test_llama_specs_match_the_megatron_fsdp_layout():
    """Scanned Llama weights (as in llama3_8b): FSDP on `embed`, Megatron on heads / hidden,
    key/value heads split like the query heads, the untied output split over the vocabulary."""
    from jax.sharding import PartitionSpec as P

    from equipax.launch.experiments.registry import get_experiment

    _, model = abstract_model(get_experiment("llama3_8b"))
    specs = flat_specs(model, mesh(1, 8, 8))
    assert specs[".embedding.weight"] == P("tensor", "fsdp")
    assert specs[".unembed.weight"] == P("fsdp", "tensor")
    assert specs[".layers.attention.q"] == P(None, "fsdp", "tensor", None)
    assert specs[".layers.attention.kv"] == P(None, "fsdp", None, "tensor", None)
    assert specs[".layers.attention.out"] == P(None, "tensor", None, "fsdp")
    assert specs[".layers.ffn.gate.weight"] == P(None, "fsdp", "tensor")
    assert specs[".layers.ffn.up.weight"] == P(None, "fsdp", "tensor")
    assert specs[".layers.ffn.down.weight"] == P(None, "tensor", "fsdp")
    assert specs[".layers.atten_norm.scale"] == P(None, None)
    assert specs[".final_norm.scale"] == P(None)


def test_a_dimension_that_does_not_divide_its_mesh_axis_is_replicated():
    from jax.sharding import PartitionSpec as P

    specs = flat_specs(tiny_lm(scan_layers=False), mesh(1, 3, 8))  # 32 % 3, 4 heads % 8
    assert specs[".stack.layers[0].attention.qkv"] == P(None, None, None, None)
    assert specs[".stack.layers[0].ffn.up.weight"] == P(None, "tensor")  # 64 hidden % 8 == 0


def test_scanned_stack_prepends_layers_and_unrolled_does_not():
    import jax

    from equipax.core.partition import leaf_axes

    for scan, path in ((True, ".stack.layers.attention.qkv"),
                       (False, ".stack.layers[1].attention.qkv")):
        model = tiny_lm(scan_layers=scan)
        axes = {jax.tree_util.keystr(p): leaf_axes(model, p, leaf)
                for p, leaf in jax.tree_util.tree_flatten_with_path(model)[0]}
        expected = ("embed", "qkv", "heads", "head_dim")
        assert axes[path] == (("layers", *expected) if scan else expected)


def test_cnn_weights_are_declared_and_replicated():
    import equinox as eqx
    import jax

    from equipax.models.cnn import AdvancedCNN, CNNConfig

    cfg = CNNConfig(in_channels=1, stem_channels=8, stage_channels=(8, 16), hidden_dims=16)
    model = eqx.filter_eval_shape(
        lambda k: eqx.nn.make_with_state(AdvancedCNN)(cfg, key=k), jax.random.key(0))[0]
    specs = flat_specs(model, mesh())
    assert ".stages[1][0].conv1.weight" in specs and ".head.weight" in specs
    assert all(all(a is None for a in spec) for spec in specs.values()), specs


def test_an_undeclared_weight_is_an_error_naming_its_path(key):
    import equinox as eqx
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    from jaxtyping import Array

    from equipax.core.nn import Linear

    blocks = {"blocks": [Linear(4, 8, axes=("embed", "hidden"), key=key), Linear(4, 8, key=key)]}
    with pytest.raises(ValueError, match=re.escape("Parameter ['blocks'][1].weight of shape (4, 8) "
                                                   "has no logical axes")) as e:
        flat_specs(blocks, mesh())
    assert "Linear(..., axes=" in str(e.value)

    class Custom(eqx.Module):
        table: Array
        vector: Array

        def __init__(self):
            self.table = jnp.zeros((4, 8))
            self.vector = jnp.zeros((8,))

    with pytest.raises(ValueError, match=r"Parameter \.table .*Declare its logical axes in the "
                                         r"layer that owns it: give Custom a method"):
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


def test_train_state_shardings_replicate_model_state_and_follow_params_in_the_optimizer(key):
    import equinox as eqx
    import jax
    import numpy as np
    import optax
    from jax.sharding import Mesh, PartitionSpec as P

    from equipax.core.partition import train_state_shardings
    from equipax.models.cnn import AdvancedCNN, CNNConfig

    class State(eqx.Module):
        step: jax.Array
        model: AdvancedCNN
        opt_state: optax.OptState
        model_state: eqx.nn.State

    cfg = CNNConfig(in_channels=1, stem_channels=8, stage_channels=(8, 16), hidden_dims=16)
    model, model_state = eqx.nn.make_with_state(AdvancedCNN)(cfg, key=key)
    opt = optax.adam(1e-3)
    state = State(jax.numpy.zeros((), jax.numpy.int32), model,
                  opt.init(eqx.filter(model, eqx.is_inexact_array)), model_state)
    m = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    shardings = train_state_shardings(state, opt, m)
    leaves = jax.tree.leaves(shardings)
    assert leaves and all(s.spec == P() or all(a is None for a in s.spec) for s in leaves)
    adam = shardings.opt_state[0]
    assert adam.mu.head.weight.spec == P(None, None)
    assert jax.tree.leaves(shardings.model_state)
