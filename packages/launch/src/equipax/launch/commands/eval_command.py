"""`launch eval`: Pax's eval mode as its own command: evaluate a training job's checkpoints.

Every checkpoint not evaluated yet is restored (model only) and evaluated on the job's eval input;
with `--follow`, new checkpoints are evaluated as they land until the training job finishes. The
results go to `<job>/eval_job/metrics.jsonl` and TensorBoard `<job>/summaries/eval_job/` (beside
the run's own `train` and `eval`); nothing of the training job's own files is touched, and a
second `launch eval` skips the steps already recorded.
"""

import json
import math
import time
from typing import TYPE_CHECKING, Annotated, Any

import typer

from equipax.core.knobs import ConfigError
from equipax.launch.commands.common import CpuDevicesOption, JobSetOption, err, fail, out, resolve_job
from equipax.launch.commands.decode_command import JobDirOption
from equipax.launch.configs.experiment import ExperimentConfig
from equipax.launch.store.storage import COMMIT_MARKER, AnyPath, is_remote, job_path, mtime

if TYPE_CHECKING:
    from equipax.data import BaseInput
    from equipax.launch.program.program import Program
    from equipax.launch.tasks import Inputs

__all__ = ["eval_cmd", "EVAL_DIR", "EvalJob"]

EVAL_DIR = "eval_job"

# What `launch eval` does with a checkpoint that does not restore (the rest of its message).
SKIPPED = (
    "skipped it (nothing is recorded for it) and went on with the others; a `launch run` of the job "
    "moves such a checkpoint to <job>/corrupt_checkpoints/ when it resumes"
)


def eval_cmd(
    job_log_dir: JobDirOption,
    follow: Annotated[
        bool, typer.Option("--follow", help="Keep evaluating new checkpoints until the job finishes.")
    ] = False,
    eval_batches: Annotated[
        int | None,
        typer.Option(
            "--eval-batches",
            help="Batches per checkpoint (0 = the whole eval set; default: the job's train.eval_batches).",
        ),
    ] = None,
    poll_seconds: Annotated[float, typer.Option("--poll-seconds", help="--follow: seconds between looks.")] = 30.0,
    idle_timeout: Annotated[
        float, typer.Option("--idle-timeout", help="--follow: stop after this many seconds without a new checkpoint.")
    ] = 3600.0,
    multiple_choice: Annotated[
        str | None,
        typer.Option(
            "--multiple-choice",
            help="Also score each checkpoint on this built-in multiple-choice set (shakespeare_next_line); "
            "default: the eval input's own set, if it defines one.",
        ),
    ] = None,
    cpu_devices: CpuDevicesOption = None,
    set_: JobSetOption = None,
) -> None:
    """Evaluate a training job's checkpoints on its eval input (Pax's eval mode); --follow for a running job."""
    import dataclasses

    from equipax.launch.cluster.devices import use_cpu_devices

    job_log_dir = job_path(job_log_dir)

    for name, value in (("--poll-seconds", poll_seconds), ("--idle-timeout", idle_timeout)):
        if not (math.isfinite(value) and value > 0):
            fail(f"{name} must be a number of seconds > 0; got {value}.")
    if eval_batches is not None and eval_batches < 0:
        fail(f"--eval-batches must be >= 0 (0 = the whole eval set); got {eval_batches}.")
    from equipax.launch.inference.multiple_choice import check_set_name

    check_set_name(multiple_choice)
    if follow:
        _wait_for_the_job(job_log_dir, poll_seconds, idle_timeout)
    cfg = resolve_job(job_log_dir, set_)[1]
    if eval_batches is not None:
        try:
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, eval_batches=eval_batches))
        except ValueError as e:
            fail(str(e))
    use_cpu_devices(cpu_devices)
    job = EvalJob(cfg, job_log_dir, multiple_choice=multiple_choice)
    job.run(follow=follow, poll_seconds=poll_seconds, idle_timeout=idle_timeout)
    if job.unreadable:
        steps = ", ".join(map(str, job.unreadable))
        fail(
            f"The checkpoint(s) of step(s) {steps} in {job_log_dir} did not restore and were not evaluated "
            f"(the warnings above say why); the others are recorded in {job.path}. Restore the files, or let "
            "`launch run` on the job set them aside (it resumes from the newest checkpoint that restores)."
        )


def _wait_for_the_job(job_dir: AnyPath, poll_seconds: float, idle_timeout: float) -> None:
    """--follow: wait for a job started at the same moment (`launch run ... & launch eval --follow`)
    to write its config.json, up to --idle-timeout; then `load_config` names what is missing."""
    config, waited, said = job_dir / "config.json", 0.0, False
    while not config.exists() and waited < idle_timeout:
        if not said:
            err.print(f"Waiting for the job in {job_dir} to start (no config.json yet)...", highlight=False)
            said = True
        pause = min(poll_seconds, 1.0, idle_timeout - waited)
        time.sleep(pause)
        waited += pause


class EvalJob:
    """The eval job of one training job: what it evaluated, and the program that evaluates."""

    def __init__(self, cfg: ExperimentConfig, job_dir: AnyPath, *, multiple_choice: str | None = None) -> None:
        from equipax.launch.jobdir.summaries import read_metrics

        self.multiple_choice_name = multiple_choice
        self.scorer: Any = None  # (set, tokenizer, seq_len), at the first checkpoint, when there is a set
        self.cfg: ExperimentConfig = cfg
        self.job_dir: AnyPath = job_path(job_dir)
        self.path: AnyPath = self.job_dir / EVAL_DIR / "metrics.jsonl"
        self.tb_dir: AnyPath = self.job_dir / "summaries" / EVAL_DIR
        self.done: set[int] = {int(r["step"]) for r in read_metrics(self.path)} if self.path.exists() else set()
        # (program, eval input, unit), at the first checkpoint
        self.program: tuple[Program, BaseInput, str] | None = None
        self.writer: Any = None  # MetricsWriter, at the first checkpoint
        self.unreadable: list[int] = []  # steps whose checkpoint did not restore: skipped, nothing recorded

    def run(self, *, follow: bool, poll_seconds: float, idle_timeout: float) -> None:
        from equipax.launch.inference.trained_job import checkpoint_steps, pick_step

        if not follow:
            pick_step(self.job_dir, None)  # no checkpoint: exit 2, saying to wait or use --follow
        last_new = time.monotonic()
        try:
            while True:
                todo = [s for s in checkpoint_steps(self.job_dir) if s not in self.done]
                for step in todo:
                    self.evaluate(step, vanished_ok=follow)
                    last_new = time.monotonic()
                if not follow:
                    if not todo:
                        out.print(
                            f"Every checkpoint of {self.job_dir} is already evaluated ({self.path}).", highlight=False
                        )
                    return
                if self.finished():
                    out.print(
                        f"The training job finished; evaluated {len(self.done)} checkpoint(s) -> {self.path}.",
                        highlight=False,
                    )
                    return
                if time.monotonic() - last_new > idle_timeout:
                    out.print(
                        f"No new checkpoint for {idle_timeout:.0f} s and the job has not finished; stopping "
                        "(run the same command again to carry on).",
                        highlight=False,
                    )
                    return
                time.sleep(poll_seconds)
        finally:
            if self.writer is not None:
                try:
                    self.writer.close()
                except OSError as e:  # each step's scalars were flushed before its line was written
                    self.writer.abandon()
                    err.print(
                        f"warning: closing the TensorBoard files in {self.tb_dir} failed ({e.strerror or e}); "
                        "every recorded step was on disk before it.",
                        highlight=False,
                    )

    def finished(self) -> bool:
        """The training job wrote result.json after its newest checkpoint, and that step is evaluated."""
        from equipax.launch.inference.trained_job import checkpoint_steps

        result = self.job_dir / "result.json"
        steps = checkpoint_steps(self.job_dir)
        if not result.exists() or not steps:
            return False
        try:
            final = json.loads(result.read_text()).get("final_step")
        except (OSError, ValueError):
            return False  # being written
        newest = self.job_dir / "checkpoints" / str(steps[-1])
        if is_remote(newest):  # an object store's folder has no time of its own: its commit marker's
            newest = newest / COMMIT_MARKER
        return final in self.done and mtime(result) >= mtime(newest)

    def _build(self) -> None:
        from equipax.launch.inference.trained_job import check_tokenizer, local_mesh
        from equipax.launch.jobdir.summaries import MetricsWriter
        from equipax.launch.program.program import build_program
        from equipax.launch.tasks import family

        check_tokenizer(self.cfg, self.job_dir)
        cfg, mesh, note = local_mesh(self.cfg)
        if note:
            err.print(note, highlight=False)
        fam = family(cfg)
        inputs = fam.build_inputs(cfg, self.job_dir, mesh=mesh, log=lambda m: err.print(m, highlight=False))
        self.program = (build_program(cfg, mesh), inputs.eval, fam.UNIT)
        self._build_scorer(inputs)
        self.path.parent.mkdir(exist_ok=True)
        self.writer = MetricsWriter(self.job_dir, path=self.path, summaries=self.tb_dir.parent)

    def _build_scorer(self, inputs: "Inputs") -> None:
        from equipax.launch.configs.experiment import as_lm, is_lm
        from equipax.launch.inference.multiple_choice import multiple_choice_set

        mc = multiple_choice_set(self.multiple_choice_name, inputs.eval)
        tokenizer = inputs.extra.get("tokenizer")
        seq_len = as_lm(self.cfg).data.seq_len if is_lm(self.cfg) else None
        if mc is not None and (tokenizer is None or seq_len is None):
            raise ConfigError(
                f"--multiple-choice scores text with a language model; this job ({self.cfg.name}) has no "
                "tokenizer (it is not a language-model job). Drop --multiple-choice."
            )
        self.scorer = None if mc is None else (mc, tokenizer, seq_len)

    def _score(self, model: Any, program: "Program", rows: int) -> dict[str, float]:
        from equipax.launch.inference.multiple_choice import score_multiple_choice

        if self.scorer is None:
            return {}
        mc, tokenizer, seq_len = self.scorer
        return score_multiple_choice(
            mc,
            model,
            program,
            tokenizer,
            seq_len=seq_len,
            rows_per_batch=rows,
            log=lambda m: err.print(m, highlight=False),
        )

    def evaluate(self, step: int, *, vanished_ok: bool) -> None:
        """Restore checkpoint `step` (model only), evaluate it, record it."""
        from equipax.launch.inference.trained_job import CheckpointUnreadable, restore_model
        from equipax.launch.training.builtin_hooks import eval_pass, eval_record

        if self.program is None:
            self._build()
        assert self.program is not None
        program, eval_input, unit = self.program
        start = time.monotonic()
        try:
            model, model_state = restore_model(
                self.job_dir, step, program, remedy=SKIPPED, log=lambda m: err.print(m, highlight=False)
            )
        except CheckpointUnreadable as e:
            err.print(f"warning: {e}", highlight=False)
            self.done.add(step)
            self.unreadable.append(step)
            return
        except ConfigError:
            if vanished_ok and not (self.job_dir / "checkpoints" / str(step)).exists():
                err.print(
                    f"note: checkpoint {step} was removed before it could be evaluated (the run keeps "
                    f"train.keep_checkpoints={self.cfg.train.keep_checkpoints}); skipped.",
                    highlight=False,
                )
                self.done.add(step)
                return
            raise
        m = eval_pass(program, eval_input, model, model_state, limit=self.cfg.train.eval_batches)
        scored = self._score(model, program, eval_input.batch_size)
        record = eval_record(m, unit) | scored | {"seconds": time.monotonic() - start}
        try:
            self.writer.write(step, EVAL_DIR, record, flush=True)
        except OSError as e:
            self.writer.abandon()
            recorded = sorted(self.done - set(self.unreadable))
            raise ConfigError(
                f"Could not record the evaluation of step {step} in {self.path} or {self.tb_dir} "
                f"({e.strerror or e}{': ' + str(e.filename) if e.filename else ''}). Nothing of it was kept; "
                f"{'steps ' + ', '.join(map(str, recorded)) + ' are' if recorded else 'no step is'} recorded. "
                "Free space (or fix the permissions) and run the same command again: it evaluates the "
                "checkpoints not recorded yet."
            ) from None
        self.done.add(step)
        out.print(
            f"step {step}: eval loss {m['loss']:.4f}, accuracy {m['accuracy']:.3f} on {m['weight']:,.0f} "
            f"{unit}{''.join(f', {k} {v:.3f}' for k, v in scored.items())} ({record['seconds']:.1f} s)",
            highlight=False,
        )
