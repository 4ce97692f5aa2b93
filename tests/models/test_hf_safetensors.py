"""The safetensors reader/writer and config.json <-> LMConfig (no model runs here)."""

import json
import struct

import ml_dtypes
import numpy as np
import pytest

from equipax.core.knobs import ConfigError
from equipax.models.hf.config import hf_config_from_lm, lm_config_from_hf, model_type_of
from equipax.models.hf.safetensors import CheckpointFormatError, HFCheckpoint, SafetensorsFile, write_safetensors
from helpers.hf import FAMILIES, hf_config, write_hf_dir


def _tensors():
    rng = np.random.default_rng(0)
    return {
        "a": rng.normal(size=(7, 5, 3)).astype(np.float32),
        "b": rng.normal(size=(4,)).astype(ml_dtypes.bfloat16),
        "c": rng.normal(size=(6, 2)).astype(np.float16),
        "s": np.array(1.5, np.float32),
    }


def test_round_trip_and_byte_range_reads(tmp_path):
    tensors = _tensors()
    write_safetensors(tmp_path / "x.safetensors", tensors, {"format": "pt"})
    f = SafetensorsFile(tmp_path / "x.safetensors")
    assert f.metadata == {"format": "pt"}
    assert (f.data_start - 8) % 8 == 0  # header padded: tensors aligned
    for name, a in tensors.items():
        got = f.read(name)
        assert got.dtype == a.dtype and got.shape == a.shape
        assert got.tobytes() == a.tobytes()
    a = tensors["a"]
    np.testing.assert_array_equal(f.read("a", (slice(2, 5), slice(1, 4))), a[2:5, 1:4])
    np.testing.assert_array_equal(f.read("a", (), view=(35, 3))[10:20], a.reshape(35, 3)[10:20])
    np.testing.assert_array_equal(f.read("a", (slice(1, 3),), view=(7, 15)), a.reshape(7, 15)[1:3])


def test_reads_files_of_the_reference_layout(tmp_path):
    # Written by hand as the format specifies (no padding, metadata last): the reader must not rely
    # on our writer's choices.
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    header = json.dumps({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}, "__metadata__": {"k": "v"}})
    (tmp_path / "h.safetensors").write_bytes(struct.pack("<Q", len(header)) + header.encode() + a.tobytes())
    f = SafetensorsFile(tmp_path / "h.safetensors")
    np.testing.assert_array_equal(f.read("w"), a)
    assert f.metadata == {"k": "v"}


def test_damaged_files_are_named(tmp_path):
    path = tmp_path / "x.safetensors"
    write_safetensors(path, _tensors())
    raw = path.read_bytes()
    (tmp_path / "short.safetensors").write_bytes(raw[:5])
    with pytest.raises(CheckpointFormatError, match=r"short\.safetensors.*truncated"):
        SafetensorsFile(tmp_path / "short.safetensors")
    (tmp_path / "head.safetensors").write_bytes(raw[:40])
    with pytest.raises(CheckpointFormatError, match=r"head\.safetensors.*header claims .*truncated"):
        SafetensorsFile(tmp_path / "head.safetensors")
    (tmp_path / "data.safetensors").write_bytes(raw[:-10])
    with pytest.raises(CheckpointFormatError, match=r"data\.safetensors.*tensor '.' ends at byte .*truncated"):
        SafetensorsFile(tmp_path / "data.safetensors")
    header = json.dumps({"i": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}}).encode()
    (tmp_path / "int.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    with pytest.raises(CheckpointFormatError, match=r"tensor 'i' is I64"):
        SafetensorsFile(tmp_path / "int.safetensors")
    header = json.dumps({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}).encode()
    (tmp_path / "size.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    with pytest.raises(CheckpointFormatError, match=r"tensor 'w' \(F32 \[3\]\) should hold 12 bytes"):
        SafetensorsFile(tmp_path / "size.safetensors")


def test_checkpoint_directories(tmp_path):
    with pytest.raises(CheckpointFormatError, match="holds no safetensors weights"):
        HFCheckpoint(tmp_path)
    t = _tensors()
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {"a": t["a"]})
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {"b": t["b"]})
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    ckpt = HFCheckpoint(tmp_path)
    assert ckpt.read("b").tobytes() == t["b"].tobytes()
    with pytest.raises(CheckpointFormatError, match="no tensor 'zz'"):
        ckpt.read("zz")
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(
        CheckpointFormatError, match=r"not in .*model-00002-of-00002\.safetensors \(e\.g\. tensor 'b'\)"
    ):
        HFCheckpoint(tmp_path)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_both_schemas_give_one_config_and_export_round_trips(family):
    v4 = lm_config_from_hf(hf_config(family, schema="v4"))
    v5 = lm_config_from_hf(hf_config(family, schema="v5"))
    assert v4 == v5
    assert model_type_of(v5) == FAMILIES[family]["model_type"]
    exported = hf_config_from_lm(v5)
    assert exported["rope_theta"] == exported["rope_parameters"]["rope_theta"] == v5.rope_theta
    assert (exported["rope_scaling"] is None) == (v5.rope_scaling is None)
    # Each schema alone reads back the same model (a 4.x reader sees rope_theta / rope_scaling only).
    only_v4 = {k: v for k, v in exported.items() if k != "rope_parameters"}
    only_v5 = {k: v for k, v in exported.items() if k not in ("rope_theta", "rope_scaling")}
    assert lm_config_from_hf(only_v4) == lm_config_from_hf(only_v5) == v5


def test_class_defaults_for_missing_keys():
    cfg = hf_config("qwen3_tied")
    del cfg["head_dim"], cfg["num_key_value_heads"]
    cfg["num_attention_heads"] = 64
    t = lm_config_from_hf(cfg).transformer
    assert (t.head_dim, t.kv_heads) == (128, 32)  # Qwen3Config's defaults, not hidden / heads
    cfg = hf_config("mistral_window")
    del cfg["sliding_window"]
    assert lm_config_from_hf(cfg).transformer.sliding_window == 4096


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2"}, r"model_type='gpt2' is not one equipax converts"),
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
            r"rope_type='yarn' is not supported",
        ),
        ({"attention_bias": True}, r"attention_bias=true"),
        ({"hidden_act": "gelu"}, r"hidden_act='gelu'"),
        ({"num_key_value_heads": 3}, r"num_kv_heads=3 does not divide"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, r"layer_types"),
    ],
)
def test_what_cannot_be_represented_is_refused(change, message):
    with pytest.raises(ConfigError, match=message):
        lm_config_from_hf(hf_config("llama3_gqa") | change)


def test_expert_knobs_read_from_either_spelling_and_dense_layers_refused():
    hub = hf_config("qwen3_moe_unnormalised")  # the hub's Qwen3-MoE spelling: num_experts
    v5 = {k: v for k, v in hub.items() if k != "num_experts"} | {"num_local_experts": hub["num_experts"]}
    t = lm_config_from_hf(hub).transformer
    assert t == lm_config_from_hf(v5).transformer
    assert (t.num_experts, t.num_experts_per_tok, t.moe_intermediate_size, t.norm_topk_prob) == (6, 3, 24, False)
    assert t.capacity_factor is None and t.qk_norm  # dropless, as transformers computes
    mixtral = lm_config_from_hf(hf_config("mixtral_experts")).transformer
    assert mixtral.norm_topk_prob and mixtral.expert_hidden_dims == hub["intermediate_size"]
    for change in ({"mlp_only_layers": [1]}, {"decoder_sparse_step": 2}):
        with pytest.raises(ConfigError, match=r"mlp_only_layers=.*same feed-forward"):
            lm_config_from_hf(hub | change)


def test_export_refuses_moe_models_without_hf_equivalent():
    import dataclasses

    cfg = lm_config_from_hf(hf_config("mixtral_experts"))
    shared = dataclasses.replace(cfg.transformer, shared_expert_intermediate_size=32)
    with pytest.raises(ConfigError, match=r"shared_expert_intermediate_size=32.*no shared expert"):
        hf_config_from_lm(dataclasses.replace(cfg, transformer=shared))
    biased = dataclasses.replace(cfg.transformer, router_bias_update_rate=0.001)
    with pytest.raises(ConfigError, match=r"router_bias_update_rate=0.001: .*no routing biases"):
        hf_config_from_lm(dataclasses.replace(cfg, transformer=biased))
    unnormalised = dataclasses.replace(cfg.transformer, norm_topk_prob=False)
    with pytest.raises(ConfigError, match=r"norm_topk_prob=False without qk_norm.*Mixtral always"):
        hf_config_from_lm(dataclasses.replace(cfg, transformer=unnormalised))


def test_export_refuses_models_without_hf_equivalent():
    from equipax.models.configs import LMConfig

    with pytest.raises(ConfigError, match=r"model.position='sinusoidal'.*no Hugging Face equivalent"):
        hf_config_from_lm(LMConfig())


def test_missing_config_is_named(tmp_path):
    from equipax.models.hf.config import read_hf_config

    with pytest.raises(ConfigError, match="has no config.json"):
        read_hf_config(tmp_path)
    write_hf_dir(tmp_path / "m", "llama3_gqa")
    assert read_hf_config(tmp_path / "m")["model_type"] == "llama"
