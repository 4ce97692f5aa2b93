"""The LM families as configurations of one stack: the published parameter counts (analytic, traced
and printed by `launch show`), every family's `_smoke` training on its 8-device mesh, resume ==
uninterrupted per family, the renamed Llama knobs and the config-time errors (exit 2 naming the
knob). The numerics of the options (RoPE scaling, QK-norm, windows, kernels) are checked in
tests/core; decoding in tests/models/test_decode.py; the pipelined Llama block in
tests/models/test_pipeline.py."""

import json
import shutil

import pytest

from helpers.cli import assert_one_paragraph, invoke
from helpers.multidevice import FAST_COMPILE, run_with_devices
from helpers.toy import persistent_compile_cache, set_args

# Totals from the published model configurations; the model cards give them rounded (Llama 3.2:
# 1.24B, 3.21B; Qwen3: 0.6B with 0.44B non-embedding, 8.2B with 6.95B non-embedding; Mistral 7B:
# 7.24B; Llama 3 / 3.1 8B: 8.03B; Llama 2 7B: 6.74B).
PUBLISHED = {
    "llama2_7b": 6_738_415_616,
    "llama3_8b": 8_030_261_248,
    "llama3_1_8b": 8_030_261_248,
    "llama3_2_1b": 1_235_814_400,
    "llama3_2_3b": 3_212_749_824,
    "qwen3_0_6b": 596_049_920,
    "qwen3_8b": 8_190_735_360,
    "mistral_7b": 7_241_732_096,
}
NON_EMBEDDING = {"qwen3_0_6b": 0.44e9, "qwen3_8b": 6.95e9}
SMOKES = [
    "llama3_1_8b_smoke",
    "llama3_2_1b_smoke",
    "llama3_2_3b_smoke",
    "qwen3_0_6b_smoke",  # (qwen3_8b_smoke: the same block and QK-norm, untied as llama3_1_8b's)
    "mistral_7b_smoke",
    "llama3_8b_pipeline_smoke",
    "qwen3_30b_a3b_smoke",
]


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_parameter_counts_analytic_and_traced(name):
    import equinox as eqx
    import jax

    from equipax.core.flops import count_params
    from equipax.launch.experiments.registry import get_experiment
    from equipax.launch.tasks import family

    cfg = get_experiment(name)
    counts = cfg.model.param_counts()
    assert counts["total"] == PUBLISHED[name]
    model, _ = eqx.filter_eval_shape(family(cfg).make_task(cfg, None).init, jax.random.key(0))
    assert count_params(model) == PUBLISHED[name]
    if name in NON_EMBEDDING:
        assert round((counts["total"] - counts["embedding"]) / 1e7) == round(NON_EMBEDDING[name] / 1e7)


def test_launch_show_prints_each_familys_count():
    for name in ("qwen3_8b", "mistral_7b", "llama3_2_1b"):
        code, out = invoke("show", "--exp", name, "--format", "json")
        assert code == 0, out
        assert json.loads(out)["derived"]["params_total"] == PUBLISHED[name]


@pytest.mark.slow
def test_every_family_smoke_trains_on_its_8_device_mesh():
    """Each new family's `_smoke` (Llama 3.1 RoPE scaling, Llama 3.2 tied embeddings, Qwen3 QK-norm,
    Mistral's window, the pipelined Llama, Qwen3-MoE's dropless experts over an `expert` axis) builds
    its training program on its own mesh and takes 3 steps that change the parameters with finite
    losses."""
    out = run_with_devices(
        f"""
    import json
    import jax, numpy as np
    import equinox as eqx
    from equipax.core.mesh import build_mesh
    from equipax.launch.experiments.registry import get_experiment
    from equipax.launch.program.training import build_training

    report, seen = {{}}, {{}}
    for name in {SMOKES!r}:
        cfg = get_experiment(name)
        same = seen.setdefault(repr((cfg.model, cfg.mesh, cfg.learner)), name)
        if same != name:  # e.g. Llama 3.2 1B and 3B shrink to the same toy model
            report[name] = report[same]
            continue
        training = build_training(cfg, build_mesh(cfg.mesh))
        state = training.init_state()
        before = jax.tree.leaves(jax.device_get(eqx.filter(state.model, eqx.is_inexact_array)))
        rng = np.random.default_rng(0)
        losses = []
        for step in range(3):
            tokens = rng.integers(0, cfg.model.vocab_size, (cfg.global_batch_size, cfg.data.seq_len + 1), np.int32)
            batch = training.place({{"ids": tokens[:, :-1], "labels": tokens[:, 1:],
                                    "weights": np.ones(tokens[:, 1:].shape, np.float32)}})
            state, metrics = training.train_step(state, batch, training.keys.step)
            losses.append(float(metrics["loss"]))
        after = jax.tree.leaves(jax.device_get(eqx.filter(state.model, eqx.is_inexact_array)))
        changed = max(float(np.max(np.abs(a - b))) for a, b in zip(after, before))
        report[name] = {{"losses": losses, "changed": changed, "devices": training.mesh.size}}
    print(json.dumps(report))
    """,
        timeout=900,
        xla_flags=FAST_COMPILE,
    )
    report = json.loads(out.strip().splitlines()[-1])
    for name in SMOKES:
        r = report[name]
        assert r["devices"] == 8, (name, r)
        assert all(abs(x) < 20 for x in r["losses"]), (name, r)
        assert r["changed"] > 0, (name, r)


# One device, in-process: the families' code paths without their 8-device meshes.
ONE_DEVICE = [
    "mesh.ici_mesh_shape=(1, 1, 1)",
    "data.per_device_batch=4",
    "train.log_every=1",
    "train.eval_every=2",
    "train.checkpoint_every=2",
]


@pytest.mark.slow
# Llama's block for the dense families (Qwen3's qk-norm and Mistral's sliding window add no state
# to a checkpoint: their resume is Llama's), and the mixture of experts with its routing state.
@pytest.mark.parametrize("name", ["llama3_1_8b_smoke", "mixtral_8x7b_smoke"])
def test_each_family_resumes_to_the_uninterrupted_runs_bits(name, tmp_path):
    # The MoE smoke's mesh has an expert axis (data, fsdp, expert, tensor): one device on all four;
    # with auxiliary-loss-free balancing, whose routing biases and last load resume too.
    moe = ["mesh.ici_mesh_shape=(1, 1, 1, 1)", "model.transformer.router_bias_update_rate=0.001"]
    one_device = [*ONE_DEVICE, *moe] if name.startswith("mixtral") else ONE_DEVICE

    def run(job, steps):
        code, out = invoke(
            "run", "--exp", name, "--job-log-dir", tmp_path / job, *set_args([*one_device, f"train.num_steps={steps}"])
        )
        assert code == 0, out
        return out

    with persistent_compile_cache(tmp_path / "jax-cache"):
        run("full", 4)
        # Stopped after step 2: the uninterrupted job as a run killed right after its checkpoint of
        # step 2 left it (its checkpoint of step 4 and result.json gone; the records of steps 3-4 stay,
        # and the resumed run drops them). The checkpoint a `train.num_steps=2` run writes (nothing
        # saved depends on num_steps), without that run.
        shutil.copytree(tmp_path / "full", tmp_path / "split")
        shutil.rmtree(tmp_path / "split" / "checkpoints" / "4")
        (tmp_path / "split" / "result.json").unlink()
        assert "Resumed from step 2" in run("split", 4)
    a = json.loads((tmp_path / "full" / "result.json").read_text())
    b = json.loads((tmp_path / "split" / "result.json").read_text())
    assert a["state_digest"] == b["state_digest"]  # parameters and optimizer state, bit for bit
    assert a["final_train_loss"] == b["final_train_loss"]


def test_old_llama_knob_paths_name_their_new_place():
    code, out = invoke("show", "--exp", "llama3_8b", "--set", "model.num_layers=2")
    assert code == 2
    assert_one_paragraph(out, "'model.num_layers': it moved. Did you mean 'model.transformer.num_layers'?")
    # A saved config in the old layout (a job's config.json) is refused, not read as another model.
    from equipax.core.knobs import ConfigError, from_dict
    from equipax.launch.configs.experiment import ExperimentConfig

    with pytest.raises(ConfigError, match=r"earlier equipax whose Llama model .* model.norm_eps.* retrain"):
        from_dict(ExperimentConfig, {"name": "old", "model": {"vocab_size": 64, "norm_eps": 1e-5, "num_layers": 2}})


@pytest.mark.parametrize(
    "exp,knobs,needles",
    [
        (
            "llama3_8b",
            ["model.transformer.num_kv_heads=5"],
            ["model.transformer.num_kv_heads=5", "[1, 2, 4, 8, 16, 32]"],
        ),
        ("llama3_8b", ["model.transformer.head_dim=127"], ["head_dim=127 is odd", "model.position='rope'"]),
        ("llama3_1_8b", ["model.rope_scaling.factor=0.5"], ["model.rope_scaling.factor", ">= 1"]),
        ("llama3_1_8b", ["model.rope_scaling.high_freq_factor=0.5"], ["low_freq_factor < high_freq_factor"]),
        (
            "llama2_7b",
            ["model.position=sinusoidal", "model.rope_scaling={'factor': 8.0}"],
            ["model.rope_scaling", "model.position='rope'"],
        ),
        ("mistral_7b", ["model.transformer.sliding_window=0"], ["model.transformer.sliding_window", "positive int"]),
        ("mistral_7b", ["model.transformer.attention=linear"], ["sliding_window=4096", "softmax"]),
        ("llama3_8b", ["model.transformer.fused_qkv=True"], ["fused_qkv=True", "fused_qkv=False"]),
        (
            "llama3_8b",
            ["model.transformer.attention_impl=cudnn", "model.transformer.atten_logit_cap=50"],
            ["attention_impl='cudnn' has no tanh logit cap", "atten_logit_cap=None"],
        ),
    ],
)
def test_family_options_that_do_not_fit_exit_2_naming_the_knob(exp, knobs, needles):
    code, out = invoke("show", "--exp", exp, *set_args(knobs))
    assert code == 2, out
    assert_one_paragraph(out, *needles)
