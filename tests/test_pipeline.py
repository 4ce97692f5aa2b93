"""Pipeline parallelism (equipax.core.nn.pipeline): pipelined == unpipelined on 8 simulated
devices for GPipe and circular schedules, sharding over `stage` with FSDP and tensor inside each
stage, exact resume, and the config errors."""

import dataclasses
import json
import subprocess
import sys
import textwrap

import pytest
from multidevice import run_with_devices
from toy import compile_cache_env

# A tiny LM (8 layers: 2 or 4 stages, x2 repeats) trained by plain Adam, shared by the children.
_MODEL = """
import dataclasses, json
import equinox as eqx, jax, jax.numpy as jnp, numpy as np, optax
from equipax.core.mesh import MeshConfig, PIPELINE_AXES, build_mesh
from equipax.core.nn import TransformerConfig
from equipax.core.partition import batch_sharding, named, param_specs
from equipax.models.lm import LMConfig, TransformerLM, lm_loss

BASE = LMConfig(vocab_size=64, max_seq_len=16, transformer=TransformerConfig(
    num_layers=8, model_dims=32, num_heads=2, head_dim=16, hidden_dims=64, remat="full"))

def pipelined(stages, schedule, microbatches=4):
    return dataclasses.replace(BASE, transformer=dataclasses.replace(
        BASE.transformer, pipeline_stages=stages, pipeline_schedule=schedule,
        pipeline_repeats=2 if schedule == "circular" else 1, pipeline_microbatches=microbatches))

def pipeline_mesh(shape):
    return build_mesh(MeshConfig(ici_mesh_shape=shape, dcn_mesh_shape=(1, 1, 1, 1), axis_names=PIPELINE_AXES))

ids = jax.random.randint(jax.random.key(1), (16, 17), 0, 64)
BATCH = {"ids": ids[:, :-1], "labels": ids[:, 1:], "weights": jnp.ones((16, 16))}

def layer_grads(grads):
    stack = grads.stack
    layers = stack.in_layer_order() if hasattr(stack, "in_layer_order") else stack.layers
    return [np.asarray(g) for g in jax.tree.leaves(eqx.filter(layers, eqx.is_array))]

def train(cfg, mesh, steps=2):
    model = TransformerLM(cfg, key=jax.random.key(0))
    batch = BATCH
    if mesh is not None:
        model = eqx.filter_shard(model, named(param_specs(eqx.filter(model, eqx.is_array), mesh), mesh))
        batch = jax.device_put(BATCH, batch_sharding(mesh))
    opt = optax.adam(1e-2)
    state = opt.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(model, state, batch):
        (loss, _), grads = eqx.filter_value_and_grad(lm_loss, has_aux=True)(model, batch, mesh=mesh)
        updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state, loss, grads

    losses, grads = [], []
    for _ in range(steps):
        model, state, loss, g = step(model, state, batch)
        losses.append(float(loss))
        grads.append(layer_grads(g) + [np.asarray(g.embedding.weight)])
    return losses, grads, model
"""


def test_pipelined_equals_unpipelined_gpipe_and_circular():
    """2 and 4 stages, GPipe and circular, composed with data/fsdp/tensor axes inside the stages:
    2 Adam steps give the unpipelined losses (rel 1e-5) and gradients (max abs diff 1e-5; the
    largest gradient entries are ~0.09; measured: loss rel <= 2.3e-7, gradients <= 2e-7)."""
    out = run_with_devices(_MODEL + textwrap.dedent("""
    ref_losses, ref_grads, _ = train(BASE, None)
    results = {}
    # (stages, schedule, mesh (stage, data, fsdp, tensor)).
    for stages, schedule, shape in [(2, "gpipe", (2, 1, 2, 2)), (4, "gpipe", (4, 1, 1, 2)),
                                    (2, "circular", (2, 2, 1, 2)), (4, "circular", (4, 1, 2, 1))]:
        losses, grads, _ = train(pipelined(stages, schedule), pipeline_mesh(shape))
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        diff = max(float(np.max(np.abs(a - b))) for g, r in zip(grads, ref_grads) for a, b in zip(g, r))
        results[f"{stages}-{schedule}"] = (rel, diff)
    print(json.dumps({"ref": ref_losses, "results": results}))
    """))
    report = json.loads(out.strip().splitlines()[-1])
    assert report["ref"][-1] < report["ref"][0]  # the steps train
    for name, (rel, diff) in report["results"].items():
        assert rel <= 1e-5, (name, rel)
        assert diff <= 1e-5, (name, diff)


def test_stage_weights_are_split_over_stage_and_sharded_inside():
    """Each stage's devices hold only its layers; inside a stage FSDP and tensor shard them as
    unpipelined; activations cross stages by collective-permute (the ppermute)."""
    out = run_with_devices(_MODEL + textwrap.dedent("""
    cfg = pipelined(2, "gpipe")
    mesh = pipeline_mesh((2, 1, 2, 2))
    model = TransformerLM(cfg, key=jax.random.key(0))
    specs = param_specs(eqx.filter(model, eqx.is_array), mesh)
    att = specs.stack.stages.attention
    qkv = att.qkv
    down = specs.stack.stages.ffn.down.weight
    sharded = eqx.filter_shard(model, named(specs, mesh))
    shard_shape = sharded.stack.stages.ffn.down.weight.addressable_shards[0].data.shape
    full_shape = sharded.stack.stages.ffn.down.weight.shape
    params, static = eqx.partition(sharded, eqx.is_array)
    loss = jax.jit(lambda p, b: lm_loss(eqx.combine(p, static), b, mesh=mesh)[0])
    hlo = loss.lower(params, jax.device_put(BATCH, batch_sharding(mesh))).compile().as_text()
    print(json.dumps({"qkv": list(qkv), "down": list(down), "shard": shard_shape, "full": full_shape,
                      "permute": hlo.count("collective-permute"), "emb": list(specs.embedding.weight)}))
    """))
    r = json.loads(out.strip().splitlines()[-1])
    assert r["qkv"][0] == "stage" and "fsdp" in r["qkv"] and "tensor" in r["qkv"], r
    assert r["down"] == ["stage", None, None, "tensor", "fsdp"], r
    assert r["full"][:3] == [2, 1, 4] and r["shard"][:3] == [1, 1, 4], r
    assert r["shard"][3:] == [r["full"][3] // 2, r["full"][4] // 2], r
    assert r["permute"] >= 1
    assert "stage" not in r["emb"]  # the embedding is outside the pipeline: replicated over stage


def test_pipeline_knob_errors():
    from equipax.core.config import ConfigError
    from equipax.core.mesh import PIPELINE_AXES, MeshConfig
    from equipax.core.nn import TransformerConfig
    from equipax.core.nn.pipeline import check_pipeline

    base = TransformerConfig(num_layers=6)
    with pytest.raises(ValueError, match=r"num_layers=6 is not divisible by pipeline_stages x pipeline_repeats = 4"):
        dataclasses.replace(base, pipeline_stages=4)
    with pytest.raises(ValueError, match=r"pipeline_stages x pipeline_repeats = 2 x 2 = 4"):
        dataclasses.replace(base, pipeline_stages=2, pipeline_schedule="circular", pipeline_repeats=2)
    with pytest.raises(ValueError, match=r"pipeline_repeats=2 needs pipeline_schedule='circular'"):
        dataclasses.replace(base, pipeline_stages=2, pipeline_repeats=2)
    with pytest.raises(ValueError, match=r"'circular' needs pipeline_repeats >= 2"):
        dataclasses.replace(base, pipeline_stages=2, pipeline_schedule="circular")
    with pytest.raises(ValueError, match=r"set one of them"):
        dataclasses.replace(base, pipeline_stages=2, pipeline_microbatches=2, pipeline_microbatch_size=4)
    with pytest.raises(ValueError, match=r"tensor_parallel='gspmd'"):
        dataclasses.replace(base, pipeline_stages=2, tensor_parallel="shard_map")

    cfg = dataclasses.replace(base, pipeline_stages=2, pipeline_microbatches=4)
    mesh = MeshConfig(ici_mesh_shape=(2, 1, 2, 2), dcn_mesh_shape=(1, 1, 1, 1), axis_names=PIPELINE_AXES)
    check_pipeline(cfg, mesh, 16)  # fits
    with pytest.raises(ConfigError, match=r"pipeline_stages=2 but the mesh's `stage` axis has size 1.*axis_names=\('stage', 'data'"):
        check_pipeline(cfg, MeshConfig(ici_mesh_shape=(1, 4, 2)), 16)
    with pytest.raises(ConfigError, match=r"pipeline_stages=4 but the mesh's `stage` axis has size 2"):
        check_pipeline(dataclasses.replace(cfg, num_layers=8, pipeline_stages=4), mesh, 16)
    with pytest.raises(ConfigError, match=r"global batch 18 is not divisible into 4 microbatches"):
        check_pipeline(cfg, mesh, 18)
    with pytest.raises(ConfigError, match=r"not divisible into microbatches of model.transformer.pipeline_microbatch_size=3"):
        check_pipeline(dataclasses.replace(cfg, pipeline_microbatches=None, pipeline_microbatch_size=3), mesh, 16)
    with pytest.raises(ConfigError, match=r"microbatch of 2 examples .* does not split evenly over the 4"):
        check_pipeline(cfg, MeshConfig(ici_mesh_shape=(2, 2, 2, 1), dcn_mesh_shape=(1, 1, 1, 1),
                                       axis_names=PIPELINE_AXES), 8)
    # A -1 (flexible) axis: the batch is checked once the mesh is fitted to the devices.
    flexible = MeshConfig(ici_mesh_shape=(2, 1, -1, 2), dcn_mesh_shape=(1, 1, 1, 1), axis_names=PIPELINE_AXES)
    check_pipeline(cfg, flexible, 2)
    with pytest.raises(ConfigError, match=r"microbatch of 4 examples .* over the 8 data x fsdp"):
        check_pipeline(cfg, flexible.fit(32), 16)
    circular = dataclasses.replace(base, num_layers=8, pipeline_stages=4, pipeline_schedule="circular",
                                   pipeline_repeats=2, pipeline_microbatches=2)
    with pytest.raises(ConfigError, match=r"circular schedule needs at least as many microbatches as stages"):
        check_pipeline(circular, MeshConfig(ici_mesh_shape=(4, 1, 1, 1), dcn_mesh_shape=(1, 1, 1, 1),
                                            axis_names=PIPELINE_AXES), 16)


def test_pipeline_errors_reach_the_cli():
    """A mismatched stage axis is a config error (exit 2) at `launch show`, naming the knobs."""
    proc = subprocess.run(
        [sys.executable, "-m", "equipax.launch.cli", "show", "--exp", "c4_gpt3_xl_pipeline_smoke",
         "--set", "model.transformer.pipeline_stages=4"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "pipeline_stages=4 but the mesh's `stage` axis has size 2" in proc.stdout + proc.stderr


def test_show_reports_stages_microbatches_and_bubble():
    from equipax.launch.experiments.registry import get_experiment
    from equipax.launch.tasks import derived_numbers

    n = derived_numbers(get_experiment("c4_gpt3_xl_pipeline"))
    assert n["devices_required"] == 64 and n["mesh_shape"] == [4, 1, 4, 4]
    assert (n["pipeline_stages"], n["pipeline_microbatches"], n["pipeline_microbatch_size"]) == (4, 32, 16)
    assert n["pipeline_bubble_fraction"] == pytest.approx(3 / 35, abs=1e-4)
    assert n["global_batch"] == 512
    assert n["params_per_stage"] == 6 * n["params_per_layer"]


@pytest.mark.slow
def test_compile_reports_one_stages_share_and_the_pipeline(tmp_path):
    """`launch compile` of the pipelined smoke (8 simulated devices): the report's pipeline section
    holds `launch show`'s numbers, and its per-device bytes are one stage's share of the state."""
    from equipax.launch.experiments.registry import get_experiment
    from equipax.launch.tasks import derived_numbers

    proc = subprocess.run(
        [sys.executable, "-m", "equipax.launch.cli", "compile", "--exp", "c4_gpt3_xl_pipeline_smoke",
         "--job-log-dir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "compile.json").read_text())
    p, params = report["pipeline"], report["params"]
    n = derived_numbers(get_experiment("c4_gpt3_xl_pipeline_smoke"))
    assert (p["stages"], p["repeats"], p["schedule"], p["microbatches"], p["microbatch_size"]) == (2, 1, "gpipe", 4, 4)
    assert p["bubble_fraction"] == n["pipeline_bubble_fraction"] == pytest.approx(1 / 5)
    assert p["params_per_stage"] == n["params_per_stage"] and p["stage_state_bytes_per_device"] > 0
    # The stages hold the layers; with the embedding (and final norm) that is the whole model.
    assert p["params_per_stage"] * p["stages"] + params["embedding"] == pytest.approx(params["total"], rel=1e-3)
    # A device holds one stage's layers + the embedding, split over fsdp x tensor = 4: f32 params
    # and Adam's two moments (the layer norms are replicated, hence the tolerance).
    stage_share = 4 * (p["params_per_stage"] + params["embedding"]) / 4
    assert params["per_device_param_bytes"] == pytest.approx(stage_share, rel=0.05)
    assert params["per_device_param_bytes"] < 0.7 * 4 * params["total"] / 4  # not the whole model's share
    assert params["per_device_param_bytes"] + params["per_device_optimizer_bytes"] == pytest.approx(
        p["stage_state_bytes_per_device"], rel=0.05)
    assert "per device    params 0.00 GiB, optimizer state 0.00 GiB, one stage's share" in proc.stdout
    assert ("pipeline      2 stages x 1 repeat (gpipe), 4 microbatches of 4 examples, bubble 20.0% = "
            "(S - 1) / (R x M + S - 1)") in proc.stdout
    assert f"{n['params_per_stage']:,} params per stage; one stage's state per device" in proc.stdout


def test_unpipelined_report_has_no_pipeline_section():
    from equipax.launch.aot.pipeline import pipeline_section
    from equipax.launch.experiments.registry import get_experiment
    from equipax.launch.tasks import derived_numbers

    assert pipeline_section(derived_numbers(get_experiment("c4_1b"))) is None
    section = pipeline_section(derived_numbers(get_experiment("c4_gpt3_xl_pipeline")))
    assert section is not None and (section["stages"], section["microbatches"]) == (4, 32)


@pytest.mark.slow
def test_pipelined_smoke_resumes_bit_for_bit(tmp_path):
    """The pipelined smoke, 4 steps straight vs 2 + 2 through a checkpoint: identical state."""
    def run(job, steps):
        proc = subprocess.run(
            [sys.executable, "-m", "equipax.launch.cli", "run", "--exp", "c4_gpt3_xl_pipeline_smoke",
             "--cpu-devices", "8", "--job-log-dir", str(job), "--set", f"train.num_steps={steps}",
             "--set", "train.checkpoint_every=2", "--set", "train.log_every=1", "--set", "train.eval_every=2",
             "--set", "model.transformer.num_layers=2"],
            capture_output=True, text=True, timeout=600, env=compile_cache_env(tmp_path / "jax-cache"))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc.stdout

    run(tmp_path / "full", 4)
    run(tmp_path / "split", 2)
    assert "Resumed from step 2" in run(tmp_path / "split", 4)
    a = json.loads((tmp_path / "full" / "result.json").read_text())
    b = json.loads((tmp_path / "split" / "result.json").read_text())
    assert a["state_digest"] == b["state_digest"]
    assert a["final_train_loss"] == b["final_train_loss"]


@pytest.mark.slow
def test_bubble_benchmark_tiny(tmp_path):
    """benchmarks/pipeline_bubble.py runs (2 stages, circular, 2 and 4 microbatches, tiny model)
    and writes its table's rows; timings themselves are not tested."""
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "pipeline_bubble.py"
    out = tmp_path / "bubble.json"
    proc = subprocess.run(
        [sys.executable, str(script), "--stages", "2", "--schedules", "circular", "--microbatches", "2,4",
         "--model-dims", "32", "--seq", "16", "--steps", "2", "--rounds", "2", "--warmup", "0", "--out", str(out)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["schedule"], r["repeats"], r["microbatches"], r["iterations"]) for r in rows] == [
        ("circular", 2, 2, 5), ("circular", 2, 4, 9)]
    assert [r["bubble_fraction"] for r in rows] == pytest.approx([1 / 5, 1 / 9])
    assert rows[0]["predicted_vs_most_microbatches"] == pytest.approx(10 / 9)
    assert rows[1]["measured_vs_most_microbatches"] == 1.0
    assert all(len(r["steps_s"]) == 4 and r["step_q1_s"] <= r["step_s"] <= r["step_q3_s"] for r in rows)
    assert "circular R=2" in proc.stdout
