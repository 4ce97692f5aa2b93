"""The plain-JAX greedy KV-cache loop of benchmarks/baseline_lm.py (the reference
benchmarks/decode_reference.py times `launch decode` against) decodes the tokens of
`equipax.models.decode.decode` on the same parameters, for both families, with prompts of
different lengths in one batch."""

import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest


@pytest.mark.parametrize("llama", [False, True], ids=["gpt", "llama"])
def test_reference_loop_decodes_the_tokens_of_equipax(llama):
    from benchmarks import baseline_lm
    from benchmarks.lm_step.baseline import baseline_for, baseline_params
    from benchmarks.lm_step.presets import Preset
    from equipax.core.nn import TransformerConfig
    from equipax.core.optim import LearnerConfig
    from equipax.launch.experiments.decoder_presets import decoder_lm
    from equipax.models.decode import decode
    from equipax.models.lm import LMConfig, TransformerLM

    if llama:
        model_cfg = decoder_lm(
            vocab_size=64, max_seq_len=24, num_layers=2, model_dims=32, num_heads=4, num_kv_heads=2, head_dim=8,
            hidden_dims=48, rope_theta=10_000.0, scan_layers=False, remat="none", dtype="float32", attention_impl="xla",
        )  # fmt: skip
    else:
        t = TransformerConfig(num_layers=2, model_dims=32, num_heads=4, head_dim=8, hidden_dims=48, scan_layers=False)
        model_cfg = LMConfig(vocab_size=64, max_seq_len=24, transformer=t, output_logit_cap=30.0)
    model = TransformerLM(model_cfg, key=jr.key(0))
    preset = Preset(
        name="t", description="", model=model_cfg, batch_size=1, seq_len=24, learner=LearnerConfig(kind="adamw")
    )
    cfg, params = baseline_for(preset), baseline_params(model)
    prompts = jnp.asarray(np.random.default_rng(0).integers(0, 64, (3, 6)), jnp.int32)
    lengths = jnp.asarray([6, 2, 4], jnp.int32)
    want, counts = decode(model, prompts, lengths, max_new_tokens=10)
    assert (np.asarray(counts) == 10).all()
    got = baseline_lm.make_greedy_decode(cfg, 10)(params, prompts, lengths)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # The check can fail: the same loop reading every row's prompt as full-width decodes other tokens.
    wrong = baseline_lm.make_greedy_decode(cfg, 10)(params, prompts, jnp.full((3,), 6, jnp.int32))
    assert (np.asarray(wrong)[1:] != np.asarray(want)[1:]).any()
