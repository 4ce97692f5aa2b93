"""LoRA adapters as a Hugging Face PEFT adapter: `adapter_model.safetensors` + `adapter_config.json`.

PEFT's LoRA adds `lora_B.weight @ lora_A.weight * (lora_alpha / r)` to a `torch.nn.Linear`'s
`[out, in]` weight, with `lora_A.weight` `[r, in]` and `lora_B.weight` `[out, r]`, under the names
`base_model.model.<the weight's module>.lora_A.weight` (e.g.
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`). An equipax adapter's A
`[in..., r]` and B `[r, out...]` give them by flattening the input and output axes in the order the
weight's own Hugging Face tensor flattens them (`TensorMap`: the tensor is the weight's
`[in..., out...]` flattened to `[in, out]` and transposed), one tensor per layer.
"""

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np

from equipax.models.hf.params import tensor_maps
from equipax.models.hf.safetensors import write_safetensors
from equipax.models.lora import LoRALM

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "PEFT_MODULES", "peft_config", "peft_tensors", "write_peft_adapter"]

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
# The Hugging Face module of each LoRA target (PEFT's `target_modules`).
PEFT_MODULES = {
    "q": "q_proj",
    "k": "k_proj",
    "v": "v_proj",
    "o": "o_proj",
    "gate": "gate_proj",
    "up": "up_proj",
    "down": "down_proj",
}


def peft_tensors(model: LoRALM) -> Iterator[tuple[str, np.ndarray]]:
    """`(name, float32 tensor)` of every adapter matrix, per layer, as PEFT names and lays them out."""
    flat = {jax.tree_util.keystr(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(model.base)[0]}
    maps = tensor_maps(model.cfg, {k: tuple(v.shape) for k, v in flat.items()})
    for name, path, index in model.where:
        adapter = model.adapters[name]
        tmap = maps[path]
        stack, inputs = adapter.stack, adapter.inputs
        fused = () if index is None else (stack + inputs,)
        assert tmap.name_axes == (*range(stack), *fused), (path, tmap.name_axes)
        outs = len(tmap.view) - inputs
        assert tmap.perm == (*range(outs, outs + inputs), *range(outs)), (path, tmap.perm)  # [out, in]
        a, b = np.asarray(jax.device_get(adapter.a), np.float32), np.asarray(jax.device_get(adapter.b), np.float32)
        rank = a.shape[-1]
        for pos in np.ndindex(*a.shape[:stack]):
            hf = str(tmap.names[(*pos, *(() if index is None else (index,)))]).removesuffix(".weight")
            a_pos, b_pos = a[pos], b[pos]
            yield f"base_model.model.{hf}.lora_A.weight", a_pos.reshape(-1, rank).T.copy()
            yield f"base_model.model.{hf}.lora_B.weight", b_pos.reshape(rank, math.prod(b_pos.shape[1:])).T.copy()


def peft_config(model: LoRALM, base_model: str = "") -> dict[str, object]:
    """The `adapter_config.json` of `model`'s adapters (PEFT's `LoraConfig`, saved)."""
    cfg = model.config
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(PEFT_MODULES[t] for t in cfg.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }


def write_peft_adapter(directory: str | os.PathLike[str], model: LoRALM, base_model: str = "") -> list[str]:
    """Write `adapter_model.safetensors` (float32, `{"format": "pt"}`) and `adapter_config.json`
    into the existing directory `directory`; returns the files written."""
    directory = Path(directory)
    write_safetensors(directory / ADAPTER_WEIGHTS, dict(peft_tensors(model)), {"format": "pt"})
    (directory / ADAPTER_CONFIG).write_text(json.dumps(peft_config(model, base_model), indent=2) + "\n")
    return [ADAPTER_WEIGHTS, ADAPTER_CONFIG]
