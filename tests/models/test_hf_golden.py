"""The committed fixtures made with the real transformers and tokenizers packages
(tests/fixtures/hf/make_fixtures.py): equipax's import, the numpy reference, KV-cache decoding and
the tokenizer give what transformers gave. No torch needed here."""

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from equipax.data import HFTokenizer
from equipax.models.decode import decode
from equipax.models.hf.config import lm_config_from_hf, read_hf_config
from equipax.models.hf.reference import logit_kl, reference_logits
from equipax.models.hf.weights import load_lm, model_logits

FIXTURES = Path(__file__).parents[1] / "fixtures" / "hf"
FAMILIES = ("llama3_2", "mistral", "qwen3", "mixtral", "qwen3_moe")


@pytest.fixture(scope="module")
def imported():
    out = {}
    for family in FAMILIES:
        directory = FIXTURES / family
        cfg = lm_config_from_hf(read_hf_config(directory))
        out[family] = (directory, cfg, load_lm(directory, cfg), dict(np.load(directory / "golden.npz")))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers(imported, family):
    directory, _, model, golden = imported[family]
    ids, want = golden["ids"], golden["logits"]
    scale = np.abs(want).max()
    np.testing.assert_allclose(model_logits(model, ids), want, rtol=1e-5, atol=1e-5 * scale)
    # The reference the gate uses agrees with transformers too (float64 vs its float32).
    np.testing.assert_allclose(reference_logits(directory, ids), want, rtol=1e-5, atol=1e-5 * scale)
    assert logit_kl(want, model_logits(model, ids)) < 1e-6


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_decoding_equals_transformers_generate(imported, family):
    _, _, model, golden = imported[family]
    prompt, want = golden["prompt"], golden["greedy"]
    tokens, _ = decode(
        model, jnp.asarray(prompt[None]), jnp.asarray([len(prompt)]), max_new_tokens=len(want) - len(prompt)
    )
    assert np.asarray(tokens)[0].tolist() == want[len(prompt) :].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_equals_transformers(imported, family):
    directory, cfg, _, golden = imported[family]
    tok = HFTokenizer.load(directory)
    info = json.loads((directory / "golden.json").read_text())
    hf = read_hf_config(directory)
    assert tok.vocab_size == cfg.vocab_size
    assert tok.encode(info["sample"]) == golden["sample_ids"].tolist()
    assert tok.decode(tok.encode(info["sample"])) == info["sample"]
    assert tok.eos_id == hf["eos_token_id"]
    assert tok.bos_id == (hf["bos_token_id"] if hf["bos_token_id"] is not None else hf["eos_token_id"])
    assert tok.decode(golden["greedy"]) == info["greedy_text"]


def test_the_gate_checks_an_experiment_with_capacity_dispatch_dropless(imported):
    """An experiment that trains Mixtral with a capacity factor (mixtral_8x7b's 1.25) initialised from
    the checkpoint: the capacity dispatch drops tokens (its logits differ from transformers'), and
    the gate checks the weights dropless, as transformers computes."""
    import dataclasses

    from equipax.models.hf.weights import parity_kl

    directory, cfg, _, golden = imported["mixtral"]
    capped = dataclasses.replace(cfg, transformer=dataclasses.replace(cfg.transformer, capacity_factor=0.5))
    model = load_lm(directory, capped)
    assert logit_kl(golden["logits"], model_logits(model, golden["ids"])) > 1e-4  # tokens were dropped
    assert parity_kl(model, directory) < 1e-6
    # Auxiliary-loss-free balancing starts from the checkpoint with its routing biases at 0.
    biased = dataclasses.replace(cfg, transformer=dataclasses.replace(cfg.transformer, router_bias_update_rate=0.001))
    model = load_lm(directory, biased)
    assert not np.asarray(model.stack.layers.ffn.router_bias).any() and parity_kl(model, directory) < 1e-6
