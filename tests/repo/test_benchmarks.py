"""The scripts of benchmarks/ run at tiny sizes and write sane JSON (the timings themselves are
benchmarks/README.md's, never a pass/fail test)."""

import dataclasses
import gzip
import importlib
import json
import math
import re
import subprocess
import sys

import pytest

from helpers import REPO
from helpers.toy import FAST_COMPILE, suite_compile_cache_env, with_xla_flags

BENCHMARKS = REPO / "benchmarks"


def timed_child_env() -> dict[str, str]:
    """The environment of a benchmark script whose timings are not tested: it compiles with
    `FAST_COMPILE` (the bubble benchmark's tiny run: 21 s of CPU against 36 s), on the suite's
    compile cache (its configurations of one model share the initialisation program: the second
    one loads it, not compiles it; the 8-device child: 33-34.5 s of CPU against 36-38 s)."""
    import os

    return with_xla_flags({**os.environ, **suite_compile_cache_env()}, FAST_COMPILE)


def test_train_step_benchmark_tiny(tmp_path):
    bench = importlib.import_module("benchmarks.train_step")
    out = tmp_path / "train_step.json"
    results = bench.main(
        [
            "--presets",
            "tiny",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--matmul-n",
            "128",
            "--matmul-repeats",
            "2",
            "--no-warm-process",
            "--out",
            str(out),
        ]
    )

    assert json.loads(out.read_text()) == results
    for key in ("date", "jax_version", "device_kind", "presets"):
        assert key in results
    tiny = results["presets"]["tiny"]
    assert tiny["matmul"]["gflops"] > 0
    assert tiny["params"] > 0 and tiny["tokens_per_step"] == 2 * 32
    for key in (
        "first_step_s",
        "tokens_per_s",
        "model_gflops_per_s",
        "mfu_vs_measured",
        "mfu_vs_theoretical",
        "model_flops_per_token",
    ):
        assert math.isfinite(tiny[key]) and tiny[key] > 0, key
    assert tiny["step_s"]["median_s"] > 0 and tiny["step_s"]["iqr_s"] >= 0
    assert 0 < tiny["compile_s"] <= tiny["first_step_s"]
    assert math.isfinite(tiny["last_loss"])


@pytest.mark.parametrize("preset", ["tiny", "llama_tiny"])
def test_compare_mode_runs_both_steps_on_the_same_numbers(tmp_path, preset):
    """GPT and the Llama block: the plain-JAX baseline of each family computes the same loss."""
    bench = importlib.import_module("benchmarks.train_step")
    out = tmp_path / "compare.json"
    results = bench.main(
        ["--compare", "--presets", preset, "--steps", "2", "--warmup", "0", "--no-warm-process", "--out", str(out)]
    )

    assert json.loads(out.read_text()) == results
    tiny = results["presets"][preset]
    # The plain-JAX step starts from the equipax model's parameters: the same math gives the same loss.
    assert tiny["max_first_loss_diff"] < 1e-5, (tiny["equipax"]["first_loss"], tiny["baseline"]["first_loss"])
    for side in ("equipax", "baseline"):
        assert tiny[side]["tokens_per_s"] > 0 and tiny[side]["compile_s"] > 0
        assert math.isfinite(tiny[side]["last_loss"])
    assert tiny["ratio"] > 0


@pytest.mark.slow
def test_compare_chip_options_and_op_profile_on_cpu(tmp_path):
    """The TPU comparison's options at toy size: scanned layers, full remat and bfloat16 compute
    on both sides agree on the first loss (within bfloat16's rounding), and the profile of each
    side, a real jax.profiler trace, gives a non-empty per-op table (benchmarks/op_profile.py)."""
    bench = importlib.import_module("benchmarks.train_step")
    profile = tmp_path / "profile"
    args = ["--compare", "--presets", "llama_tiny", "--scan", "--remat", "full", "--dtype", "bfloat16"]
    args += ["--attention", "auto", "--steps", "1", "--warmup", "0", "--no-warm-process", "--no-isolate"]
    results = bench.main(
        [*args, "--profile", str(profile), "--profile-steps", "1", "--top", "5", "--out", str(tmp_path / "c.json")]
    )

    r = results["presets"]["llama_tiny"]
    assert (r["dtype"], r["attention_impl"], r["remat"]) == ("bfloat16", "xla", {"equipax": "full", "baseline": "full"})
    assert r["max_first_loss_diff"] < 1e-2 * r["equipax"]["first_loss"], (r["equipax"], r["baseline"])
    summary = json.loads((profile / "llama_tiny" / "op_profile.json").read_text())
    for side in ("equipax", "plain"):
        assert summary[side]["device_ms_per_step"] > 0 and summary[side]["op_events"] > 0
        assert 0 < len(summary[side]["top_ops"]) <= 5 and summary[side]["top_ops"][0]["ms_per_step"] > 0


@pytest.mark.parametrize(("tensor_parallel", "kernel"), [("gspmd", "splash"), ("shard_map", "xla")])
def test_attention_auto_is_the_kernel_the_model_runs(tensor_parallel, kernel):
    """--attention auto gives both sides of --compare the kernel the equipax step computes with, as
    `launch run` resolves it (`attention_kernel`): on a TPU at seq 128, splash, except in a
    tensor_parallel='shard_map' block, where splash cannot nest and the model runs XLA's."""
    from benchmarks.lm_step.presets import PRESETS, resolve_attention, with_overrides
    from equipax.core.knobs import set_knobs

    preset = with_overrides(PRESETS["llama_tiny"](), scan=None, remat=None, attention="auto", dtype="bfloat16")
    model = set_knobs(preset.model, {"transformer.tensor_parallel": tensor_parallel, "max_seq_len": 128})
    preset = dataclasses.replace(preset, model=model, seq_len=128)
    assert resolve_attention(preset, platform="tpu").model.transformer.attention_impl == kernel


def test_op_profile_needs_only_the_standard_library(tmp_path):
    """benchmarks/op_profile.py summarises a trace wherever the trace is copied: as a script and as a
    module of the `benchmarks` package, in an interpreter without site-packages (-I -S)."""
    trace = tmp_path / "perfetto_trace.json.gz"
    event = {"ph": "X", "name": "fusion.1", "ts": 0, "dur": 10, "pid": 1, "tid": 1, "args": {"hlo_op": "fusion.1"}}
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": [event]}, f)
    as_module = f"import sys; sys.path.insert(0, {str(REPO)!r}); from benchmarks import op_profile; "
    as_module += f"print(op_profile.summarize_trace({str(trace)!r}, steps=1)['device_ms_per_step'])"
    for args in ([str(BENCHMARKS / "op_profile.py"), str(trace), "--steps", "1"], ["-c", as_module]):
        done = subprocess.run([sys.executable, "-I", "-S", *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "0.01" in done.stdout, done.stdout + done.stderr


def test_cli_latency_benchmark_runs_and_reports_no_heavy_imports(tmp_path):
    bench = importlib.import_module("benchmarks.cli_latency")
    out = tmp_path / "cli.json"
    results = bench.main(["--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    for name, r in results["commands"].items():
        assert 0 < r["min_s"] <= r["median_s"] <= r["max_s"], name
        assert r["heavy_imports"] == "", (name, r["heavy_imports"])


def test_input_pipeline_benchmark_smoke(tmp_path):
    bench = importlib.import_module("benchmarks.input_pipeline")
    out = tmp_path / "input.json"
    results = bench.main(
        [
            "--batches",
            "3",
            "--warmup",
            "1",
            "--threads",
            "0",
            "--hosts",
            "1,2",
            "--shards",
            "2",
            # Two plays' documents, not all 38: each C4 build's token-count pass covers the shards
            # (four builds of every play took most of this test's 90 s on a loaded 2-core machine).
            "--plays",
            "2",
            "--set",
            "data.tokenizer=byte",
            "--step-tokens-per-s",
            "1000",
            "--out",
            str(out),
        ]
    )
    assert json.loads(out.read_text()) == results
    assert results["settings"]["plays"] == 2 and results["c4_documents"] > 0
    assert set(results["cases"]) == {
        "default",
        "c4_packed_jsonl_threads0",
        "c4_packed_arrayrecord_threads0",
        "c4_packed_jsonl_threads0_host0of2",
        "c4_packed_arrayrecord_threads0_host0of2",
    }
    for case in results["cases"].values():
        assert math.isfinite(case["tokens_per_s"]) and case["tokens_per_s"] > 0
        assert case["x_train_step"] == case["tokens_per_s"] / 1000
        assert 0 < case["real_fraction"] <= 1


def test_decode_benchmark_smoke(tmp_path):
    """benchmarks/decode.py runs and writes sane JSON (timings themselves are not tested)."""
    bench = importlib.import_module("benchmarks.decode")
    out = tmp_path / "decode.json"
    results = bench.main(
        [
            "--families",
            "llama",
            "--tiny",
            "--prompt-len",
            "4",
            "--new-tokens",
            "4",
            "--repeats",
            "1",
            "--uncached-repeats",
            "1",
            "--out",
            str(out),
        ]
    )
    assert json.loads(out.read_text()) == results
    row = results["families"]["llama"]
    assert row["greedy_tokens_match"] is True
    for key in (
        "prefill_s",
        "cached_total_s",
        "uncached_total_s",
        "speedup",
        "cached_tokens_per_s",
        "decode_per_token_s",
    ):
        assert row[key] >= 0, key


BUBBLE_ARGS = ["--stages", "2", "--schedules", "circular", "--microbatches", "2,4", "--model-dims", "32", "--seq", "16"]
BUBBLE_ARGS += ["--steps", "2", "--rounds", "2", "--warmup", "0"]
MOE_ARGS = ["--ep", "2", "--model-dims", "32", "--seq", "16", "--steps", "1", "--rounds", "2", "--warmup", "0"]
CONTEXT_MEMORY_ARGS = ["--seqs", "64", "--cps", "1,2", "--layers", "1", "--model-dims", "32", "--heads", "2"]
CONTEXT_MEMORY_ARGS += ["--vocab", "64"]
# The 8-device benchmarks in one child, through their importable `main`s: one JAX and equipax
# start-up, not three. Its stdout is each one's, after a line `=== NAME ===`.
EIGHT_DEVICE_CHILD = """
import importlib, json, sys
sys.path.insert(0, sys.argv[1])
for name, argv in json.loads(sys.argv[2]):
    print(f"=== {name} ===", flush=True)
    importlib.import_module(f"benchmarks.{name}").main(argv)
"""


@pytest.fixture(scope="module")
def eight_device_benchmarks(tmp_path_factory):
    """`{name: (stdout, JSON written)}` of pipeline_bubble.py, moe_dispatch.py and
    context_memory.py (memory only) at tiny sizes, run in one child process of 8 simulated devices."""
    out = tmp_path_factory.mktemp("eight_device_benchmarks")
    runs = {"pipeline_bubble": BUBBLE_ARGS, "moe_dispatch": MOE_ARGS, "context_memory": CONTEXT_MEMORY_ARGS}
    argvs = [(name, [*args, "--out", str(out / f"{name}.json")]) for name, args in runs.items()]
    proc = subprocess.run(
        [sys.executable, "-c", EIGHT_DEVICE_CHILD, str(REPO), json.dumps(argvs)],
        capture_output=True,
        text=True,
        timeout=600,
        env=timed_child_env(),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    parts = re.split(r"^=== (\w+) ===$", proc.stdout, flags=re.MULTILINE)[1:]
    stdouts = dict(zip(parts[::2], parts[1::2]))
    assert list(stdouts) == list(runs), proc.stdout[-3000:]
    return {name: (stdouts[name], json.loads((out / f"{name}.json").read_text())) for name in runs}


@pytest.mark.slow
def test_bubble_benchmark_tiny(eight_device_benchmarks):
    """benchmarks/pipeline_bubble.py runs (2 stages, circular, 2 and 4 microbatches, tiny model)
    and writes its table's rows; timings themselves are not tested."""
    stdout, results = eight_device_benchmarks["pipeline_bubble"]
    rows = results["rows"]
    assert [(r["schedule"], r["repeats"], r["microbatches"], r["iterations"]) for r in rows] == [
        ("circular", 2, 2, 5),
        ("circular", 2, 4, 9),
    ]
    assert [r["bubble_fraction"] for r in rows] == pytest.approx([1 / 5, 1 / 9])
    assert rows[0]["predicted_vs_most_microbatches"] == pytest.approx(10 / 9)
    assert rows[1]["measured_vs_most_microbatches"] == 1.0
    assert all(len(r["steps_s"]) == 4 and r["step_q1_s"] <= r["step_s"] <= r["step_q3_s"] for r in rows)
    assert "circular R=2" in stdout


@pytest.mark.slow
def test_moe_dispatch_benchmark_tiny(eight_device_benchmarks):
    """benchmarks/moe_dispatch.py runs (EP 2, dropless and capacity, tiny model) and writes its
    table's rows; timings themselves are not tested. One expert-parallel size: another is the same
    code on another mesh, and each costs two compiles (expert parallelism == one device is
    tests/models/test_moe_parallel.py's)."""
    rows = eight_device_benchmarks["moe_dispatch"][1]["rows"]
    assert [(r["ep"], r["dispatch"]) for r in rows] == [(2, "dropless"), (2, "capacity 1.25")]
    assert rows[0]["vs_dropless_lowest_ep"] == 1.0
    assert rows[1]["vs_dropless_lowest_ep"] == rows[1]["step_s"] / rows[0]["step_s"]
    assert all(len(r["steps_s"]) == 2 and r["step_q1_s"] <= r["step_s"] <= r["step_q3_s"] for r in rows)


def test_hf_import_memory_benchmark_tiny(tmp_path):
    """benchmarks/hf_import_memory.py loads a tiny synthetic checkpoint in 1 and in 2 processes and
    reports each one's shards (the memory figures themselves are benchmarks/README.md's)."""
    bench = importlib.import_module("benchmarks.hf_import_memory")
    out = tmp_path / "hf.json"
    results = bench.main(["--hidden", "128", "--layers", "2", "--processes", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == results
    total = sum(r["shards_held_bytes"] for r in results["sharded"])
    assert total == results["single"][0]["shards_held_bytes"] > 0
    assert len(results["sharded"]) == 2 and all(r["shards_held_bytes"] * 2 == total for r in results["sharded"])


@pytest.mark.slow
def test_context_memory_benchmark_tiny(eight_device_benchmarks):
    """benchmarks/context_memory.py compiles (never runs) the gradient step at a context axis of 2,
    both strategies, tiny model, and writes its rows of XLA's per-device memory analysis."""
    rows = eight_device_benchmarks["context_memory"][1]["rows"]
    assert [(r["context"], r["strategy"]) for r in rows] == [(1, "all_gather"), (2, "all_gather"), (2, "ring")]
    assert all(r["temp_bytes"] > 0 and r["argument_bytes"] > 0 for r in rows)


@pytest.mark.slow
def test_context_step_time_benchmark_tiny(tmp_path):
    """benchmarks/context_memory.py --time-steps runs the real train step at context 2 (2 simulated
    devices), both strategies, tiny model, and writes interleaved step times; timings themselves
    are not tested."""
    out = tmp_path / "time.json"
    args = ["--seqs", "64", "--cps", "2", "--layers", "1", "--model-dims", "32", "--heads", "2", "--vocab", "384"]
    args += ["--time-steps", "2", "--rounds", "2", "--warmup", "0", "--out", str(out)]
    env = dict(timed_child_env(), JAX_NUM_CPU_DEVICES="2")
    script = str(BENCHMARKS / "context_memory.py")
    proc = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["context"], r["strategy"]) for r in rows] == [(2, "all_gather"), (2, "ring")]
    assert all(len(r["steps_s"]) == 4 and r["step_q1_s"] <= r["step_s"] <= r["step_q3_s"] for r in rows)
    assert "| 64 | 2 | ring |" in proc.stdout


def test_context_step_time_rejects_cps_other_than_device_count(monkeypatch, capsys):
    """A --cps other than the device count is a usage error (checked in this process, before
    anything compiles: a child would cost a JAX start-up for an argument check)."""
    import jax

    n = jax.device_count()
    # The script sets JAX_NUM_CPU_DEVICES (for JAX started after it) if unset: not for this process's children.
    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", str(n))
    bench = importlib.import_module("benchmarks.context_memory")
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--seqs", "64", "--cps", str(n + 1), "--time-steps", "2", "--out", "/nonexistent/never-written"])
    assert exit_.value.code == 2
    assert f"--time-steps runs the train step on all {n} devices" in capsys.readouterr().err


def test_quantized_matmul_benchmark_tiny(tmp_path):
    """benchmarks/quantized_matmul.py on the CPU at toy size: every program compiles, the int8 one's
    three matmuls (forward and both backward) are int8, and no timing is taken off a TPU."""
    spec = importlib.util.spec_from_file_location("benchmarks_quantized_matmul", BENCHMARKS / "quantized_matmul.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "q.json"
    results = module.main(
        ["--tokens", "16", "--d-in", "32", "--d-out", "64", "--decode-tokens", "2", "--out", str(out)]
    )
    assert json.loads(out.read_text()) == results
    assert (results["int8"]["matmuls"], results["int8"]["int8_matmuls"]) == (3, 3)
    assert results["bf16"]["int8_matmuls"] == 0
    assert all("median_s" not in results[name] for name in ("bf16", "int8", "bf16_serve", "int8w_serve"))


_TOY_C4 = [
    *("model.vocab_size=384", "model.max_seq_len=128", "model.transformer.num_layers=2"),
    *("model.transformer.model_dims=128", "model.transformer.num_heads=2", "model.transformer.head_dim=64"),
    *("model.transformer.hidden_dims=256", "data.seq_len=128", "data.per_device_batch=2"),
]


@pytest.mark.slow
def test_quantized_step_benchmark_compiles_both_programs_for_a_tpu(tmp_path):
    """benchmarks/quantized_step.py at toy size (c4_1b shrunk), compiled by XLA:TPU for a v5e: the
    int8 train step's projections are int8 matmuls (forward and both backward), and the int8w decode
    step reads its int8 weights as int8: fewer bytes than bf16's, no float copy of them in memory."""
    from equipax.launch.hardware.tpu import libtpu_available

    if not libtpu_available():
        pytest.skip("needs libtpu (XLA:TPU)")
    bench = importlib.import_module("benchmarks.quantized_step")
    out = tmp_path / "q.json"
    args = ["--cache-len", "64", "--out", str(out), *[a for s in _TOY_C4 for a in ("--set", s)]]
    results = bench.main(args)
    assert json.loads(out.read_text()) == results
    # 2 attention and 2 MLP projections (c4_1b's MLP is not gated), 3 matmuls each, in the one loop body.
    assert results["step_int8"]["matmuls"]["int8"] == 4 * 3 and results["step_bf16"]["matmuls"]["int8"] == 0
    assert results["decode_int8w"]["hbm_bytes"] < results["decode_bf16"]["hbm_bytes"]
    assert results["decode_int8w"]["float_weight_copies"] == 0


def test_float_weight_copies_finds_a_dequantized_weight_in_memory():
    """The check the decode figures rely on: an int8 weight converted inside its matmul writes no
    float copy; one converted into an array of its own (an optimization barrier keeps XLA from
    fusing the conversion into the matmul) does."""
    import jax
    import jax.numpy as jnp

    from equipax.launch.hardware.tpu import libtpu_available, lookup_slice, topology_devices

    if not libtpu_available():
        pytest.skip("needs libtpu (XLA:TPU)")
    bench = importlib.import_module("benchmarks.quantized_step")
    placed = jax.sharding.SingleDeviceSharding(topology_devices(lookup_slice("v5e-1"))[0])
    # A weight too large for on-chip memory in bf16 (128 MiB), where a copy would stay unseen.
    x = jax.ShapeDtypeStruct((1, 4096), jnp.bfloat16, sharding=placed)
    w = jax.ShapeDtypeStruct((4096, 16384), jnp.int8, sharding=placed)

    def copies(convert):
        hlo = jax.jit(lambda x, w: x @ convert(w)).lower(x, w).compile().as_text()
        return bench.float_weight_copies(hlo, {w.shape})

    assert copies(lambda w: w.astype(jnp.bfloat16)) == 0
    assert copies(lambda w: jax.lax.optimization_barrier(w.astype(jnp.bfloat16))) >= 1


@pytest.mark.slow
def test_first_step_benchmark_times_phases_and_compiles_a_runs_programs_for_a_tpu(tmp_path):
    """One fresh toy run per interpreter (its phases, the time after the first step), and the
    programs a run compiles, compiled for a v5e by libtpu on this host."""
    spec = importlib.util.spec_from_file_location("benchmarks_first_step", BENCHMARKS / "first_step.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "first_step.json"
    results = bench.main(
        ["--rounds", "1", "--fresh-only", "--cache", "off", "--python", f"this={sys.executable}", "--out", str(out)]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    (run,) = results["runs"]["fresh, this, cache off"]
    assert {"start-up", "config", "devices", "inputs", "build", "first step"} <= set(run)
    assert 0 < run["total"] < run["process_wall"] and 0 < run["after_first_step"] < run["process_wall"]

    toy = [a for s in bench.TOY for a in ("--set", s)]
    programs = tmp_path / "programs.json"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "first_step.py"), "--programs", "v5e-1", *toy, "--out", str(programs)],
        capture_output=True,
        text=True,
        timeout=600,
        env=timed_child_env(),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    compiled = json.loads(programs.read_text())
    for name in ("init", "train step", "eval step", "checksums"):
        assert compiled[name]["compile_s"] > 0, name
    assert compiled["init"]["temp_bytes"] >= 0


def test_splash_blocks_times_each_setting_and_records_it(tmp_path):
    """benchmarks/splash_blocks.py in interpret mode at a toy shape: a row per block setting with
    its time and the blocks it ran, in the JSON it writes."""
    from benchmarks import splash_blocks

    out = tmp_path / "s.json"
    rows = splash_blocks.main(["--out", str(out), "--toy", "--interpret", "--repeats", "1"])
    assert [(r["block_q"], r["block_kv"], r["fused_bwd"]) for r in rows] == [(128, 128, True), (256, 128, False)]
    assert all(r["ms"] > 0 and "error" not in r for r in rows), rows
    assert json.loads(out.read_text()) == json.loads(json.dumps(rows))


def test_device_open_variants_time_each_environment_and_refuse_a_malformed_one(tmp_path):
    """`device_open.py --variants`: one process per setting, the setting in its environment; a
    setting that is not NAME=VALUE is refused, naming it."""
    from benchmarks import device_open

    with pytest.raises(SystemExit, match="NAME=VALUE"):
        device_open.parse_variant("TPU_PREMAPPED_BUFFER_SIZE")
    out = tmp_path / "open.json"
    variants = ["--variants", "default", "EQUIPAX_TEST_VARIANT=1"]
    got = device_open.main(["--rounds", "1", *variants, "--transfer-mib", "1", "--many", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == got
    assert set(got["medians"]) == {"default", "EQUIPAX_TEST_VARIANT=1"}
    for runs in got["runs"].values():
        (run,) = runs
        assert run["platform"] == "cpu" and set(run["moves"]) == {"1 MiB", "2 x 256 MiB"}
        assert 0 < run["open_s"] < run["wall_s"] and run["exit_s"] >= 0
    assert got["runs"]["EQUIPAX_TEST_VARIANT=1"][0]["env"] == {"EQUIPAX_TEST_VARIANT": "1"}
    assert got["runs"]["default"][0]["env"] == {}


def test_launch_timeline_times_the_checkpointers_calls(tmp_path, monkeypatch, caplog):
    """`launch_timeline.py --checkpoints`: each call of the checkpointer logs its duration (the
    restore's until its arrays are on the devices), once however often it is asked for."""
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import launch_timeline
    from equipax.launch.jobdir.checkpoints import Checkpointer

    for name in launch_timeline.CHECKPOINTER_CALLS:  # put back after the test
        monkeypatch.setattr(Checkpointer, name, getattr(Checkpointer, name))
    launch_timeline.time_checkpointer()
    launch_timeline.time_checkpointer()
    state = {"w": jnp.arange(6.0).reshape(2, 3)}
    with caplog.at_level("WARNING", logger=launch_timeline.log.name):
        ckpt = Checkpointer(tmp_path / "ckpt", keep=1)
        ckpt.save(1, state, {"cursor": 1})
        ckpt.wait()
        step, back, data, _ = ckpt.restore_latest({"w": jnp.zeros((2, 3))})
        ckpt.close()
    assert step == 1 and data == {"cursor": 1}
    np.testing.assert_array_equal(np.asarray(back["w"]), np.asarray(state["w"]))
    calls = [re.fullmatch(r"Checkpointer\.(\w+): \d+\.\d{3} s", r.getMessage()) for r in caplog.records]
    assert all(calls), [r.getMessage() for r in caplog.records]
    names = [m.group(1) for m in calls if m]
    assert set(names) == set(launch_timeline.CHECKPOINTER_CALLS), names  # save/restore also wait inside
    assert names.count("save") == names.count("restore_latest") == names.count("close") == 1, names
    assert names.index("save") < names.index("restore_latest") < names.index("close") == len(names) - 1
