"""`model.transformer.remat="auto"`: the cheapest policy whose compiled step fits, chosen by compiling.

The toy experiment's candidates compile in seconds; the commands run in-process and share JAX's
persistent compilation cache, so a candidate compiled once is not compiled again by the next one.
"""

import json
import subprocess
import sys

import jax
import pytest

from equipax.launch.aot.tpu import libtpu_available
from helpers.toy import TOY, persistent_compile_cache, set_args

AUTO = [*set_args(TOY), "--set", "model.transformer.remat=auto"]


def invoke(*args):
    from typer.testing import CliRunner

    from equipax.launch.cli import app

    return CliRunner().invoke(app, list(args))


def remat_record(job):
    return json.loads((job / "compile.json").read_text())["remat"]


def check_choice(record, budget_bytes, *, ordered=True):
    """The chosen row fits, every cheaper one was compiled and did not, none after it was compiled.
    `ordered`: also that recomputation grows down the list (at 1024 tokens dots_saveable recomputes
    more than save_attention_out: 17.2 against 16.1 GFLOP a step for c4_1b_smoke)."""
    rows = record["candidates"]
    i = [r["policy"] for r in rows].index(record["policy"])
    assert rows[i]["fits"] and rows[i]["total_bytes"] <= budget_bytes
    assert all(r["fits"] is False and r["total_bytes"] > budget_bytes for r in rows[:i])
    assert all(r["total_bytes"] is None for r in rows[i + 1 :])
    # Recomputation grows down the list, and so does the projected step time.
    flops = [r["remat_flops_per_step"] for r in rows]
    assert flops[0] == 0 < min(flops[1:]) and flops[-1] == max(flops)
    assert flops == sorted(flops) or not ordered
    return i


# JAX 0.10's XLA:CPU assigns the toy step the same temporaries under every policy (1758788 bytes,
# though the programs do recompute: 39 dots without remat, 49 with full), so no budget separates
# them; from JAX 0.11 they shrink down the list (2.1 MB without remat, 1.39 MB with full).
@pytest.mark.skipif(
    jax.__version_info__ < (0, 11), reason="JAX 0.10's XLA:CPU reports the same memory for every remat policy"
)
def test_auto_chooses_by_compiling_changes_with_the_budget_caches_and_runs(tmp_path):
    # In-process, with JAX's persistent compilation cache: a candidate compiled by one command is
    # not compiled again by the next (the run's step is the compiled program too).
    with persistent_compile_cache(tmp_path / "jax_cache"):
        _auto_commands(tmp_path)


def _auto_commands(tmp_path):
    job = tmp_path / "job"
    result = invoke("compile", "--exp", "shakespeare_tiny", *AUTO, "--job-log-dir", str(job))
    assert result.exit_code == 0, result.output
    big = remat_record(job)
    # 32 GiB of a TPU v4 (the default target) less 10%: no remat fits; only it was compiled.
    assert big["policy"] == "none" and check_choice(big, big["budget_bytes"]) == 0 and not big["cached"]
    assert [r["policy"] for r in big["candidates"]] == ["none", "dots_saveable", "save_attention_out", "full"]
    assert "auto -> none" in result.output and "<- chosen" in result.output
    report = json.loads((job / "compile.json").read_text())
    assert report["memory_per_device"]["total_bytes"] == big["candidates"][0]["total_bytes"]

    # A budget under the no-remat step's own memory: a policy that recomputes is chosen.
    gib = big["candidates"][0]["total_bytes"] * 0.9 / 2**30
    small = ["--hbm-gib", str(gib), "--set", "train.hbm_margin=0"]
    result = invoke("compile", "--exp", "shakespeare_tiny", *AUTO, *small, "--job-log-dir", str(job))
    assert result.exit_code == 0, result.output
    shrunk = remat_record(job)
    assert check_choice(shrunk, shrunk["budget_bytes"]) > 0 and shrunk["policy"] != "none"
    assert json.loads((job / "compile.json").read_text())["memory_per_device"]["fits"]

    # The same command again: the choice is read from the job's remat_auto.json, nothing else compiles.
    result = invoke("compile", "--exp", "shakespeare_tiny", *AUTO, *small, "--job-log-dir", str(job))
    assert result.exit_code == 0, result.output
    again = remat_record(job)
    assert again["cached"] and again["policy"] == shrunk["policy"] and again["candidates"] == shrunk["candidates"]
    assert "compiling with remat=" not in result.output and "cached" in result.output

    # Nothing fits: exit 2 with the table, naming the knob and the fixes.
    result = invoke("compile", "--exp", "shakespeare_tiny", *AUTO, "--hbm-gib", "1e-6", "--job-log-dir", str(job))
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "model.transformer.remat='auto': no remat policy fits" in text and "Traceback" not in text
    assert "data.per_device_batch" in text and "--hbm-gib" in text and "full" in text

    # `launch run` under the same budget (train.hbm_gib_per_device) chooses on its own devices and
    # records the policy it ran in config.json.
    run = tmp_path / "run"
    args = ["--set", "train.num_steps=1", "--set", "train.sample.tokens=0", "--set", "train.eval_batches=1"]
    budget = ["--set", f"train.hbm_gib_per_device={gib}", "--set", "train.hbm_margin=0"]
    result = invoke("run", "--exp", "shakespeare_tiny", *AUTO, *args, *budget, "--job-log-dir", str(run))
    assert result.exit_code == 0, result.output
    chosen = json.loads((run / "config.json").read_text())["model"]["transformer"]["remat"]
    assert chosen == shrunk["policy"]
    assert f"model.transformer.remat='auto' -> {chosen!r}" in result.output and "<- chosen" in result.output
    assert "auto, chosen by compiling" in (run / "knobs.txt").read_text()
    cache = json.loads((run / "remat_auto.json").read_text())
    assert [e["policy"] for e in cache.values()] == [chosen]


@pytest.mark.skipif(not libtpu_available(), reason="libtpu (XLA:TPU, the `aot` dependency group) is not installed")
def test_auto_for_a_tpu_topology_shrinks_with_the_budget(tmp_path):
    # XLA:TPU's own memory figures for a v4-16 slice: under a budget below the no-remat step's
    # (which fits the default 32 GiB), a recomputing policy is chosen; offloading is a candidate.
    # Activations must outweigh the parameters and optimizer state for recomputing to save memory:
    # at the smoke's own 32 tokens the no-remat step is the smallest of all (0.00362 GiB per device
    # against 0.00683 for dots_saveable, since the non-finite guard lost its second norm); at 8 x 1024
    # tokens per device it takes 1.15 GiB against 0.18 (dots_saveable) and 0.11 (full); at the 1 x 1024
    # tokens used here, 21.2 MB against 9.7 MB (dots_saveable), and the budget of 0.015 GiB (16.1 MB)
    # lies between. Two candidates compile either way; XLA:TPU compiles the smaller program in about
    # half the CPU time (the command: 13.9 s of CPU against 26.1 s at 8 x 1024 with a 0.5 GiB budget).
    # XLA attention (not the default `auto`, which picks splash on a TPU): these figures are its
    # [q, k] logits', which splash never holds, so with splash no remat already fits the budget.
    args = ["compile", "--exp", "c4_1b_smoke", "--topology", "v4-16", "--set", "model.transformer.remat=auto"]
    args += ["--set", "model.transformer.attention_impl=xla"]
    args += ["--set", "data.seq_len=1024", "--set", "model.max_seq_len=1024", "--set", "data.per_device_batch=1"]
    small = ["--hbm-gib", "0.015", "--set", "train.hbm_margin=0", "--job-log-dir", str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, "-m", "equipax.launch.cli", *args, *small], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    record = remat_record(tmp_path)
    assert "offload_attention_out" in [r["policy"] for r in record["candidates"]]
    none = record["candidates"][0]
    assert none["policy"] == "none" and none["total_bytes"] < 32 * 0.9 * 2**30  # the default budget's choice
    assert check_choice(record, record["budget_bytes"], ordered=False) > 0
    assert json.loads((tmp_path / "compile.json").read_text())["compile"]["backend"] == "tpu"


def test_an_unknown_policy_is_a_usage_error_naming_the_choices():
    from typer.testing import CliRunner

    from equipax.launch.cli import app

    result = CliRunner().invoke(app, ["show", "--exp", "shakespeare_tiny", "--set", "model.transformer.remat=some"])
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert "model.transformer.remat" in text and "'auto'" in text and "'save_attention_out'" in text
