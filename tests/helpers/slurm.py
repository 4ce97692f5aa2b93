"""A one-node SLURM cluster on localhost, for tests that submit real jobs (Debian's slurm-wlm + munge).

`local_slurm(root)` writes a munge key and a slurm.conf under `root`, starts munged, slurmctld and
slurmd in the foreground (this process owns and stops them), waits until the node is idle and
yields the environment that points sbatch/srun/scancel at it (`SLURM_CONF`). Everything talks over
127.0.0.1 on free ports; nothing outside `root` is touched. `.ci/run` installs the packages;
`missing()` says why a test skips where they are absent.
"""

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from equipax.launch.cluster.local_cluster import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scancel", "scontrol", "squeue", "sinfo")


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def missing() -> str | None:
    """Why a local SLURM cannot run here (None: it can)."""
    absent = [n for n in (*DAEMONS, *CLIENTS) if _which(n) is None]
    if absent:
        return (
            f"SLURM is not installed ({', '.join(absent)} not found): `apt-get install slurm-wlm munge` "
            "(.ci/run does) to run the SLURM tests"
        )
    if os.geteuid() != 0:
        return (
            f"the test SLURM needs root (this process runs as uid {os.geteuid()}): slurmd starts each job step as "
            "its user and must run as root"
        )
    return None


def _conf(root: Path, cpus: int) -> str:
    return "\n".join(
        [
            "ClusterName=equipax-test",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # A requeued job may start again once the old run's credentials expire (cred_expire, 120 s by
            # default, which SLURM also waits before it starts a requeued job): seconds here.
            f"AuthInfo=socket={root}/munge/munge.socket,cred_expire=5",
            f"StateSaveLocation={root}/state",
            f"SlurmdSpoolDir={root}/spool",
            f"SlurmctldPidFile={root}/slurmctld.pid",
            f"SlurmdPidFile={root}/slurmd.pid",
            f"SlurmctldLogFile={root}/log/slurmctld.log",
            f"SlurmdLogFile={root}/log/slurmd.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "SchedulerType=sched/builtin",
            # The main scheduling loop starts a pending job whose begin time has come (a requeued one): every
            # 60 s by default, every 2 s here.
            "SchedulerParameters=sched_interval=2",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ReturnToService=2",
            "JobRequeue=1",
            "SlurmdParameters=config_overrides",  # the node may declare more CPUs than the machine has
            f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=4000 State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@contextlib.contextmanager
def local_slurm(root: Path, *, cpus: int = 4, timeout: float = 60.0) -> Iterator[dict[str, str]]:
    """Run munged + slurmctld + slurmd under `root`; yield the environment for SLURM's clients."""
    for d in ("munge", "state", "spool", "log"):
        (root / d).mkdir(parents=True, exist_ok=True)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    (root / "munge").chmod(0o700)
    conf = root / "slurm.conf"
    conf.write_text(_conf(root, cpus))
    env = dict(os.environ, SLURM_CONF=str(conf))
    procs: list[subprocess.Popen] = []
    try:
        munge = root / "munge"
        procs.append(
            subprocess.Popen(
                [
                    _which("munged"),
                    "--foreground",
                    "--force",
                    f"--socket={munge}/munge.socket",
                    f"--key-file={key}",
                    f"--log-file={munge}/munged.log",
                    f"--pid-file={munge}/munged.pid",
                    f"--seed-file={munge}/seed",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )
        )
        _wait(lambda: (munge / "munge.socket").exists(), timeout, "munged did not start", root)
        procs.append(
            subprocess.Popen(
                [_which("slurmctld"), "-D", "-i", "-f", str(conf)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )
        )
        procs.append(
            subprocess.Popen(
                [_which("slurmd"), "-D", "-f", str(conf), "-N", "localhost"],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )
        )

        def idle() -> bool:
            state = subprocess.run([_which("sinfo"), "-h", "-o", "%T"], env=env, capture_output=True, text=True)
            return state.stdout.strip() == "idle"

        _wait(idle, timeout, "the SLURM node did not become idle", root)
        yield env
    finally:
        if len(procs) == len(DAEMONS):  # job steps outlive slurmd: end what a failed test left running
            _cancel_all(env)
        for proc in reversed(procs):
            _stop(proc)


def _cancel_all(env: dict[str, str]) -> None:
    jobs = subprocess.run([_which("squeue"), "-h", "-o", "%i"], env=env, capture_output=True, text=True).stdout.split()
    if not jobs:
        return
    subprocess.run([_which("scancel"), "--full", "--signal=KILL", *jobs], env=env, capture_output=True)
    subprocess.run([_which("scancel"), *jobs], env=env, capture_output=True)
    deadline = time.monotonic() + 30
    while (
        time.monotonic() < deadline
        and subprocess.run([_which("squeue"), "-h", "-o", "%i"], env=env, capture_output=True, text=True).stdout.split()
    ):
        time.sleep(0.5)


def _wait(ready, timeout: float, what: str, root: Path) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted((root / "log").glob("*.log")))
            raise RuntimeError(f"{what} within {timeout:.0f} s\n{logs}")
        time.sleep(0.2)


def job_state(job_id: str, env: dict[str, str]) -> str:
    """The job's state ("PENDING", "RUNNING", ...), or "" once it has left the queue."""
    out = subprocess.run([_which("squeue"), "-h", "-j", job_id, "-o", "%T"], env=env, capture_output=True, text=True)
    return out.stdout.strip()


def scontrol(env: dict[str, str], *args: str) -> str:
    return subprocess.run([_which("scontrol"), *args], env=env, capture_output=True, text=True, check=True).stdout
