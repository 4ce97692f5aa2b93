"""benchmarks/tpu/run.sh's `decode`, `moe` and `ring` parts at toy size on this host's CPU, their
Python entry points in this process (decode_reference.py, moe_dispatch.py --real-devices,
ring_one_chip.py): each runs and writes its JSON (the timings themselves are the chip's,
benchmarks/README.md "On a real TPU"); and run.sh takes the three parts by name."""

import importlib.util
import json
import subprocess
import sys

import pytest

from helpers import REPO
from helpers.cli import run as launch_run
from helpers.toy import fast_compile_in_process

BENCHMARKS = REPO / "benchmarks"


def _load(name: str, monkeypatch):
    """A benchmark script as a module of the `benchmarks` package."""
    # moe_dispatch.py sets up 8 simulated CPU devices at import unless the command line asks for
    # the host's own: this process's environment (inherited by later tests' children) stays as is.
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--real-devices"])
    return importlib.import_module(f"benchmarks.{name}")


def test_decode_part_compares_launch_decode_with_the_plain_loop(tmp_path, monkeypatch):
    """decode_reference.py on a toy job trained here (no `launch` process: the job exists, and no
    CLI batch size): decode_texts and the plain-JAX loop (decode_plain.py) decode the same tokens,
    and both prefills are timed alone."""
    bench = _load("decode_reference", monkeypatch)
    code, output = launch_run(tmp_path / "jobs" / "shakespeare_tiny", "train.num_steps=2")
    assert code == 0, output
    out = tmp_path / "decode.json"
    args = ["--exps", "shakespeare_tiny", "--job-root", str(tmp_path / "jobs"), "--cli-batch-sizes", ""]
    args += ["--batch-sizes", "2", "--batches", "2", "--new-tokens", "4", "--compile-cache", "", "--out", str(out)]
    with fast_compile_in_process():
        results = bench.main([*args, "--prefill-len", "8", "--profile", str(tmp_path / "profile")])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    prefill = results["experiments"]["shakespeare_tiny"]["prefill"]
    assert prefill["length"] == 8 and prefill["by_batch"]["2"]["equipax_tokens_per_s"] > 0
    assert prefill["by_batch"]["2"]["plain_tokens_per_s"] > 0
    row = results["experiments"]["shakespeare_tiny"]["by_batch"]["2"]
    assert row["same_tokens"] and row["token_agreement"] == 1.0 and row["cli_same_tokens"] is None
    assert row["launch_decode_tokens_per_s"] is None and row["reference_tokens_per_s"] > 0
    assert row["in_process_tokens_per_s"] > 0 and row["paired_ratio"] > 0
    assert row["decode_call_tokens_per_s"] > 0 and row["decode_call_paired_ratio"] > 0
    # --profile: one traced batch of each side, their device ops summed per generated token.
    assert all(row["profile"][side]["device_ms_per_token"] > 0 for side in ("equipax", "plain"))
    assert (tmp_path / "profile" / "shakespeare_tiny_b2" / "op_profile.json").is_file()


@pytest.mark.slow
def test_decode_part_decodes_an_int8w_job_from_its_int8_weights(tmp_path, monkeypatch):
    """A job trained with model.quantization=int8w (run.sh's DECODE_ARGS="... --set
    model.quantization=int8w"): equipax decodes from the int8 copy made once at load, as `launch
    decode` does (half the projections' bytes of the bf16 reference's), the reference from the float
    weights."""
    bench = _load("decode_reference", monkeypatch)
    code, output = launch_run(tmp_path / "jobs" / "shakespeare_tiny", "train.num_steps=2", "model.quantization=int8w")
    assert code == 0, output
    args = ["--exps", "shakespeare_tiny", "--job-root", str(tmp_path / "jobs"), "--cli-batch-sizes", ""]
    args += ["--batch-sizes", "1", "--batches", "2", "--new-tokens", "4", "--compile-cache", ""]
    with fast_compile_in_process():
        results = bench.main([*args, "--out", str(tmp_path / "decode.json")])
    exp = results["experiments"]["shakespeare_tiny"]
    assert exp["quantization"] == "int8w" and exp["weight_bytes_in_dtype"] < exp["reference_weight_bytes"]
    row = exp["by_batch"]["1"]
    assert row["in_process_tokens_per_s"] > 0 and row["reference_tokens_per_s"] > 0


@pytest.mark.slow
def test_moe_part_times_both_dispatches_on_one_real_device(tmp_path, monkeypatch):
    """moe_dispatch.py --real-devices --devices 1: dropless and capacity at EP 1, compiled at once
    in threads, then each run in turn (its state freed): tokens/s, XLA memory, dropped fraction."""
    bench = _load("moe_dispatch", monkeypatch)
    out = tmp_path / "moe.json"
    args = ["--real-devices", "--devices", "1", "--ep", "1", "--model-dims", "32", "--seq", "16", "--steps", "2"]
    args += ["--rounds", "1", "--warmup", "0", "--parallel-compile", "--out", str(out)]
    with fast_compile_in_process():
        results = bench.main(args)
    rows = results["rows"]
    assert [(r["ep"], r["dispatch"]) for r in rows] == [(1, "dropless"), (1, "capacity 1.25")]
    for r in rows:
        assert len(r["steps_s"]) == 2 and r["tokens_per_s"] > 0 and r["compile_s"] > 0
        assert r["xla_memory_bytes"]["argument_bytes"] > 0 and "moe_dropped_fraction" in r["last_metrics"]
    assert rows[0]["last_metrics"]["moe_dropped_fraction"] == 0.0  # dropless
    assert results["devices"].startswith("1 cpu devices")


@pytest.mark.slow
def test_ring_part_shows_one_program_at_context_one_and_runs_the_kernels(tmp_path, monkeypatch):
    """ring_one_chip.py: at a context axis of 1 the ring and all-gather steps are one program, which
    differs from the step without a context axis in its mesh declaration only; both steps run, each
    in turn, and the four attention kernels (the splash ones in the Pallas interpreter) run forward
    and back."""
    bench = _load("ring_one_chip", monkeypatch)
    out = tmp_path / "ring.json"
    args = ["--layers", "1", "--model-dims", "32", "--heads", "2", "--kv-heads", "1", "--head-dim", "16"]
    args += ["--hidden-dims", "64", "--vocab", "256", "--seq", "128", "--kernel-seqs", "128", "--interpret"]
    args += ["--steps", "1", "--warmup", "0", "--time-layouts", "none,ring", "--reps", "1", "--out", str(out)]
    with fast_compile_in_process():
        results = bench.main(args)
    programs = results["programs"]
    assert programs["sha256"]["ring"] == programs["sha256"]["all_gather"] != programs["sha256"]["none"]
    assert programs["ring_vs_none_differing_line_count"] == 2
    assert all("sdy.mesh" in line for line in programs["ring_vs_none_differing_lines"])
    assert list(results["train_steps"]) == ["none", "ring"]
    assert all(r["step_s"] > 0 and r["tokens_per_step"] == 128 for r in results["train_steps"].values())
    assert [(r["kernel"], r["seq"]) for r in results["kernels"]] == [
        ("xla", 128),
        ("splash", 128),
        ("ring", 128),
        ("splash_ring", 128),
    ]
    assert all(r["ms"] > 0 for r in results["kernels"]), results["kernels"]


@pytest.mark.parametrize("part", ["decode", "moe", "ring", "runs"])
def test_run_script_takes_the_parts_by_name(part, tmp_path):
    """run.sh accepts each part (it stops at the missing wheels, before installing or running
    anything), names them in its usage error, and its header documents each part's variable."""
    script = BENCHMARKS / "tpu" / "run.sh"
    taken = subprocess.run(
        ["bash", str(script), "--wheels", str(tmp_path / "none"), "--out", str(tmp_path / "out"), part],
        capture_output=True,
        text=True,
    )
    assert taken.returncode == 2 and "no wheels" in taken.stderr
    refused = subprocess.run(["bash", str(script), f"{part}x"], capture_output=True, text=True)
    assert refused.returncode == 2 and "check usage runs speed profile peak attention decode moe ring" in refused.stderr
    assert f"{part.upper()}_ARGS" in script.read_text().split("set -Eeuo pipefail")[0]


def test_runs_part_reads_a_runs_figures_and_keeps_out_of_foreign_folders(tmp_path):
    """user_runs.py (run.sh's `runs`): the time to first step by phase from `launch run`'s output,
    the last logged train step and MFU and the final eval from the job's metrics.jsonl; a --out
    holding anything it did not write is refused before any run starts."""
    spec = importlib.util.spec_from_file_location("tpu_parts_user_runs", BENCHMARKS / "tpu" / "user_runs.py")
    assert spec is not None and spec.loader is not None
    runs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runs)
    job = tmp_path / "job"
    job.mkdir()
    records = [
        {"step": 5, "split": "train", "loss": 9.0, "tokens_per_s": 10.0, "tflops_per_s_per_device": 1.0, "mfu": 0.1},
        {"step": 10, "split": "train", "loss": 8.0, "tokens_per_s": 20.0, "tflops_per_s_per_device": 2.0, "mfu": 0.2},
        {"step": 10, "split": "eval", "loss": 8.5},
    ]
    (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    text = "x\nTime to first step 47.3 s: start-up 1.3, config 1.0, remat auto 3.5, first step 12.2 (s).\n"
    got = runs.figures(text, job)
    assert got["time_to_first_step_s"] == 47.3
    assert got["phases_s"] == {"start-up": 1.3, "config": 1.0, "remat auto": 3.5, "first step": 12.2}
    assert got["last_train"]["step"] == 10 and got["mfu"] == 0.2 and got["final_eval_loss"] == 8.5
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "tpu" / "user_runs.py"), "--out", str(foreign), "--runs", "toy"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "did not write" in proc.stderr
    assert [p.name for p in foreign.iterdir()] == ["keep.txt"]


def test_every_named_run_is_a_valid_config():
    """Each run of user_runs.py (run.sh's `runs`) names a registered experiment and knobs that
    validate: a typo there would cost a call on the chip."""
    from equipax.core.knobs import apply_overrides
    from equipax.launch.experiments import registry

    spec = importlib.util.spec_from_file_location("tpu_parts_user_runs_valid", BENCHMARKS / "tpu" / "user_runs.py")
    assert spec is not None and spec.loader is not None
    runs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runs)
    for name, (exp, sets) in runs.RUNS.items():
        _, sources = apply_overrides(registry.get_experiment(exp), list(sets))
        assert all(sources[s.split("=", 1)[0]] == "--set" for s in sets), name
