"""`launch run --distributed-auto` under real schedulers: a one-node SLURM cluster on localhost (sbatch,
srun, scancel, requeue) and Open MPI's mpirun, each with 2 processes x 2 simulated CPU devices.

Each run is compared with a reference computed once: `launch local-cluster` with the same 2 x 2
layout (the same bits). The scheduler runs are preempted with SIGTERM and resumed, and must end on
the reference's parameters bit for bit. (That two processes train as one does, to float rounding,
is tests/launch/test_multihost.py's check, whatever starts the processes.) The SLURM and Open MPI
packages come from Debian (`.ci/run` installs them); where they are missing the tests say so and
skip.
"""

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import slurm
from helpers.toy import compile_cache_env

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("schedulers")]  # one worker: one compile cache

# 2-process CPU steps take ~0.3 s: a SIGTERM sent after the first lands with steps to go (the SLURM
# job's landed after step 4 of 16, and of 10, on loaded 2-core machines: 6 steps to spare). Each of
# the module's 4 runs trains them.
STEPS = 10
RUN = [
    "--exp",
    "c4_22b_2x_smoke",
    *[
        a
        for s in (
            "mesh.ici_mesh_shape=(1,2,1)",
            f"train.num_steps={STEPS}",
            "train.log_every=1",
            "train.eval_every=1000",
            "train.checkpoint_every=1000",
        )
        for a in ("--set", s)
    ],
]
LAUNCH = [sys.executable, "-m", "equipax.launch.cli"]


def train_losses(job: Path) -> dict[int, float]:
    recs = [json.loads(ln) for ln in (job / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return {r["step"]: r["loss"] for r in recs if r["split"] == "train"}


def digest(job: Path) -> str:
    return json.loads((job / "result.json").read_text())["state_digest"]


def wait_until(ready, timeout: float, what: str, tail=lambda: ""):
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout:.0f} s\n{tail()}")
        time.sleep(0.2)


def training_started(job: Path) -> bool:
    return (job / "metrics.jsonl").exists() and bool(train_losses(job))


def launch_env(cache: Path) -> dict[str, str]:
    """The environment of every `launch` process here: one compile cache, this venv's `launch` on PATH."""
    return dict(
        compile_cache_env(cache),
        PYTHONUNBUFFERED="1",
        TERM="dumb",
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    )


# Ranks on loopback only, unbound (XLA's threads may use every core), as root where the tests run so.
MPIRUN = [
    "mpirun",
    "-np",
    "2",
    "--oversubscribe",
    "--bind-to",
    "none",
    "--mca",
    "oob_tcp_if_include",
    "lo",
    *(["--allow-run-as-root"] if os.geteuid() == 0 else []),
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """`local-cluster`: 2 processes x 2 devices of the same run, uninterrupted."""
    root = tmp_path_factory.mktemp("reference")
    env = launch_env(root.parent / "jax-cache")
    two = subprocess.run(
        [
            *LAUNCH,
            "local-cluster",
            "-n",
            "2",
            "--cpu-devices",
            "2",
            "--",
            "run",
            *RUN,
            "--job-log-dir",
            str(root / "two"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert two.returncode == 0, two.stdout[-3000:]
    assert len(train_losses(root / "two")) == STEPS
    return {"env": env, "two": train_losses(root / "two"), "digest": digest(root / "two")}


def assert_resumed_exactly(job: Path, reference: dict, output: str) -> None:
    resumed = re.findall(r"Resumed from step (\d+)", output)
    assert resumed and 0 < int(resumed[0]) < STEPS, output[-4000:]
    assert train_losses(job) == reference["two"]  # every step, both runs' records, bit for bit
    assert digest(job) == reference["digest"]


def mpi_missing() -> str | None:
    """Why mpirun cannot run here (None: it can)."""
    if shutil.which("mpirun") is None:
        return "Open MPI is not installed (mpirun not found): `apt-get install openmpi-bin` (.ci/run does)"
    return None


NO_SLURM = slurm.missing()
NO_MPI = mpi_missing()


def test_a_skip_says_what_is_missing_and_how_to_install_it(monkeypatch):
    """Where the packages are absent the scheduler tests skip with these reasons (`pytest -rs` shows them)."""
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda name, path=None: None if name in ("slurmd", "mpirun") else "/x")
    assert slurm.missing() == (
        "SLURM is not installed (slurmd not found): `apt-get install slurm-wlm munge` (.ci/run does) to run the "
        "SLURM tests"
    )
    assert "mpirun not found" in str(mpi_missing()) and "apt-get install openmpi-bin" in str(mpi_missing())
    monkeypatch.setattr(shutil, "which", lambda name, path=None: "/x")
    assert slurm.missing() is None and mpi_missing() is None
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "must run as root" in str(slurm.missing())


@pytest.mark.skipif(NO_SLURM is not None, reason=str(NO_SLURM))
def test_slurm_job_trains_is_preempted_requeued_and_resumes_bit_for_bit(tmp_path, reference):
    from typer.testing import CliRunner

    from equipax.launch.cli import app

    job, script = tmp_path / "job", tmp_path / "train.sbatch"
    made = CliRunner().invoke(
        app,
        [
            "slurm",
            *RUN,
            "--nodes",
            "1",
            "--tasks-per-node",
            "2",
            "--cpu-devices",
            "2",
            "--job-log-dir",
            str(job),
            "--launcher",
            shlex.join(LAUNCH),
            "-o",
            str(script),
        ],
    )
    assert made.exit_code == 0, made.output
    with slurm.local_slurm(tmp_path / "slurm") as slurm_env:
        env = dict(reference["env"], SLURM_CONF=slurm_env["SLURM_CONF"])

        # Too many tasks for the mesh: every task refuses before JAX starts, naming both numbers.
        bad = subprocess.run(
            [
                "srun",
                "-n",
                "3",
                *LAUNCH,
                "run",
                *RUN,
                "--distributed-auto",
                "--cpu-devices",
                "2",
                "--job-log-dir",
                str(tmp_path / "bad"),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert bad.returncode == 2, bad.stdout + bad.stderr
        assert bad.stderr.count("3 tasks (SLURM_NTASKS=3) x 2 devices each = 6 devices") == 3, bad.stderr
        assert "needs 4: submit 2 tasks" in bad.stderr and "Traceback" not in bad.stderr
        assert not (tmp_path / "bad").exists()

        job_id = (
            subprocess.run(
                ["sbatch", "--parsable", str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, check=True
            )
            .stdout.strip()
            .split(";")[0]
        )
        log = tmp_path / f"c4_22b_2x_smoke-{job_id}.out"

        def show() -> str:
            return (log.read_text() if log.exists() else "(no output yet)")[-4000:] + slurm.scontrol(
                env, "show", "job", job_id
            )

        wait_until(lambda: training_started(job), 240, "the SLURM job did not start training", show)
        subprocess.run(["scancel", "--signal=TERM", job_id], env=env, check=True)

        # exit 75 -> `scontrol requeue` in the script -> the job runs again (slurm.conf: cred_expire=5).
        def ended() -> bool:
            info = slurm.scontrol(env, "show", "job", job_id)
            return "Restarts=1" in info and re.search(r"JobState=(COMPLETED|FAILED|CANCELLED)", info) is not None

        wait_until(ended, 300, "the requeued job did not finish", show)
        info = slurm.scontrol(env, "show", "job", job_id)
        assert "JobState=COMPLETED" in info and "ExitCode=0:0" in info, show()
    output = log.read_text()
    assert "Stopped by SIGTERM after step" in output and "requeueing job" in output, output[-4000:]
    assert "from SLURM's environment" in output
    assert_resumed_exactly(job, reference, output)


@pytest.mark.skipif(NO_MPI is not None, reason=str(NO_MPI))
def test_mpirun_job_trains_is_preempted_and_resumes_bit_for_bit(tmp_path, reference):
    job = tmp_path / "job"
    cmd = [*MPIRUN, *LAUNCH, "run", *RUN, "--distributed-auto", "--cpu-devices", "2", "--job-log-dir", str(job)]
    first = subprocess.Popen(
        cmd, env=reference["env"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        wait_until(lambda: training_started(job) or first.poll() is not None, 240, "mpirun did not start training")
        # A scheduler's SIGTERM reaches every rank (mpirun's own would kill them 1 s later: docs/multihost.md).
        ranks = subprocess.run(["pgrep", "-P", str(first.pid)], capture_output=True, text=True).stdout.split()
        assert len(ranks) == 2, ranks
        for pid in ranks:
            os.kill(int(pid), signal.SIGTERM)
        out, _ = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 75, out[-4000:]  # mpirun passes the ranks' exit code on
    assert out.count("Stopped by SIGTERM after step") == 2, out[-4000:]  # both ranks, the same step
    assert "from Open MPI's environment" in out
    second = subprocess.run(cmd, env=reference["env"], capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stdout[-4000:]
    assert_resumed_exactly(job, reference, second.stdout)


@pytest.mark.skipif(NO_MPI is not None, reason=str(NO_MPI))
def test_mpirun_ranks_short_of_the_mesh_stop_right_after_discovery(tmp_path):
    """Open MPI does not say how many devices a rank has, so the count is checked once the job has
    started: without --cpu-devices each rank has 1 CPU device, 2 in all for the 4-device mesh, and
    every rank stops with exit 2 before training (each rank's code echoed; mpirun lets both finish)."""
    job = tmp_path / "job"
    rank = '"$@"; echo "rank $OMPI_COMM_WORLD_RANK exited $?"'
    cmd = [*MPIRUN, "--mca", "orte_abort_on_non_zero_status", "0", "bash", "-c", rank, "-", *LAUNCH]
    cmd += ["run", *RUN, "--distributed-auto", "--job-log-dir", str(job)]
    done = subprocess.run(cmd, env=launch_env(tmp_path / "jax-cache"), capture_output=True, text=True, timeout=180)
    out = done.stdout + done.stderr
    assert sorted(re.findall(r"rank \d exited \d+", out)) == ["rank 0 exited 2", "rank 1 exited 2"], out[-4000:]
    assert out.count("The job has 2 processes x 1 device each = 2 devices") == 2, out[-4000:]
    assert "needs 4: run 4 processes, or give each process 2 devices" in out and "Traceback" not in out
    assert out.count("from Open MPI's environment") == 2  # both joined: the check came after discovery
    assert not (job / "metrics.jsonl").exists()
