"""`model.transformer.remat="auto"`: the fastest policy whose compiled step fits, by the compiled
programs' roofline, never one projected slower than the experiment's own policy; cached per job
and per machine.

The toy experiment's candidates compile in seconds; the commands run in-process and share JAX's
persistent compilation cache, so a candidate compiled once is not compiled again by the next one.
"""

import json
import os
import subprocess
import sys

import jax
import pytest

from equipax.launch.hardware.tpu import libtpu_available
from helpers.toy import TOY, persistent_compile_cache, set_args

AUTO = [*set_args(TOY), "--set", "model.transformer.remat=auto"]
# The policies auto tries on a CPU (no host memory to offload to), least recomputation first.
CPU_CANDIDATES = ["none", "dots_with_context", "dots_saveable", "save_attention_out", "save_context", "full"]


def invoke(*args):
    from typer.testing import CliRunner

    from equipax.launch.cli import app

    return CliRunner().invoke(app, list(args))


def remat_record(job):
    return json.loads((job / "compile.json").read_text())["remat"]


def compiled(record):
    return [r["policy"] for r in record["candidates"] if r["total_bytes"] is not None]


def row(record, policy):
    return next(r for r in record["candidates"] if r["policy"] == policy)


def check_never_slower(record):
    """The choice fits; where it is not the experiment's own policy, either that one does not fit
    or the choice is projected at least MIN_GAIN faster; no faster-projected policy that fits was
    passed over for own."""
    from equipax.launch.aot.remat import MIN_GAIN

    chosen, own = row(record, record["policy"]), row(record, record["own"])
    assert chosen["fits"] and chosen["total_bytes"] <= record["budget_bytes"]
    if record["policy"] != record["own"] and own["fits"]:
        assert chosen["projected_step_s"] <= own["projected_step_s"] * (1 - MIN_GAIN)
    if not own["fits"]:
        fitting = [r["projected_step_s"] for r in record["candidates"] if r["fits"]]
        assert chosen["projected_step_s"] == min(fitting)


# JAX 0.10's XLA:CPU assigns the toy step the same temporaries under every policy (1758788 bytes,
# though the programs do recompute: 39 dots without remat, 49 with full), so no budget separates
# them; from JAX 0.11 they shrink down the list (2.1 MB without remat, 1.39 MB with full).
@pytest.mark.skipif(
    jax.__version_info__ < (0, 11), reason="JAX 0.10's XLA:CPU reports the same memory for every remat policy"
)
@pytest.mark.slow
def test_auto_chooses_by_compiling_changes_with_the_budget_caches_and_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("EQUIPAX_CACHE_DIR", str(tmp_path / "machine"))
    # In-process, with JAX's persistent compilation cache: a candidate compiled by one command is
    # not compiled again by the next (the run's step is the compiled program too).
    with persistent_compile_cache(tmp_path / "jax_cache"):
        _auto_commands(tmp_path)


def _auto_commands(tmp_path):
    job = tmp_path / "job"
    result = invoke("compile", "--exp", "shakespeare_tiny", *AUTO, "--job-log-dir", str(job))
    assert result.exit_code == 0, result.output
    big = remat_record(job)
    # shakespeare_tiny's own policy is none: nothing recomputes less, and under 32 GiB of a TPU v4
    # (the default target) less the margin it fits, so it is the only one compiled.
    assert big["own"] == "none" and big["policy"] == "none" and compiled(big) == ["none"] and not big["cached"]
    assert [r["policy"] for r in big["candidates"]] == CPU_CANDIDATES
    assert "auto -> none" in result.output and "<- chosen" in result.output and "none (own)" in result.output
    report = json.loads((job / "compile.json").read_text())
    assert report["memory_per_device"]["total_bytes"] == row(big, "none")["total_bytes"]
    assert row(big, "none")["flops"] > 0 and row(big, "none")["projected_step_s"] > 0

    # A budget under the no-remat step's own memory: own does not fit, so the policies that
    # recompute are compiled and the fastest projected one that fits is chosen.
    gib = row(big, "none")["total_bytes"] * 0.9 / 2**30
    small = ["--hbm-gib", str(gib), "--set", "train.hbm_margin=0"]
    result = invoke("compile", "--exp", "shakespeare_tiny", *AUTO, *small, "--job-log-dir", str(job))
    assert result.exit_code == 0, result.output
    shrunk = remat_record(job)
    assert shrunk["policy"] != "none" and "does not fit" in shrunk["reason"]
    assert compiled(shrunk) == CPU_CANDIDATES
    check_never_slower(shrunk)
    assert json.loads((job / "compile.json").read_text())["memory_per_device"]["fits"]

    # The same command again: the choice is read from the job's remat_auto.json, nothing else compiles.
    result = invoke("compile", "--exp", "shakespeare_tiny", *AUTO, *small, "--job-log-dir", str(job))
    assert result.exit_code == 0, result.output
    again = remat_record(job)
    assert again["cached"] == "job" and again["policy"] == shrunk["policy"]
    assert again["candidates"] == shrunk["candidates"]
    assert "compiling with remat=" not in result.output and "cached" in result.output
    # Another job of the same experiment on this machine: from the machine's cache, nothing compiles.
    other = tmp_path / "other"
    result = invoke("compile", "--exp", "shakespeare_tiny", *AUTO, *small, "--job-log-dir", str(other))
    assert result.exit_code == 0, result.output
    assert remat_record(other)["cached"] == "machine" and remat_record(other)["policy"] == shrunk["policy"]
    assert "compiling with remat=" not in result.output
    assert [e["policy"] for e in json.loads((other / "remat_auto.json").read_text()).values()] == [shrunk["policy"]]

    # Nothing fits: exit 2 with the table, naming the knob and the fixes.
    result = invoke("compile", "--exp", "shakespeare_tiny", *AUTO, "--hbm-gib", "1e-6", "--job-log-dir", str(job))
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "model.transformer.remat='auto': no remat policy fits" in text and "Traceback" not in text
    assert "data.per_device_batch" in text and "--hbm-gib" in text and "full" in text

    # `launch run` under the same budget (train.hbm_gib_per_device) chooses on its own devices,
    # priced at a nominal host's figures, and records the policy it ran and why.
    run = tmp_path / "run"
    args = ["--set", "train.num_steps=1", "--set", "train.sample.tokens=0", "--set", "train.eval_batches=1"]
    budget = ["--set", f"train.hbm_gib_per_device={gib}", "--set", "train.hbm_margin=0"]
    result = invoke("run", "--exp", "shakespeare_tiny", *AUTO, *args, *budget, "--job-log-dir", str(run))
    assert result.exit_code == 0, result.output
    chosen = json.loads((run / "config.json").read_text())["model"]["transformer"]["remat"]
    assert chosen != "none"
    assert f"model.transformer.remat='auto' -> {chosen!r}" in result.output and "<- chosen" in result.output
    knobs = (run / "knobs.txt").read_text()
    assert "auto, chosen by compiling: the fastest projected of those that fit" in knobs
    cache = json.loads((run / "remat_auto.json").read_text())
    assert [e["policy"] for e in cache.values()] == [chosen]


def test_the_rule_keeps_the_own_policy_unless_a_faster_one_fits():
    """The compiled figures of c4_1b at 6 layers, batch 8, on one TPU v5e (own policy full;
    benchmarks/README.md): dots_saveable fits and is projected 7.5% faster, save_attention_out
    0.3% slower; the chip measured the same order."""
    from equipax.launch.aot.remat import MIN_GAIN
    from equipax.launch.aot.remat_search import Outcome, decide, fastest_that_fits

    faster = ["none", "dots_saveable", "save_attention_out"]
    figures = {
        "full": Outcome(True, 0.2333),
        "none": Outcome(False, None),
        "dots_saveable": Outcome(True, 0.2158),
        "save_attention_out": Outcome(True, 0.2339),
    }
    assert decide("full", faster, figures, MIN_GAIN).policy == "dots_saveable"
    # Without dots_saveable (over the budget), save_attention_out fits but is not faster: full stays.
    no_dots = figures | {"dots_saveable": Outcome(False, 0.2158)}
    assert decide("full", faster, no_dots, MIN_GAIN).policy == "full"
    # Faster by less than MIN_GAIN: own stays.
    close = no_dots | {"save_attention_out": Outcome(True, 0.2333 * (1 - MIN_GAIN / 2))}
    assert decide("full", faster, close, MIN_GAIN).policy == "full"
    # Undecided until own and the earlier candidates are compiled; never waits for a later one.
    assert decide("full", faster, {"dots_saveable": figures["dots_saveable"]}, MIN_GAIN).waits == "full"
    assert decide("full", faster, {"full": figures["full"]}, MIN_GAIN).waits == "none"
    partial = {k: figures[k] for k in ("full", "none", "dots_saveable")}
    assert decide("full", faster, partial, MIN_GAIN).policy == "dots_saveable"
    # Own does not fit: the fastest projected of those that fit.
    assert decide("dots_saveable", ["none"], no_dots, MIN_GAIN).fallback
    order = ["none", "dots_with_context", "dots_saveable", "save_attention_out", "save_context", "full"]
    assert fastest_that_fits(order, no_dots, "dots_saveable").policy == "full"


@pytest.mark.parametrize(
    ("exp", "own"),
    [
        ("shakespeare_tiny", "none"),
        ("c4_1b_smoke", "full"),
        ("llama3_2_1b", "full"),
        ("qwen3_0_6b", "save_context"),
        ("not_registered", "full"),
    ],
)
def test_the_own_policy_is_the_one_the_experiment_names(exp, own):
    import dataclasses

    from equipax.launch.aot.remat import own_policy
    from equipax.launch.experiments.registry import get_experiment

    cfg = get_experiment("shakespeare_tiny" if exp == "not_registered" else exp)
    assert own_policy(dataclasses.replace(cfg, name=exp)) == own


@pytest.mark.skipif(not libtpu_available(), reason="libtpu (XLA:TPU, the `aot` dependency group) is not installed")
@pytest.mark.slow
def test_auto_for_a_tpu_topology_shrinks_with_the_budget(tmp_path):
    # XLA:TPU's programs for a v4-16 slice: under a budget below the no-remat step's (which fits
    # the default 32 GiB), a policy that recomputes is chosen, priced by its compiled program;
    # offloading is a candidate, never compiled while the own policy (full) fits. Activations must
    # outweigh the parameters and optimizer state for recomputing to save memory: at the smoke's
    # own 32 tokens the no-remat step is the smallest of all (0.00362 GiB per device against 0.00683
    # for dots_saveable); at the 1 x 1024 tokens used here, 21.2 MB against 9.7 MB (dots_saveable),
    # and the budget of 0.015 GiB (16.1 MB) lies between. XLA attention (not the default `auto`,
    # which picks splash on a TPU): these figures are its [q, k] logits', which splash never holds,
    # so with splash no remat already fits the budget.
    args = ["compile", "--exp", "c4_1b_smoke", "--topology", "v4-16", "--set", "model.transformer.remat=auto"]
    args += ["--set", "model.transformer.attention_impl=xla"]
    args += ["--set", "data.seq_len=1024", "--set", "model.max_seq_len=1024", "--set", "data.per_device_batch=1"]
    small = ["--hbm-gib", "0.015", "--set", "train.hbm_margin=0", "--job-log-dir", str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, "-m", "equipax.launch.cli", *args, *small],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "EQUIPAX_CACHE_DIR": str(tmp_path / "machine")},  # this test's own
    )
    assert proc.returncode == 0, proc.stderr
    record = remat_record(tmp_path)
    assert "offload_attention_out" in [r["policy"] for r in record["candidates"]]
    assert row(record, "offload_attention_out")["total_bytes"] is None
    none = row(record, "none")  # compiled, or ruled out by its traced floor without compiling
    size = none["total_bytes"] if none["total_bytes"] is not None else none["floor_bytes"]
    assert size < 32 * 0.95 * 2**30 and not none["fits"]  # the default budget's would fit
    assert record["own"] == "full" and record["policy"] != "none"
    check_never_slower(record)
    assert record["roofline"]["name"] == "tpu-v4"
    assert json.loads((tmp_path / "compile.json").read_text())["compile"]["backend"] == "tpu"


def test_an_unknown_policy_is_a_usage_error_naming_the_choices():
    from typer.testing import CliRunner

    from equipax.launch.cli import app

    result = CliRunner().invoke(app, ["show", "--exp", "shakespeare_tiny", "--set", "model.transformer.remat=some"])
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert "model.transformer.remat" in text and "'auto'" in text and "'save_attention_out'" in text
