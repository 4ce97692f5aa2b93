import importlib.util
import json
import math
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "train_step.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("benchmarks_train_step", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_step_benchmark_tiny(tmp_path):
    bench = _load_script()
    out = tmp_path / "train_step.json"
    results = bench.main([
        "--presets", "tiny", "--steps", "2", "--warmup", "1",
        "--matmul-n", "128", "--matmul-repeats", "2", "--no-warm-process",
        "--out", str(out),
    ])

    assert json.loads(out.read_text()) == results
    for key in ("date", "jax_version", "device_kind", "presets"):
        assert key in results
    tiny = results["presets"]["tiny"]
    assert tiny["matmul"]["gflops"] > 0
    assert tiny["params"] > 0 and tiny["tokens_per_step"] == 2 * 32
    for key in (
        "first_step_s", "tokens_per_s", "model_gflops_per_s", "mfu_vs_measured",
        "mfu_vs_theoretical", "model_flops_per_token",
    ):
        assert math.isfinite(tiny[key]) and tiny[key] > 0, key
    assert tiny["step_s"]["median_s"] > 0 and tiny["step_s"]["iqr_s"] >= 0
    assert 0 < tiny["compile_s"] <= tiny["first_step_s"]
    assert math.isfinite(tiny["last_loss"])


def test_compare_mode_runs_both_steps_on_the_same_numbers(tmp_path):
    bench = _load_script()
    out = tmp_path / "compare.json"
    results = bench.main([
        "--compare", "--presets", "tiny", "--steps", "2", "--warmup", "0", "--no-warm-process",
        "--out", str(out),
    ])

    assert json.loads(out.read_text()) == results
    tiny = results["presets"]["tiny"]
    # The plain-JAX step starts from the equipax model's parameters: the same math gives the same loss.
    assert tiny["max_first_loss_diff"] < 1e-5, (tiny["equipax"]["first_loss"], tiny["baseline"]["first_loss"])
    for side in ("equipax", "baseline"):
        assert tiny[side]["tokens_per_s"] > 0 and tiny[side]["compile_s"] > 0
        assert math.isfinite(tiny[side]["last_loss"])
    assert tiny["ratio"] > 0


def test_cli_latency_benchmark_runs_and_reports_no_heavy_imports(tmp_path):
    spec = importlib.util.spec_from_file_location("benchmarks_cli_latency", SCRIPT.parent / "cli_latency.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "cli.json"
    results = bench.main(["--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    for name, r in results["commands"].items():
        assert 0 < r["min_s"] <= r["median_s"] <= r["max_s"], name
        assert r["heavy_imports"] == "", (name, r["heavy_imports"])
