"""Every registered experiment's weights declare logical axes that the rules map, and the Llama-style
experiments' specs (Llama, Qwen3, Mistral: one `TransformerLM`) are the Megatron + FSDP layout."""

import pytest

from helpers.partition import flat_specs, mesh


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


def test_every_registered_experiment_declares_the_axes_of_its_weights():
    from jax.sharding import PartitionSpec as P

    from equipax.launch.experiments.registry import entries

    kinds = {"TransformerLM": [], "AdvancedCNN": []}
    for entry in entries():
        if getattr(entry, "kind", "train") != "train":
            continue
        kind, model = abstract_model(entry.fn())
        for m in (mesh(), mesh(2, 64, 1), mesh(1, 1, 8)):
            specs = flat_specs(model, m)  # raises, naming the weight, if one is undeclared
            assert specs, entry.name
        kinds.setdefault(kind, []).append(entry.name)
        if kind == "TransformerLM":  # the big weights really are sharded, not replicated
            specs = flat_specs(model, mesh())
            assert specs[".embedding.weight"] == P("tensor", "fsdp"), entry.name
            if not model.cfg.tie_embeddings:
                assert specs[".unembed.weight"] == P("fsdp", "tensor"), entry.name
    assert kinds["AdvancedCNN"], kinds
    assert {
        "shakespeare_tiny",
        "c4_22b_2x",
        "shakespeare_llama_tiny",
        "llama2_7b",
        "llama3_8b",
        "llama3_1_8b",
        "llama3_2_1b",
        "qwen3_8b",
        "mistral_7b",
        "llama3_8b_smoke",
    } <= set(kinds["TransformerLM"]), kinds


def declared_axes(model):
    """`{path: logical axes}` of every array leaf, each axis named by the layer that owns it."""
    import jax

    from equipax.core.partition import leaf_axes

    return {
        jax.tree_util.keystr(p): leaf_axes(model, p, leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(model)[0]
    }


@pytest.mark.parametrize(
    "name",
    ["shakespeare_llama_tiny", "llama2_7b", "llama3_8b", "llama3_8b_smoke", "llama3_2_1b", "qwen3_8b", "mistral_7b"],
)
def test_every_llama_style_weight_declares_logical_axes_the_rules_map(name):
    """No array of a Llama-style model falls back to "undeclared, replicated": every dimension of
    every weight (norm scales included) names a logical axis that `LOGICAL_TO_MESH` maps."""
    from equipax.core.partition import LOGICAL_TO_MESH
    from equipax.launch.experiments.registry import get_experiment

    kind, model = abstract_model(get_experiment(name))
    assert kind == "TransformerLM"
    axes = declared_axes(model)
    # embedding, final norm (+ unembedding when untied) + 8 arrays per block (+ 2 QK-norm scales);
    # one stacked block when scanned
    t = model.cfg.transformer
    blocks = 1 if t.scan_layers else t.num_layers
    want = 2 + (0 if model.cfg.tie_embeddings else 1) + (8 + 2 * t.qk_norm) * blocks
    assert len(axes) == want, sorted(axes)
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
    assert specs[".stack.layers.attention.q"] == P(None, "fsdp", "tensor", None)
    assert specs[".stack.layers.attention.kv"] == P(None, "fsdp", None, "tensor", None)
    assert specs[".stack.layers.attention.out"] == P(None, "tensor", None, "fsdp")
    assert specs[".stack.layers.ffn.gate.weight"] == P(None, "fsdp", "tensor")
    assert specs[".stack.layers.ffn.up.weight"] == P(None, "fsdp", "tensor")
    assert specs[".stack.layers.ffn.down.weight"] == P(None, "tensor", "fsdp")
    assert specs[".stack.layers.atten_norm.scale"] == P(None, None)
    assert specs[".final_norm.scale"] == P(None)


def test_the_experiments_logical_axis_rules_reach_the_train_state_shardings(monkeypatch):
    """`--set mesh.logical_axis_rules=...` is what build_training shards the train state by."""
    import jax

    import equipax.launch.program.training as build
    from equipax.core.knobs import apply_overrides
    from equipax.core.mesh import build_mesh
    from equipax.launch.experiments.registry import get_experiment

    seen = []
    real = build.train_state_shardings
    monkeypatch.setattr(build, "train_state_shardings", lambda *a: seen.append(a[3]) or real(*a))
    rules = (
        "(('embed', None), ('vocab', 'tensor'), ('heads', 'tensor'), ('hidden', 'tensor'), ('head_dim', None), "
        "('qkv', None), ('layers', None), ('stage', 'stage'), ('norm', None))"
    )
    cfg, _ = apply_overrides(get_experiment("shakespeare_tiny"), [f"mesh.logical_axis_rules={rules}"])
    build.build_training(cfg, build_mesh(cfg.mesh, jax.devices()[:1]))
    assert seen == [dict(cfg.mesh.logical_axis_rules)] and seen[0]["embed"] is None
