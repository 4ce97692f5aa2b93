"""Eval inputs: Pax `reset_for_eval` semantics (full padded passes, or rolling batches)."""

from collections.abc import Mapping
from typing import Any

from equipax.data.base import BaseInput, Batch, check_positive
from equipax.data.metrics import DecodeMetric, MultipleChoiceSet

__all__ = ["make_eval_input", "RollingEvalInput"]


class RollingEvalInput(BaseInput):
    """Pax `reset_for_eval=False`: each eval run reads the next `num_batches` batches of a repeating input.

    `reset()` starts a new eval *run* without rewinding the data, so consecutive runs continue
    where the last one stopped; within a run, `get_next` raises StopIteration after
    `num_batches` batches. The state holds the wrapped input's state, so a resumed job's rolling
    eval continues too.

    **Arguments:**

    - `source`: a repeating input (`repeat=True`), e.g. a held-out split read like training data.
    - `num_batches`: batches per eval run (Pax `eval_loop_num_batches`).
    """

    def __init__(self, source: BaseInput, num_batches: int) -> None:
        if not source.repeat:
            raise ValueError(
                f"Rolling eval (reset_for_eval=False) needs a repeating input; {type(source).__name__} "
                f"has repeat=False and would run dry. Build it with repeat=True, or use reset_for_eval=True."
            )
        check_positive("num_batches (eval_loop_num_batches)", num_batches)
        super().__init__(
            batch_size=source.batch_size,
            num_infeed_hosts=source.num_infeed_hosts,
            infeed_host_index=source.infeed_host_index,
            seed=source.seed,
            repeat=False,
            tokenizer=source.tokenizer,
        )
        self.source = source
        self.num_batches: int = int(num_batches)
        self._taken = 0

    def get_next(self) -> Batch:
        if self._taken >= self.num_batches:
            raise StopIteration
        batch = self.source.get_next()
        self._taken += 1
        return batch

    def reset(self) -> None:
        self._taken = 0

    def decode_metrics(self) -> tuple[DecodeMetric, ...]:
        return self.source.decode_metrics()

    def multiple_choice(self) -> MultipleChoiceSet | None:
        return self.source.multiple_choice()

    def get_state(self) -> dict[str, Any]:
        return {"source": self.source.get_state(), "taken": self._taken}

    def set_state(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping) or set(state) != {"source", "taken"}:
            raise ValueError(f"RollingEvalInput.set_state expects the dict from get_state(), got {state!r}.")
        self.source.set_state(state["source"])
        self._taken = int(state["taken"])


def make_eval_input(inp: BaseInput, *, reset_for_eval: bool, num_batches: int) -> BaseInput:
    """Check an eval setup and return the input the eval loop should read.

    **Arguments:**

    - `inp`: the eval data: `repeat=False` for `reset_for_eval=True`, `repeat=True` otherwise.
    - `reset_for_eval`: True: every eval run is one full pass (padded, equal batch counts on
      every host). False: rolling eval over `num_batches` batches per run.
    - `num_batches`: batches per eval run; 0 means the whole pass (only with `reset_for_eval=True`).

    **Returns:** `inp` itself, or a `RollingEvalInput` around it.
    """
    if reset_for_eval:
        if inp.repeat:
            raise ValueError(
                "reset_for_eval=True makes one full pass per eval run, but the eval input repeats "
                "(repeat=True) and would never end. Build it with repeat=False, or use reset_for_eval=False "
                "with eval_loop_num_batches."
            )
        if num_batches < 0:
            raise ValueError(f"num_batches must be >= 0 (0 = the whole pass), got {num_batches}.")
        return inp
    if num_batches <= 0:
        raise ValueError(
            "reset_for_eval=False (rolling eval) needs eval_loop_num_batches > 0: the number of batches "
            f"each eval run reads (train.eval_batches); got {num_batches}."
        )
    return RollingEvalInput(inp, num_batches)
