"""A LoRA adapter on the tiny Llama 3.2 fixture, as the real `peft` library reads it: the committed
tests/fixtures/hf/llama3_2_lora holds the adapter equipax exported (seeded A and B, every target)
and the logits `peft.PeftModel` computed with it (tests/fixtures/hf/check_peft.py, run in a
throwaway torch environment). Here, without torch: equipax still exports that adapter, and its LoRA
model's logits equal peft's."""

from pathlib import Path

import equinox as eqx
import jax
import numpy as np

from equipax.models.configs import LoRAConfig
from equipax.models.hf.config import lm_config_from_hf, read_hf_config
from equipax.models.hf.peft import ADAPTER_WEIGHTS, write_peft_adapter
from equipax.models.hf.safetensors import SafetensorsFile
from equipax.models.hf.weights import load_lm, model_logits
from equipax.models.lora import LoRALM

FIXTURES = Path(__file__).parents[1] / "fixtures" / "hf"
BASE, ADAPTER = FIXTURES / "llama3_2", FIXTURES / "llama3_2_lora"
CONFIG = LoRAConfig(enabled=True, rank=4, alpha=8.0, targets=("q", "k", "v", "o", "gate", "up", "down"))


def seeded_lora() -> LoRALM:
    """The fixture's adapter: every A and B drawn from numpy's generator (seed 0), B large enough
    that the adapter moves the logits well past float32 noise."""
    model = LoRALM(load_lm(BASE, lm_config_from_hf(read_hf_config(BASE))), CONFIG, key=jax.random.key(0))
    rng = np.random.default_rng(0)
    leaves, tree = jax.tree.flatten(model.adapters)
    leaves = [np.asarray(rng.normal(0.0, 0.1, x.shape), np.float32) for x in leaves]
    return eqx.tree_at(lambda m: m.adapters, model, replace=jax.tree.unflatten(tree, leaves))


def _tensors(path: Path) -> dict[str, np.ndarray]:
    f = SafetensorsFile(path)
    return {name: np.asarray(f.read(name)) for name in f.tensors}


def test_lora_logits_equal_peft(tmp_path):
    model = seeded_lora()
    write_peft_adapter(tmp_path, model)
    got, want = _tensors(tmp_path / ADAPTER_WEIGHTS), _tensors(ADAPTER / ADAPTER_WEIGHTS)
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    golden = np.load(ADAPTER / "peft_logits.npz")
    ids, peft, base = golden["ids"], golden["logits"], golden["base_logits"]
    logits = model_logits(model.merged(), ids)
    scale = np.abs(peft).max()
    assert np.abs(peft - base).max() > 100 * 1e-5 * scale  # the adapter matters at this tolerance
    np.testing.assert_allclose(logits, peft, rtol=1e-5, atol=1e-5 * scale)
