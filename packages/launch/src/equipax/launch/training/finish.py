"""The end of a run: final eval numbers, the family's extras (the LM's sample), result.json, plots."""

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from equipax.launch.jobdir.checksums import tree_digest
from equipax.launch.training.hooks import Hook, evaluate
from equipax.launch.jobdir.ownership import write_text_atomic
from equipax.launch.jobdir.plots import plot_loss
from equipax.launch.jobdir.summaries import read_metrics

if TYPE_CHECKING:
    from equipax.launch.training.loop import Run

__all__ = ["finish", "RunResult"]


@dataclasses.dataclass
class RunResult:
    """What a finished run reports (also written to result.json)."""

    job_dir: Path
    start_step: int
    final_step: int
    final_train_loss: float | None
    final_eval_loss: float | None
    final_eval_accuracy: float | None
    state_digest: str
    extra: dict[str, Any]  # the family's (unigram_entropy, sample) and the epoch history



def finish(run: "Run", hooks: list[Hook], state: Any, fam: Any, log: Any) -> RunResult:
    """After the last step: final eval numbers, the family's extras, result.json and plots."""
    if run.start == run.total:
        # Resumed from the final checkpoint (killed after it): report what the finished run did.
        run.last_train = next((r for r in reversed(read_metrics(run.writer.path)) if r.get("split") == "train"),
                              {}) if run.writer.path.exists() else {}
        run.last_eval = evaluate(run, state)
    extra = dict(run.inputs.info)
    extra |= fam.finish(run.cfg, state.model, run.inputs, key=run.training.keys.sample, log=log)
    if extra.get("sample") is not None:
        run.writer.add_text("eval", "sample", extra["sample"], run.total)
        log("[bold]Sample:[/]")
        run.progress.console.print(extra["sample"], highlight=False, markup=False)
    for hook in hooks:
        extra |= hook.result(run)
    run.writer.close()
    result = RunResult(job_dir=run.job_dir, start_step=run.start, final_step=run.total,
                       final_train_loss=run.last_train.get("loss"), final_eval_loss=run.last_eval.get("loss"),
                       final_eval_accuracy=run.last_eval.get("accuracy"), state_digest=tree_digest(state),
                       extra=extra)
    if run.primary:
        plot_loss(read_metrics(run.writer.path), run.job_dir / "plots" / "loss.png", title=run.cfg.name)
        summary = {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(result).items()
                   if k != "extra"} | extra
        write_text_atomic(run.job_dir / "result.json", json.dumps(summary, indent=2) + "\n")
    if result.final_eval_loss is not None:
        line = (f"Final eval loss {result.final_eval_loss:.4f}, accuracy {result.final_eval_accuracy:.4f}")
        if extra.get("unigram_entropy") is not None:
            line += f" (nats/token; unigram entropy of the training tokens: {extra['unigram_entropy']:.4f})"
        log(line)
    return result
