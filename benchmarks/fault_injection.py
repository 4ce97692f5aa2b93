"""Fault injection: kill a tiny `launch run` at random moments, resume, compare bit for bit.

Each trial starts a fresh job directory and runs the same command repeatedly as a user would
after a crash or a preemption: up to `--kills` times the process gets SIGKILL or SIGTERM at a
seeded random moment (during start-up, tokenizer training, steps, evals, or an asynchronous
checkpoint write), then a last run finishes. The final parameters digest and losses
(result.json) must equal those of one uninterrupted run, and metrics.jsonl must hold each
logged step once. Prints a table and writes JSON:

    uv run python benchmarks/fault_injection.py --trials 12 --out benchmarks/results/fault_injection.json

Bit flips (`--bitflips`, on by default): before one resume of each trial, one random bit of one
random file of the newest complete checkpoint is flipped, as bit rot would. That resume must set
the checkpoint aside (its checksums or its files do not read back) and fall back to the previous
one, or, where the bit was not part of the saved state (a timestamp in orbax's metadata),
restore the same values; either way the final run must match.

Figures: kills sent (by signal), SIGTERMs answered with exit 75, kills that left a partial
(temporary) checkpoint directory behind, corrupt checkpoints found on resume without a bit flip
(set aside to `corrupt_checkpoints/`; must be 0), bit flips made and detected, corrupt restores
(a flipped checkpoint restored in a trial that then mismatched; must be 0), and mismatches
against the uninterrupted run (must be 0).

`--elastic`: every run of a trial (the killed ones and the last) starts on a seeded random number
of simulated devices from `--devices` (default 1, 2, 4), never the previous run's, with the mesh's
fsdp axis taking them all, so each resume restores the state onto another mesh; the uninterrupted reference runs on 1
device. The data order must not change: every logged step once, and the losses equal the
reference's to `--rtol` (1e-4: reductions over another sharding sum in another order; the
parameters' digest is not compared).

`--startup-signals`: instead, `--trials` fresh runs each get SIGTERM or SIGINT at a seeded random
moment of start-up; a run that exits 0 lost its signal (must be 0), and none may print a traceback.
"""

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from helpers.toy import TOY, set_args  # noqa: E402

FIRST_STEP = "Compiled and ran the first step"
EXIT_PREEMPTED = 75
LOG_EVERY = 2


ELASTIC_KNOBS = ["mesh.ici_mesh_shape=(1, -1, 1)"]  # fsdp takes every device present


def run_args(steps: int, tokenizer: str, elastic: bool = False) -> list[str]:
    """The tiny run every process of every trial repeats (checkpoints every 2 steps)."""
    return set_args(
        [
            *TOY,
            *(ELASTIC_KNOBS if elastic else []),
            f"train.num_steps={steps}",
            f"train.log_every={LOG_EVERY}",
            "train.eval_every=8",
            "train.checkpoint_every=2",
            "train.keep_checkpoints=2",
            "train.sample.tokens=0",
            f"data.tokenizer={tokenizer}",
        ]
    )


class Proc:
    """One `launch run` process whose output is read on a thread (to time kills after step 1)."""

    def __init__(self, job: Path, args: list[str], env: dict[str, str]):
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "equipax.launch.cli", "run", "--job-log-dir", str(job), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.started = time.monotonic()
        self.lines: list[str] = []
        self.first_step = threading.Event()
        self.first_step_s: float | None = None  # seconds from start to the first step's line
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.append(line)
            if FIRST_STEP in line:
                self.first_step_s = time.monotonic() - self.started
                self.first_step.set()
        self.first_step.set()  # ended before (or without) a first step

    def wait(self, timeout: float) -> int:
        code = self.popen.wait(timeout=timeout)
        self._reader.join(timeout=10)
        if self.popen.stdout is not None:
            self.popen.stdout.close()
        return code

    @property
    def output(self) -> str:
        return "".join(self.lines)


def env_for(cache_dir: Path) -> dict[str, str]:
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PYTHONUNBUFFERED="1",
        # Compiled programs are reused across the many short processes (same executables).
        JAX_COMPILATION_CACHE_DIR=str(cache_dir),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
    return env


def latest_complete(job: Path) -> int:
    d = job / "checkpoints"
    return max((int(p.name) for p in d.iterdir() if p.name.isdigit()), default=0) if d.exists() else 0


def partial_saves(job: Path) -> int:
    d = job / "checkpoints"
    return sum(1 for p in d.iterdir() if ".orbax-checkpoint-tmp" in p.name) if d.exists() else 0


def flip_a_bit(job: Path, rng: random.Random) -> dict | None:
    """Flip one random bit of one random file of the newest complete checkpoint (None if none)."""
    step = latest_complete(job)
    if step == 0:
        return None
    files = sorted(p for p in (job / "checkpoints" / str(step)).rglob("*") if p.is_file() and p.stat().st_size)
    target = rng.choice(files)
    data = bytearray(target.read_bytes())
    offset, bit = rng.randrange(len(data)), rng.randrange(8)
    data[offset] ^= 1 << bit
    target.write_bytes(bytes(data))
    return {"step": step, "file": str(target.relative_to(job)), "offset": offset, "bit": bit}


def with_devices(args: list[str], devices: int | None) -> list[str]:
    return args if devices is None else [*args, "--cpu-devices", str(devices)]


def same_run(a: dict, b: dict, rtol: float | None) -> bool:
    """Outcomes equal: exactly, or (`rtol`) the same logged steps with losses equal to `rtol`."""
    if rtol is None:
        return a == b
    close = lambda x, y: abs(x - y) <= rtol * max(abs(x), abs(y))  # noqa: E731
    return (
        a["logged"] == b["logged"]
        and a["duplicate_records"] == b["duplicate_records"] == 0
        and all(close(x, y) for x, y in zip(a["losses"], b["losses"], strict=True))
        and close(a["final_train_loss"], b["final_train_loss"])
        and close(a["final_eval_loss"], b["final_eval_loss"])
    )


def outcome(job: Path) -> dict:
    res = json.loads((job / "result.json").read_text())
    records = [json.loads(ln) for ln in (job / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    keys = [(r["step"], r["split"]) for r in records]
    # A SIGTERM also logs the step it stopped at; compare the records on the schedule (every 2).
    on_schedule = [r for r in records if r["step"] % LOG_EVERY == 0]
    return {
        "state_digest": res["state_digest"],
        "final_train_loss": res["final_train_loss"],
        "final_eval_loss": res["final_eval_loss"],
        "duplicate_records": len(keys) - len(set(keys)),
        "logged": [(r["step"], r["split"]) for r in on_schedule],
        "losses": [r["loss"] for r in on_schedule],
    }


def reference(
    work: Path, args: list[str], env: dict[str, str], timeout: float, name: str = "reference"
) -> tuple[dict, float, float]:
    """The uninterrupted run: its outcome, seconds to the first step, seconds of training after it."""
    job = work / name
    proc = Proc(job, args, env)
    code = proc.wait(timeout)
    if code != 0:
        raise RuntimeError(f"the uninterrupted run failed ({code}):\n{proc.output}")
    total = time.monotonic() - proc.started
    first = proc.first_step_s or total
    return outcome(job), first, total - first


def trial(
    work: Path,
    index: int,
    rng: random.Random,
    args: list[str],
    env: dict[str, str],
    *,
    kills: int,
    steps: int,
    startup_s: float,
    train_s: float,
    timeout: float,
    signals: list[str] | None = None,
    anchored: bool | None = None,
    first_delay_s: float | None = None,
    bitflip: bool = False,
    devices: list[int] | None = None,
) -> dict:
    """One trial: `kills` interrupted runs, then one that finishes (each on a random one of
    `devices` simulated devices, when given). Returns its record."""
    job = work / f"trial{index}"
    record = {"trial": index, "kills": [], "corrupt_found": 0, "partial_saves": 0, "bitflip": None, "devices": []}
    flip_before = rng.randrange(1, kills + 1) if bitflip else -1  # a resume: there may be a checkpoint
    for k in range(kills + 1):
        remaining = (steps - latest_complete(job)) / steps  # a resumed run has less to do
        if k == flip_before:
            record["bitflip"] = flip_a_bit(job, rng)
        # --elastic: another device count than the previous run's, so every resume changes the mesh
        previous = record["devices"][-1] if record["devices"] else None
        count = rng.choice([d for d in devices if d != previous] or devices) if devices else None
        record["devices"].append(count)
        proc = Proc(job, with_devices(args, count), env)
        if k < kills:
            sig = signals[k] if signals else rng.choice(["SIGKILL", "SIGTERM"])
            # A quarter of the kills land during start-up (imports, tokenizer, compile, restore);
            # the rest during training proper: steps, evals, asynchronous checkpoint writes.
            after_first = rng.random() < 0.75 if anchored is None else anchored
            delay = rng.uniform(0.0, train_s * remaining if after_first else startup_s)
            if k == 0 and first_delay_s is not None:
                delay = first_delay_s
            if after_first:
                proc.first_step.wait(timeout)
            time.sleep(delay)
            sent = proc.popen.poll() is None
            if sent:
                proc.popen.send_signal(getattr(signal, sig))
            code = proc.wait(timeout)
            left = partial_saves(job)
            record["partial_saves"] += left
            record["kills"].append(
                {
                    "signal": sig,
                    "after_first_step": after_first,
                    "delay_s": round(delay, 3),
                    "sent": sent,
                    "exit": code,
                    "partial_save_left": left,
                }
            )
            if sig == "SIGTERM" and sent and code not in (EXIT_PREEMPTED, 0, -signal.SIGTERM):
                raise RuntimeError(f"SIGTERM gave exit {code}:\n{proc.output}")
        else:
            code = proc.wait(timeout)
            if code != 0:
                raise RuntimeError(f"trial {index}: the final run failed ({code}):\n{proc.output}")
        found = proc.output.count("does not restore")
        flipped = record["bitflip"]
        # The flipped checkpoint is read by the first run after the flip that gets to restore.
        if flipped is not None and not flipped.get("detected"):
            line = next(
                (
                    ln.strip()
                    for ln in proc.output.splitlines()
                    if f"the checkpoint of step {flipped['step']} does not restore" in ln
                ),
                "",
            )
            flipped["detected"], flipped["message"] = bool(line), line
            found -= int(bool(line))
        record["corrupt_found"] += found
    record["outcome"] = outcome(job)
    return record


def run_trials(
    trials: int,
    *,
    seed: int = 0,
    steps: int = 24,
    kills: int = 2,
    tokenizer: str = "sentencepiece",
    work: Path | None = None,
    signals: list[str] | None = None,
    anchored: bool | None = None,
    first_delay_s: float | None = None,
    timeout: float = 300.0,
    bitflips: bool = False,
    devices: list[int] | None = None,
    rtol: float = 1e-4,
) -> dict:
    """Run the reference and `trials` fault trials; return the figures (and every trial's record).

    `devices`: the elastic mode (each run on a random one of these device counts, the reference
    on 1; outcomes compared to `rtol`)."""
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        work = work or Path(tmp)
        env = env_for(work / "jax-cache")
        args = run_args(steps, tokenizer, elastic=bool(devices))
        ref, startup_s, train_s = reference(work, with_devices(args, 1 if devices else None), env, timeout)
        rng = random.Random(seed)
        records = []
        for i in range(trials):
            rec = trial(
                work,
                i,
                rng,
                args,
                env,
                kills=kills,
                steps=steps,
                startup_s=startup_s,
                train_s=train_s,
                timeout=timeout,
                signals=signals,
                anchored=anchored,
                first_delay_s=first_delay_s,
                bitflip=bitflips,
                devices=devices,
            )
            rec["match"] = same_run(rec.pop("outcome"), ref, rtol if devices else None)
            records.append(rec)
            flip = rec["bitflip"]
            flip_text = (
                f", bit flip in {flip['file']} {'detected' if flip['detected'] else 'not detected'}" if flip else ""
            )
            on = f" on {rec['devices']} devices" if devices else ""
            print(
                f"trial {i}{on}: {[(k['signal'], k['exit']) for k in rec['kills']]} partial saves left "
                f"{rec['partial_saves']}, corrupt found {rec['corrupt_found']}{flip_text}, "
                f"{'match' if rec['match'] else 'MISMATCH'}",
                flush=True,
            )
    sent = [k for r in records for k in r["kills"] if k["sent"]]
    flips = [r for r in records if r["bitflip"] is not None]
    return {
        "trials": trials,
        "seed": seed,
        "steps": steps,
        "tokenizer": tokenizer,
        "elastic_devices": devices,
        "device_changes_on_resume": sum(sum(a != b for a, b in zip(r["devices"], r["devices"][1:])) for r in records),
        "kills_sent": len(sent),
        "sigkill": sum(k["signal"] == "SIGKILL" for k in sent),
        "sigterm": sum(k["signal"] == "SIGTERM" for k in sent),
        "sigterm_exit_75": sum(k["signal"] == "SIGTERM" and k["exit"] == EXIT_PREEMPTED for k in sent),
        "kills_leaving_partial_save": sum(k["partial_save_left"] > 0 for k in sent),
        "corrupt_checkpoints_found": sum(r["corrupt_found"] for r in records),
        "bitflips": len(flips),
        "bitflips_detected": sum(r["bitflip"]["detected"] for r in flips),
        "bitflips_in_array_files_detected": f"{sum(r['bitflip']['detected'] for r in flips if _array_file(r))}"
        f"/{sum(1 for r in flips if _array_file(r))}",
        "corrupt_restores": sum(not r["bitflip"]["detected"] and not r["match"] for r in flips),
        "mismatches": sum(not r["match"] for r in records),
        "uninterrupted_run_s": round(startup_s + train_s, 1),
        "uninterrupted_training_s": round(train_s, 1),
        "wall_s": round(time.monotonic() - t0, 1),
        "records": records,
    }


def startup_signals(
    trials: int, *, seed: int = 0, steps: int = 24, tokenizer: str = "sentencepiece", timeout: float = 300.0
) -> dict:
    """`--startup-signals`: SIGTERM or SIGINT at a seeded random moment of start-up, one fresh run each.

    The moment is uniform in [0, the uninterrupted run's seconds to its first step]: the imports,
    the config, JAX's device start-up, the data and the compile. A run that then exits 0 lost the
    signal (it trained on as if none came); each must exit 75 (or die of the signal itself, when it
    lands before the interpreter ran the entry point's first line), with no traceback.
    """
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        env = env_for(work / "jax-cache")
        args = run_args(steps, tokenizer)
        reference(work, args, env, timeout)  # fills the compilation cache that every later run reads
        _, startup_s, _ = reference(work, args, env, timeout, name="warm-reference")
        rng = random.Random(seed)
        records = []
        for i in range(trials):
            sig = rng.choice([signal.SIGTERM, signal.SIGINT])
            delay = rng.uniform(0.0, startup_s)
            proc = Proc(work / f"startup{i}", args, env)
            time.sleep(max(0.0, delay - (time.monotonic() - proc.started)))
            sent = proc.popen.poll() is None
            if sent:
                proc.popen.send_signal(sig)
            code = proc.wait(timeout)
            rec = {
                "signal": sig.name,
                "delay_s": round(delay, 3),
                "fraction_of_startup": round(delay / startup_s, 3),
                "sent": sent,
                "exit": code,
                # Landed after this run's first step: the loop's own path (checkpoint, then 75), not start-up.
                "during_startup": proc.first_step_s is None or delay < proc.first_step_s,
                "lost": sent and code == 0 and (proc.first_step_s is None or delay < proc.first_step_s),
                "traceback": "Traceback" in proc.output or "Exception ignored" in proc.output,
            }
            records.append(rec)
            print(f"startup signal {i}: {sig.name} at {delay:.2f} s -> exit {code}", flush=True)
    sent = [r for r in records if r["sent"] and r["during_startup"]]
    return {
        "startup_trials": trials,
        "landed_after_the_first_step": sum(r["sent"] and not r["during_startup"] for r in records),
        "seed": seed,
        "startup_s": round(startup_s, 2),
        "signals_sent": len(sent),
        "exit_75": sum(r["exit"] == EXIT_PREEMPTED for r in sent),
        "killed_by_the_signal": sum(r["exit"] < 0 for r in sent),
        "lost_signals": sum(r["lost"] for r in sent),
        "tracebacks": sum(r["traceback"] for r in sent),
        "other_exits": sorted(
            {r["exit"] for r in sent} - {0, EXIT_PREEMPTED} - {r["exit"] for r in sent if r["exit"] < 0}
        ),
        "wall_s": round(time.monotonic() - t0, 1),
        "records": records,
    }


def _array_file(record: dict) -> bool:
    """The flipped file holds array data (orbax's OCDBT data files)."""
    return "/state/" in record["bitflip"]["file"] and "/d/" in record["bitflip"]["file"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--kills", type=int, default=2, help="interrupted runs per trial before the last one")
    p.add_argument("--tokenizer", choices=["sentencepiece", "byte"], default="sentencepiece")
    p.add_argument(
        "--bitflips",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="flip one bit of the newest checkpoint before one resume of each trial",
    )
    p.add_argument(
        "--startup-signals",
        action="store_true",
        help="instead: --trials runs, each sent SIGTERM or SIGINT at a random moment of start-up; count lost signals",
    )
    p.add_argument(
        "--elastic",
        action="store_true",
        help="start every run of a trial on a random device count from --devices (resume onto another mesh)",
    )
    p.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4], help="device counts for --elastic")
    p.add_argument("--rtol", type=float, default=1e-4, help="--elastic: loss tolerance against the reference")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    a = p.parse_args()
    if a.startup_signals:
        figures = startup_signals(a.trials, seed=a.seed, steps=a.steps, tokenizer=a.tokenizer)
        for k, v in figures.items():
            print(f"{k:28s} {v}") if k != "records" else None
        if a.out:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(figures, indent=2) + "\n")
        sys.exit(1 if figures["lost_signals"] or figures["tracebacks"] or figures["other_exits"] else 0)
    figures = run_trials(
        a.trials,
        seed=a.seed,
        steps=a.steps,
        kills=a.kills,
        tokenizer=a.tokenizer,
        bitflips=a.bitflips,
        devices=a.devices if a.elastic else None,
        rtol=a.rtol,
    )
    summary = {k: v for k, v in figures.items() if k != "records"}
    for k, v in summary.items():
        print(f"{k:28s} {v}")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(figures, indent=2) + "\n")
    sys.exit(1 if figures["mismatches"] or figures["corrupt_restores"] else 0)


if __name__ == "__main__":
    main()
