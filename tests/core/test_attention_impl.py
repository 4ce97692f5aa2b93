"""`model.transformer.attention_impl`: every kernel agrees with `reference_attention` (causal mask,
logit cap, packed segments), "auto" picks per platform, and a kernel the platform lacks is a config
error naming the knob (through an LM: tests/models/test_lm.py; through the CLI:
tests/launch/test_launch.py). The splash kernel runs here in the Pallas interpreter; cuDNN's call is
checked through the same `jax.nn` entry point with XLA (no GPU here); the TPU compile of splash is
in tests/launch/test_compile_tpu.py."""

import dataclasses

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

from equipax.core.knobs import ConfigError
from equipax.core.nn import TransformerConfig
from equipax.core.nn.attention import reference_attention, softmax_attention
from equipax.core.nn.fused_attention import attention_kernel, cudnn_attention, resolve_attention_impl, splash_attention

B, S, H, D = 2, 128, 2, 16  # splash blocks are multiples of 128, in the interpreter too


def _qkv(key, dtype=jnp.float32):
    return tuple(jr.normal(k, (B, S, H, D), dtype) for k in jr.split(key, 3))


def _segments():
    # Two packed documents per row, split at different places.
    pos = jnp.arange(S)[None, :]
    return (pos >= jnp.array([[20], [41]])).astype(jnp.int32)


CASES = [
    pytest.param(dict(causal=True), id="causal"),
    pytest.param(dict(causal=True, logit_cap=2.0), id="causal-cap"),
    pytest.param(dict(causal=True, segments=True), id="causal-segments"),
    pytest.param(dict(causal=False, logit_cap=5.0, segments=True), id="full-cap-segments"),
]


def _args(case):
    case = dict(case)
    seg = _segments() if case.pop("segments", False) else None
    return {**case, "segment_ids": seg}


@pytest.mark.parametrize("case", CASES)
def test_splash_kernel_matches_reference_forward_and_gradients(case, key):
    q, k, v = _qkv(key)
    kw = _args(case)

    def loss(fn, q, k, v):
        return jnp.sum(jnp.sin(fn(q, k, v, **kw)))

    splash = jax.jit(lambda q, k, v: splash_attention(q, k, v, interpret=True, **kw))
    np.testing.assert_allclose(splash(q, k, v), reference_attention(q, k, v, **kw), rtol=1e-5, atol=1e-5)
    g_splash = jax.grad(
        lambda *a: loss(lambda *b, **c: splash_attention(*b, interpret=True, **c), *a), argnums=(0, 1, 2)
    )(q, k, v)
    g_ref = jax.grad(lambda *a: loss(reference_attention, *a), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g_splash, g_ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("segments", [False, True])
def test_cudnn_call_matches_reference(segments, key):
    # The same jax.nn.dot_product_attention call the cuDNN path makes, lowered by XLA on this CPU.
    q, k, v = _qkv(key)
    seg = _segments() if segments else None
    out = cudnn_attention(q, k, v, causal=True, segment_ids=seg, implementation="xla")
    ref = reference_attention(q, k, v, causal=True, segment_ids=seg)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_auto_picks_per_platform():
    f32, bf16 = jnp.float32, jnp.bfloat16
    pick = lambda platform, **kw: resolve_attention_impl(  # noqa: E731
        "auto", platform, **{"seq_len": 1024, "dtype": bf16, "logit_cap": None, **kw}
    )
    assert pick("cpu") == "xla"
    assert pick("tpu") == "splash" and pick("tpu", seq_len=100) == "xla"
    assert pick("gpu") == "cudnn" and pick("gpu", dtype=f32) == "xla" and pick("gpu", logit_cap=50.0) == "xla"


@pytest.mark.parametrize(
    "impl, platform, kw, message",
    [
        ("cudnn", "cpu", {}, "needs a CUDA GPU, but this program runs on cpu"),
        ("cudnn", "gpu", {"dtype": jnp.float32}, "model.dtype='bfloat16'"),
        ("cudnn", "gpu", {"logit_cap": 50.0}, "atten_logit_cap=None"),
        ("splash", "cpu", {}, "is a TPU kernel, but this program runs on cpu"),
        ("splash", "tpu", {"seq_len": 100}, "divisible by 128"),
    ],
)
def test_a_kernel_the_platform_lacks_is_a_config_error(impl, platform, kw, message):
    args = {"seq_len": 1024, "dtype": jnp.bfloat16, "logit_cap": None, **kw}
    with pytest.raises(ConfigError, match="model.transformer.attention_impl") as e:
        resolve_attention_impl(impl, platform, **args)
    assert message in str(e.value) and "'auto'" in str(e.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"attention_impl": "cudnn"}, "atten_logit_cap=None"),  # the default cap is 50
        ({"attention_impl": "splash", "attention": "linear"}, "attention='softmax'"),
        ({"attention_impl": "splash", "tensor_parallel": "shard_map"}, "cannot nest"),
    ],
)
def test_contradicting_knobs_fail_when_the_config_is_built(overrides, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig(**overrides)


def test_softmax_attention_xla_is_the_einsum_path(key):
    q, k, v = _qkv(key)
    seg = _segments()
    out = softmax_attention(q, k, v, causal=True, logit_cap=3.0, segment_ids=seg, impl="auto")
    np.testing.assert_allclose(
        out, reference_attention(q, k, v, causal=True, logit_cap=3.0, segment_ids=seg), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize(
    ("knobs", "platform", "seq_len", "dtype", "context", "kernel"),
    [
        ({}, "tpu", 256, "float32", 1, "splash"),
        ({}, "tpu", 200, "float32", 1, "xla"),  # splash needs 128 x k positions
        ({"atten_logit_cap": None}, "gpu", 256, "bfloat16", 1, "cudnn"),
        ({}, "gpu", 256, "bfloat16", 1, "xla"),  # cuDNN has no logit cap
        ({}, "cpu", 256, "float32", 1, "xla"),
        ({"pipeline_stages": 2}, "tpu", 256, "float32", 1, "xla"),  # splash cannot nest in a stage
        ({}, "tpu", 256, "float32", 2, "xla (all_gather)"),
        ({"attention_impl": "splash", "context_parallel_strategy": "ring"}, "tpu", 256, "float32", 2, "splash (ring)"),
        ({"attention": "linear"}, "tpu", 256, "float32", 1, None),
    ],
)
def test_attention_kernel_names_what_auto_resolves_to(knobs, platform, seq_len, dtype, context, kernel):
    base = TransformerConfig(num_layers=2, model_dims=32, num_heads=2, head_dim=16, hidden_dims=64)
    cfg = dataclasses.replace(base, **{"atten_logit_cap": 50.0, "attention_impl": "auto", **knobs})
    assert attention_kernel(cfg, platform, seq_len=seq_len, dtype=dtype, context=context) == kernel
