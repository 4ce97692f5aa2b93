"""The Pax LM experiments: every registered experiment resolves and shows without devices; the
Pax configs carry the knobs of Pax's own experiment classes (as docs/experiments.md lists them);
each `_smoke` variant keeps its parent's mesh axes."""

import json
import math

import pytest

from helpers import REPO

PAX = ["lm_cloud_2b", "lm_cloud_transformer", "c4_1b", "c4_16b", "c4_22b_1x", "c4_22b_2x"]


def names():
    from equipax.launch.experiments.registry import entries

    return [e.name for e in entries()]


def get(name):
    from equipax.launch.experiments.registry import get_experiment

    return get_experiment(name)


def show_json(name):
    from typer.testing import CliRunner

    from equipax.launch.cli import app

    result = CliRunner().invoke(app, ["show", "--exp", name, "--format", "json"])
    assert result.exit_code == 0, f"{name}: {result.output}\n{result.exception!r}"
    return json.loads(result.stdout)


def test_all_pax_experiments_and_smokes_are_registered():
    registered = set(names())
    for name in PAX:
        assert name in registered and f"{name}_smoke" in registered, name


@pytest.mark.parametrize("name", names())
def test_every_experiment_resolves_and_shows_json(name):
    data = show_json(name)
    assert data["config"]["name"] == name
    if "params_total" in data["derived"]:
        assert data["derived"]["params_total"] > 0


# The Pax experiment classes' knobs (docs/experiments.md, "Registered experiments"): (layers, d, ff,
# heads, head_dim, per-core batch, seq, vocab, ici, dcn, dtype, scanned).
TABLE = {
    "lm_cloud_2b": (18, 3072, 4 * 3072, 24, 128, 8, 1024, 32000, (1, 4, 1), (1, 1, 1), "bfloat16", True),
    "lm_cloud_transformer": (10, 1024, 4 * 1024, 16, 64, 16, 1024, 32000, (4, 1, 1), (1, 1, 1), "float32", False),
    "c4_1b": (13, 2560, 4 * 2560, 20, 128, 32, 1024, 32000, (1, 4, 1), (1, 1, 1), "bfloat16", True),
    "c4_16b": (36, 6144, 4 * 6144, 48, 128, 16, 1024, 32000, (1, 16, 2), (1, 1, 1), "bfloat16", True),
    "c4_22b_1x": (48, 6144, 24576, 24, 256, 16, 1024, 32768, (1, 64, 1), (1, 1, 1), "bfloat16", True),
    "c4_22b_2x": (48, 6144, 24576, 24, 256, 16, 1024, 32768, (1, 64, 1), (2, 1, 1), "bfloat16", True),
}


@pytest.mark.parametrize("name", PAX)
def test_pax_configs_match_the_spec_table(name):
    from equipax.launch.aot.remat import own_policy

    layers, d, ff, heads, head_dim, per_core, seq, vocab, ici, dcn, dtype, scanned = TABLE[name]
    cfg = get(name)
    t = cfg.model.transformer
    assert (t.num_layers, t.model_dims, t.hidden_dims, t.num_heads, t.head_dim) == (layers, d, ff, heads, head_dim)
    assert heads * head_dim == d
    assert cfg.data.per_device_batch == per_core
    assert cfg.data.seq_len == cfg.model.max_seq_len == seq
    assert cfg.model.vocab_size == vocab
    assert (tuple(cfg.mesh.ici_mesh_shape), tuple(cfg.mesh.dcn_mesh_shape)) == (ici, dcn)
    assert cfg.model.dtype == dtype
    assert t.scan_layers is scanned
    # Pax's repeated layers use CHECKPOINT_POLICY=SAVE_NOTHING: full rematerialisation; c4_1b
    # chooses by compiling, never projected slower than that (its own policy, by the same table).
    assert t.remat == ("auto" if name == "c4_1b" else "full" if scanned else "none")
    assert own_policy(cfg) == ("full" if scanned else "none")
    assert cfg.train.sample.tokens == 0
    # The data each Pax class names: synthetic for lm_cloud_*, packed C4 from a local directory.
    if name.startswith("c4_"):
        assert (cfg.data.source, cfg.data.packing, cfg.data.reset_for_eval) == ("c4", True, True)
        assert cfg.data.path
    else:
        assert (cfg.data.source, cfg.data.packing) == ("synthetic", False)
    # Derived numbers follow the mesh: global batch = per-core batch x devices.
    devices = math.prod(i * j for i, j in zip(ici, dcn))
    derived = show_json(name)["derived"]
    assert derived["devices_required"] == devices
    assert derived["global_batch"] == per_core * devices
    assert derived["tokens_per_step"] == per_core * devices * seq


def test_lm_cloud_specifics():
    two_b = get("lm_cloud_2b")
    assert (two_b.data.source, two_b.train.num_steps, two_b.model.transformer.activation) == ("synthetic", 300, "gelu")
    assert two_b.learner.schedule.peak_learning_rate == 2.5e-4  # LmCloudSpmd's LEARNING_RATE
    dp = get("lm_cloud_transformer")
    t = dp.model.transformer
    assert (dp.data.source, dp.train.num_steps, t.activation, dp.model.dtype) == ("synthetic", 2000, "relu", "float32")
    assert dp.model.output_logit_cap is None  # TransformerLmPmapAdam sets no softmax cap
    # Pure data parallel (Pax's pmap): only the `data` axis is > 1, params are replicated.
    assert dp.mesh.axis_size("fsdp", "tensor") == 1 and dp.mesh.axis_size("data") == dp.mesh.num_devices > 1


def test_c4_22b_2x_numbers_and_optimizer():
    cfg = get("c4_22b_2x")
    derived = show_json("c4_22b_2x")["derived"]
    assert derived["params_total"] == pytest.approx(21.9e9, rel=0.01)
    assert derived["global_batch"] == 2048
    assert derived["tokens_per_step"] == 2_097_152
    assert derived["devices_required"] == 128
    assert cfg.train.log_every == 10  # SUMMARY_INTERVAL_STEPS
    # Pax's 22B optimiser.
    lr = cfg.learner
    assert lr.kind == "pax_adam"
    assert (lr.b1, lr.b2, lr.eps, lr.weight_decay) == (0.9, 0.99, 1e-6, 1e-3)
    assert (lr.clip_gradient_norm, lr.clip_update_rms) == (5.0, 1.0)
    s = lr.schedule
    assert s.kind == "linear_rampup_exponential_decay"
    assert (s.peak_learning_rate, s.warmup_steps, s.decay_steps, s.final_fraction) == (1e-3, 4000, 300_000, 0.1)
    # Model defaults: pre-LayerNorm, GELU, no biases, sinusoidal positions, caps 50 / 30.
    t = cfg.model.transformer
    assert (t.norm, t.activation, t.gated, t.use_bias) == ("layernorm", "gelu", False, False)
    assert (t.atten_logit_cap, cfg.model.output_logit_cap, cfg.model.position) == (50.0, 30.0, "sinusoidal")
    # One slice: the same model, half the devices and batch.
    one = get("c4_22b_1x")
    assert one.model == cfg.model and one.learner == cfg.learner
    assert show_json("c4_22b_1x")["derived"]["global_batch"] == 1024


def _pattern(shape):
    return tuple(s > 1 for s in shape)


@pytest.mark.parametrize("name", PAX)
def test_smoke_keeps_code_path_and_mesh_axes(name):
    full, smoke = get(name), get(f"{name}_smoke")
    assert _pattern(smoke.mesh.ici_mesh_shape) == _pattern(full.mesh.ici_mesh_shape)
    assert _pattern(smoke.mesh.dcn_mesh_shape) == _pattern(full.mesh.dcn_mesh_shape)
    assert smoke.mesh.num_devices <= 8
    ft, st = full.model.transformer, smoke.model.transformer
    for knob in ("activation", "gated", "norm", "use_bias", "atten_logit_cap", "scan_layers", "remat", "attention"):
        # remat "auto" is chosen on the full experiment's own hardware; its smoke keeps Pax's
        # policy (on a CPU, "auto" would compile every candidate to pick "none").
        want = "full" if (knob, getattr(ft, knob)) == ("remat", "auto") else getattr(ft, knob)
        assert getattr(st, knob) == want, knob
    assert smoke.model.output_logit_cap == full.model.output_logit_cap
    assert smoke.model.position == full.model.position
    assert smoke.learner.kind == full.learner.kind
    assert smoke.learner.schedule.kind == full.learner.schedule.kind
    for knob in ("b1", "b2", "eps", "weight_decay", "clip_gradient_norm", "clip_update_rms"):
        assert getattr(smoke.learner, knob) == getattr(full.learner, knob), knob
    # Small enough for seconds on a CPU.
    assert smoke.data.source == "synthetic"
    assert st.num_layers <= 2 and st.model_dims <= 64 and smoke.data.seq_len <= 64
    assert smoke.model.vocab_size == 384 and smoke.train.num_steps <= 10
    assert smoke.global_batch_size % smoke.mesh.batch_parallelism == 0
    assert st.num_heads % smoke.mesh.axis_size("tensor") == 0


def test_docs_list_every_registered_experiment():

    from equipax.launch.experiments.registry import entries

    text = (REPO / "docs" / "experiments.md").read_text()
    missing = [
        e.name for e in entries() if e.path.startswith("equipax.launch.experiments.") and f"| `{e.name}` |" not in text
    ]
    assert not missing, f"add these to the table in docs/experiments.md: {missing}"


# The Pax README's `--exp=` paths (docs/coming_from_pax.md) and the experiment each must be.
PAX_README = {
    "tasks.lm.params.lm_cloud.LmCloudSpmd2BLimitSteps": "lm_cloud_2b",
    "tasks.lm.params.lm_cloud.LmCloudTransformerAdamLimitSteps": "lm_cloud_transformer",
    "tasks.lm.params.c4.C4Spmd1BAdam4Replicas": "c4_1b",
    "tasks.lm.params.c4.C4Spmd16BAdam32Replicas": "c4_16b",
    "tasks.lm.params.c4.C4SpmdPipelineGpt3SmallAdam64Replicas": "c4_gpt3_xl_pipeline",
    "tasks.lm.params.c4_multislice.C4Spmd22BAdam1xv4_128": "c4_22b_1x",
    "tasks.lm.params.c4_multislice.C4Spmd22BAdam2xv4_128": "c4_22b_2x",
}


@pytest.mark.parametrize("path", list(PAX_README))
def test_pax_class_paths_resolve_to_their_experiment(path):
    """The whole path, `paxml.` + it, the module tail and the bare class all name the experiment;
    its description names the same Pax class (the alias sits on the right function)."""
    from equipax.launch.experiments.registry import lookup

    cls = path.rsplit(".", 1)[-1]
    for name in (path, f"paxml.{path}", ".".join(path.split(".")[-2:]), cls):
        assert lookup(name).name == PAX_README[path], name
    assert f"Pax {cls}:" in get(PAX_README[path]).description
    for name in (f"{path}_smoke", f"paxml.{path}_smoke", f"{cls}_smoke"):  # its smoke twin
        assert lookup(name).name == PAX_README[path] + "_smoke", name
    assert path in lookup(cls).aliases


def test_an_unknown_pax_class_suggests_the_close_ones_and_an_alias_cannot_be_given_twice():
    from equipax.core.knobs import ConfigError
    from equipax.launch.experiments.registry import also_known_as, lookup

    with pytest.raises(ConfigError, match=r"Did you mean 'C4Spmd1BAdam4Replicas' \(= c4_1b\)"):
        lookup("tasks.lm.params.c4.C4Spmd1BAdam8Replicas")

    def c4_1b_copy():
        raise AssertionError("never called")

    with pytest.raises(ValueError, match="given twice"):
        also_known_as("tasks.lm.params.c4.C4Spmd1BAdam4Replicas")(c4_1b_copy)


def test_pax_spellings_on_the_command_line(tmp_path, monkeypatch):
    """`--job_log_dir=X` / `--job_log_dir X` are `--job-log-dir`; a `gs://` job directory whose store
    does not answer is exit 2 naming the variable to set (never a local directory named `gs:`;
    tests/launch/test_object_storage.py runs one against an emulator); `launch list` and `launch
    show` name the Pax paths."""
    from typer.testing import CliRunner

    from equipax.launch.cli import app

    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    for args in (["--job_log_dir=missing"], ["--job_log_dir", "missing"]):
        result = runner.invoke(app, ["eval", *args])
        assert result.exit_code == 2 and "--job-log-dir missing does not exist" in result.output, result.output
    from helpers.object_stores import free_port

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    result = runner.invoke(app, ["run", "--exp=C4Spmd1BAdam4Replicas", "--job_log_dir=gs://bucket/job"])
    assert result.exit_code == 2 and "does not answer" in result.output, result.output
    assert "STORAGE_EMULATOR_HOST" in result.output, result.output
    assert not any(tmp_path.iterdir())
    listing = runner.invoke(app, ["list"]).output
    rows = {tuple(line.split()) for line in listing.splitlines()}
    assert all((path, "=", name) in rows for path, name in PAX_README.items()), listing
    shown = runner.invoke(app, ["show", "--exp=C4Spmd22BAdam2xv4_128", "--format", "json"])
    assert json.loads(shown.output)["aliases"] == ["tasks.lm.params.c4_multislice.C4Spmd22BAdam2xv4_128"]
