"""MaxText <-> equipax config translation: `launch convert maxtext`, `show --format maxtext`."""

import json

import pytest

from helpers import REPO

# MaxText's 2xv4-128.sh as the Pax README translates it (C4Spmd22BAdam2xv4_128).
MAXTEXT_2XV4_128 = {
    "global_parameter_scale": 3,
    "base_num_decoder_layers": 16,
    "base_emb_dim": 2048,
    "base_mlp_dim": 8192,
    "base_num_heads": 8,
    "head_dim": 256,
    "per_device_batch_size": 16,
    "max_target_length": 1024,
    "vocab_size": 32768,
    "dtype": "bfloat16",
    "ici_fsdp_parallelism": 64,
    "dcn_data_parallelism": 2,
}


def launch(*args):
    from typer.testing import CliRunner

    from equipax.launch.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


def _model_and_mesh(cfg):
    from equipax.core.knobs import flatten

    return {k: v for k, v in flatten(cfg).items() if k.startswith(("model.", "mesh."))}


def test_maxtext_2xv4_128_converts_to_c4_22b_2x(tmp_path):
    import yaml

    from equipax.core.knobs import apply_overrides
    from equipax.launch.experiments.registry import get_experiment

    config = tmp_path / "2xv4-128.yml"
    config.write_text(yaml.safe_dump(MAXTEXT_2XV4_128))
    result = launch("convert", "maxtext", config, "--format", "json", "--scale-rule", "linear")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["not_translated"] == {} and out["exp"] == "c4_1b"
    sets = [f"{k}={v!r}" for k, v in out["set"].items()]
    cfg, _ = apply_overrides(get_experiment(out["exp"]), sets)
    assert _model_and_mesh(cfg) == _model_and_mesh(get_experiment("c4_22b_2x"))
    assert cfg.global_batch_size == 2048


def test_set_lines_apply_as_printed(tmp_path):
    import shlex

    from equipax.core.knobs import apply_overrides
    from equipax.launch.experiments.registry import get_experiment

    config = tmp_path / "m.yml"
    config.write_text("dtype: bfloat16\nici_fsdp_parallelism: 4\nlearning_rate: 1e-3\n")
    result = launch("convert", "maxtext", config, "steps=100", "--exp", "c4_1b_smoke")
    assert result.exit_code == 0, result.output
    words = shlex.split(" ".join(line for line in result.stdout.splitlines() if line.startswith("--set")))
    cfg, _ = apply_overrides(get_experiment("c4_1b_smoke"), words[1::2])
    assert (cfg.model.dtype, cfg.mesh.ici_mesh_shape, cfg.train.num_steps) == ("bfloat16", (1, 4, 1), 100)
    schedule = cfg.learner.schedule
    assert (schedule.kind, schedule.peak_learning_rate, schedule.warmup_steps, schedule.decay_steps) == (
        "warmup_cosine",
        1e-3,
        10,
        90,
    )  # "1e-3" is a string to YAML 1.1, a number to MaxText


def test_maxtext_to_equipax_and_back_is_the_identity():
    from equipax.launch.translators.maxtext.translate import to_equipax, to_maxtext

    maxtext = {  # MaxText's v4/22b.sh with an optimizer, a schedule and caps
        "global_parameter_scale": 1,
        "base_num_decoder_layers": 48,
        "base_emb_dim": 6144,
        "base_mlp_dim": 24576,
        "base_num_query_heads": 24,
        "base_num_kv_heads": 24,
        "head_dim": 256,
        "vocab_size": 32768,
        "max_target_length": 2048,
        "dtype": "bfloat16",
        "per_device_batch_size": 13,
        "ici_data_parallelism": 1,
        "ici_fsdp_parallelism": 64,
        "ici_tensor_parallelism": 1,
        "scan_layers": True,
        "remat_policy": "minimal",
        "mlp_activations": ["silu", "linear"],
        "attn_logits_soft_cap": 50.0,
        "final_logits_soft_cap": 0.0,
        "learning_rate": 3e-4,
        "lr_schedule_type": "cosine",
        "warmup_steps_fraction": 0.1,
        "learning_rate_final_fraction": 0.1,
        "learning_rate_schedule_steps": 1000,
        "opt_type": "adamw",
        "adam_b1": 0.9,
        "adam_b2": 0.95,
        "adam_eps": 1e-8,
        "adam_weight_decay": 0.1,
        "gradient_clipping_threshold": 1.0,
        "steps": 1000,
        "checkpoint_period": 500,
        "eval_interval": 100,
        "dataset_type": "tfds",
        "dataset_name": "c4/en:3.1.0",
        "dataset_path": "/data/c4",
        "packing": True,
        "profiler": "xplane",
        "skip_first_n_steps_for_profiler": 3,
        "profiler_steps": 4,
        "upload_all_profiler_results": False,
    }
    forward = to_equipax(maxtext)
    assert forward.skipped == {}
    knobs = forward.knobs | {"mesh.dcn_mesh_shape": (1, 1, 1), "data.per_device_batch": 13}
    back = to_maxtext(knobs | {"model.transformer.pipeline_stages": 1, "model.max_seq_len": 2048}).knobs
    assert {k: back[k] for k in maxtext} == maxtext


def test_global_parameter_scale_rules():
    from equipax.launch.translators.maxtext.translate import to_equipax

    base = {"base_num_decoder_layers": 16, "base_emb_dim": 2048, "base_mlp_dim": 8192, "base_num_query_heads": 8}
    dims = ("num_layers", "model_dims", "hidden_dims", "num_heads")

    def sizes(scale, rule):
        knobs = to_equipax(base | {"global_parameter_scale": scale}, scale_rule=rule).knobs
        return tuple(knobs[f"model.transformer.{d}"] for d in dims)

    assert sizes(3, "linear") == (48, 6144, 24576, 24)
    assert sizes(8, "doubling") == (32, 4096, 16384, 16)  # one doubling of each
    assert sizes(16, "doubling") == (32, 4096, 32768, 32)  # then heads and mlp first
    assert (
        "power of two"
        in to_equipax({"global_parameter_scale": 3}, scale_rule="doubling").skipped["global_parameter_scale"]
    )


def test_untranslated_keys_are_listed_with_why():
    from equipax.launch.translators.maxtext.translate import to_equipax

    t = to_equipax(
        {
            "base_num_query_heads": 32,
            "base_num_kv_heads": 8,
            "ici_sequence_parallelism": 2,
            "ici_autoregressive_parallelism": 1,
            "remat_policy": "save_qkv_proj",
            "per_device_batch_size": 0.5,
            "enable_checkpointing": True,
            "mesh_axes": ["data", "fsdp"],
            "vllm_additional_config": {"max_model_len": 4096},
            "quantization": "int4w",
        }
    )
    # no decoder_block: the base experiment's block, with grouped-query attention
    assert t.knobs == {
        "model.transformer.num_heads": 32,
        "model.transformer.num_kv_heads": 8,
        "model.transformer.fused_qkv": False,
    }
    assert set(t.skipped) == {
        *("ici_sequence_parallelism", "remat_policy", "per_device_batch_size", "mesh_axes", "quantization")
    }
    assert "'int8'" in t.skipped["quantization"]  # int4w: the modes equipax has are listed
    assert "no sequence axis" in t.skipped["ici_sequence_parallelism"]
    assert "'full'" in t.skipped["remat_policy"]
    assert t.ignored == {"vllm_additional_config": "{'max_model_len': 4096}"}
    assert any("fused_qkv=False" in n for n in t.notes)


def test_quantization_translates_both_ways():
    import yaml

    from equipax.launch.translators.maxtext.translate import to_equipax

    for maxtext, equipax in (("int8", "int8"), ("int8w", "int8w"), ("fp8", "fp8"), ("", "none")):
        assert to_equipax({"quantization": maxtext}).knobs["model.quantization"] == equipax
    assert "int4" in to_equipax({"quantization": "int4"}).skipped["quantization"]
    show = launch("show", "--exp", "shakespeare_tiny", "--set", "model.quantization=int8", "--format", "maxtext")
    assert show.exit_code == 0, show.output
    assert yaml.safe_load(show.stdout)["quantization"] == "int8"


def test_convert_reports_untranslated_keys_and_bad_input(tmp_path):
    config = tmp_path / "m.yml"
    config.write_text("vocab_size: 1000\nfoo: [1, {a: 2}]\nbar: {b: [3]}\n")
    result = launch("convert", "maxtext", config)
    assert result.exit_code == 0 and "--set model.vocab_size=1000" in result.stdout
    assert "2 keys with no equipax meaning: foo, bar" in result.output
    config.write_text("base_emb_dim: -5\n")  # translated, but no valid experiment
    assert launch("convert", "maxtext", config).exit_code == 2
    config.write_text("- a list\n")
    bad = launch("convert", "maxtext", config)
    assert bad.exit_code == 2 and "not a MaxText config" in bad.output


def test_show_format_maxtext():
    import yaml

    result = launch("show", "--exp", "c4_22b_2x", "--format", "maxtext")
    assert result.exit_code == 0, result.output
    values = yaml.safe_load(result.stdout)
    assert (
        values["base_num_decoder_layers"],
        values["base_emb_dim"],
        values["ici_fsdp_parallelism"],
        values["dcn_data_parallelism"],
        values["per_device_batch_size"],
    ) == (48, 6144, 64, 2, 16)
    assert "# not translated: learner.schedule.kind" in result.stdout
    assert "# not translated: model.transformer.norm" in result.stdout  # no MaxText block of Pax's GPT
    assert "decoder_block" not in values
    assert launch("show", "--exp", "cnn_digits", "--format", "maxtext").exit_code == 2


def test_docs_table_is_the_mapping():
    from equipax.launch.translators.maxtext.translate import markdown_table

    docs = (REPO / "docs" / "maxtext.md").read_text()
    assert markdown_table() in docs


# --- MaxText 0.2.5's own configs, as tests/fixtures/maxtext/ reproduces their shapes -----------

FIXTURES = REPO / "tests" / "fixtures" / "maxtext"
CONFIGS = FIXTURES / "configs"
PUBLISHED = {k: v for k, v in json.loads((FIXTURES / "published.json").read_text()).items() if k != "_about"}
FACTS = json.loads((FIXTURES / "facts.json").read_text())


def _convert(*args):
    result = launch("convert", "maxtext", *args, "--format", "json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_model_files_translate_to_the_published_size(name):
    model = CONFIGS / "models" / f"{name}.yml"
    alone = _convert(model)
    merged = _convert(CONFIGS / "base.yml", model)
    by_name = _convert(CONFIGS / "base.yml", f"model_name={name}")
    want = PUBLISHED[name]
    assert alone["params"] == merged["params"] == by_name["params"] == want["params"]
    size = float(want["size"].rstrip("B")) * 1e9  # the card's rounding of the same count
    digits = len(want["size"].rstrip("B").replace(".", "").lstrip("0"))
    assert f"{want['params']:.{digits}g}" == f"{size:.{digits}g}"
    assert alone["exp"] == merged["exp"] == by_name["exp"]
    assert alone["set"] == {k: v for k, v in by_name["set"].items() if k in alone["set"]}
    if name == "llama3-8b":  # the check can fail: full multi-head attention is another count
        assert _convert(model, "base_num_kv_heads=32")["params"] != want["params"]


def test_families_and_their_knobs():
    llama3 = _convert(CONFIGS / "base.yml", "model_name=llama3-8b")
    assert llama3["exp"] == "llama3_8b"
    s = llama3["set"]
    assert (s["model.transformer.num_kv_heads"], s["model.transformer.fused_qkv"], s["model.rope_theta"]) == (
        8,
        False,
        500_000.0,
    )
    assert (s["model.position"], s["model.transformer.norm"], s["model.tie_embeddings"]) == ("rope", "rmsnorm", False)
    assert s["data.packing"] is False and s["learner.clip_update_rms"] is None  # dependent knobs, said
    assert any("data.packing=False" in n for n in llama3["notes"])
    assert "logical_axis_rules" in llama3["not_translated"] and len(llama3["no_equipax_meaning"]) > 5
    scaled = _convert(CONFIGS / "base.yml", "model_name=llama3.1-8b")  # MaxText scales by model_name
    assert scaled["exp"] == "llama3_1_8b" and scaled["set"]["model.rope_scaling.factor"] == 8.0
    assert _convert(CONFIGS / "base.yml")["exp"] == "llama2_7b"  # base.yml alone: MaxText's llama2 block
    spm = _convert(CONFIGS / "base.yml", "model_name=llama2-7b", "tokenizer_path=/m/tokenizer.model")["set"]
    assert (spm["data.tokenizer"], spm["data.vocab_path"]) == ("sentencepiece", "/m/tokenizer.model")
    qwen = _convert(CONFIGS / "models" / "qwen3-0.6b.yml")
    assert qwen["exp"] == "qwen3_8b" and qwen["set"]["model.transformer.qk_norm"] is True
    assert qwen["set"]["model.tie_embeddings"] is True and qwen["set"]["model.embedding_init_std"] is None
    moe = _convert(CONFIGS / "base.yml", "model_name=qwen3-30b-a3b", "ici_expert_parallelism=8")
    assert moe["exp"] == "qwen3_30b_a3b" and moe["set"]["model.transformer.num_experts"] == 128
    assert moe["set"]["mesh.ici_mesh_shape"] == [1, -1, 8, 1]
    cp = _convert(
        CONFIGS / "base.yml", "model_name=llama3-8b", "ici_context_parallelism=4", "context_parallel_strategy=ring"
    )
    assert cp["set"]["mesh.axis_names"] == ["data", "fsdp", "context", "tensor"]
    assert (cp["set"]["mesh.ici_mesh_shape"], cp["set"]["model.transformer.context_parallel_strategy"]) == (
        [1, -1, 4, 1],
        "ring",
    )
    # With pipeline stages as well: both axes (context parallelism runs inside the stages).
    both = _convert(
        CONFIGS / "base.yml",
        "model_name=llama3-8b",
        "ici_context_parallelism=2",
        "ici_pipeline_parallelism=2",
        "num_layers_per_pipeline_stage=16",
    )
    assert both["set"]["mesh.axis_names"] == ["stage", "data", "fsdp", "context", "tensor"], both
    assert both["set"]["mesh.ici_mesh_shape"] == [2, 1, -1, 2, 1], both
    assert "ici_context_parallelism" not in both.get("skipped", {}), both


@pytest.mark.parametrize(
    "name, missing",
    [
        ("qwen2.5-7b", "decoder_block='qwen2'"),
        ("deepseek3-tiny", "decoder_block='deepseek'"),
        ("qwen3-vl-2b", "use_mrope=True"),
    ],
)
def test_architectures_the_stack_lacks_exit_2_naming_them(name, missing):
    for args in ([CONFIGS / "models" / f"{name}.yml"], [CONFIGS / "base.yml", f"model_name={name}"]):
        result = launch("convert", "maxtext", *args)
        assert result.exit_code == 2, result.output
        assert missing in " ".join(result.output.split()) and "Traceback" not in result.output
    result = launch("convert", "maxtext", CONFIGS / "models" / "qwen3-8b.yml", "attention_bias=true")
    assert result.exit_code == 2 and "attention_bias=True" in result.output


def test_model_name_resolution_errors(tmp_path):
    missing = launch("convert", "maxtext", CONFIGS / "base.yml", "model_name=nope-1b")
    assert missing.exit_code == 2 and "no model file" in missing.output
    clash = launch("convert", "maxtext", CONFIGS / "base.yml", "model_name=llama3-8b", "vocab_size=1000")
    assert clash.exit_code == 2 and "override_model_config" in clash.output
    ok = _convert(CONFIGS / "base.yml", "model_name=llama3-8b", "vocab_size=1000", "override_model_config=true")
    assert ok["set"]["model.vocab_size"] == 1000
    onto_gpt = _convert(CONFIGS / "base.yml", "model_name=mistral-7b", "--exp", "c4_1b")
    assert onto_gpt["params"] == PUBLISHED["mistral-7b"]["params"]  # the block is set whole, any base


def _lm_experiments():
    from equipax.core.knobs import flatten
    from equipax.launch.experiments.registry import entries

    for entry in entries():
        cfg = entry.fn()
        if entry.kind == "train" and cfg.kind == "lm" and "model.transformer.num_layers" in flatten(cfg):
            yield entry.name, cfg


def test_every_lm_experiment_round_trips_through_maxtext():
    """equipax -> MaxText -> equipax gives the same config but for what the reverse lists."""
    from equipax.core.knobs import ConfigError, flatten
    from equipax.launch.translators.maxtext.translate import apply_translation, to_equipax, to_maxtext

    seen = 0
    for name, cfg in _lm_experiments():
        knobs = flatten(cfg)
        there = to_maxtext(knobs)
        back_t = to_equipax(there.knobs)
        assert back_t.skipped == {}, name
        if "model.rope_scaling" in there.skipped:  # MaxText has Llama 3.1's scaling only: a clear refusal
            with pytest.raises(ConfigError, match="rope_scaling"):
                apply_translation(cfg, back_t.knobs)
            continue
        back = flatten(apply_translation(cfg, back_t.knobs))
        listed = set(there.skipped) | {"model.transformer.norm"}  # the rule of Pax's GPT block, see show
        diff = {k: (knobs[k], back[k]) for k in knobs if knobs[k] != back[k] and k not in listed}
        assert diff == {}, name
        seen += 1
    assert seen > 30


def test_show_writes_maxtext_0_2_5_keys_and_values():
    """Every key `show --format maxtext` writes is a key of MaxText 0.2.5's base.yml, every
    enumerated value one its loader accepts (tests/fixtures/maxtext/facts.json, read from the wheel)."""
    from equipax.core.knobs import flatten
    from equipax.launch.translators.maxtext.translate import to_maxtext

    keys, domains = set(FACTS["keys"]), FACTS["domains"]
    blocks = set()
    for name, cfg in _lm_experiments():
        out = to_maxtext(flatten(cfg)).knobs
        assert set(out) <= keys, (name, set(out) - keys)
        for key, allowed in domains.items():
            assert key not in out or out[key] in allowed, (name, key, out[key])
        assert out["per_device_batch_size"] is not None
        blocks.add(out.get("decoder_block"))
    assert blocks == {None, "llama2", "mistral", "qwen3", "mixtral", "qwen3_moe"}


def test_translator_facts_match_maxtext_0_2_5():
    from equipax.launch.translators.maxtext.blocks import FAMILIES, MISSING_BLOCKS
    from equipax.launch.translators.maxtext.rules import QUANTIZATIONS_BACK, REMATS
    from equipax.launch.translators.maxtext.training import OPTIMIZERS
    from equipax.launch.translators.maxtext.values import MAXTEXT_DEFAULTS

    assert {k: MAXTEXT_DEFAULTS[k] for k in FACTS["defaults"]} == FACTS["defaults"]
    assert set(MAXTEXT_DEFAULTS) - set(FACTS["defaults"]) == set()
    assert set(FAMILIES) | set(MISSING_BLOCKS) == set(FACTS["domains"]["decoder_block"])  # every block classified
    assert set(OPTIMIZERS) <= set(FACTS["domains"]["opt_type"])
    assert set(REMATS) <= set(FACTS["domains"]["remat_policy"])
    assert set(QUANTIZATIONS_BACK.values()) <= set(FACTS["domains"]["quantization"])
    assert "cosine_learning_rate_final_fraction" in FACTS["not_keys"]  # renamed before 0.2: read, never written


def test_no_value_of_any_key_crashes_the_translation():
    """Every key of a merged base.yml + model file, given a value of the wrong kind (a word, a
    list, a dict), with and without a decoder_block: a translation or a ConfigError (exit 2),
    never another exception (MaxText's list-valued keys once ended in 'unhashable type')."""
    import yaml

    from equipax.core.knobs import ConfigError
    from equipax.launch.translators.maxtext.translate import to_equipax

    merged = yaml.safe_load((CONFIGS / "base.yml").read_text()) | yaml.safe_load(
        (CONFIGS / "models" / "mixtral-8x7b.yml").read_text()
    )
    outcomes = {"ok": 0, "exit 2": 0}
    for config in (merged, {k: v for k, v in merged.items() if k != "decoder_block"}):
        for key in config:
            for bad in ("x", [1, "a"], {"a": [1]}):
                try:
                    to_equipax({**config, key: bad})
                    outcomes["ok"] += 1
                except ConfigError:
                    outcomes["exit 2"] += 1
    assert outcomes["ok"] > 100 and outcomes["exit 2"] > 50  # both outcomes exercised
    result = launch("convert", "maxtext", CONFIGS / "base.yml", "decoder_block=[llama2]")
    assert result.exit_code == 2 and "is not a decoder block's name" in result.output


def test_context_parallelism_round_trips_and_ring_gets_the_kernel_maxtext_needs():
    from equipax.core.knobs import flatten
    from equipax.launch.experiments.registry import get_experiment
    from equipax.launch.translators.maxtext.translate import apply_translation, to_equipax, to_maxtext

    knobs = flatten(get_experiment("llama3_8b")) | {
        "mesh.axis_names": ("data", "fsdp", "context", "tensor"),
        "mesh.ici_mesh_shape": (1, 32, 2, 1),
        "mesh.dcn_mesh_shape": (1, 1, 1, 1),
    }
    out = to_maxtext(knobs)
    assert (out.knobs["ici_context_parallelism"], out.knobs["context_parallel_strategy"]) == (2, "all_gather")
    ring = to_maxtext(knobs | {"model.transformer.context_parallel_strategy": "ring"})
    # MaxText 0.2.5's loader refuses ring context parallelism on another kernel (checked with it)
    assert (ring.knobs["attention"], ring.knobs["use_tokamax_splash"]) == ("flash", True)
    assert "model.transformer.attention_impl" in ring.skipped
    back = flatten(apply_translation(get_experiment("llama3_8b"), to_equipax(out.knobs).knobs))
    assert {k: back[k] for k in ("mesh.axis_names", "mesh.ici_mesh_shape")} == {
        "mesh.axis_names": ("data", "fsdp", "context", "tensor"),
        "mesh.ici_mesh_shape": (1, 32, 2, 1),
    }
    # Fewer sequences than devices (a sequence split over the context axis): MaxText's fraction
    # per device, read back as the global batch over the mesh; without a device count, skipped.
    small = knobs | {"data.per_device_batch": None, "data.batch_size": 16}
    assert to_maxtext(small).knobs["per_device_batch_size"] == 0.25
    assert {k: to_equipax(to_maxtext(small).knobs).knobs[k] for k in ("data.per_device_batch", "data.batch_size")} == {
        "data.per_device_batch": None,
        "data.batch_size": 16,
    }
    assert "per_device_batch_size" in to_equipax({"per_device_batch_size": 0.25}).skipped
