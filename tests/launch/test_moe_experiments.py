"""The mixture-of-experts experiments: published total and active parameter counts (analytic,
traced, and printed by `launch show`), FLOPs from the active parameters, the router metrics in a
run's train records, and bad MoE knobs as exit 2 naming the knob. (Their `_smoke` variants train
in tests/launch/test_lm_families.py and docs/moe.md; expert parallelism's numbers are checked in
tests/models/test_moe_parallel.py.)"""

import json
from types import SimpleNamespace

import pytest

from helpers.cli import assert_one_paragraph, invoke

# Hugging Face's configs (Mixtral-8x7B-v0.1: "46.7B total, 12.9B active"; Qwen3-30B-A3B: "30.5B,
# 3.3B activated").
PUBLISHED = {"mixtral_8x7b": (46_702_792_704, 12_879_925_248), "qwen3_30b_a3b": (30_532_122_624, 3_353_032_704)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_total_and_active_parameters(name):
    import equinox as eqx
    import jax

    from equipax.core.flops import count_params
    from equipax.launch.experiments.registry import get_experiment
    from equipax.launch.tasks import family

    total, active = PUBLISHED[name]
    cfg = get_experiment(name)
    counts = cfg.model.param_counts()
    assert (counts["total"], counts["active"]) == (total, active)
    model, _ = eqx.filter_eval_shape(family(cfg).make_task(cfg, None).init, jax.random.key(0))
    assert count_params(model) == total
    code, out = invoke("show", "--exp", name, "--format", "json")
    assert code == 0, out
    derived = json.loads(out)["derived"]
    assert (derived["params_total"], derived["params_active"]) == (total, active)
    # The model FLOPs (and so MFU) follow the active parameters: 6 x active + attention.
    assert 6 * active < derived["model_flops_per_token"] < 6 * active * 1.2


@pytest.mark.parametrize(
    "override, needles",
    [
        ("model.transformer.num_experts_per_tok=9", ["model.transformer.num_experts_per_tok=9", "num_experts=8"]),
        ("model.transformer.capacity_factor=0", ["model.transformer.capacity_factor", "got 0"]),
        ("mesh.ici_mesh_shape=(1, 1, 3, 1)", ["model.transformer.num_experts=8", "`expert` axis of size 3"]),
    ],
)
def test_bad_moe_knobs_exit_2_naming_the_knob(override, needles):
    code, out = invoke("show", "--exp", "mixtral_8x7b_smoke", "--set", override)
    assert code == 2, out
    assert_one_paragraph(out, *needles)


def test_train_records_carry_the_router_metrics():
    from equipax.launch.training.train_log import StepTimer, TrainLog

    written = []
    run = SimpleNamespace(
        cfg=SimpleNamespace(train=SimpleNamespace(log_every=1)),
        total=1,
        unit="tokens",
        check_nonfinite=lambda step: None,
        training=SimpleNamespace(mesh=SimpleNamespace(size=1), infeed=None),
        writer=SimpleNamespace(write=lambda step, split, record: written.append((step, split, record))),
        inputs=SimpleNamespace(train=SimpleNamespace(counters=dict, counter_metrics=lambda totals: {})),
    )
    # A stand-in run (the suite's runtime type check refuses it as __init__'s argument).
    log = TrainLog.__new__(TrainLog)
    log.run, log.timer, log.units_per_step, log.flops_per_step = run, StepTimer(0), 8, None  # pyright: ignore[reportAttributeAccessIssue]
    log.peak_tflops, log.nonfinite_total, log.progress, log.pending = None, lambda: 0, lambda s, r: None, None
    metrics = {"loss": 1.5, "loss_sum": 3.0, "moe_aux_loss": 2.1, "moe_expert_0_tokens": 5.0, "loss/router_aux": 2.1}
    log.after_dispatch(1, metrics, stopping=False)
    log.flush()
    [(step, split, record)] = written
    assert (step, split, record["loss"]) == (1, "train", 1.5)
    assert record["moe_aux_loss"] == 2.1 and record["moe_expert_0_tokens"] == 5.0
    assert record["loss/router_aux"] == 2.1  # each named loss (docs/extending.md, "Several losses")
    assert "loss_sum" not in record
