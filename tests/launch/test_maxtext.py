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
    result = launch("convert", "maxtext", config, "--format", "json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["not_translated"] == {}
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


@pytest.mark.parametrize("name", ["c4_1b", "c4_16b", "c4_22b_2x"])
def test_equipax_to_maxtext_and_back_is_the_identity(name):
    from equipax.core.knobs import flatten
    from equipax.launch.experiments.registry import get_experiment
    from equipax.launch.translators.maxtext import to_equipax, to_maxtext

    knobs = flatten(get_experiment(name))
    back = to_equipax(to_maxtext(knobs).knobs)
    assert back.skipped == {} and len(back.knobs) > 20
    assert {k: knobs[k] for k in back.knobs} == back.knobs


def test_maxtext_to_equipax_and_back_is_the_identity():
    from equipax.launch.translators.maxtext import to_equipax, to_maxtext

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
        "warmup_steps_fraction": 0.1,
        "cosine_learning_rate_final_fraction": 0.1,
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
        "dataset_type": "c4",
        "dataset_path": "/data/c4",
        "profiler": "xplane",
        "skip_first_n_steps_for_profiler": 3,
        "profiler_steps": 4,
        "upload_all_profiler_results": False,
    }
    forward = to_equipax(maxtext)
    assert forward.skipped == {}
    back = to_maxtext(forward.knobs | {"mesh.dcn_mesh_shape": (1, 1, 1)}).knobs
    assert {k: back[k] for k in maxtext} == maxtext


def test_global_parameter_scale_rules():
    from equipax.launch.translators.maxtext import to_equipax

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
    from equipax.launch.translators.maxtext import to_equipax

    t = to_equipax(
        {
            "decoder_block": "llama2",
            "base_num_query_heads": 32,
            "base_num_kv_heads": 8,
            "ici_sequence_parallelism": 2,
            "ici_autoregressive_parallelism": 1,
            "remat_policy": "save_qkv_proj",
            "dcn_data_parallelism": -1,
            "per_device_batch_size": 0.5,
            "enable_checkpointing": True,
            "quantization": "int8",
        }
    )
    assert t.knobs == {"model.transformer.num_heads": 32}
    assert set(t.skipped) == {
        "decoder_block",
        "base_num_kv_heads",
        "ici_sequence_parallelism",
        "remat_policy",
        "dcn_data_parallelism",
        "per_device_batch_size",
        "quantization",
    }
    assert "grouped-query attention" in t.skipped["base_num_kv_heads"]
    assert "no sequence axis" in t.skipped["ici_sequence_parallelism"]
    assert "'full'" in t.skipped["remat_policy"]
    assert t.skipped["quantization"] == "no equipax knob"


def test_convert_reports_untranslated_keys_and_bad_input(tmp_path):
    config = tmp_path / "m.yml"
    config.write_text("decoder_block: llama2\nvocab_size: 1000\n")
    result = launch("convert", "maxtext", config)
    assert result.exit_code == 0 and "--set model.vocab_size=1000" in result.stdout
    assert "not translated: decoder_block" in result.output
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
    assert launch("show", "--exp", "cnn_digits", "--format", "maxtext").exit_code == 2


def test_docs_table_is_the_mapping():
    from equipax.launch.translators.maxtext import markdown_table

    docs = (REPO / "docs" / "maxtext.md").read_text()
    assert markdown_table() in docs
