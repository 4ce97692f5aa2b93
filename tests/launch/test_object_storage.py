"""Job directories and data in object storage (`gs://`, `s3://`), end to end against local emulators
that the tests start on 127.0.0.1 (tests/helpers/object_stores.py: `gcp-storage-emulator`, and
moto's S3 server): a run reading its C4-format shards and SentencePiece vocabulary from the bucket
trains into the bucket, is stopped by SIGTERM, resumes to the uninterrupted run's bits; the job's
lock refuses a second run; `launch eval` and `launch decode` read the job there; a damaged
checkpoint is detected by its checksums and set aside; a step whose save was killed before its
commit marker is never restored (on S3, a run killed while the emulator holds that marker's upload);
conversation files and a Hugging Face tokenizer read from the bucket; bad input (a missing bucket,
an endpoint that does not answer, no credentials, a data path or vocabulary that is not in the
bucket) is exit 2 in seconds; the Pax README's commands (docs/coming_from_pax.md) train into the
bucket and resume."""

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


# The runs' data, in the bucket (`_upload_data`): packed documents, so the job's token-count cache
# (`data_cache/`) is written there too.
def _data(scheme="gs", root=""):
    base = f"{scheme}://bkt/data" if scheme else f"{root}/bkt/data"  # no scheme: on local disk
    return [
        "data.source=c4",
        f"data.path={base}",
        "data.tokenizer=sentencepiece",
        f"data.vocab_path={base}/vocab.model",
        "data.packing=true",
    ]


DATA = _data()


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


_CHILDREN: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_child_outlives_its_test():
    """A test that fails while a `launch run` child is frozen (SIGSTOP) or still training kills it:
    left running it would hold its job and warn about itself in whichever test came next."""
    yield
    while _CHILDREN:
        proc = _CHILDREN.pop()
        if proc.poll() is None:
            proc.kill()
        if proc.stdout is not None:
            proc.stdout.close()
        proc.wait()


def _launch(args, env, cache) -> subprocess.Popen:
    entry = "import runpy, sys; sys.argv[0] = 'launch'; runpy.run_module('equipax.launch.cli', run_name='__main__')"
    proc = subprocess.Popen(
        [sys.executable, "-c", entry, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", **cache, **env},
    )
    _CHILDREN.append(proc)
    return proc


def _run_args(job, *overrides, data=None):
    data = data or _data(str(job).split("://", 1)[0])
    return ["run", "--exp", "shakespeare_tiny", "--job-log-dir", job, *set_args([*FAST, *ONE_LAYER, *data, *overrides])]


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    """The `launch run` children's compile cache, one for the module: the gs:// and s3:// runs are
    the same programs (the store is not part of them), compiled once."""
    env = compile_cache_env(tmp_path_factory.mktemp("programs"))
    return {k: v for k, v in env.items() if k.startswith(("JAX_", "XLA_"))}


def _upload_data(fs, tmp_path, root="") -> None:
    """Two plays as a numbered set of two C4-format training shards, one as the validation shard,
    and a 384-piece SentencePiece vocabulary trained on them, uploaded to gs://bkt/data (or, with
    a local `fs`, written to `root`/bkt/data)."""
    from equipax.data import SentencePieceTokenizer, load_plays

    plays = load_plays()
    shards = {
        "c4-train.00000-of-00002.jsonl": plays["macbeth"],
        "c4-train.00001-of-00002.jsonl": plays["othello"],
        "c4-validation.00000-of-00001.jsonl": plays["hamlet"][:20_000],
    }
    for name, text in shards.items():
        docs = [block for block in text.split("\n\n") if block.strip()]
        fs.pipe(f"{root}bkt/data/{name}", "".join(json.dumps({"text": d}) + "\n" for d in docs).encode())
    SentencePieceTokenizer.train([plays["macbeth"], plays["othello"]], vocab_size=384, model_path=tmp_path / "v.model")
    fs.pipe(f"{root}bkt/data/vocab.model", (tmp_path / "v.model").read_bytes())


@pytest.fixture(scope="module")
def straight(tmp_path_factory, programs) -> str:
    """The state digest of the uninterrupted run that the stopped and resumed gs:// and s3:// jobs
    must end on, bit for bit: the same run with the same data on local disk. One run for both tests
    (the store is part of neither the data nor the programs) instead of one in each bucket."""
    import fsspec

    root = tmp_path_factory.mktemp("straight")
    _upload_data(fsspec.filesystem("file", auto_mkdir=True), root, root=f"{root}/")
    code, out = _finish(_launch(_run_args(root / "job", data=_data("", root)), {}, programs))
    assert code == 0, out
    return json.loads((root / "job" / "result.json").read_text())["state_digest"]


def _signal_after_first_step(proc: subprocess.Popen, sig: int) -> list[str]:
    """Read the run's output until its first step's line, then send it `sig`; the lines read."""
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step 1/"):
            proc.send_signal(sig)
            break
    return lines


def _finish(proc: subprocess.Popen, lines=()) -> tuple[int, str]:
    try:
        out = "".join(lines) + proc.communicate(timeout=300)[0]
    except subprocess.TimeoutExpired:
        # A run that hangs: SIGABRT makes Python's fault handler (PYTHONFAULTHANDLER, set by
        # `_launch`) print every thread's stack, so the failure says where it waited.
        proc.send_signal(signal.SIGABRT)
        out = "".join(lines) + proc.communicate(timeout=60)[0]
        pytest.fail(f"the run did not end within 300 s; its output, then each thread's stack:\n{out[-20000:]}")
    return proc.returncode, out


def _words(output: str) -> str:
    """A usage error's text as one line (typer draws it in a box, wrapped)."""
    return " ".join(output.replace("│", " ").split())


def _store(env):
    from gcsfs.core import GCSFileSystem  # not gcsfs's default class, which asks a control-plane API first

    return GCSFileSystem(endpoint_url=env["STORAGE_EMULATOR_HOST"], token="anon")


@pytest.mark.slow
def test_gcs_job_trains_stops_resumes_and_detects_damage(gcs, tmp_path, monkeypatch, programs, straight):
    cache = programs
    fs = _store(gcs)
    _upload_data(fs, tmp_path)

    # The run, its data read from the bucket, stopped by SIGTERM after its first step. Frozen there
    # (SIGSTOP: its lock held), it makes a second run of the job exit 2 naming it.
    proc = _launch(_run_args("gs://bkt/job"), gcs, cache)
    lines = _signal_after_first_step(proc, signal.SIGSTOP)
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

    # Resumed to the end: the uninterrupted run's bits (`straight`), in result.json in the bucket.
    code, out = _finish(_launch(_run_args("gs://bkt/job"), gcs, cache))
    assert code == 0 and "Resumed from step" in out, out
    assert json.loads(fs.cat("bkt/job/result.json"))["state_digest"] == straight
    assert {"config.json", "knobs.txt", "metrics.jsonl", "result.json", "checkpoints", "summaries", "plots"} <= {
        p.rsplit("/", 1)[1] for p in fs.ls("bkt/job")
    }
    assert not fs.exists("bkt/job/tokenizer.model")  # data.vocab_path's, not one trained for the job
    lengths = [p.rsplit("/", 1)[1].split("-")[1] for p in fs.ls("bkt/job/data_cache")]
    assert sorted(lengths) == ["eval", "train"], lengths  # the packed documents' token counts
    assert fs.ls("bkt/job/summaries/train") and fs.exists("bkt/job/plots/loss.png")
    assert fs.exists("bkt/job/checkpoints/4/commit_success.txt")  # orbax's commit marker
    assert not fs.exists("bkt/job/.lock")  # a finished run releases the job

    # `launch eval` and `launch decode` read the job from the bucket and write their outputs there.
    code, out = invoke("eval", "--job-log-dir", "gs://bkt/job")
    assert code == 0, out
    assert {r["step"] for r in map(json.loads, fs.cat("bkt/job/eval_job/metrics.jsonl").splitlines())} >= {4}
    code, out = invoke("decode", "--job-log-dir", "gs://bkt/job", "--prompt", "ROMEO:", "--max-new-tokens", 4)
    assert code == 0 and "ROMEO:" in out and "step 4 of gs://bkt/job" in out, out
    code, out = invoke(
        "decode", "--job-log-dir", "gs://bkt/job", "--split", "eval", "--max-examples", 2, "--max-new-tokens", 2
    )  # the job packs its rows; decode reads the eval split one document a row
    assert code == 0 and "one example per row" in out, out
    assert len(fs.cat("bkt/job/decoder_out/4/outputs.jsonl").splitlines()) == 2

    # Bit rot in the newest checkpoint's array data: the checksums catch it, the step is set aside
    # (kept, in corrupt_checkpoints/), and the run resumes from the step before, to the same bits.
    from equipax.launch.inference.trained_job import checkpoint_steps
    from equipax.launch.store.storage import job_path

    steps = checkpoint_steps(job_path("gs://bkt/job"))
    assert steps[-1] == 4 and len(steps) >= 2, steps  # the SIGTERM's own step, and 4
    previous = steps[-2]
    # One flipped bit in the middle of every array data file of the step (not only the largest:
    # a data file can hold bytes no restore reads, and one full run here flipped such a byte).
    for data in [p for p in fs.find("bkt/job/checkpoints/4/state") if "/d/" in p]:
        raw = bytearray(fs.cat(data))
        raw[len(raw) // 2] ^= 0x10
        fs.pipe(data, bytes(raw))
    code, out = _finish(_launch(_run_args("gs://bkt/job"), gcs, cache))
    assert code == 0, out
    assert "the checkpoint of step 4 does not restore" in out and f"Resumed from step {previous}" in out, out
    fs.invalidate_cache()  # this process listed the job before the run set step 4 aside
    assert [p.rsplit("/", 1)[1].split("-")[0] for p in fs.ls("bkt/job/corrupt_checkpoints")] == ["4"]
    assert json.loads(fs.cat("bkt/job/result.json"))["state_digest"] == straight

    # A save killed before orbax wrote its commit marker: that step is never restored.
    from equipax.launch.jobdir.checkpoints import Checkpointer

    fs.rm("bkt/job/checkpoints/4/commit_success.txt")
    assert checkpoint_steps(job_path("gs://bkt/job")) == steps[:-1]
    ckpt = Checkpointer(job_path("gs://bkt/job/checkpoints"), keep=3)
    try:
        assert ckpt.latest_step() == previous
    finally:
        ckpt.close()


def test_a_stalled_client_does_not_hold_up_the_gcs_emulator(gcs):
    """A client stopped halfway through an upload (a run frozen by SIGSTOP, as above) must not block
    everyone else's requests: the emulator serves each connection in its own thread. On the
    one-request-at-a-time server the listing below waits for the stalled upload forever."""
    import socket
    import urllib.request

    host, port = gcs["STORAGE_EMULATOR_HOST"].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as stalled:
        stalled.sendall(
            b"POST /upload/storage/v1/b/bkt/o?uploadType=media&name=stalled HTTP/1.1\r\n"
            b"Host: x\r\nContent-Type: application/octet-stream\r\nContent-Length: 1000\r\n\r\n" + b"x" * 10
        )
        time.sleep(0.2)  # the emulator has taken the connection and waits for the rest of the body
        with urllib.request.urlopen(
            f"{gcs['STORAGE_EMULATOR_HOST']}/storage/v1/b/bkt/o?prefix=nothing", timeout=10
        ) as r:
            assert r.status == 200
        stalled.sendall(b"x" * 990)  # finished, it is stored as any upload
        assert stalled.recv(4096).split(b"\r\n", 1)[0].split()[1] == b"200"


def test_a_store_that_takes_connections_but_never_answers_is_exit_2(monkeypatch):
    """An endpoint that accepts the connection and then says nothing (a stalled server, a proxy
    holding requests: here a socket that listens and never accepts) is exit 2 naming the variable,
    after `ANSWER_TIMEOUT_S` (2 s here), not a `launch run` waiting for ever."""
    import socket

    from equipax.launch.store import checks as store_checks

    monkeypatch.setattr(store_checks, "ANSWER_TIMEOUT_S", 2.0)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel completes the handshake; nothing ever reads the request
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{silent.getsockname()[1]}")
        code, out = invoke("run", "--job-log-dir", "gs://bkt/job")
    out = _words(out)
    assert code == 2, out
    assert "accepted a connection but did not answer within 2 s" in out and "STORAGE_EMULATOR_HOST" in out, out


def test_store_problems_are_exit_2_in_seconds(gcs, monkeypatch, tmp_path):
    """A bucket that does not exist, an endpoint that does not answer, no credentials, a scheme that
    is not a store, data that is not in the bucket: exit 2 with the fix, before anything starts."""
    for name, value in gcs.items():
        monkeypatch.setenv(name, value)
    code, out = invoke("run", "--job-log-dir", "gs://no-such-bucket/job")
    out = _words(out)
    assert code == 2, out
    assert "the bucket gs://no-such-bucket does not exist" in out and "gcloud storage buckets create" in out, out

    # Data paths: a directory or bucket that is not there, a vocabulary that is not, s3://.
    c4 = [*FAST, "data.source=c4"]
    for knobs, message in [
        (["data.path=gs://bkt/no-such-dir"], "data.path 'gs://bkt/no-such-dir' does not exist"),
        (["data.path=gs://no-such-bucket/c4"], "data.path 'gs://no-such-bucket/c4': the bucket gs://no-such-bucket"),
        (
            ["data.path=gs://bkt/c4", "data.tokenizer=sentencepiece", "data.vocab_path=gs://bkt/no.model"],
            "data.vocab_path='gs://bkt/no.model': no vocabulary file 'gs://bkt/no.model' in the bucket",
        ),
    ]:
        code, out = invoke("run", "--job-log-dir", tmp_path / "job", *set_args([*c4, *knobs]))
        out = _words(out)
        assert code == 2 and message in out, out

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
    from equipax.launch.store import checks as store_checks

    monkeypatch.setattr(
        store_checks, "_endpoint", lambda scheme: (gcs["STORAGE_EMULATOR_HOST"], "STORAGE_EMULATOR_HOST")
    )
    with pytest.raises(ConfigError, match="no Google Cloud credentials were found.*GOOGLE_APPLICATION_CREDENTIALS"):
        store_checks.check_store("gs://bkt/job", "--job-log-dir")

    code, out = invoke("run", "--job-log-dir", "hdfs://namenode/job")
    out = _words(out)
    assert code == 2 and "hdfs:// URL" in out and "supported as gs:// and s3://" in out, out


def test_conversations_and_a_hugging_face_vocabulary_read_from_the_bucket(gcs, monkeypatch):
    """The chat source's conversation files and a Hugging Face tokenizer directory (tokenizer.json
    with its tokenizer_config.json and chat template) read from gs://: what the local copies give."""
    import dataclasses
    from pathlib import Path

    from equipax.launch.experiments.registry import get_experiment
    from equipax.launch.tasks.lm_data import build_tokenizer
    from helpers import REPO

    for name, value in gcs.items():
        monkeypatch.setenv(name, value)
    fs = _store(gcs)
    chat, vocab = REPO / "tests/fixtures/chat/sft", REPO / "tests/fixtures/chat/llama3"
    for local, remote in [(chat, "bkt/sft"), (vocab, "bkt/llama3")]:
        for file in local.iterdir():
            fs.pipe(f"{remote}/{file.name}", file.read_bytes())
    base = get_experiment("llama3_2_chat_cpu")
    knobs = dict(source="chat", train_files="train*.jsonl", eval_files="eval*.jsonl")
    here, there = (
        dataclasses.replace(base, data=dataclasses.replace(base.data, path=path, vocab_path=vpath, **knobs))
        for path, vpath in [(str(chat), str(vocab)), ("gs://bkt/sft", "gs://bkt/llama3")]
    )
    source = there.data.token_source
    assert source.conversations(there.data, "train").messages == source.conversations(here.data, "train").messages
    local, remote = (build_tokenizer(cfg, Path("unused"), log=lambda _: None) for cfg in (here, there))
    assert remote.fingerprint() == local.fingerprint() and remote.chat_template == local.chat_template
    assert remote.chat_template and remote.eos_id == local.eos_id


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server holding the empty bucket `bkt`: (the environment that points at it, its
    `HeldUploads`)."""
    pytest.importorskip("moto.server", reason="the S3 emulator (moto[server], a dev dependency)")
    from helpers.object_stores import s3_emulator

    with s3_emulator("bkt") as (env, uploads):
        yield env, uploads


def _s3_store(env):
    import s3fs

    return s3fs.S3FileSystem(
        endpoint_url=env["AWS_ENDPOINT_URL"], key=env["AWS_ACCESS_KEY_ID"], secret=env["AWS_SECRET_ACCESS_KEY"]
    )


@pytest.mark.slow
def test_s3_job_trains_stops_resumes_and_survives_a_killed_save(s3, tmp_path, monkeypatch, programs, straight):
    """An s3:// job reading its shards and vocabulary from s3://, stopped by SIGTERM, then resumed
    and SIGKILLed while its next checkpoint was being committed (the step's commit marker held by
    the emulator), then resumed again, to the uninterrupted run's bits (`straight`). The killed save
    leaves a step without its marker, which nothing lists or restores."""
    env, uploads = s3
    fs = _s3_store(env)
    _upload_data(fs, tmp_path)

    proc = _launch(_run_args("s3://bkt/job"), env, programs)
    lines = _signal_after_first_step(proc, signal.SIGTERM)
    code, out = _finish(proc, lines)
    assert code == 75 and "Run the same command again to resume" in out, out
    from equipax.launch.inference.trained_job import checkpoint_steps
    from equipax.launch.jobdir.checkpoints import Checkpointer
    from equipax.launch.store.storage import filesystem, job_path

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    stopped = checkpoint_steps(job_path("s3://bkt/job"))
    assert stopped and stopped[-1] < 4, stopped  # the SIGTERM's own step

    # Resumed, and killed while orbax commits the last step (4): its commit marker's upload is held.
    uploads.hold(r"/bkt/job/checkpoints/4/commit_success\.txt$")
    proc = _launch(_run_args("s3://bkt/job"), env, programs)
    try:
        assert uploads.held.wait(timeout=240), "the save of step 4 never reached its commit marker"
    finally:
        proc.kill()
        out = proc.communicate(timeout=60)[0]
        uploads.hold("")
        uploads.release.set()
    assert f"Resumed from step {stopped[-1]}" in out, out
    fs.invalidate_cache()
    written = fs.find("bkt/job/checkpoints/4")
    assert any("/state/" in p for p in written) and "bkt/job/checkpoints/4/commit_success.txt" not in written
    filesystem(job_path("s3://bkt/job"))[0].invalidate_cache()  # this process listed the job before step 4
    complete = checkpoint_steps(job_path("s3://bkt/job"))
    assert 4 not in complete and complete[-1] >= stopped[-1], complete
    ckpt = Checkpointer(job_path("s3://bkt/job/checkpoints"), keep=3)
    try:
        assert ckpt.latest_step() == complete[-1] and 4 not in ckpt.all_steps()
    finally:
        ckpt.close()

    # Resumed again: from the newest complete step, to the uninterrupted run's bits.
    code, out = _finish(_launch(_run_args("s3://bkt/job"), env, programs))
    assert code == 0 and f"Resumed from step {complete[-1]}" in out, out
    assert json.loads(fs.cat("bkt/job/result.json"))["state_digest"] == straight
    fs.invalidate_cache()
    assert {"config.json", "knobs.txt", "metrics.jsonl", "checkpoints", "summaries", "data_cache"} <= {
        p.rsplit("/", 1)[1] for p in fs.ls("bkt/job")
    }
    for step in (2, 4):  # orbax's commit marker (step 4's rewritten), and no temporary folder renamed into place
        assert fs.exists(f"bkt/job/checkpoints/{step}/commit_success.txt")
    assert not [p for p in fs.find("bkt/job") if "orbax-checkpoint-tmp" in p]
    assert not fs.exists("bkt/job/.lock")


def test_s3_store_problems_are_exit_2_in_seconds(s3, monkeypatch, tmp_path):
    """s3://: a bucket that does not exist (job directory and data path), an endpoint that does not
    answer, no credentials: exit 2 naming what to set, before anything starts."""
    env, _ = s3
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    started = time.monotonic()
    code, out = invoke("run", "--job-log-dir", "s3://no-such-bucket/job")
    out = _words(out)
    assert code == 2 and "the bucket s3://no-such-bucket does not exist" in out and "aws s3 mb" in out, out
    code, out = invoke(
        "run",
        "--job-log-dir",
        tmp_path / "job",
        *set_args([*FAST, "data.source=c4", "data.path=s3://no-such-bucket/c4"]),
    )
    out = _words(out)
    assert code == 2 and "data.path 's3://no-such-bucket/c4': the bucket s3://no-such-bucket" in out, out
    code, out = invoke(
        "run", "--job-log-dir", tmp_path / "job", *set_args([*FAST, "data.source=c4", "data.path=s3://bkt/no-such-dir"])
    )
    out = _words(out)
    assert code == 2 and "data.path 's3://bkt/no-such-dir' does not exist" in out, out

    from helpers.object_stores import free_port

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    code, out = invoke("run", "--job-log-dir", "s3://bkt/job")
    out = _words(out)
    assert code == 2 and "does not answer" in out and "AWS_ENDPOINT_URL" in out, out

    monkeypatch.setenv("AWS_ENDPOINT_URL", env["AWS_ENDPOINT_URL"])
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    missing = str(tmp_path / "none")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", missing)
    monkeypatch.setenv("AWS_CONFIG_FILE", missing)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role off EC2 (skips its 1 s probe)
    code, out = invoke("run", "--job-log-dir", "s3://bkt/job")
    out = _words(out)
    assert code == 2 and "no AWS credentials were found" in out and "AWS_ACCESS_KEY_ID" in out, out
    assert not any((tmp_path / "job").glob("*"))
    assert time.monotonic() - started < 30


def _doc_commands(page: str, marker: str) -> list[list[str]]:
    """The `launch` arguments of each command line of docs/`page`'s blocks marked `marker`."""
    import shlex

    from helpers import REPO

    sys.path.insert(0, str(REPO))
    from docs_hooks import code_blocks

    lines = [
        line.strip()
        for block in code_blocks((REPO / "docs" / page).read_text())
        if marker in block.markers
        for line in block.body.splitlines()
        if line.strip()
    ]
    words = [shlex.split(line) for line in lines]
    assert words and all(w[:3] == ["uv", "run", "launch"] for w in words), lines
    return [w[3:] for w in words]


@pytest.mark.slow
def test_pax_readme_commands_train_into_the_bucket_and_resume(gcs):
    """docs/coming_from_pax.md's commands as a Pax user types them (`--exp=<Pax class path>_smoke
    --job_log_dir=gs://my-bucket/...`), run as written against the emulator: the Pax README's six
    experiments train into the bucket, and a run stopped after two steps resumes from its checkpoint
    there to the uninterrupted run's state, bit for bit. One process on 8 simulated devices runs
    them all (`--cpu-devices 8` on each line: the same count, so JAX starts once)."""
    from helpers.launch_lines import launch_in_one_process
    from helpers.toy import FAST_COMPILE, suite_compile_cache_env, with_xla_flags

    fs = _store(gcs)
    fs.mkdir("my-bucket")
    commands = _doc_commands("coming_from_pax.md", "gcs-emulator")
    assert len(commands) == 8, commands
    env = with_xla_flags({**os.environ, **suite_compile_cache_env(), **gcs, "JAX_PLATFORMS": "cpu"}, FAST_COMPILE)
    outcomes = launch_in_one_process(commands, env)

    def job(args):
        return next(a.split("=", 1)[1] for a in args if a.startswith("--job_log_dir=")).removeprefix("gs://")

    from equipax.launch.experiments.registry import get_experiment

    for args, (code, out) in zip(commands, outcomes, strict=True):
        assert code == 0, f"{args}\n{out}"
        cfg = get_experiment(args[1].removeprefix("--exp="))
        steps = 2 if "train.num_steps=2" in args else cfg.train.num_steps
        assert f"step {steps}/{steps}" in out, out
        assert fs.exists(f"{job(args)}/checkpoints/{steps}/commit_success.txt"), out
        assert cfg.name.endswith("_smoke") and json.loads(fs.cat(f"{job(args)}/config.json"))["name"] == cfg.name

    # The six distinct Pax experiments.
    assert len({json.loads(fs.cat(f"{job(a)}/config.json"))["name"] for a in commands}) == 6
    # The stopped run, rerun as the same command: resumed in the bucket, to the uninterrupted bits.
    (stopped, _), (resumed, (_, out)) = list(zip(commands, outcomes, strict=True))[-2:]
    assert stopped == [*resumed, "--set", "train.num_steps=2"] and "Resumed from step 2" in out, out
    straight = next(a for a in commands if a[1] == resumed[1] and job(a) != job(resumed))
    a, b = (json.loads(fs.cat(f"{job(args)}/result.json")) for args in (straight, resumed))
    assert a["state_digest"] == b["state_digest"] and a["final_train_loss"] == b["final_train_loss"]
