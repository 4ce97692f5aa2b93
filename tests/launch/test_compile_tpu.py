"""`launch compile --topology`: the exact train step compiled by XLA:TPU (libtpu) for a real TPU slice.

libtpu is in the default environment (the `aot` dependency group), so these run in the normal
suite on any Linux x86_64 host; no TPU is needed.
"""

import json
import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner


def launch(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "equipax.launch.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def invoke(*args):
    from equipax.launch.cli import app

    return CliRunner().invoke(app, list(args))


# Each command through the CLI (CliRunner: exit code, stdout, stderr), in turn, in one process.
_COMMANDS = """
import json, sys, traceback
from typer.testing import CliRunner
from equipax.launch.cli import app

results = {}
for name, args in json.loads(sys.argv[1]).items():
    r = CliRunner().invoke(app, args)
    stderr = r.stderr
    if r.exc_info is not None and not isinstance(r.exception, SystemExit):  # a crash: its traceback
        stderr += "".join(traceback.format_exception(*r.exc_info))
    results[name] = {"returncode": r.exit_code, "stdout": r.stdout, "stderr": stderr}
if len(sys.argv) > 2:  # then Python code of the test's own, which sets `results["after"]`
    exec(sys.argv[2])
print(json.dumps(results))
"""

# After the v4-16 compile: the programs `launch run` compiles for the same experiment and slice,
# compiled in this process again into the cache it wrote (every program written, as there).
# `launch run`'s own path: `build_training`, `Training.lower` and `compile_init`, `compile_cache`
# (feeds_batches=False: the infeed alone differs, and no host of the topology runs here). With
# remat "none", a program the compile did not write, as a control.
_RUN_PROGRAMS = """
import dataclasses
from pathlib import Path
import jax
from equipax.core.knobs import set_knob
from equipax.core.mesh import build_mesh
from equipax.launch.commands.common import resolve
from equipax.launch.hardware.tpu import lookup_slice, topology_devices
from equipax.launch.program.training import build_training
from equipax.launch.training.startup import compile_cache

cache, job = sys.argv[3], sys.argv[4]
entries = lambda: sorted(p.name for p in Path(cache).iterdir())
_, cfg, _ = resolve("c4_1b_smoke", [])
devices = topology_devices(lookup_slice("v4-16"))
cfg = dataclasses.replace(cfg, mesh=cfg.mesh.fit(len(devices)))
mesh = build_mesh(cfg.mesh, devices)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
with compile_cache(cache, Path(job), reads=False):
    before = entries()
    training = build_training(cfg, mesh, feeds_batches=False)
    training.lower().compile()
    training.compile_init()
    same = entries()
    build_training(set_knob(cfg, "model.transformer.remat", "none"), mesh, feeds_batches=False).lower().compile()
results["after"] = {"before": before, "same": same, "control": entries()}
"""


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """The v4-16 compile and the refused c4_16b compile, in that order, in one fresh process (one
    Python, JAX, equipax and libtpu start-up, not two): {name: (job directory, the command's exit
    code, stdout and stderr)}. libtpu loads in the first; what it writes to the process's own stderr
    (file descriptor 2, not the command's) is the v4-16 command's too."""
    jobs = {name: tmp_path_factory.mktemp(name) for name in ("v4_16", "refused", "cache")}
    cache = jobs["cache"] / "xla"
    commands = {
        "v4_16": [
            *("compile", "--exp", "c4_1b_smoke", "--topology", "v4-16", "--job-log-dir", str(jobs["v4_16"])),
            *("--set", f"train.compiler.cache_dir={cache}"),
        ],
        # Twice c4_16b's per-device batch: XLA:TPU refuses the program (temporaries > 30.75 GiB of
        # HBM) within seconds, before the full compile.
        "refused": [
            *("compile", "--exp", "c4_16b", "--topology", "v4-64", "--set", "data.per_device_batch=32"),
            *("--job-log-dir", str(jobs["refused"]), "--strict"),
        ],
    }
    proc = subprocess.run(
        [sys.executable, "-c", _COMMANDS, json.dumps(commands), _RUN_PROGRAMS, str(cache), str(jobs["cache"])],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(proc.stdout.splitlines()[-1])
    out = {}
    for name, args in commands.items():
        r = results[name]
        stderr = r["stderr"] + (proc.stderr if name == "v4_16" else "")
        out[name] = (jobs[name], subprocess.CompletedProcess(args, r["returncode"], r["stdout"], stderr))
    out["cache"] = (cache, results["after"])
    return out


def test_small_experiment_compiles_for_a_v4_slice_with_xla_tpu(fresh):
    tmp_path, proc = fresh["v4_16"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "compile.json").read_text())
    assert report["compile"]["backend"] == "tpu" and report["compile"]["device_kind"] == "TPU v4"
    assert report["topology"] == {
        "slice": "v4-16",
        "topology": "v4:2x2x2",
        "chip_config": "megacore",
        "num_slices": 1,
        "chips_per_slice": 8,
    }
    assert report["target"]["name"] == "tpu-v4" and report["memory_per_device"]["budget_gib"] == 32
    m = report["memory_per_device"]
    # The state is FSDP-sharded over 8 chips and donated: arguments alias outputs.
    assert m["argument_bytes"] >= report["params"]["per_device_param_bytes"] > 0
    assert 0 < m["alias_bytes"] <= m["argument_bytes"]
    assert m["generated_code_bytes"] > 0 and m["peak_bytes"] > 0
    assert m["total_bytes"] == (
        m["argument_bytes"] + m["output_bytes"] - m["alias_bytes"] + m["temp_bytes"] + m["generated_code_bytes"]
    )
    assert m["fits"] and "XLA:TPU" in m["note"]
    assert report["collectives"]["all-gather"] > 0  # FSDP gathers the weights
    # attention_impl='auto', resolved for the TPU: xla, as splash needs a sequence of 128 x k.
    assert report["attention"] == {
        "knob": "model.transformer.attention_impl",
        "value": "auto",
        "kernel": "xla",
        "platform": "tpu",
        "seq_len": 32,
        "dtype": "float32",
    }
    assert "attention     auto -> xla (tpu, seq 32)" in proc.stdout
    assert "2 x v4-16" not in proc.stdout and "1 x v4-16 (v4:2x2x2, TPU v4)" in proc.stdout
    assert "all-gather" in proc.stdout and "TPU heap peak" in proc.stdout
    # libtpu's warnings about missing TPU VM metadata are silenced.
    assert "TPU_ACCELERATOR_TYPE" not in proc.stderr and "TPU_WORKER_HOSTNAMES" not in proc.stderr


def test_the_compiled_programs_are_in_the_cache_a_run_loads_them_from(fresh):
    # `launch compile --topology` writes the train step and the initialisation into the cache that
    # train.compiler.cache_dir names; `launch run`'s programs for that experiment and slice are
    # found under the same keys (compiled again, they add no entry), another program is not.
    job, proc = fresh["v4_16"]
    cache, after = fresh["cache"]
    report = json.loads((job / "compile.json").read_text())
    assert report["compile"]["init_s"] > 0
    programs = {name.split("-")[0] for name in after["before"] if name.endswith("-cache")}
    assert {"jit_train_step", "jit_make"} <= programs  # the step, and `Training.compile_init`'s `make`
    assert report["cache"] == {"dir": str(cache), "programs_written": len(programs)}
    assert f"{len(programs)} programs written to {cache}" in proc.stdout
    assert after["same"] == after["before"]
    added = [name.split("-")[0] for name in set(after["control"]) - set(after["before"]) if name.endswith("-cache")]
    assert added == ["jit_train_step"]  # remat "none": a step of its own
    assert "could not read" not in proc.stderr  # the compile-only client's refusal to load is expected


def test_a_run_on_the_slice_finds_the_remat_choice_launch_compile_made(tmp_path, monkeypatch):
    # remat="auto" chosen by `launch compile --topology v5e-1`; then `launch run`'s own choosing on
    # that slice (its device, the v5e's allocator limit, the roofline of its device kind) finds the
    # choice in the machine's cache and compiles nothing.
    import contextlib
    import dataclasses

    from equipax.core.mesh import build_mesh
    from equipax.launch.commands.common import resolve
    from equipax.launch.hardware.accelerators import ACCELERATORS
    from equipax.launch.hardware.tpu import lookup_slice, topology_devices
    from equipax.launch.training import loop

    monkeypatch.setenv("EQUIPAX_CACHE_DIR", str(tmp_path / "machine"))
    sets = ["model.transformer.remat=auto", "mesh.ici_mesh_shape=(1,-1,1)", "train.compiler.cache_dir="]
    args = [arg for knob in sets for arg in ("--set", knob)]
    result = invoke("compile", "--exp", "c4_1b_smoke", "--topology", "v5e-1", *args, "--job-log-dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "compile.json").read_text())
    assert report["memory_per_device"]["budget_gib"] == ACCELERATORS["tpu-v5e"].allocatable_gib < 16
    assert report["remat"]["cached"] is None  # searched

    allocator_limit = 16_909_336_064 - 2**20  # another v5e's bytes_limit: the key holds the budget to 16 MiB
    monkeypatch.setattr(loop, "local_device_memory_gib", lambda: allocator_limit / 2**30)
    _, cfg, _ = resolve("c4_1b_smoke", sets)
    devices = topology_devices(lookup_slice("v5e-1"))
    cfg = dataclasses.replace(cfg, mesh=cfg.mesh.fit(len(devices)))
    logged = []
    with contextlib.ExitStack() as cleanup:
        chosen, _, compiled = loop._choose_remat(
            cfg, build_mesh(cfg.mesh, devices), tmp_path / "run", {}, logged.append, cleanup
        )
    assert compiled is None and "cached in the machine's cache" in logged[0]
    assert chosen.model.transformer.remat == report["remat"]["policy"]


def test_multislice_mesh_spans_the_slices(tmp_path):
    # c4_22b_2x_smoke: data 2 across slices (DCN) x fsdp 4 within a v4-8 slice; --slices defaults to 2.
    result = invoke("compile", "--exp", "c4_22b_2x_smoke", "--topology", "v4-8", "--job-log-dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "compile.json").read_text())
    assert report["devices"] == 8 and report["mesh"] == {"data": 2, "fsdp": 4, "tensor": 1}
    assert report["topology"]["num_slices"] == 2 and report["compile"]["backend"] == "tpu"
    # Gradients are summed over the data axis, which runs across the two slices.
    assert report["collectives"]["all-reduce"] > 0
    assert "2 x v4-8 (v4:2x2x1, TPU v4)" in result.output


def test_xla_tpu_refusing_the_program_is_does_not_fit(fresh):
    # The compiler's refusal is the report's answer, and --strict exits 3.
    tmp_path, proc = fresh["refused"]
    assert proc.returncode == 3, proc.stdout + proc.stderr
    m = json.loads((tmp_path / "compile.json").read_text())["memory_per_device"]
    assert not m["fits"] and "RESOURCE_EXHAUSTED" in m["compiler_refused"]
    assert m["temp_bytes"] > m["available_bytes"] > 30 * 2**30
    assert "DOES NOT FIT" in proc.stdout and "the compiler refused the program" in proc.stdout


def test_misspelled_topology_lists_the_valid_ones():
    result = invoke("compile", "--exp", "c4_1b", "--topology", "v4-129")
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert "Unknown --topology 'v4-129'" in text
    for name in ("v4-8", "v4-128", "v5e-16", "v5p-64", "v6e-256"):
        assert name in text


def test_topology_of_the_wrong_size_is_a_user_error():
    # c4_1b_smoke's mesh is 8 devices; a v4-8 slice has 4 chips.
    result = invoke("compile", "--exp", "c4_1b_smoke", "--topology", "v4-8")
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert "needs 8 devices" in text and "1 x v4-8 has 4" in text


def test_target_must_match_the_topology():
    result = invoke("compile", "--exp", "c4_1b_smoke", "--topology", "v4-16", "--target", "tpu-v5e")
    assert result.exit_code == 2 and "does not match --topology v4-16" in " ".join(result.output.split())


@pytest.mark.parametrize(
    "name, topology, chip_config, chips, target",
    [
        ("v4-8", "v4:2x2x1", "megacore", 4, "tpu-v4"),
        ("v4-128", "v4:4x4x4", "megacore", 64, "tpu-v4"),
        ("v5p-256", "v5p:4x4x8", "megacore", 128, "tpu-v5p"),
        ("v5e-16", "v5e:4x4", "default", 16, "tpu-v5e"),
        ("v5litepod-256", "v5e:16x16", "default", 256, "tpu-v5e"),
        ("v6e-8", "v6e:2x4", "default", 8, "tpu-v6e"),
    ],
)
def test_slice_names_map_to_libtpu_topologies(name, topology, chip_config, chips, target):
    from equipax.launch.hardware.tpu import lookup_slice

    s = lookup_slice(name)
    assert (s.topology, s.chip_config, s.chips, s.target_name) == (topology, chip_config, chips, target)


def test_every_generation_gives_its_devices():
    from equipax.launch.hardware.tpu import TPU_SLICES, topology_devices

    for name, kind in (("v5e-4", "TPU v5 lite"), ("v6e-4", "TPU v6 lite"), ("v5p-8", "TPU v5")):
        devices = topology_devices(TPU_SLICES[name])
        assert len(devices) == TPU_SLICES[name].chips and devices[0].device_kind == kind


SPLASH = (
    "--set",
    "model.transformer.attention_impl=splash",
    "--set",
    "data.seq_len=128",
    "--set",
    "model.max_seq_len=128",
)


@pytest.mark.parametrize(
    "exp, topology, mesh",
    [
        ("c4_1b_smoke", "v5p-16", {"data": 1, "fsdp": 8, "tensor": 1}),
        ("c4_16b_smoke", "v4-16", {"data": 1, "fsdp": 4, "tensor": 2}),  # heads split over `tensor`
        # Grouped-query heads (4 over 1) and a sliding window of 8: splash's GQA and LocalMask.
        ("mistral_7b_smoke", "v5p-16", {"data": 1, "fsdp": 8, "tensor": 1}),
    ],
)
def test_splash_attention_lowers_and_compiles_for_a_tpu_slice(exp, topology, mesh, tmp_path):
    # In-process (as the multislice test): a child's Python, JAX and equipax start-up saved.
    result = invoke("compile", "--exp", exp, "--topology", topology, *SPLASH, "--job-log-dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "compile.json").read_text())
    assert report["mesh"] == mesh and report["compile"]["backend"] == "tpu"
    # The Pallas kernels (forward, and dq / dkv backward) are Mosaic custom calls in the program.
    assert report["custom_calls"].get("tpu_custom_call", 0) >= 3, report["custom_calls"]
    assert "tpu_custom_call" in result.output


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
@pytest.mark.slow
def test_splash_under_context_parallelism_compiles_for_a_tpu_slice(tmp_path, strategy):
    """attention_impl='splash' on a `context` axis of 2 (zigzag layout: each chip holds two chunks
    of 128 positions of 512): XLA:TPU compiles it, the kernels as Mosaic custom calls. All-gather:
    each chunk of queries over the gathered keys, per device (the `lax.switch` over the context
    index). Ring: each pair of query and key chunks as the blocks rotate (the `lax.switch` over
    the pair's mask), the keys and values moved by collective-permutes, not gathered. In-process,
    as the multislice test."""
    result = invoke(
        "compile",
        "--exp",
        "c4_1b_smoke",
        "--topology",
        "v5p-8",
        *("--set", "model.transformer.attention_impl=splash"),
        *("--set", f"model.transformer.context_parallel_strategy={strategy}"),
        *("--set", "data.seq_len=512", "--set", "model.max_seq_len=512"),
        *("--set", "mesh.axis_names=('data','fsdp','context','tensor')"),
        *("--set", "mesh.ici_mesh_shape=(1,2,2,1)", "--set", "mesh.dcn_mesh_shape=(1,1,1,1)"),
        "--job-log-dir",
        str(tmp_path),
    )
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "compile.json").read_text())
    assert report["mesh"] == {"data": 1, "fsdp": 2, "context": 2, "tensor": 1}
    # All-gather: 2 devices' branches x 2 chunks x (forward, dq, dkv); with full remat the forward
    # twice (16). Ring: 4 pairs x 2 masks (causal, full) x (forward, dq, dkv), the forward twice (20).
    assert report["custom_calls"].get("tpu_custom_call", 0) >= 12, report["custom_calls"]
    permutes = report["collectives"]["collective-permute"]
    # The ring's loops: keys and values forward, and again with their gradients backward.
    assert permutes >= 2 if strategy == "ring" else permutes == 0, report["collectives"]


def test_splash_on_simulated_cpu_devices_is_a_config_error(tmp_path):
    proc = launch("compile", "--exp", "c4_1b_smoke", *SPLASH, "--job-log-dir", str(tmp_path))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    text = " ".join(proc.stderr.split())
    assert "model.transformer.attention_impl='splash' is a TPU kernel" in text and "Traceback" not in text


def _weight_passes_on_xla_tpu(rows: int, *, optimizer=None, layers: int = 0, **step_options) -> tuple[int, int]:
    """How many times XLA:TPU's program for a guarded step of a `[rows, 8192]` weight writes
    and reads an array of the weight's shape at its top level (outside loops): (writes, reads).
    Applying the update in one pass writes 3 (parameter, first and second moment); each pass over
    the weight reads it. `optimizer`: the step's (default: AdamW after a global-norm clip).
    `layers`: a `[layers, rows, 8192]` stack the loss scans over instead, as the models' layers
    are, so the gradient comes out of the loop as theirs does. Each test takes its own `rows`: a
    program compiled for a compile-only device cannot be loaded back from the suite's persistent
    compilation cache, so no two tests may compile the same one."""
    import jax
    import jax.numpy as jnp
    import optax

    from equipax.core.step import LossFnTask, init_train_state, make_train_step
    from equipax.launch.hardware.tpu import lookup_slice, topology_devices

    # >= 128 MiB of float32: too large for XLA:TPU to keep in the chip's on-core memory.
    shape = (layers, rows, 8192) if layers else (rows, 8192)
    weight = f"f32[{','.join(map(str, shape))}]"

    def loss_fn(model, batch, key):
        if not layers:
            y = batch["x"] @ model["w"].astype(jnp.bfloat16)
            return jnp.mean(jnp.square(y.astype(jnp.float32))), {}

        def layer(h, w):
            return jnp.tanh(h @ w.astype(jnp.bfloat16)[:, :rows]), None

        h, _ = jax.lax.scan(layer, batch["x"], model["w"])
        return jnp.mean(jnp.square(h.astype(jnp.float32))), {}

    sharding = jax.sharding.SingleDeviceSharding(topology_devices(lookup_slice("v5e-1"))[0])
    opt = optimizer or optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.1))
    options = {"skip_nonfinite": True, "check_update_norm": True, "platform": "tpu", **step_options}
    step = make_train_step(LossFnTask(loss_fn), opt, optax.constant_schedule(1e-3), **options)
    state = jax.eval_shape(lambda: init_train_state({"w": jnp.zeros(shape, jnp.float32)}, opt))

    def placed(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    batch = {"x": placed(jax.ShapeDtypeStruct((64, rows), jnp.bfloat16))}
    key = placed(jax.eval_shape(lambda: jax.random.key(0)))
    hlo = step.lower(jax.tree.map(placed, state), batch, key).compile().as_text()
    entry = hlo[hlo.index("\nENTRY") :]
    entry = entry[: entry.index("\n}\n")]
    big: set[str] = set()  # names of the instructions that are (or hold) weight-shaped arrays
    writes = reads = 0
    for line in entry.splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (.*?) ([\w-]+)\((.*?)\)", line)
        if not m:
            continue
        name, shape, op, operands = m.groups()
        if weight in shape:
            big.add(name)
        if op in ("parameter", "tuple", "get-tuple-element", "bitcast"):
            continue
        writes += shape.count(weight)
        operands = re.sub(r"/\*index=\d+\*/", "", operands)  # (the printer numbers every fifth)
        reads += sum(o.strip().lstrip("%").split("#")[0] in big for o in operands.split(","))
    return writes, reads


def test_update_norm_is_taken_in_the_pass_that_applies_the_update():
    """train.check_update_norm's `update_norm` costs no memory pass on a TPU: XLA:TPU fuses the
    sum into the pass that applies the update. (optax.tree.norm(updates) made it write every
    update to memory and read it back: ~4% of a 0.5B-parameter step on a v5e, benchmarks/README.md.)
    Without the norm, the flag that stands in for it (the largest square) is fused the same way:
    the same writes and reads as with the norm."""
    without = _weight_passes_on_xla_tpu(4096, check_update_norm=False)
    with_norm = _weight_passes_on_xla_tpu(4096, check_update_norm=True)
    assert without[0] == with_norm[0] == 3
    assert without[1] == with_norm[1], (without, with_norm)


def test_param_norm_costs_no_pass_of_its_own_on_a_tpu():
    """On a TPU the `param_norm` sum is fused into a pass that reads the parameters anyway: the
    step reads the weight once less than with the barrier other platforms keep, and writes no
    copy of it."""
    writes_tpu, reads_tpu = _weight_passes_on_xla_tpu(4608, platform="tpu")
    writes_cpu, reads_cpu = _weight_passes_on_xla_tpu(4608, platform="cpu")
    assert writes_tpu == writes_cpu == 3
    assert reads_tpu < reads_cpu, (reads_tpu, reads_cpu)


def test_pax_adam_moves_adamw_bytes_but_one_reread_of_the_moments():
    """Pax's Adam as the Pax experiments use it (global-norm clip, Adam, per-tensor update-RMS
    clip, decoupled weight decay) under the non-finite guard, on a stack of layers: XLA:TPU writes
    the weights and both moments once each, as for AdamW, and reads the moments once more. The
    RMS clip needs each update's whole RMS before any of it is applied, so the update is applied
    in a second pass, which recomputes it from the moments the first pass wrote (AdamW's one pass
    reads the gradient and both moments once). Computed from the moments before the guard's
    select, the update made XLA also write the unselected first moment and the update's
    denominator, and read them back: 7 writes and 11 reads against AdamW's 5 and 7 here
    (benchmarks/README.md, "Pax's learner")."""
    pytest.importorskip("libtpu")
    from equipax.core.optim import LearnerConfig, make_learner

    adamw = make_learner(LearnerConfig(kind="adamw", weight_decay=0.1)).optimizer
    pax = make_learner(LearnerConfig(kind="pax_adam", weight_decay=0.1, clip_update_rms=1.0)).optimizer
    writes_adamw, reads_adamw = _weight_passes_on_xla_tpu(2048, optimizer=adamw, layers=2)
    writes_pax, reads_pax = _weight_passes_on_xla_tpu(2056, optimizer=pax, layers=2)
    assert writes_pax == writes_adamw, (writes_pax, writes_adamw)
    assert reads_pax == reads_adamw + 2, (reads_pax, reads_adamw)


def test_splash_without_segment_ids_runs_the_unsegmented_kernel():
    """Unpacked rows (no segment ids) get the kernel without segment ids; packed rows the
    segmented one. (All-zero ids made every unpacked step load and compare a block of ids per
    block of logits: 2.8% of llama_1b's step on a v5e, benchmarks/README.md.)"""
    import jax
    import jax.numpy as jnp

    from equipax.core.nn.fused_attention import splash_attention
    from equipax.launch.hardware.tpu import lookup_slice, topology_devices

    sharding = jax.sharding.SingleDeviceSharding(topology_devices(lookup_slice("v5e-1"))[0])
    qkv = jax.ShapeDtypeStruct((2, 256, 4, 128), jnp.bfloat16, sharding=sharding)
    seg = jax.ShapeDtypeStruct((2, 256), jnp.int32, sharding=sharding)

    def kernels(*args):
        def attend(q, k, v, *seg):
            return splash_attention(q, k, v, causal=True, segment_ids=seg[0] if seg else None)

        hlo = jax.jit(attend).lower(*args).compile().as_text()
        return set(re.findall(r"(splash_mha_fwd\w*)", hlo))

    # (Programs of their own: a compile-only device cannot load one from the persistent cache.)
    unpacked, packed = kernels(qkv, qkv, qkv), kernels(qkv, qkv, qkv, seg)
    assert unpacked and not any("segmented" in k for k in unpacked), unpacked
    assert any("segmented" in k for k in packed), packed
