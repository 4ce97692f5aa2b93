"""Multi-host training with real jax.distributed processes on localhost (launch local-cluster)."""

import json
import re
import shutil
import subprocess
import sys
import time

import pytest

from helpers.launch_lines import launch_in_one_process
from helpers.toy import compile_cache_env, suite_compile_cache_env

SMOKE = [
    "--exp",
    "c4_22b_2x_smoke",
    "--set",
    "train.log_every=1",
    "--set",
    "train.eval_every=100",
    "--set",
    "train.checkpoint_every=2",
]


def launch(*args, timeout=300, env=None):
    return subprocess.run(
        [sys.executable, "-m", "equipax.launch.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def train_losses(job, split="train"):
    recs = [json.loads(ln) for ln in (job / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if r["split"] == split]


def eval_losses(job):
    return train_losses(job, "eval")


def cluster(job, *sets, env=None, processes=2, devices=8):
    return launch(
        "local-cluster",
        "--processes",
        str(processes),
        "--cpu-devices",
        str(devices // processes),
        "--",
        "run",
        *SMOKE,
        *[a for s in sets for a in ("--set", s)],
        "--job-log-dir",
        str(job),
        env=env,
    )


@pytest.mark.slow
def test_two_processes_equal_one_process_read_disjoint_shards_and_resume_exactly(tmp_path):
    """Two processes train as one; a 2-process checkpoint resumes as 1 and as 4 processes. (As 2
    processes, bit for bit: tests/launch/test_schedulers.py, under SLURM's requeue and mpirun, and
    tests/launch/test_reliability.py in one process; dropped here for the suite's time, 9 CPU-s.)"""
    env = compile_cache_env(tmp_path / "jax-cache")  # the four runs compile the same programs once
    two = cluster(tmp_path / "two", env=env)
    assert two.returncode == 0, two.stdout[-4000:] + two.stderr[-2000:]

    # Stopped after step 2: the uninterrupted run's job as a run killed right after its checkpoint
    # of step 2 left it (its checkpoint of step 4 and result.json gone; the records of steps 3-4,
    # written after that checkpoint, stay: a resumed run drops them). The same checkpoint a run of
    # `train.num_steps=2` writes (nothing saved depends on num_steps), without a 2-process run
    # (13.8 s of CPU) to write it. Resumed to 4 steps on another process count below.
    shutil.copytree(tmp_path / "two", tmp_path / "split")
    shutil.rmtree(tmp_path / "split" / "checkpoints" / "4")
    (tmp_path / "split" / "result.json").unlink()
    shutil.copytree(tmp_path / "split", tmp_path / "as_one")
    shutil.copytree(tmp_path / "split", tmp_path / "as_four")

    # The one-process runs (from scratch, and the 2-process checkpoint resumed) in one child: one
    # start-up of Python and JAX for both, on the same 8 devices. It is never killed, so it shares
    # the suite's compile cache: its programs are the ones the Pax README's c4_22b_2x_smoke line
    # compiles (tests/launch/test_object_storage.py), so whichever test runs second reads them.
    (code, one), (code_alone, alone) = launch_in_one_process(
        [["run", *SMOKE, "--cpu-devices", "8", "--job-log-dir", tmp_path / job] for job in ("one", "as_one")],
        {**env, **suite_compile_cache_env()},
    )
    assert code == 0, one[-4000:]
    assert train_losses(tmp_path / "two") == pytest.approx(train_losses(tmp_path / "one"), rel=1e-5)
    # Every process logs with its prefix; each reads its own examples.
    reads = dict(re.findall(r"\[p(\d)\] host \d/2 reads examples (\[[\d, ]+\])", two.stdout))
    assert set(reads) == {"0", "1"}, two.stdout[-3000:]
    assert not set(json.loads(reads["0"])) & set(json.loads(reads["1"]))
    # Only process 0 wrote the job files (one copy of each record).
    assert len(train_losses(tmp_path / "two")) == 4

    # The 2-process checkpoint resumes as one process on the same 8 devices: the data order is
    # global (one saved cursor), so the losses continue the 2-process run's.
    assert code_alone == 0, alone[-4000:]
    assert "Resumed from step 2 on 8 devices in 1 process" in alone, alone[-3000:]
    assert "(the checkpoint was written on 8 devices in 2 processes" in alone
    assert "the data order is unchanged" in alone
    assert train_losses(tmp_path / "as_one") == pytest.approx(train_losses(tmp_path / "two"), rel=1e-5)

    # And as four processes of 2 devices each: each reads a quarter of every global batch.
    four = cluster(tmp_path / "as_four", env=env, processes=4)
    assert four.returncode == 0, four.stdout[-3000:] + four.stderr[-2000:]
    assert "Resumed from step 2 on 8 devices in 4 processes" in four.stdout, four.stdout[-3000:]
    assert "the data order is unchanged" in four.stdout
    assert train_losses(tmp_path / "as_four") == pytest.approx(train_losses(tmp_path / "two"), rel=1e-5)


# A context axis of 4 across two processes of 2 devices: both read every row, each places half
# of every sequence (docs/long_context.md, "A context axis across hosts").
CONTEXT_ACROSS_HOSTS = [
    "mesh.axis_names=('data', 'fsdp', 'context', 'tensor')",
    "mesh.ici_mesh_shape=(1, 1, 2, 1)",
    "mesh.dcn_mesh_shape=(1, 1, 2, 1)",
    "train.eval_every=2",
    "data.reset_for_eval=True",  # each eval the same batch (a rolling eval's place is not saved)
]


@pytest.mark.slow
def test_a_context_axis_across_processes_trains_and_resumes_as_one_process(tmp_path):
    """A one-process checkpoint resumes on two processes whose devices split each sequence, with the
    same batches (the data state is global), and they train as one process on the same mesh does.
    Placing the same half of the sequence on both hosts changes the losses (checked by hand)."""
    env = compile_cache_env(tmp_path / "jax-cache")
    sets = [a for s in CONTEXT_ACROSS_HOSTS for a in ("--set", s)]

    def alone(job, *more):
        return launch("run", *SMOKE, *sets, *more, "--cpu-devices", "4", "--job-log-dir", str(tmp_path / job), env=env)

    # The uninterrupted reference runs in one process. Its job, as a run killed right after its
    # checkpoint of step 2 left it (the checkpoint of step 4 and result.json gone; a resumed run drops
    # the records written after step 2), is the one-process checkpoint: no second one-process run.
    one = alone("one")
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-2000:]
    shutil.copytree(tmp_path / "one", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "4")
    (tmp_path / "resumed" / "result.json").unlink()
    resumed = cluster(tmp_path / "resumed", *CONTEXT_ACROSS_HOSTS, env=env, devices=4)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-2000:]
    assert "Resumed from step 2 on 4 devices in 2 processes" in resumed.stdout, resumed.stdout[-3000:]
    assert "the data order is unchanged" in resumed.stdout
    # Both hosts of the context group read the same rows (one infeed host).
    reads = dict(re.findall(r"\[p(\d)\] host \d/2 reads examples (\[[\d, ]+\])", resumed.stdout))
    assert set(reads) == {"0", "1"} and reads["0"] == reads["1"], resumed.stdout[-3000:]
    # One copy of each record: steps 1-2 of the one process, steps 3-4 of the two (process 0 writes).
    assert len(train_losses(tmp_path / "resumed")) == 4
    assert len(eval_losses(tmp_path / "resumed")) == 2  # steps 2 and 4
    # Steps 3-4 and the eval at step 4 on two processes: the one process's.
    assert train_losses(tmp_path / "resumed") == pytest.approx(train_losses(tmp_path / "one"), rel=1e-5)
    assert eval_losses(tmp_path / "resumed") == pytest.approx(eval_losses(tmp_path / "one"), rel=1e-5)


@pytest.mark.slow
def test_a_killed_process_stops_the_cluster_with_a_message(tmp_path):
    job = tmp_path / "victim"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "equipax.launch.cli",
            "local-cluster",
            "--processes",
            "2",
            "--cpu-devices",
            "4",
            "--grace-s",
            "5",
            "--",
            "run",
            *SMOKE,
            "--set",
            "train.num_steps=100000",
            "--job-log-dir",
            str(job),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines = []
        assert proc.stdout is not None
        for line in proc.stdout:  # wait until training runs
            lines.append(line)
            if "[p1] step " in line:
                break
        pids = subprocess.run(
            ["pgrep", "-f", "--", f"{job}.*--process-id 1"], capture_output=True, text=True
        ).stdout.split()
        assert pids, "".join(lines[-20:])
        killed_at = time.monotonic()
        for pid in pids:
            subprocess.run(["kill", "-9", pid])
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        subprocess.run(["pkill", "-9", "-f", "--", str(job)])
    elapsed = time.monotonic() - killed_at
    assert proc.returncode != 0
    assert elapsed < 60
    assert "process 1" in rest and "killed by SIGKILL" in rest, rest[-3000:]


def test_incomplete_distributed_flags_are_a_user_error():
    from typer.testing import CliRunner

    from equipax.launch.cli import app

    result = CliRunner().invoke(app, ["run", "--num-processes", "2"])
    assert result.exit_code == 2
    assert "--coordinator, --process-id missing" in result.output


def test_host_states_round_trip_and_refuse_another_host_count():
    from equipax.core.knobs import ConfigError
    from equipax.launch.cluster.distributed import gather_host_states, host_state

    saved = gather_host_states({"epoch": 1, "position": 5})
    assert host_state(saved) == {"epoch": 1, "position": 5}
    with pytest.raises(ConfigError, match="input state of 2 host"):
        host_state({"hosts": [{}, {}]})
    # A global data order's state is saved once and read by any number of hosts.
    state = {"row": 16, "global_batch": 8, "rows_per_epoch": 40}
    assert gather_host_states(state, global_state=True) == {"global": state}
    assert host_state({"global": state}) == state


def test_local_cluster_needs_a_run_command():
    from typer.testing import CliRunner

    from equipax.launch.cli import app

    result = CliRunner().invoke(app, ["local-cluster", "--processes", "2", "--", "show"])
    assert result.exit_code == 2 and "runs a `run` command" in result.output
