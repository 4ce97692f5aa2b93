"""Reliability, training's knobs: every seed is range-checked with the config, model knobs that no
shape depends on are still validated, and what `auto` knobs resolved to is recorded. Each test
drives the CLI and checks the exit code and the one-paragraph message. docs/errors.md lists each case."""

import pytest

from helpers.cli import assert_one_paragraph, invoke, run
from helpers.toy import TOY


def sets(*overrides: str) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


# --- seeds: an int in [0, 2**63), refused with the config (before any work) -----------------


@pytest.mark.parametrize(
    ("exp", "knob"),
    [
        ("shakespeare_tiny", "train.seed"),
        ("shakespeare_tiny", "data.seed"),
        ("shakespeare_tiny", "train.vn.vn_seed"),
        ("cnn_digits", "data.seed"),
    ],
)
@pytest.mark.parametrize("value", [2**63, -1])
def test_a_seed_out_of_range_is_refused_by_show(exp, knob, value):
    code, out = invoke("show", "--exp", exp, *sets(f"{knob}={value}"))
    assert code == 2, out
    assert_one_paragraph(out, knob, "expected a seed, an int in [0, 2**63)", str(value))


def test_the_largest_seed_is_accepted():
    code, out = invoke("show", "--exp", "shakespeare_tiny", *sets(f"train.seed={2**63 - 1}", f"data.seed={2**63 - 1}"))
    assert code == 0, out


def test_decode_refuses_a_seed_out_of_range(tmp_path):
    code, out = invoke("decode", "--job-log-dir", tmp_path / "job", "--prompt", "ROMEO:", "--seed", 2**63)
    assert code == 2, out
    assert_one_paragraph(out, "--seed", "expected a seed, an int in [0, 2**63)")


# --- model knobs are checked whatever else is set ---------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (["model.lora.alpha=inf"], ["model.lora.alpha must be a finite number > 0", "inf"]),
        (["model.lora.enabled=true", "model.lora.alpha=nan"], ["model.lora.alpha must be a finite number > 0"]),
        # The toy's projections are 32 wide: an adapter of rank 64 has rank 32 at most.
        (
            ["model.lora.enabled=true", "model.lora.rank=64"],
            ["model.lora.rank=64 exceeds the width", "has rank at most 32", "set model.lora.rank <= 32"],
        ),
        # A dense model (num_experts=0) still refuses MoE knobs out of their range.
        (["model.transformer.capacity_factor=-5"], ["model.transformer.capacity_factor must be None", "-5"]),
        (["model.transformer.moe_intermediate_size=0"], ["model.transformer.moe_intermediate_size"]),
    ],
)
def test_out_of_range_model_knobs_are_refused_by_show(overrides, needles):
    code, out = invoke("show", "--exp", "shakespeare_tiny", *sets(*TOY, *overrides))
    assert code == 2, out
    assert_one_paragraph(out, *needles)


def test_a_lora_rank_up_to_the_narrowest_width_is_accepted():
    code, out = invoke(
        "show", "--exp", "shakespeare_tiny", *sets(*TOY, "model.lora.enabled=true", "model.lora.rank=32")
    )
    assert code == 0, out


# --- what `auto` knobs resolved to is recorded ---------------------------------------------------


def test_knobs_txt_records_what_attention_auto_runs_as(tmp_path):
    code, out = run(tmp_path / "job", "train.num_steps=1", "train.eval_every=1", "train.checkpoint_every=1")
    assert code == 0, out
    line = next(ln for ln in (tmp_path / "job" / "knobs.txt").read_text().splitlines() if "attention_impl" in ln)
    assert line.split("=", 1)[1].strip().startswith("'auto'  # experiment; auto -> 'xla' on this mesh (cpu, seq 32")
    assert '"attention_impl": "auto"' in (tmp_path / "job" / "config.json").read_text()  # resolved again elsewhere
