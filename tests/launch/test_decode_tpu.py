"""The decode loop as XLA:TPU compiles it (offline, with libtpu; no TPU needed).

c4_1b at 6 layers decoded a batch of 8 at 0.61x a plain-JAX KV-cache loop on a v5e: XLA:TPU's
memory-space assignment kept the stacked output projection in on-chip memory across the token
loop and moved it out and back in every layer (benchmarks/README.md, "Decode on the chip").
`equipax.models.decode.TPU_DECODE_COMPILER_OPTIONS` stops that; these tests read the compiled
program.
"""

import re

import pytest

pytest.importorskip("libtpu", reason="XLA:TPU (libtpu) is not installed: `uv sync` installs it")


def _decode_program_text(batch: int, compiler_options: dict | None) -> str:
    """XLA:TPU's optimized program of `launch decode`'s loop for c4_1b at 6 layers, bf16, greedy,
    `batch` prompts 16 tokens wide, 128 new tokens, on one v5e chip."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from equipax.core.knobs import set_knob
    from equipax.launch.configs.experiment import as_lm
    from equipax.launch.experiments.registry import get_experiment
    from equipax.launch.hardware.tpu import lookup_slice, topology_devices
    from equipax.models import decode
    from equipax.models.lm import TransformerLM

    sharding = jax.sharding.SingleDeviceSharding(topology_devices(lookup_slice("v5e-1"))[0])
    cfg = as_lm(set_knob(get_experiment("c4_1b"), "model.transformer.num_layers", 6)).model
    model = eqx.filter_eval_shape(lambda: TransformerLM(cfg, key=jax.random.key(0)))
    is_shape = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    arrays, static = eqx.partition(model, is_shape, is_leaf=is_shape)
    arrays = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), arrays)

    def loop(arrays, prompts, lengths, eos, pad):
        model = eqx.combine(arrays, static)
        return decode._decode_loop(model, prompts, lengths, None, 128, 0.0, None, None, eos, pad)

    def placed(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    args = (placed((batch, 16), jnp.int32), placed((batch,), jnp.int32), placed((), jnp.int32), placed((), jnp.int32))
    lowered = jax.jit(loop, compiler_options=compiler_options).lower(arrays, *args)
    return lowered.compile().as_text()


def _stacked_weights_moved(hlo: str) -> list[str]:
    """The async copies and slices of a stacked bf16 weight ([6, ...] with the model's 2560
    embedding in it) in the program: each moves a whole layer stack between memories."""
    moves = []
    for line in hlo.splitlines():
        if " copy-start(" in line or " slice-start(" in line:
            moves += [s for s in re.findall(r"bf16\[6,[\d,]+\]", line.split(" = ", 1)[1]) if "2560" in s][:1]
    return moves


@pytest.mark.slow
def test_decode_loop_moves_no_weight_stack_on_a_tpu():
    from equipax.models.decode import TPU_DECODE_COMPILER_OPTIONS

    assert _stacked_weights_moved(_decode_program_text(8, TPU_DECODE_COMPILER_OPTIONS)) == []
