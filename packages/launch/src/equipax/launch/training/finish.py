"""The end of a run: final eval numbers, the family's extras (the LM's sample), result.json, plots.

The final checkpoint is written in the background while these are computed; `finish` waits for it
to be complete on disk before result.json says the run finished.
"""

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from etils import epath
from rich.console import Console

from equipax.launch.jobdir.checksums import tree_digest
from equipax.launch.jobdir.ownership import write_text_atomic
from equipax.launch.jobdir.plots import NO_MATPLOTLIB, plot_loss
from equipax.launch.jobdir.summaries import read_metrics
from equipax.launch.store.storage import AnyPath
from equipax.launch.training.ahead import CHECKSUMS, wait_for
from equipax.launch.training.builtin_hooks import evaluate
from equipax.launch.training.hooks import Hook, RunContext

if TYPE_CHECKING:
    from equipax.core.step import TrainState
    from equipax.launch.tasks import Family

__all__ = ["finish", "RunResult"]


@dataclasses.dataclass
class RunResult:
    """What a finished run reports (also written to result.json)."""

    job_dir: AnyPath
    start_step: int
    final_step: int
    final_train_loss: float | None
    final_eval_loss: float | None
    final_eval_accuracy: float | None
    state_digest: str
    extra: dict[str, Any]  # the family's (unigram_entropy, sample) and the epoch history


def finish(
    run: RunContext,
    hooks: Sequence[Hook],
    state: "TrainState[Any]",
    fam: "Family",
    *,
    last_train: Mapping[str, float],
    outputs: Mapping[str, Any],
    console: Console,
) -> RunResult:
    """After the last step: final eval numbers, the family's extras, result.json and plots; closes
    the run's checkpointer (waits for the final checkpoint's write) before writing result.json.

    Arguments:
        run: the finished run.
        hooks: its hooks (each adds its `result`).
        state: the final train state.
        fam: the task family (its `finish` adds the LM's sample).
        last_train: the newest train record.
        outputs: every hook's newest output (the final eval is the eval hook's).
        console: where the sample is printed.
    """
    last_eval = outputs.get("eval", {})
    if run.start == run.total:
        # Resumed from the final checkpoint (killed after it): report what the finished run did.
        last_train = (
            next((r for r in reversed(read_metrics(run.writer.path)) if r.get("split") == "train"), {})
            if run.writer.path.exists()
            else {}
        )
        last_eval = evaluate(run, state)
    log = lambda m: console.print(m, highlight=False)  # noqa: E731
    extra = dict(run.inputs.info)
    extra |= fam.finish(run.cfg, state.model, run.inputs, key=run.training.keys.sample, log=log)
    if extra.get("sample") is not None:
        run.writer.add_text("eval", "sample", extra["sample"], run.total)
        log("[bold]Sample:[/]")
        console.print(extra["sample"], highlight=False, markup=False)
    for hook in hooks:
        extra |= hook.result(run, outputs)
    run.writer.close()
    wait_for(run.ahead, CHECKSUMS)
    digest = tree_digest(state, run.checkpointer.checksums(state))  # the final save's sums
    if (
        run.primary
        and plot_loss(read_metrics(run.writer.path), run.job_dir / "plots" / "loss.png", title=run.cfg.name) is None
    ):
        log(f"note: plots/loss.png not written: {NO_MATPLOTLIB}")
    run.checkpointer.close()  # the final checkpoint complete on disk before result.json
    result = RunResult(
        job_dir=run.job_dir,
        start_step=run.start,
        final_step=run.total,
        final_train_loss=last_train.get("loss"),
        final_eval_loss=last_eval.get("loss"),
        final_eval_accuracy=last_eval.get("accuracy"),
        state_digest=digest,
        extra=extra,
    )
    if run.primary:
        summary = {
            k: (str(v) if isinstance(v, (Path, epath.Path)) else v)
            for k, v in dataclasses.asdict(result).items()
            if k != "extra"
        } | extra
        write_text_atomic(run.job_dir / "result.json", json.dumps(_finite_or_null(summary), indent=2) + "\n")
    if result.final_eval_loss is not None:
        line = f"Final eval loss {result.final_eval_loss:.4f}, accuracy {result.final_eval_accuracy:.4f}"
        if extra.get("unigram_entropy") is not None:
            line += f" (nats/token; unigram entropy of the training tokens: {extra['unigram_entropy']:.4f})"
        log(line)
    return result


def _finite_or_null(value: Any) -> Any:
    """`value` with NaN and infinities as None: result.json is strict JSON (a bare `NaN` is not),
    which every JSON reader (jq, JavaScript) accepts; metrics.jsonl keeps the values as logged."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(v) for v in value]
    return value
