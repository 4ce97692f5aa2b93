"""Synthetic LM tokens: deterministic random batches for smoke tests and benchmarks."""

from collections.abc import Mapping
from typing import Any

import numpy as np

from equipax.data.base import BaseInput, Batch, check_positive, check_state_keys
from equipax.data.lm_input import lm_batch

__all__ = ["SyntheticLMInput"]


class SyntheticLMInput(BaseInput):
    """Uniformly random tokens; example i depends only on `(seed, i)`, whatever the host count.

    State is `{"step": n}`, the same on every host. With `repeat=False` it yields `num_batches` batches then stops.

    **Arguments:**

    - `vocab_size`: tokens are drawn from `[0, vocab_size)`.
    - `seq_len`: tokens per example.
    - `num_batches`: batches per pass; required when `repeat=False`, ignored otherwise.
    - `batch_size`, `num_infeed_hosts`, `infeed_host_index`, `seed`, `repeat`: see `BaseInput`.
    """

    global_state = True  # the step count, the same on every host

    def __init__(
        self,
        *,
        vocab_size: int,
        seq_len: int,
        batch_size: int,
        num_infeed_hosts: int = 1,
        infeed_host_index: int = 0,
        seed: int = 0,
        repeat: bool = True,
        num_batches: int | None = None,
    ) -> None:
        super().__init__(
            batch_size=batch_size,
            num_infeed_hosts=num_infeed_hosts,
            infeed_host_index=infeed_host_index,
            seed=seed,
            repeat=repeat,
        )
        check_positive("vocab_size", vocab_size)
        check_positive("seq_len", seq_len)
        if not repeat:
            if num_batches is None:
                raise ValueError("SyntheticLMInput(repeat=False) needs num_batches, the length of one pass.")
            check_positive("num_batches", num_batches)
        self.vocab_size: int = int(vocab_size)
        self.seq_len: int = int(seq_len)
        self.num_batches: int | None = None if num_batches is None else int(num_batches)
        self._step = 0

    def get_next(self) -> Batch:
        if not self.repeat and self._step >= (self.num_batches or 0):
            raise StopIteration
        first = self._step * self.global_batch_size + self.infeed_host_index * self.batch_size
        example_ids = np.arange(first, first + self.batch_size, dtype=np.int64)
        # Each example is drawn from its own (seed, example id) stream, so the global batch is
        # the same whatever the number of hosts that share it.
        windows = np.stack(
            [
                np.random.default_rng([self.seed, int(i)]).integers(
                    0, self.vocab_size, self.seq_len + 1, dtype=np.int32
                )
                for i in example_ids
            ]
        )
        self._step += 1
        return lm_batch(windows, example_ids, batch_size=self.batch_size, pad_id=0)

    def reset(self) -> None:
        self._step = 0

    def get_state(self) -> dict[str, Any]:
        return {"step": self._step}

    def set_state(self, state: Mapping[str, Any]) -> None:
        self._step = check_state_keys(state, ("step",), type(self).__name__)["step"]
