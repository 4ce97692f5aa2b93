"""Sharding annotations live with the layers: the LM's and the CNN's weights declare their logical
axes (the Pax LM's specs are the Megatron + FSDP layout), scanned stacks get `layers`, a dimension
a mesh axis does not divide is replicated."""

from helpers.partition import flat_specs, mesh


def tiny_lm(**transformer):
    import jax

    from equipax.core.nn import TransformerConfig
    from equipax.models import LMConfig, TransformerLM

    cfg = LMConfig(
        vocab_size=64,
        max_seq_len=16,
        transformer=TransformerConfig(
            num_layers=2, model_dims=32, num_heads=4, head_dim=8, hidden_dims=64, **transformer
        ),
    )
    return TransformerLM(cfg, key=jax.random.key(0))


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


def test_a_dimension_that_does_not_divide_its_mesh_axis_is_replicated():
    from jax.sharding import PartitionSpec as P

    specs = flat_specs(tiny_lm(scan_layers=False), mesh(1, 3, 8))  # 32 % 3, 4 heads % 8
    assert specs[".stack.layers[0].attention.qkv"] == P(None, None, None, None)
    assert specs[".stack.layers[0].ffn.up.weight"] == P(None, "tensor")  # 64 hidden % 8 == 0


def test_scanned_stack_prepends_layers_and_unrolled_does_not():
    import jax

    from equipax.core.partition import leaf_axes

    for scan, path in ((True, ".stack.layers.attention.qkv"), (False, ".stack.layers[1].attention.qkv")):
        model = tiny_lm(scan_layers=scan)
        axes = {
            jax.tree_util.keystr(p): leaf_axes(model, p, leaf)
            for p, leaf in jax.tree_util.tree_flatten_with_path(model)[0]
        }
        expected = ("embed", "qkv", "heads", "head_dim")
        assert axes[path] == (("layers", *expected) if scan else expected)


def test_cnn_weights_are_declared_and_replicated():
    import equinox as eqx
    import jax

    from equipax.models.cnn import AdvancedCNN, CNNConfig

    cfg = CNNConfig(in_channels=1, stem_channels=8, stage_channels=(8, 16), hidden_dims=16)
    model = eqx.filter_eval_shape(lambda k: eqx.nn.make_with_state(AdvancedCNN)(cfg, key=k), jax.random.key(0))[0]
    specs = flat_specs(model, mesh())
    assert ".stages[1][0].conv1.weight" in specs and ".head.weight" in specs
    assert all(all(a is None for a in spec) for spec in specs.values()), specs


def test_train_state_shardings_replicate_model_state_and_follow_params_in_the_optimizer(key):
    import equinox as eqx
    import jax
    import numpy as np
    import optax
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

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
    state = State(
        jax.numpy.zeros((), jax.numpy.int32), model, opt.init(eqx.filter(model, eqx.is_inexact_array)), model_state
    )
    m = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    shardings = train_state_shardings(state, opt, m)
    leaves = jax.tree.leaves(shardings)
    assert leaves and all(s.spec == P() or all(a is None for a in s.spec) for s in leaves)
    adam = shardings.opt_state[0]
    assert adam.mu.head.weight.spec == P(None, None)
    assert jax.tree.leaves(shardings.model_state)
