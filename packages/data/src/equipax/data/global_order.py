"""A data order over the whole dataset that does not depend on the number of hosts.

Global row `p` of a repeating input is row `p % rows_per_epoch` of epoch `p // rows_per_epoch`;
global batch N is rows `[N * G, (N + 1) * G)` for the global batch G; host h of H reads its
contiguous rows `[N * G + h * b, N * G + (h + 1) * b)` with `b = G / H` (Pax's
`num_infeed_hosts` / `infeed_host_index` contract). A row is a pure function of `(seed, epoch,
row)`, so the global batches are byte-identical at any host count, and the state is one row
cursor, the same on every host: a job may resume on another number of hosts and devices and read
exactly the batches it would have read.
"""

from collections.abc import Mapping
from typing import Any

import numpy as np
from jaxtyping import Int

from equipax.data.base import BaseInput, Batch, check_state_keys

__all__ = ["GlobalOrderInput", "epoch_permutation"]

STATE_KEYS = ("row", "global_batch", "rows_per_epoch")


def epoch_permutation(seed: int, epoch: int, n: int) -> Int[np.ndarray, " n"]:
    """The shuffled order of `n` records in `epoch`: the same on every host, different every epoch."""
    return np.random.default_rng([seed, epoch]).permutation(n).astype(np.int64)


class GlobalOrderInput(BaseInput):
    """Base class of the inputs whose rows are numbered over the whole dataset (see the module doc).

    A subclass sets `rows_per_epoch` and implements `_read_rows(positions)`: the rows at global
    positions `positions` (all below `rows_per_epoch` for an eval pass). This class does the rest:
    which rows this host reads, eval passes with padding rows, and the state.

    Training (`repeat=True`): endless; batches run on across epoch boundaries. Eval
    (`repeat=False`): one pass of `num_batches = ceil(rows_per_epoch / global_batch)` global
    batches, the rows past the data padding with weight 0; the rows (padding included) are the
    same whatever the number of hosts, so a full-pass eval gives the same sums at any host count.

    State: `{"row": the next global row, "global_batch", "rows_per_epoch"}`, identical on every
    host (`global_state`); `set_state` refuses a state saved with another global batch or another
    dataset (a different number of rows per epoch).
    """

    global_state: bool = True
    rows_per_epoch: int

    def _init_order(self, rows_per_epoch: int) -> None:
        self.rows_per_epoch = int(rows_per_epoch)
        self._row = 0

    @property
    def num_batches(self) -> int | None:
        """Global batches per eval pass (every host emits this many); None for a repeating input."""
        if self.repeat:
            return None
        return max(1, -(-self.rows_per_epoch // self.global_batch_size))

    def host_positions(self, row: int) -> Int[np.ndarray, " batch"]:
        """The global positions this host reads in the global batch that starts at `row`."""
        first = row + self.infeed_host_index * self.batch_size
        return np.arange(first, first + self.batch_size, dtype=np.int64)

    def _read_rows(self, positions: Int[np.ndarray, " n"]) -> Batch:
        raise NotImplementedError

    def _padding(self, n: int) -> Batch:
        raise NotImplementedError

    def get_next(self) -> Batch:
        positions = self.host_positions(self._row)
        if self.repeat:
            batch = self._read_rows(positions)
        else:
            if self._row >= (self.num_batches or 0) * self.global_batch_size:
                raise StopIteration
            real = positions[positions < self.rows_per_epoch]
            if real.size == 0:
                batch = self._padding(self.batch_size)
            else:
                batch = self._read_rows(real)
                if real.size < self.batch_size:
                    pad = self._padding(self.batch_size - real.size)
                    batch = {k: np.concatenate([v, pad[k]]) for k, v in batch.items()}
        self._row += self.global_batch_size
        return batch

    def reset(self) -> None:
        self._row = 0

    def get_state(self) -> dict[str, Any]:
        return {"row": self._row, "global_batch": self.global_batch_size, "rows_per_epoch": self.rows_per_epoch}

    def set_state(self, state: Mapping[str, Any]) -> None:
        name = type(self).__name__
        try:
            fields = check_state_keys(state, STATE_KEYS, name)
        except ValueError as e:
            if isinstance(state, Mapping) and set(state) == set(STATE_KEYS):
                raise
            raise ValueError(
                f"{e} A state written by an input with per-host positions cannot be mapped onto the global order."
            ) from None
        if fields["global_batch"] != self.global_batch_size:
            raise ValueError(
                f"The {name} state was saved with a global batch of {fields['global_batch']} rows, but this input "
                f"reads {self.global_batch_size} ({self.batch_size} per host x {self.num_infeed_hosts} hosts): "
                "the following batches would differ from the saved run's. Keep the global batch size."
            )
        if fields["rows_per_epoch"] != self.rows_per_epoch:
            raise ValueError(
                f"The {name} state was saved over a dataset of {fields['rows_per_epoch']} rows per epoch, but this "
                f"input has {self.rows_per_epoch}: it was saved with a different dataset, seq_len, packing or "
                "tokenizer."
            )
        limit = None if self.repeat else (self.num_batches or 0) * self.global_batch_size
        if fields["row"] % self.global_batch_size or (limit is not None and fields["row"] > limit):
            raise ValueError(
                f"The {name} state's row {fields['row']} is not the start of a global batch of this input "
                f"({self.global_batch_size} rows{'' if limit is None else f', {limit} rows per pass'})."
            )
        self._row = fields["row"]
