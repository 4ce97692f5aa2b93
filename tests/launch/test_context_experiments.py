"""Context parallelism through `launch`: the knob errors reach the CLI as exit 2
(tests/models/test_context_parallel_lm.py checks each error; this, that `launch show` reports it
before anything is built), and a run on a context axis resumes bit for bit."""

import dataclasses
import json
import subprocess
import sys

import pytest


def test_context_errors_reach_the_cli():
    """A sequence the zigzag layout cannot cut is exit 2 at `launch show`, naming the knobs."""
    sets = [
        "mesh.axis_names=('data', 'fsdp', 'context', 'tensor')",
        "mesh.ici_mesh_shape=(1, 1, 4, 1)",
        "mesh.dcn_mesh_shape=(1, 1, 1, 1)",
        "data.seq_len=36",
    ]
    cmd = [sys.executable, "-m", "equipax.launch.cli", "show", "--exp", "shakespeare_llama_tiny"]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "data.seq_len=36 cannot be split" in proc.stdout + proc.stderr
    assert "multiple of 8" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_context_parallel_run_resumes_to_the_uninterrupted_runs_bits(tmp_path):
    """`launch run` on data 2 x context 2 (ring attention, zigzag) for 4 steps, and the same
    stopped at step 2 and resumed: the same parameters and optimizer state, bit for bit. One
    4-device child runs both commands, so they share its compiled programs. The stopped job is the
    uninterrupted one as a run killed right after its checkpoint of step 2 left it (the checkpoint
    of step 4 and result.json gone; a resumed run drops the records written after step 2): the
    checkpoint a run of `train.num_steps=2` writes (nothing saved depends on num_steps), without
    that run."""
    from helpers.multidevice import FAST_COMPILE, run_with_devices
    from helpers.toy import TOY, set_args

    knobs = [
        *TOY,
        "mesh.axis_names=('data', 'fsdp', 'context', 'tensor')",
        "mesh.ici_mesh_shape=(2, 1, 2, 1)",
        "mesh.dcn_mesh_shape=(1, 1, 1, 1)",
        "model.transformer.context_parallel_strategy=ring",
        "train.log_every=1",
        "train.eval_every=2",
        "train.checkpoint_every=2",
        "train.eval_batches=1",
        "train.sample.tokens=0",
    ]
    out = run_with_devices(
        f"""
        import json, pathlib, shutil
        from typer.testing import CliRunner
        from equipax.launch.cli import app
        def run(job, steps):
            args = ["run", "--exp", "shakespeare_llama_tiny", "--job-log-dir", {str(tmp_path)!r} + "/" + job,
                    *{set_args(knobs)!r}, "--set", f"train.num_steps={{steps}}"]
            result = CliRunner().invoke(app, args)
            assert result.exit_code == 0, result.output
            return result.output
        run("full", 4)
        root = pathlib.Path({str(tmp_path)!r})
        shutil.copytree(root / "full", root / "split")
        shutil.rmtree(root / "split" / "checkpoints" / "4")
        (root / "split" / "result.json").unlink()
        print(json.dumps({{"resumed": "Resumed from step 2" in run("split", 4)}}))
        """,
        devices=4,
        timeout=600,
        xla_flags=FAST_COMPILE,
    )
    assert json.loads(out.strip().splitlines()[-1]) == {"resumed": True}
    a, b = (json.loads((tmp_path / job / "result.json").read_text()) for job in ("full", "split"))
    assert a["state_digest"] == b["state_digest"]  # parameters and optimizer state, bit for bit
    assert a["final_train_loss"] == b["final_train_loss"]
    config = json.loads((tmp_path / "full" / "config.json").read_text())
    assert config["mesh"]["ici_mesh_shape"] == [2, 1, 2, 1]


@pytest.mark.parametrize(
    "name, seq_len, context, strategy",
    [("llama3_1_8b_32k", 32_768, 4, "all_gather"), ("llama3_1_8b_128k", 131_072, 16, "ring")],
)
def test_long_context_experiments_validate_and_split_their_sequence(name, seq_len, context, strategy):
    """The 32K/128K experiments build (every config check passes), their context axis cuts the
    sequence into the zigzag's 2 x CP chunks, each chip holds 8,192 tokens, and `launch show`
    prints them without hardware."""
    from typer.testing import CliRunner

    from equipax.core.mesh_config import CONTEXT
    from equipax.launch.cli import app
    from equipax.launch.experiments.registry import get_experiment

    cfg = get_experiment(name)
    t = cfg.model.transformer
    assert cfg.data.seq_len == seq_len <= cfg.model.max_seq_len
    assert cfg.mesh.axis_size(CONTEXT) == context and t.context_parallel_load_balance
    assert seq_len % (2 * context) == 0
    assert t.context_parallel_strategy == strategy
    # one sequence per fsdp group, split over `context`: 8,192 tokens per chip
    assert cfg.global_batch_size == cfg.mesh.batch_parallelism and seq_len // context == 8_192
    assert cfg.global_batch_size * seq_len // cfg.mesh.num_devices == 8_192
    assert cfg.model.rope_scaling is not None and cfg.model.rope_scaling.factor == 8.0  # Llama 3.1's 128K RoPE
    result = CliRunner().invoke(app, ["show", "--exp", name, "--format", "json"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    assert shown["derived"]["tokens_per_step"] == 8_192 * cfg.mesh.num_devices
    assert shown["derived"]["params_total"] == 8_030_261_248


def test_folding_the_context_axis_keeps_the_devices_and_the_batch():
    from equipax.core.mesh_config import AXES
    from equipax.launch.aot.context_report import fold_context
    from equipax.launch.experiments.registry import get_experiment

    cfg = get_experiment("llama3_1_8b_128k")
    folded = fold_context(cfg)
    assert folded.mesh.axis_names == AXES and folded.mesh.shape == (1, 128, 1)
    # 8 sequences on 128 chips: without the axis a chip holds at least one whole sequence
    assert (cfg.global_batch_size, folded.global_batch_size) == (8, 128)
    per_device = dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, per_device_batch=1),
        mesh=dataclasses.replace(cfg.mesh, ici_mesh_shape=(1, 8, 8, 1), dcn_mesh_shape=(1, 1, 2, 1)),
    )
    folded = fold_context(per_device)
    assert folded.mesh.dcn_mesh_shape == (1, 2, 1) and folded.mesh.ici_mesh_shape == (1, 64, 1)  # DCN folds alike
    assert folded.data == per_device.data  # a batch the folded mesh splits is kept
    # 24 sequences over 16 data x 4 fsdp: the next multiple of 64
    odd = dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, batch_size=24),
        mesh=dataclasses.replace(cfg.mesh, ici_mesh_shape=(8, 1, 16, 1)),
    )
    assert fold_context(odd).global_batch_size == 128


def test_compare_context_needs_a_context_axis():
    from typer.testing import CliRunner

    from equipax.launch.cli import app

    result = CliRunner().invoke(app, ["compile", "--exp", "llama3_8b_smoke", "--compare-context"])
    assert result.exit_code == 2, result.output
    assert "has no `context` axis" in " ".join(result.output.split())


@pytest.mark.slow
def test_compile_reports_memory_with_and_without_context_parallelism(tmp_path):
    """`launch compile --compare-context` on 4 simulated devices (context 4, ring) at 512 tokens: the
    second program folds the axis into fsdp, has no collective-permute, and holds the [S, S] logits,
    so its temporaries are larger; both are in compile.json and in the printout."""
    import os

    from helpers.multidevice import FAST_COMPILE
    from helpers.toy import set_args, suite_compile_cache_env, with_xla_flags

    knobs = [
        "mesh.axis_names=('data', 'fsdp', 'context', 'tensor')",
        "mesh.ici_mesh_shape=(1, 1, 4, 1)",
        "mesh.dcn_mesh_shape=(1, 1, 1, 1)",
        "model.transformer.context_parallel_strategy=ring",
        "model.vocab_size=384",
        "model.max_seq_len=512",
        "model.transformer.num_layers=1",
        "model.transformer.model_dims=32",
        "model.transformer.head_dim=8",
        "model.transformer.hidden_dims=64",
        "data.seq_len=512",
        "data.per_device_batch=1",
    ]
    env = with_xla_flags(dict(os.environ, **suite_compile_cache_env()), FAST_COMPILE)
    cmd = [sys.executable, "-m", "equipax.launch.cli", "compile", "--exp", "shakespeare_llama_tiny"]
    cmd += [*set_args(knobs), "--compare-context", "--job-log-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "compile.json").read_text())
    without = report["without_context"]
    assert report["mesh"] == {"data": 1, "fsdp": 1, "context": 4, "tensor": 1}
    assert without["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1} and without["folded_into"] == "fsdp"
    assert report["collectives"]["collective-permute"] > 0 and without["collectives"]["collective-permute"] == 0
    m, w = report["memory_per_device"], without["memory_per_device"]
    assert w["temp_bytes"] > m["temp_bytes"]
    assert without["total_bytes_saved_by_context"] == w["total_bytes"] - m["total_bytes"]
    assert without["tokens_per_device"] == without["tokens_per_device_with_context"] == 512  # the batch kept
    assert without["stablehlo_sha256"] != report["stablehlo_sha256"]
    assert "without CP    the context axis folded into fsdp" in proc.stdout
