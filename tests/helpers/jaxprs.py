"""What a traced program runs: the splash forward kernels in a jaxpr that are live (their results used)."""


def splash_forward_kernels(jaxpr) -> int:
    """Splash forward kernels (`pallas_call`s named `*_fwd_*`) the program `jaxpr` runs, in every
    nested jaxpr: those whose results are used (an unused one, which partial evaluation can leave
    behind and XLA removes, is not counted; a loop's body counts once)."""
    import jax

    live = {v for v in jaxpr.outvars if isinstance(v, jax.extend.core.Var)}
    count = 0
    for eqn in reversed(jaxpr.eqns):
        if not any(v in live for v in eqn.outvars) and not eqn.effects:
            continue
        live.update(v for v in eqn.invars if isinstance(v, jax.extend.core.Var))
        if eqn.primitive.name == "pallas_call" and "_fwd_" in str(eqn.params["name"]):
            count += 1
        count += sum(splash_forward_kernels(sub) for sub in jax.extend.core.jaxprs_in_params(eqn.params))
    return count
