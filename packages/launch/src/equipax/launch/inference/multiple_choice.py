"""`launch eval --multiple-choice NAME`: score a job's checkpoints on a multiple-choice set.

Each choice is scored by the model's log-likelihood of its tokens after the item's context
(`equipax.models.score`): the context is `[bos] + encode(context)`, the choice `encode(choice)`
(cut to its first `seq_len - 1` tokens where it is longer, so that a context token precedes it:
every choice of a short-window model is then compared on the same number of tokens; the run
says how many were cut), and every (item, choice) pair is one row of the job's eval batch, scored
in one forward pass per batch on the job's mesh. The set's score metrics (`equipax.data.metrics`) turn the scores into
the record's `<set>/<metric>` numbers. The set is the one named on the command line (a built-in,
`MULTIPLE_CHOICE_SETS`), else the one the job's eval input defines (`BaseInput.multiple_choice`).
"""

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from equipax.core.knobs import ConfigError
from equipax.data.metrics import MULTIPLE_CHOICE_SETS, MultipleChoiceSet

if TYPE_CHECKING:
    from equipax.data import BaseInput
    from equipax.launch.program.program import Program

__all__ = ["check_set_name", "multiple_choice_set", "score_multiple_choice"]


def check_set_name(name: str | None) -> None:
    """ConfigError unless `name` is None or a built-in set's name (checked before any work)."""
    if name is not None and name not in MULTIPLE_CHOICE_SETS:
        raise ConfigError(
            f"--multiple-choice {name!r} is not a built-in multiple-choice set; the sets are "
            f"{', '.join(sorted(MULTIPLE_CHOICE_SETS))}. An input of your own defines its set with "
            'BaseInput.multiple_choice() (docs/extending.md, "Metrics defined by the input").'
        )


def multiple_choice_set(name: str | None, eval_input: "BaseInput") -> MultipleChoiceSet | None:
    """The set to score: the built-in `name`, else the eval input's own (None: none)."""
    if name is None:
        return eval_input.multiple_choice()
    check_set_name(name)
    return MULTIPLE_CHOICE_SETS[name]()


def score_multiple_choice(
    mc: MultipleChoiceSet,
    model: Any,
    program: "Program",
    tokenizer: Any,
    *,
    seq_len: int,
    rows_per_batch: int,
    log: Callable[[str], object] = print,
) -> dict[str, float]:
    """The set's metrics for `model`: `{"<set>/<metric>": value}`.

    Arguments:
        mc: the set.
        model: the restored model (on `program`'s mesh).
        program: the job's `Program` (its batch sharding places the rows).
        tokenizer: the job's tokenizer.
        seq_len: tokens per row (the job's `data.seq_len`); longer contexts keep their end.
        rows_per_batch: rows per forward pass on this host (the eval input's batch size).
        log: where the note on cut choices goes.
    """
    from equipax.launch.inference.sampling import host_array
    from equipax.models.score import continuation_rows, row_log_likelihoods

    pairs, sizes, cut = [], [], 0
    for item in mc.items:
        context = [tokenizer.bos_id, *tokenizer.encode(item.context)]
        for choice in item.choices:
            tokens = tokenizer.encode(choice)
            cut += len(tokens) > seq_len - 1
            pairs.append((context, tokens[: seq_len - 1]))
            sizes.append(len(choice))
    if cut:
        log(
            f"note: {cut} of {len(pairs)} choices of {mc.name} are longer than the job's rows allow "
            f"(data.seq_len={seq_len}); each is scored on its first {seq_len - 1} tokens."
        )
    try:
        rows = continuation_rows(pairs, seq_len=seq_len, pad_id=tokenizer.pad_id)
    except ValueError as e:
        raise ConfigError(f"The multiple-choice set {mc.name!r} does not fit this job: {e}") from None
    scores = np.zeros((len(pairs),), np.float64)
    for start in range(0, len(pairs), rows_per_batch):
        chunk = {k: v[start : start + rows_per_batch] for k, v in rows.items()}
        n = chunk["ids"].shape[0]
        padded = {
            k: np.concatenate([v, np.zeros((rows_per_batch - n, *v.shape[1:]), v.dtype)]) for k, v in chunk.items()
        }
        placed = program.place(padded)
        out = host_array(row_log_likelihoods(model, placed["ids"], placed["labels"], placed["weights"]))
        scores[start : start + n] = out[:n]  # every host passed the same rows: the first host's part
    per_item, at = [], 0
    for item in mc.items:
        k = len(item.choices)
        per_item.append([(float(scores[at + j]), sizes[at + j]) for j in range(k)])
        at += k
    return mc.score(per_item)
