import importlib.util
import json
import math
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "input_pipeline.py"


def test_input_pipeline_benchmark_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("benchmarks_input_pipeline", SCRIPT)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "input.json"
    results = bench.main(["--batches", "3", "--warmup", "1", "--threads", "0", "--shards", "2",
                          "--set", "data.tokenizer=byte", "--step-tokens-per-s", "1000", "--out", str(out)])
    assert json.loads(out.read_text()) == results
    assert set(results["cases"]) == {"default", "c4_packed_jsonl_threads0", "c4_packed_arrayrecord_threads0"}
    for case in results["cases"].values():
        assert math.isfinite(case["tokens_per_s"]) and case["tokens_per_s"] > 0
        assert case["x_train_step"] == case["tokens_per_s"] / 1000
        assert 0 < case["real_fraction"] <= 1
