"""`model.dtype="bfloat16"` is mixed precision (docs/knobs.md, "Mixed precision"): matmuls and
attention take bfloat16 inputs; norm statistics, softmax statistics, the logits (cast after their
bfloat16 matmul) and the loss are float32; parameters, gradients and optimizer state stay float32
(that a bf16 run of the default experiment learns like the f32 one: tests/launch/test_bf16_run.py)."""

import equinox as eqx
import jax
import jax.extend
import jax.numpy as jnp
import jax.random as jr
import optax

from equipax.core.nn import TransformerConfig
from equipax.core.step import init_train_state
from equipax.models import LMConfig, TransformerLM, lm_loss

CFG = LMConfig(
    vocab_size=64,
    max_seq_len=16,
    dtype="bfloat16",
    transformer=TransformerConfig(num_layers=2, model_dims=16, num_heads=2, head_dim=8, hidden_dims=32),
)


def _batch():
    tokens = jr.randint(jr.key(1), (2, 17), 0, 64, dtype=jnp.int32)
    return {"ids": tokens[:, :-1], "labels": tokens[:, 1:], "weights": jnp.ones((2, 16), jnp.float32)}


def _eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _eqns(sub)


def test_bf16_computes_matmuls_in_bf16_and_statistics_in_f32():
    model = TransformerLM(CFG, key=jr.key(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    grad_fn = jax.grad(lambda p, b: lm_loss(eqx.combine(p, static), b)[0])
    jaxpr = jax.make_jaxpr(grad_fn)(params, _batch())
    eqns = list(_eqns(jaxpr.jaxpr))
    dots = [e for e in eqns if e.primitive.name == "dot_general"]
    assert dots and all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars), [
        tuple(v.aval.dtype for v in e.invars) for e in dots
    ]
    # Softmax and log-softmax exponents, logs and the norms' rsqrt: all float32.
    stats = [e for e in eqns if e.primitive.name in ("exp", "log", "rsqrt")]
    assert stats and all(e.outvars[0].aval.dtype == jnp.float32 for e in stats)
    # The attention logits accumulate in float32 (einsum_f32); the output logits are cast to it.
    assert any(e.params.get("preferred_element_type") == jnp.float32 for e in dots)
    # Dtypes are the traced program's (eval_shape traces what a call runs, without compiling it).
    assert jax.eval_shape(model, _batch()["ids"]).dtype == jnp.float32
    grads = jax.eval_shape(grad_fn, params, _batch())
    assert {leaf.dtype for leaf in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}


def test_bf16_keeps_parameters_and_optimizer_state_in_f32():
    model = TransformerLM(CFG, key=jr.key(0))
    state = init_train_state(model, optax.adamw(1e-3))
    dtypes = {leaf.dtype for leaf in jax.tree.leaves(eqx.filter((state.model, state.opt_state), eqx.is_inexact_array))}
    assert dtypes == {jnp.dtype(jnp.float32)}
