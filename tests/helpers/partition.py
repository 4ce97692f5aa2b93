"""Partition specs of a model's weights on an abstract data x fsdp x tensor mesh, by path."""


def mesh(data=2, fsdp=4, tensor=2):
    from jax.sharding import AbstractMesh

    return AbstractMesh((data, fsdp, tensor), ("data", "fsdp", "tensor"))


def flat_specs(model, m, rules=None):
    """`{path: PartitionSpec}` for every array leaf of `model` on mesh `m` (`rules`: logical axis ->
    mesh axis, default the built-in table)."""
    import jax
    from jax.sharding import PartitionSpec as P

    from equipax.core.partition import param_specs

    specs = param_specs(model, m, rules)
    leaves = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0]
    return {jax.tree_util.keystr(path): spec for path, spec in leaves}
