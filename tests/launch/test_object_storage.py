"""Job directories in object storage (`gs://`), end to end against a local GCS emulator that the
tests start on 127.0.0.1 (tests/helpers/object_stores.py): a run trains into the bucket, is
stopped by SIGTERM, resumes to the uninterrupted run's bits; the job's lock refuses a second run;
`launch eval` and `launch decode` read the job there; a damaged checkpoint is detected by its
checksums and set aside; a step whose save was killed before its commit marker is never restored;
bad input (a missing bucket, an endpoint that does not answer, no credentials, `s3://`) is exit 2
in seconds."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers.cli import FAST, assert_one_paragraph, invoke
from helpers.toy import compile_cache_env, set_args

pytestmark = pytest.mark.xdist_group("object_storage")

ONE_LAYER = ["model.transformer.num_layers=1", "train.num_steps=4", "train.eval_every=2", "train.eval_batches=1"]


@pytest.fixture(scope="session")
def gcs(tmp_path_factory):
    """A GCS emulator holding the empty bucket `bkt`; yields the environment that points at it."""
    pytest.importorskip("gcp_storage_emulator", reason="the GCS emulator (gcp-storage-emulator, a dev dependency)")
    from helpers.object_stores import emulator

    try:
        with emulator("bkt", tmp_path_factory.mktemp("gcs") / "emulator.log") as env:
            yield env
    except RuntimeError as e:
        pytest.skip(f"the GCS emulator did not start: {e}")


def _launch(args, env, cache) -> subprocess.Popen:
    entry = "import runpy, sys; sys.argv[0] = 'launch'; runpy.run_module('equipax.launch.cli', run_name='__main__')"
    return subprocess.Popen(
        [sys.executable, "-c", entry, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", **cache, **env},
    )


def _run_args(job, *overrides):
    return ["run", "--exp", "shakespeare_tiny", "--job-log-dir", job, *set_args([*FAST, *ONE_LAYER, *overrides])]


def _finish(proc: subprocess.Popen, lines=()) -> tuple[int, str]:
    out = "".join(lines) + proc.communicate(timeout=300)[0]
    return proc.returncode, out


def _words(output: str) -> str:
    """A usage error's text as one line (typer draws it in a box, wrapped)."""
    return " ".join(output.replace("│", " ").split())


def _store(env):
    from gcsfs.core import GCSFileSystem  # not gcsfs's default class, which asks a control-plane API first

    return GCSFileSystem(endpoint_url=env["STORAGE_EMULATOR_HOST"], token="anon")


@pytest.mark.slow
def test_gcs_job_trains_stops_resumes_and_detects_damage(gcs, tmp_path, monkeypatch):
    cache = compile_cache_env(tmp_path / "jax-cache")
    fs = _store(gcs)

    # The uninterrupted run: its result.json, in the bucket, holds the final state's digest.
    code, out = _finish(_launch(_run_args("gs://bkt/straight"), gcs, cache))
    assert code == 0, out
    straight = json.loads(fs.cat("bkt/straight/result.json"))
    assert {"config.json", "knobs.txt", "metrics.jsonl", "result.json", "checkpoints", "summaries", "plots"} <= {
        p.rsplit("/", 1)[1] for p in fs.ls("bkt/straight")
    }
    assert fs.ls("bkt/straight/summaries/train") and fs.exists("bkt/straight/plots/loss.png")
    assert fs.exists("bkt/straight/checkpoints/4/commit_success.txt")  # orbax's commit marker
    assert not fs.exists("bkt/straight/.lock")  # a finished run releases the job

    # The same run stopped by SIGTERM after its first step. Frozen there (SIGSTOP: its lock held),
    # it makes a second run of the job exit 2 naming it.
    proc = _launch(_run_args("gs://bkt/job"), gcs, cache)
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step 1/"):
            proc.send_signal(signal.SIGSTOP)
            break
    for name, value in gcs.items():
        monkeypatch.setenv(name, value)
    code, second = invoke(*_run_args("gs://bkt/job"))
    proc.send_signal(signal.SIGCONT)
    proc.send_signal(signal.SIGTERM)
    assert code == 2, second
    assert_one_paragraph(second, "is in use by another run", f"pid {proc.pid}")
    code, out = _finish(proc, lines)
    assert code == 75, out
    assert "Run the same command again to resume" in out, out

    # Resumed to the end: the uninterrupted run's bits.
    code, out = _finish(_launch(_run_args("gs://bkt/job"), gcs, cache))
    assert code == 0 and "Resumed from step" in out, out
    assert json.loads(fs.cat("bkt/job/result.json"))["state_digest"] == straight["state_digest"]

    # `launch eval` and `launch decode` read the job from the bucket and write their outputs there.
    code, out = invoke("eval", "--job-log-dir", "gs://bkt/job")
    assert code == 0, out
    assert {r["step"] for r in map(json.loads, fs.cat("bkt/job/eval_job/metrics.jsonl").splitlines())} >= {4}
    code, out = invoke("decode", "--job-log-dir", "gs://bkt/job", "--prompt", "ROMEO:", "--max-new-tokens", 4)
    assert code == 0 and "ROMEO:" in out and "step 4 of gs://bkt/job" in out, out
    code, out = invoke(
        "decode", "--job-log-dir", "gs://bkt/job", "--split", "eval", "--max-examples", 2, "--max-new-tokens", 2
    )
    assert code == 0, out
    assert len(fs.cat("bkt/job/decoder_out/4/outputs.jsonl").splitlines()) == 2

    # Bit rot in the newest checkpoint's array data: the checksums catch it, the step is set aside
    # (kept, in corrupt_checkpoints/), and the run resumes from the step before, to the same bits.
    from equipax.launch.inference.trained_job import checkpoint_steps
    from equipax.launch.jobdir.storage import job_path

    steps = checkpoint_steps(job_path("gs://bkt/job"))
    assert steps[-1] == 4 and len(steps) >= 2, steps  # the SIGTERM's own step, and 4
    previous = steps[-2]
    data = sorted((p for p in fs.find("bkt/job/checkpoints/4/state") if "/d/" in p), key=lambda p: fs.info(p)["size"])[
        -1
    ]
    raw = bytearray(fs.cat(data))
    raw[len(raw) // 2] ^= 0x10
    fs.pipe(data, bytes(raw))
    code, out = _finish(_launch(_run_args("gs://bkt/job"), gcs, cache))
    assert code == 0, out
    assert "the checkpoint of step 4 does not restore" in out and f"Resumed from step {previous}" in out, out
    assert [p.rsplit("/", 1)[1].split("-")[0] for p in fs.ls("bkt/job/corrupt_checkpoints")] == ["4"]
    assert json.loads(fs.cat("bkt/job/result.json"))["state_digest"] == straight["state_digest"]

    # A save killed before orbax wrote its commit marker: that step is never restored.
    from equipax.launch.jobdir.checkpoints import Checkpointer

    fs.rm("bkt/job/checkpoints/4/commit_success.txt")
    assert checkpoint_steps(job_path("gs://bkt/job")) == steps[:-1]
    ckpt = Checkpointer(job_path("gs://bkt/job/checkpoints"), keep=3)
    try:
        assert ckpt.latest_step() == previous
    finally:
        ckpt.close()


def test_store_problems_are_exit_2_in_seconds(gcs, monkeypatch):
    """A bucket that does not exist, an endpoint that does not answer, no credentials, a scheme that
    is not a store: exit 2 with the fix, before anything starts."""
    for name, value in gcs.items():
        monkeypatch.setenv(name, value)
    code, out = invoke("run", "--job-log-dir", "gs://no-such-bucket/job")
    out = _words(out)
    assert code == 2, out
    assert "the bucket gs://no-such-bucket does not exist" in out and "gcloud storage buckets create" in out, out

    from helpers.object_stores import free_port

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{free_port()}")
    started = time.monotonic()
    code, out = invoke("run", "--job-log-dir", "gs://bkt/job")
    out = _words(out)
    assert code == 2 and "does not answer" in out and "STORAGE_EMULATOR_HOST" in out, out
    assert time.monotonic() - started < 10

    monkeypatch.delenv("STORAGE_EMULATOR_HOST")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", "/nonexistent/key.json")
    from equipax.core.knobs import ConfigError
    from equipax.launch.jobdir import store_checks

    monkeypatch.setattr(
        store_checks, "_endpoint", lambda scheme: (gcs["STORAGE_EMULATOR_HOST"], "STORAGE_EMULATOR_HOST")
    )
    with pytest.raises(ConfigError, match="no Google Cloud credentials were found.*GOOGLE_APPLICATION_CREDENTIALS"):
        store_checks.check_store("gs://bkt/job", "--job-log-dir")

    code, out = invoke("run", "--job-log-dir", "hdfs://namenode/job")
    out = _words(out)
    assert code == 2 and "hdfs:// URL" in out and "supported as gs://" in out, out
    code, out = invoke("run", "--job-log-dir", "s3://bkt/job")
    out = _words(out)
    assert code == 2 and "s3:// job directories are not supported yet" in out, out
