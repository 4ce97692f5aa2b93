"""Reliability: nothing saved is ever wrong, every failure is named, and
checkpoints verify themselves. Each test drives the CLI (in-process, or as a real process where
signals, resource limits or `os._exit` are involved) and checks the exit code, the message and
that nothing already in the job directory was damaged. docs/errors.md lists each case."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.cli import FAST, assert_one_paragraph, invoke, run, snapshot
from helpers.toy import persistent_compile_cache

# One-layer toy runs, with a model vocabulary larger than the byte tokenizer's 260 ids.
ONE_LAYER = ["model.transformer.num_layers=1", "model.vocab_size=512"]
CACHE: dict[str, str] = {}  # JAX's persistent compilation cache of this module's runs (env form)


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
    """This module's runs compile the same few programs: keep them on disk from run to run
    (in-process and in the child processes), then restore JAX's settings."""
    with persistent_compile_cache(tmp_path_factory.mktemp("jax-cache")) as env:
        CACHE.update(env)
        yield
    CACHE.clear()


def launch_process(*args, env=None, file_size_limit: int | None = None) -> subprocess.Popen:
    """`launch ...` as its own process (the console entry point: signal handlers, os._exit).

    `file_size_limit`: no file the process writes grows past this many bytes (EFBIG: what a
    full disk does to a write), set inside the child (no fork of this JAX process).
    """
    limit = (
        f"import resource; resource.setrlimit(resource.RLIMIT_FSIZE, ({file_size_limit}, {file_size_limit})); "
        if file_size_limit
        else ""
    )
    entry = (
        f"import runpy, sys; {limit}sys.argv[0] = 'launch'; runpy.run_module('equipax.launch.cli', run_name='__main__')"
    )
    return subprocess.Popen(
        [sys.executable, "-c", entry, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "PYTHONUNBUFFERED": "1",
            **CACHE,
            # Under the limit, no bytecode written either: a `.pyc` cut short would stay for every
            # later process (tests/helpers/bytecode.py).
            **({"PYTHONDONTWRITEBYTECODE": "1"} if file_size_limit else {}),
            **(env or {}),
        },
    )


def run_args(job, *overrides) -> list[str]:
    from helpers.toy import set_args

    return ["run", "--exp", "shakespeare_tiny", "--job-log-dir", str(job), *set_args([*FAST, *overrides])]


@pytest.fixture(scope="module")
def finished_job(tmp_path_factory):
    """A finished 4-step toy job with checkpoints 2 and 4 (copied by each test that uses it), and a hot
    sample over its 512 ids, 252 unknown to the byte tokenizer (16 tokens: one decode program, 32 two)."""
    job = tmp_path_factory.mktemp("finished2") / "job"
    code, out = run(job, "train.num_steps=4", "train.sample.tokens=16", "train.sample.temperature=50.0", *ONE_LAYER)
    assert code == 0, out
    return job


@pytest.fixture
def job_copy(finished_job, tmp_path):
    job = tmp_path / "job"
    shutil.copytree(finished_job, job)
    return job


def train_records(job: Path) -> dict[int, dict]:
    records = [json.loads(ln) for ln in (job / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if r["split"] == "train"}


# --- the guard checks the update; "last good checkpoint" is one training continues from ---


def test_overflowing_learning_rate_names_a_checkpoint_training_continues_from(job_copy):
    code, out = run(job_copy, "train.num_steps=10", "learner.schedule.peak_learning_rate=1e30", *ONE_LAYER)
    assert code == 4, out
    assert_one_paragraph(
        out,
        "step 5: the update is not finite",
        "The run became unstable at step 5",
        "the learning rate is likely too high",
        "The last good checkpoint is step 4",
        "unstable_checkpoints",
    )
    assert sorted(p.name for p in (job_copy / "checkpoints").iterdir()) == ["2", "4"]
    assert [p.name.split("-")[0] for p in (job_copy / "unstable_checkpoints").iterdir()] == ["6"]
    # The named checkpoint is one training continues from, with a sane learning rate.
    code, out = run(job_copy, "train.num_steps=10", *ONE_LAYER)
    assert code == 0 and "Resumed from step 4" in out, out
    records = train_records(job_copy)
    assert all(isinstance(records[s]["loss"], float) and records[s]["loss"] < 10 for s in range(5, 11)), records
    assert json.loads((job_copy / "result.json").read_text())["final_eval_loss"] < 10


@pytest.mark.parametrize(("learning_rate", "rerun"), [("1e30", True), ("1e10", False)])
def test_without_the_update_norm_check_a_blown_up_checkpoint_is_never_named_good(tmp_path, learning_rate, rerun):
    """train.check_update_norm=false: the step whose update overflowed (1e30) or left the
    parameters finite but too large for the model (1e10: the next loss is NaN) is where the run
    became unstable; the checkpoint it wrote is set aside, not named good, and a rerun with a
    sane learning rate trains from step 0 (once: both leave the same empty checkpoints/)."""
    job = tmp_path / "job"
    knobs = ["train.check_update_norm=false", *ONE_LAYER]
    code, out = run(job, "train.num_steps=8", f"learner.schedule.peak_learning_rate={learning_rate}", *knobs)
    assert code == 4, out
    assert_one_paragraph(
        out,
        "The run became unstable at step 2",
        "the learning rate is likely too high",
        "No checkpoint from before that step remains",
    )
    assert "The last good checkpoint" not in out
    assert list((job / "checkpoints").iterdir()) == []
    assert sorted(p.name.split("-")[0] for p in (job / "unstable_checkpoints").iterdir()) == ["2", "4"]
    if not rerun:
        return
    code, out = run(job, "train.num_steps=4", *knobs)
    assert code == 0, out
    records = train_records(job)
    assert all(isinstance(records[s]["loss"], float) and records[s]["loss"] < 10 for s in range(1, 5)), records


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_non_finite_learning_rate_refused(value, tmp_path):
    code, out = run(tmp_path / "job", f"learner.schedule.peak_learning_rate={value}")
    assert code == 2, out
    assert_one_paragraph(out, "schedule.peak_learning_rate: expected a finite number > 0")
    assert not (tmp_path / "job").exists()


# --- resuming checks what the saved state means --------------------------------------


def test_resume_after_a_shape_keeping_model_change_names_the_changed_knobs(job_copy):
    """The activation and the attention logit cap keep every parameter's shape, so the checkpoint
    restores: the run says which model knobs changed. How the model is computed (remat) is free."""
    code, out = run(
        job_copy,
        "train.num_steps=6",
        "model.transformer.activation=silu",
        "model.transformer.atten_logit_cap=20.0",
        "model.transformer.remat=full",
        *ONE_LAYER,
    )
    assert code == 0 and "Resumed from step 4" in out, out
    note = next((ln for ln in out.splitlines() if ln.startswith("note: the model changed")), "")
    assert "model.transformer.activation: 'gelu' -> 'silu'" in note, out
    assert "model.transformer.atten_logit_cap: 50.0 -> 20.0" in note, out
    assert "remat" not in note, out


def test_resume_refuses_changed_data_knobs_and_lists_them(job_copy):
    before = snapshot(job_copy)
    code, out = run(job_copy, "train.num_steps=6", "data.batch_size=8", "data.seq_len=16", "data.seed=7", *ONE_LAYER)
    assert code == 2, out
    assert_one_paragraph(
        out,
        "cannot be resumed with these knobs",
        "global batch",
        "4 -> 8",
        "data.seq_len: 32 -> 16",
        "data.seed: 1234 -> 7",
        "new directory",
    )
    assert snapshot(job_copy) == before


def test_resume_with_a_new_global_batch_needs_allow_new_data_order_and_records_it(job_copy):
    from equipax.launch.jobdir.checkpoints import Checkpointer

    code, out = run(job_copy, "train.num_steps=6", "data.batch_size=8", *ONE_LAYER)
    assert code == 2, out
    assert_one_paragraph(out, "global batch", "4 -> 8", "--allow-new-data-order")
    code, out = invoke(
        *run_args(job_copy, "train.num_steps=6", "data.batch_size=8", *ONE_LAYER), "--allow-new-data-order"
    )
    assert code == 0, out
    assert "--allow-new-data-order: the data changed" in out and "Resumed from step 4" in out, out
    checkpointer = Checkpointer(job_copy / "checkpoints", keep=3)
    try:
        meta = checkpointer._read_meta(6)
    finally:
        checkpointer.close()
    assert meta is not None and [c["step"] for c in meta["data_order_changes"]] == [4], meta
    # The new order is the job's order from now on: the next resume needs no flag.
    code, out = run(job_copy, "train.num_steps=8", "data.batch_size=8", *ONE_LAYER)
    assert code == 0 and "Resumed from step 6" in out, out


def test_resume_refuses_another_tokenizer(job_copy):
    before = {k: v for k, v in snapshot(job_copy).items() if not k.startswith("tokenizer")}
    code, out = run(job_copy, "train.num_steps=6", "data.tokenizer=sentencepiece", *ONE_LAYER)
    assert code == 2, out
    assert_one_paragraph(out, "data.tokenizer: 'byte' -> 'sentencepiece'")
    assert {k: v for k, v in snapshot(job_copy).items() if not k.startswith("tokenizer")} == before


def test_resume_accepts_learner_and_loop_changes(job_copy):
    code, out = run(
        job_copy, "train.num_steps=6", "learner.schedule.peak_learning_rate=2e-3", "train.eval_batches=1", *ONE_LAYER
    )
    assert code == 0 and "Resumed from step 4" in out, out


def test_config_json_deleted_another_experiment_refused(job_copy):
    (job_copy / "config.json").unlink()
    before = snapshot(job_copy)
    code, out = run(job_copy, "train.num_steps=6", *ONE_LAYER, exp="shakespeare_tiny_linear")
    assert code == 2, out
    assert_one_paragraph(
        out, "written by experiment 'shakespeare_tiny', not 'shakespeare_tiny_linear'", "--exp shakespeare_tiny"
    )
    assert snapshot(job_copy) == before


# --- checkpoints verify themselves; metrics lines that are not records --------------


def flip_a_bit(step_dir: Path) -> Path:
    """Flip one bit in the middle of the largest array file (same size: what bit rot does)."""
    target = max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x08
    target.write_bytes(bytes(data))
    return target


def reference_checksum(x) -> str:
    """The obvious host version of `checksums.array_checksums`: flat index, numpy uint32 arithmetic."""
    import numpy as np

    w = np.asarray(x)
    w = w.astype(np.uint8) if w.dtype == np.bool_ else w
    w = w.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[w.dtype.itemsize]).astype(np.uint32).ravel()
    h = (np.arange(w.size, dtype=np.uint32) * np.uint32(0x9E3779B1) + np.uint32(0x7F4A7C15)) | np.uint32(1)
    p = w * h
    return f"{int(p.sum(dtype=np.uint32)):08x}{int((p * h).sum(dtype=np.uint32)):08x}"


def test_checksums_match_the_reference_and_see_every_flipped_bit():
    import jax
    import jax.numpy as jnp
    import numpy as np

    from equipax.launch.jobdir.checksums import array_checksums

    arrays = {
        "f32": jax.random.normal(jax.random.key(0), (33, 7, 5)),
        "bf16": jnp.full((9, 4), 3, jnp.bfloat16),
        "i32": jnp.arange(100, dtype=jnp.int32),
        "bool": jnp.array([True, False, True]),
        "u8": jnp.arange(7, dtype=jnp.uint8),
        "scalar": jnp.asarray(2.5),
    }
    sums = array_checksums(arrays)
    assert sums == {k: reference_checksum(v) for k, v in arrays.items()}
    bits = np.asarray(arrays["f32"]).reshape(-1).view(np.uint32)
    for i in range(0, bits.size, 37):  # a flip of any bit of any element changes the checksum
        for bit in (0, 13, 31):
            flipped = bits.copy()
            flipped[i] ^= np.uint32(1 << bit)
            assert array_checksums({"f32": flipped.view(np.float32).reshape(33, 7, 5)})["f32"] != sums["f32"]


def test_host_and_device_checksums_agree(monkeypatch):
    """The numpy sums (arrays in this host's memory) equal the device program's (arrays on an
    accelerator or split over processes) for every dtype a state holds, 64-bit and PRNG keys
    included, and do not depend on the chunk size; a changed element changes both."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from equipax.launch.jobdir import checksums

    def both(arrays):
        names = sorted(arrays)
        host = {k: checksums.host_checksum(arrays[k]) for k in names}
        device = np.asarray(checksums._checksums([jnp.asarray(arrays[k]) for k in names]))
        return host, {k: (int(a), int(b)) for k, (a, b) in zip(names, device)}

    arrays = {
        "f32": jax.random.normal(jax.random.key(0), (33, 7, 5)),
        "bf16": jax.random.normal(jax.random.key(1), (9, 4), jnp.bfloat16),
        "f16": jnp.linspace(-3, 3, 11, dtype=jnp.float16),
        "i8": jnp.arange(-5, 6, dtype=jnp.int8),
        "bool": jnp.array([True, False, True]),
        "scalar": jnp.asarray(2.5),
        "key": jax.random.split(jax.random.key(3), 3),
        "empty": jnp.zeros((0, 4)),
    }
    host, device = both(arrays)
    assert host == device
    monkeypatch.setattr(checksums, "_HOST_CHUNK", 16)  # the f32 array's 1,155 elements in 73 chunks
    assert both(arrays)[0] == host
    # `array_checksums` takes numpy for a small state in host memory, the program above the limit.
    small = checksums.array_checksums(arrays)
    monkeypatch.setattr(checksums, "HOST_CHECKSUM_MAX_BYTES", 0)
    assert checksums.array_checksums(arrays) == small == {k: f"{a:08x}{b:08x}" for k, (a, b) in host.items()}
    assert checksums.on_this_host(arrays["f32"]) and checksums.on_this_host(np.zeros(3))
    with jax.enable_x64(True):
        wide = {"f64": jnp.linspace(-1, 1, 13, dtype=jnp.float64), "i64": jnp.arange(2**40, 2**40 + 9, dtype=jnp.int64)}
        host64, device64 = both(wide)
    assert host64 == device64
    changed = np.asarray(arrays["f32"]).copy()
    changed[4, 2, 1] += 1
    host_changed, device_changed = both({"f32": changed})
    assert host_changed["f32"] != host["f32"] and device_changed["f32"] != device["f32"]


def test_bit_flip_and_unreadable_metrics_lines_on_resume(job_copy):
    """4: a flipped bit in the newest checkpoint is found by its checksums; 10: metrics.jsonl lines
    that are not JSON objects in UTF-8 are dropped with a warning naming the file."""
    flip_a_bit(job_copy / "checkpoints" / "4")
    with (job_copy / "metrics.jsonl").open("ab") as f:
        f.write(b"[1, 2, 3]\n\xff\xfe not utf-8\n")
    code, out = run(job_copy, "train.num_steps=6", *ONE_LAYER)
    assert code == 0, out
    assert "the checkpoint of step 4 does not restore (ChecksumMismatch" in out and "Resumed from step 2" in out, out
    assert [p.name[:2] for p in (job_copy / "corrupt_checkpoints").iterdir()] == ["4-"]
    assert "warning: dropped 2 unreadable line(s) of" in out and "metrics.jsonl" in out, out
    assert sorted(train_records(job_copy)) == [1, 2, 3, 4, 5, 6]


# --- a finished job rerun with fewer steps keeps its result --------------------------------


def test_fewer_steps_than_trained_keeps_the_result(job_copy):
    before = snapshot(job_copy)
    code, out = run(job_copy, "train.num_steps=2", *ONE_LAYER)
    assert code == 2, out
    assert_one_paragraph(out, "already trained to step 4", "train.num_steps=2", "result.json is kept")
    assert snapshot(job_copy) == before


# --- a model vocabulary larger than the tokenizer's ----------------------------------------


def test_vocab_larger_than_the_tokenizer_samples_and_finishes(finished_job):
    result = json.loads((finished_job / "result.json").read_text())
    assert result["final_step"] == 4 and isinstance(result["sample"], str) and result["sample"]


# --- checkpoint writes that fail ----------------------------------------------------------


def test_file_size_limit_while_saving_names_the_step_without_tracebacks(tmp_path):
    job = tmp_path / "job"
    # Every file stops at 60 KB (Python ignores SIGXFSZ: writes fail with EFBIG, as on a full disk):
    # the small files fit, the checkpoint's array file does not.
    # A compilation cache of its own (an entry cut at the limit must not reach other runs), written
    # for every program: each write fails too, which the run reports in one line.
    cache = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache"), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    args = run_args(job, "train.num_steps=4", "train.log_every=4", *ONE_LAYER)
    proc = launch_process(*args, env=cache, file_size_limit=60_000)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2, out
    assert_one_paragraph(out, "Could not write the checkpoint of step 2", "No complete checkpoint exists yet")
    # The OS error reaches the message as EFBIG's text or, when tensorstore's write fails first while
    # opening an array, as its OUT_OF_RANGE status: which one wins depends on thread timing.
    assert "File too large" in out or "OUT_OF_RANGE" in out, out
    # The cache's failed writes in one line, not JAX's two per program; no warnings about orbax's
    # write coroutines left unawaited by the failed save (at exit, whenever they are collected).
    assert out.count("warning: could not write JAX's compilation cache (OSError: [Errno 27]") == 1, out
    assert "compilation cache entry" not in out and "never awaited" not in out, out
    assert len(out.splitlines()) < 10, out  # no orbax tracebacks


def test_a_failing_compilation_cache_is_one_warning_line(tmp_path, capsys):
    import warnings

    from equipax.launch.training.startup import compile_cache

    with warnings.catch_warnings(record=True) as caught:  # what reaches the warnings machinery
        warnings.simplefilter("always")
        with compile_cache("cache", tmp_path):
            for name in ("jit_make", "jit_train_step"):
                warnings.warn(
                    f"Error writing persistent compilation cache entry for '{name}': OSError: boom", stacklevel=1
                )
            warnings.warn("Error reading persistent compilation cache entry for 'jit_x': ValueError: cut", stacklevel=1)
            warnings.warn("something else", stacklevel=1)
        warnings.warn("Error writing persistent compilation cache entry for 'after': OSError: later", stacklevel=1)
    err = capsys.readouterr().err
    assert err.count("warning: could not write JAX's compilation cache (OSError: boom); the run goes on") == 1, err
    assert err.count("warning: could not read JAX's compilation cache (ValueError: cut)") == 1, err
    assert len(err.splitlines()) == 2, err
    # Other warnings are shown as before, and outside the run JAX's warning is JAX's again.
    assert [str(w.message).split()[0] for w in caught] == ["something", "Error"], caught
    assert "for 'after'" in str(caught[1].message)


def test_only_orbax_coroutines_left_unawaited_are_silenced(tmp_path):
    import gc
    import warnings

    from equipax.launch.jobdir.orbax_quiet import quiet_unawaited

    def coroutine(filename: str):
        scope: dict = {}
        exec(compile("async def write_fragment():\n    pass\n", filename, "exec"), scope)
        return scope["write_fragment"]()

    shown: list = []
    previous = warnings._showwarnmsg  # pyright: ignore[reportAttributeAccessIssue]
    warnings._showwarnmsg = quiet_unawaited(shown.append)  # pyright: ignore[reportAttributeAccessIssue]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            orbax, ours = coroutine("/site-packages/orbax/checkpoint/x.py"), coroutine(str(tmp_path / "mine.py"))
            del orbax, ours
            gc.collect()
    finally:
        warnings._showwarnmsg = previous  # pyright: ignore[reportAttributeAccessIssue]
    assert [str(m.message).splitlines()[0] for m in shown] == ["coroutine 'write_fragment' was never awaited"]
    assert "mine.py" in shown[0].source.cr_code.co_filename


def test_checkpoints_path_is_a_file(tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    (job / "checkpoints").write_text("not a directory")
    code, out = run(job)
    assert code == 2, out
    assert_one_paragraph(out, "checkpoints is a file", "--job-log-dir")
    assert "Compiled" not in out and (job / "checkpoints").read_text() == "not a directory"


# --- multi-host start-up ------------------------------------------------------------------


def test_coordinator_that_never_appears(tmp_path):
    from equipax.launch.cluster.local_cluster import free_port

    port = free_port()
    proc = launch_process(
        *run_args(tmp_path / "job"),
        "--coordinator",
        f"127.0.0.1:{port}",
        "--num-processes",
        2,
        "--process-id",
        1,
        "--coordinator-timeout",
        2,
    )
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out
    assert "Joining the distributed job as process 1 of 2: coordinator 127.0.0.1" in out, out
    assert_one_paragraph(
        out, "did not start within 2 s", f"nothing accepts connections at 127.0.0.1:{port}", "--coordinator-timeout"
    )


def test_malformed_coordinator(tmp_path):
    code, out = invoke(
        "run", "--job-log-dir", tmp_path / "job", "--coordinator", "not a host", "--num-processes", 2, "--process-id", 1
    )
    assert code == 2, out
    assert_one_paragraph(out, "--coordinator 'not a host' is not HOST:PORT")


# --- signals outside the training steps ---------------------------------------------------


def test_ctrl_c_during_imports(tmp_path):
    # With the suite's bytecode written (tests/helpers/bytecode.py) the imports take well under a
    # second; read none of it (an empty bytecode tree, nothing written), so that they compile from
    # source and take seconds, as on a first run: the signal then lands among them.
    no_bytecode = {"PYTHONPYCACHEPREFIX": str(tmp_path / "no-bytecode"), "PYTHONDONTWRITEBYTECODE": "1"}
    proc = launch_process(*run_args(tmp_path / "job"), env=no_bytecode)
    import time

    # Signal once numpy is mapped: the handler is in (cli.py installs it before the heavy imports)
    # and JAX's imports, seconds from source, are under way. A fixed delay raced the interpreter's
    # own start-up on a loaded machine (the signal landed in `pathlib`'s import, before cli.py's
    # first statement could run).
    maps = Path(f"/proc/{proc.pid}/maps")
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if "_multiarray_umath" in maps.read_text():
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, out
    assert_one_paragraph(out, "Stopped by SIGINT while starting up; nothing was written", "Run the same command again")
    assert not (tmp_path / "job").exists()


def test_sigterm_before_the_first_step(tmp_path):
    proc = launch_process(*run_args(tmp_path / "job"))
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:  # the job's header: start-up (data, build, restore) comes next
        lines.append(line)
        if "examples/step" in line:
            break
    proc.send_signal(signal.SIGTERM)
    out = "".join(lines) + proc.communicate(timeout=120)[0]
    assert proc.returncode == 75, out
    assert_one_paragraph(out, "Stopped by SIGTERM outside the training steps")
    assert not (tmp_path / "job").exists()  # nothing was written: no empty job directory left


# --- platform and memory ------------------------------------------------------------------


def test_unavailable_platform(tmp_path):
    proc = launch_process(*run_args(tmp_path / "job"), env={"JAX_PLATFORMS": "cuda"})
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out
    assert_one_paragraph(out, "JAX could not start the platform(s) JAX_PLATFORMS='cuda'", "Unset JAX_PLATFORMS")


def test_out_of_memory_names_the_knobs(tmp_path, monkeypatch):
    import equipax.launch.training.loop as loop

    def oom(*args, **kwargs):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 123456789 bytes.")

    monkeypatch.setattr(loop, "build_training", oom)
    code, out = run(tmp_path / "job")
    assert code == 2, out
    assert_one_paragraph(out, "Out of memory", "data.batch_size", "launch compile")


# --- right exit code, right advice --------------------------------------------------------


def test_mesh_mismatch_suggests_only_existing_experiments(tmp_path):
    code, out = invoke("run", "--exp", "c4_1b_smoke", "--job-log-dir", tmp_path / "job")
    assert code == 2, out
    assert_one_paragraph(out, "The mesh needs 8 devices", "--cpu-devices 8")
    assert "_smoke_smoke" not in out and "so their product is" not in out
    code, out = invoke(
        "run", "--exp", "shakespeare_tiny", "--job-log-dir", tmp_path / "job", "--set", "mesh.ici_mesh_shape=(2, 1, 1)"
    )
    assert code == 2 and "shakespeare_tiny_smoke" not in out, out


def test_cpu_devices_the_mesh_cannot_use_refused_at_once(tmp_path):
    code, out = invoke("run", "--exp", "c4_1b_smoke", "--job-log-dir", tmp_path / "job", "--cpu-devices", 10000)
    assert code == 2, out
    assert_one_paragraph(out, "--cpu-devices 10000 gives 10000 devices", "needs 8", "use --cpu-devices 8")


def test_missing_c4_path_with_a_tokenizer_to_train(tmp_path):
    code, out = invoke(
        "run",
        "--job-log-dir",
        tmp_path / "job",
        "--set",
        "data.source=c4",
        "--set",
        f"data.path={tmp_path / 'nowhere'}",
    )
    assert code == 2, out
    assert_one_paragraph(out, "does not exist")
    assert "Raise model.vocab_size" not in out


def test_hosts_zero_is_named(tmp_path):
    code, out = invoke("data", "inspect", "--hosts", 0)
    assert code == 2, out
    assert_one_paragraph(out, "--hosts must be >= 1")


def test_huge_integer_is_named_as_an_integer(tmp_path):
    code, out = invoke("show", "--set", "train.num_steps=" + "9" * 5000)
    assert code == 2, out
    assert_one_paragraph(out, "Knob 'train.num_steps'", "an integer of 5000 digits")


@pytest.mark.parametrize(
    "error, shown",
    [
        (RuntimeError("it broke."), "Unexpected RuntimeError: it broke. This"),
        (AssertionError(), "Unexpected AssertionError (no message). This"),
    ],
)
def test_unexpected_error_text(error, shown, tmp_path, monkeypatch):
    import equipax.launch.training.loop as loop

    def boom(*args, **kwargs):
        raise error

    monkeypatch.setattr(loop, "run_experiment", boom)
    code, out = run(tmp_path / "job")
    assert code == 1, out
    assert_one_paragraph(out, shown)
    assert ". ." not in out and "..  " not in out and ".. This" not in out


def test_a_signal_that_interrupted_an_import_is_still_exit_75(monkeypatch):
    """Found by benchmarks/fault_injection.py: a SIGTERM landing while `run` imports JAX left a
    half-initialised module, and naming the error imported it again (exit 1, a traceback). The
    signal's message and exit code now come before any import."""
    from equipax.launch.errors import describe
    from equipax.launch.exit_codes import EXIT_PREEMPTED
    from equipax.launch.failures import Interrupted

    monkeypatch.setitem(sys.modules, "equipax.core.task", None)  # importing it now raises ImportError
    message, code = describe(Interrupted("SIGTERM"))
    assert code == EXIT_PREEMPTED and "Stopped by SIGTERM" in message
    # what a signal leaves is said per command: eval and decode resume nothing
    assert "evaluates the checkpoints not recorded yet" in describe(Interrupted("SIGTERM"), "eval")[0]
    decode = describe(Interrupted("SIGINT"), "decode")[0]
    assert "nothing was written to --output" in decode and "resumes" not in decode


def test_orbax_write_futures_without_orbax_frames_are_quiet():
    """A flake seen once in CI: after a failed save, asyncio reported
    tensorstore write futures ("Future exception was never retrieved") whose exceptions carry no
    orbax frame, only the path of the checkpoint being written; those are dropped too, nothing else."""
    import logging

    from equipax.launch.jobdir.orbax_quiet import QuietOrbaxFutures

    def record(message, exc):
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, None, (type(exc), exc, None))

    tensorstore = ValueError(
        'OUT_OF_RANGE: Error writing ".opt_state/.zarray" in OCDBT database at local file '
        '"/job/checkpoints/2.orbax-checkpoint-tmp/state.orbax-checkpoint-tmp/ocdbt.process_0/"'
    )
    quiet = QuietOrbaxFutures()
    assert not quiet.filter(record("Future exception was never retrieved", tensorstore))
    assert quiet.filter(record("Future exception was never retrieved", ValueError("a user's own future")))
    assert quiet.filter(record("Task was destroyed but it is pending!", tensorstore))
