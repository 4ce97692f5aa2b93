"""Custom inputs by composition: post-process the batches of another input."""

from collections.abc import Callable, Mapping
from typing import Any

from equipax.data.base import BaseInput, Batch
from equipax.data.metrics import DecodeMetric, MultipleChoiceSet

__all__ = ["MappedInput"]


class MappedInput(BaseInput):
    """Apply `fn` to every batch of `source` (the Pax "override `get_next`" pattern, by wrapping).

    Host layout, `reset`, state, counters and `ids_to_strings` are those of `source`, so a wrapped
    training input resumes exactly like the original. `fn` must be deterministic (a pure function
    of the batch) for resume to stay exact; it may add, drop or change arrays but must keep the
    leading per-host batch dimension.

    **Arguments:**

    - `source`: the input to wrap.
    - `fn`: `batch -> batch`.
    """

    def __init__(self, source: BaseInput, fn: Callable[[Batch], Batch]) -> None:
        super().__init__(
            batch_size=source.batch_size,
            num_infeed_hosts=source.num_infeed_hosts,
            infeed_host_index=source.infeed_host_index,
            seed=source.seed,
            repeat=source.repeat,
            tokenizer=source.tokenizer,
        )
        self.source = source
        self.fn = fn
        self.global_state: bool = source.global_state

    def get_next(self) -> Batch:
        batch = self.fn(self.source.get_next())
        for k, v in batch.items():
            if v.shape[:1] != (self.batch_size,):
                raise ValueError(
                    f"MappedInput fn returned {k!r} with shape {v.shape}; every array must keep the "
                    f"leading per-host batch dimension {self.batch_size}."
                )
        return batch

    def reset(self) -> None:
        self.source.reset()

    def get_state(self) -> dict[str, Any]:
        return self.source.get_state()

    def set_state(self, state: Mapping[str, Any]) -> None:
        self.source.set_state(state)

    def counters(self) -> dict[str, int]:
        return self.source.counters()

    def counter_metrics(self, totals: Mapping[str, int]) -> dict[str, int | float]:
        return self.source.counter_metrics(totals)

    def decode_metrics(self) -> tuple[DecodeMetric, ...]:
        return self.source.decode_metrics()

    def multiple_choice(self) -> MultipleChoiceSet | None:
        return self.source.multiple_choice()

    def __getattr__(self, name: str) -> Any:
        # num_batches, seq_len, ... of the wrapped input (only called for missing attributes).
        if name == "source":
            raise AttributeError(name)
        return getattr(self.source, name)
