"""`launch bench attention` and the `attention_bench` experiment, end to end at tiny sizes."""

import json
import re

TINY = ["--batch", "2", "--head-dim", "8", "--repeats", "2"]


def invoke(*args):
    from typer.testing import CliRunner

    from equipax.launch.cli import app

    return CliRunner().invoke(app, list(args))


def _rows(path):
    result = json.loads((path / "attention_bench.json").read_text())
    return result, {(r["seq_len"], r["implementation"]): r for r in result["results"]}


def test_bench_attention_writes_table_json_and_plot(tmp_path):
    impls = "softmax_reference,softmax,softmax_jax_nn,linear,linear_reference"
    out = tmp_path / "bench"
    res = invoke(
        "bench",
        "attention",
        "--seq",
        "16,32",
        *TINY,
        "--causal",
        "--chunk-size",
        "5",
        "--impl",
        impls,
        "--out",
        str(out),
    )
    assert res.exit_code == 0, res.output
    assert "speed" in res.output or "x vs softmax" in res.output
    result, rows = _rows(out)
    assert result["baseline"] == "softmax" and result["config"]["causal"] is True
    assert set(rows) == {(n, i) for n in (16, 32) for i in impls.split(",")}
    for r in rows.values():
        assert r["status"] == "ok", r
        t = r["time_ms"]
        assert 0 < t["min"] <= t["median"] and t["mean"] > 0 and t["std"] >= 0
        assert r["analytic_bytes"] > 0 and r["xla_temp_bytes"] is not None
    assert rows[(16, "softmax")]["speedup_vs_baseline"] == 1.0
    assert (out / "attention_bench.png").stat().st_size > 10_000


def test_run_attention_bench_experiment_skips_what_does_not_fit(tmp_path):
    job = tmp_path / "job"
    # 50 MB: the [2 1 4096 4096] softmax logits (128 MiB) cannot fit, linear attention can.
    res = invoke(
        "run",
        "--exp",
        "attention_bench",
        "--job-log-dir",
        str(job),
        "--set",
        "seq_lens=(16, 4096)",
        "--set",
        "batch_size=2",
        "--set",
        "head_dim=8",
        "--set",
        "repeats=2",
        "--set",
        "memory_limit_gb=0.05",
    )
    assert res.exit_code == 0, res.output
    result, rows = _rows(job)
    assert result["config"]["seq_lens"] == [16, 4096]
    assert all(rows[(16, i)]["status"] == "ok" for i in result["config"]["implementations"])
    assert rows[(4096, "softmax")]["status"] == "skipped"
    assert "GiB" in rows[(4096, "softmax")]["reason"]
    assert rows[(4096, "linear")]["status"] == "ok"
    assert rows[(4096, "linear")]["speedup_vs_baseline"] is None  # no baseline at that length
    assert (job / "attention_bench.png").exists()


def test_out_of_memory_is_reported_not_raised(tmp_path, monkeypatch):
    from equipax.launch.bench import attention_timing as bench
    from equipax.launch.experiments.attention_bench import AttentionBenchConfig

    real = bench._measure

    def measure(name, cfg, qkv):
        if name == "softmax_reference":
            raise MemoryError("RESOURCE_EXHAUSTED: Out of memory allocating 9 GB")
        return real(name, cfg, qkv)

    monkeypatch.setattr(bench, "_measure", measure)
    cfg = AttentionBenchConfig(seq_lens=(8,), batch_size=1, head_dim=4, repeats=1)
    result = bench.run_attention_bench(cfg, tmp_path)
    status = {r["implementation"]: r["status"] for r in result["results"]}
    assert status == {"softmax_reference": "out_of_memory", "softmax": "ok", "softmax_jax_nn": "ok", "linear": "ok"}


def test_bench_user_errors_exit_2(tmp_path):
    res = invoke("bench", "attention", "--impl", "softmax,flash", "--out", str(tmp_path))
    assert res.exit_code == 2 and "flash" in res.output and "choose from" in res.output
    res = invoke("run", "--exp", "attention_bench", "--set", "repeats=0")
    assert res.exit_code == 2 and "repeats must be >= 1" in res.output


def test_list_and_show_handle_the_benchmark_experiment():
    from equipax.launch.experiments.registry import entries

    assert {"attention_bench", "shakespeare_tiny_linear"} <= {e.name for e in entries()}
    res = invoke("list")
    assert res.exit_code == 0, res.output
    res = invoke("show", "--exp", "attention_bench", "--format", "json")
    assert res.exit_code == 0, res.output
    shown = json.loads(res.output)
    assert shown["config"]["seq_lens"][-1] == 6000 and shown["derived"] == {}
    res = invoke("show", "--exp", "shakespeare_tiny_linear")
    assert res.exit_code == 0, res.output
    assert re.search(r"model\.transformer\.attention\s*=\s*'linear'", res.output), res.output
