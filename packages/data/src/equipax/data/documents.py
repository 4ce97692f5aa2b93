"""Language-model inputs over a collection of documents, on grain (shuffle, host slices, packing)."""

from collections.abc import Mapping
from typing import Any

import grain
import numpy as np
from grain.experimental import ConcatThenSplitIterDataset

from equipax.data.base import BaseInput, Batch, Documents, check_positive
from equipax.data.tokenizers import Tokenizer

__all__ = ["DocumentLMInput"]


def _tuples(tree: Any) -> Any:
    """JSON turns tuples into lists; grain's packing state compares slices with tuples."""
    if isinstance(tree, Mapping):
        return {k: _tuples(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return tuple(_tuples(v) for v in tree)
    return tree


def _jsonable(tree: Any) -> Any:
    if isinstance(tree, Mapping):
        return {str(k): _jsonable(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_jsonable(v) for v in tree]
    if isinstance(tree, np.integer):
        return int(tree)
    return tree


class DocumentLMInput(BaseInput):
    """LM batches from documents: each document is `[bos] + encode(text) + [eos]`.

    The pipeline is grain's: document indices -> (training) a seeded global shuffle, different
    every epoch and the same on every host, repeated forever -> this host's slice
    `[infeed_host_index::num_infeed_hosts]` -> tokenize -> rows -> batches. Hosts therefore never
    share a document within an epoch.

    Rows: with `packing=True`, documents are concatenated and split into rows of `seq_len`
    (grain's `ConcatThenSplitIterDataset`); each row carries `segment_ids` (1, 2, ... per document
    piece, 0 on padding) and `positions` (restarting at 0 in every segment), which the LM uses to
    mask attention across documents. With `packing=False` each document is one row, cut to
    `seq_len` tokens and padded (weight 0).

    Eval (`repeat=False`): one ordered pass over this host's documents. Every host emits the same
    number of batches, `num_batches`, the most any host needs; rows and batches past the data are
    padding with weight 0. With packing, computing that number tokenizes every host's share once.

    State (`get_state`) is grain's iterator state plus the batch count: small and JSON-serialisable.

    **Arguments:**

    - `documents`: a random-access sequence of texts (a list, or `TextShards`).
    - `tokenizer`: encodes texts; its `pad_id`, `bos_id`, `eos_id` are used.
    - `seq_len`: tokens per row.
    - `packing`: pack documents into rows (True) or one document per row (False).
    - `read_threads`: grain reader threads for tokenization (0 reads on the calling thread).
    - `batch_size`, `num_infeed_hosts`, `infeed_host_index`, `seed`, `repeat`: see `BaseInput`.
    """

    def __init__(
        self,
        documents: Documents,
        *,
        tokenizer: Tokenizer,
        seq_len: int,
        batch_size: int,
        num_infeed_hosts: int = 1,
        infeed_host_index: int = 0,
        seed: int = 0,
        repeat: bool = True,
        packing: bool = True,
        read_threads: int = 1,
    ) -> None:
        super().__init__(
            batch_size=batch_size,
            num_infeed_hosts=num_infeed_hosts,
            infeed_host_index=infeed_host_index,
            seed=seed,
            repeat=repeat,
            tokenizer=tokenizer,
        )
        check_positive("seq_len", seq_len)
        if len(documents) == 0:
            raise ValueError("documents is empty: an input needs at least one document.")
        if seed >= 2**32:
            raise ValueError(f"seed must be below 2**32 for grain's shuffle, got {seed}.")
        if read_threads < 0:
            raise ValueError(f"read_threads must be >= 0, got {read_threads}.")
        self.documents = documents
        self.seq_len: int = int(seq_len)
        self.packing: bool = bool(packing)
        self.read_threads: int = int(read_threads)
        self._tok = tokenizer
        self._rows_per_host: list[int] | None = None
        self._iter = self._make_iter()
        self._batches = 0

    # --- the grain pipeline ----------------------------------------------------------------

    def _encode(self, index: int) -> dict[str, np.ndarray]:
        tokens = [self._tok.bos_id, *self._tok.encode(self.documents[int(index)]), self._tok.eos_id]
        t = np.asarray(tokens, np.int32)
        if not self.packing:
            return {"ids": t[:-1], "labels": t[1:], "example_id": np.asarray(int(index), np.int64)}
        return {"ids": t[:-1], "labels": t[1:]}

    def _pad_row(self, element: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        n = min(len(element["ids"]), self.seq_len)
        ids = np.full((self.seq_len,), self._tok.pad_id, np.int32)
        labels = np.full((self.seq_len,), self._tok.pad_id, np.int32)
        ids[:n], labels[:n] = element["ids"][:n], element["labels"][:n]
        weights = np.zeros((self.seq_len,), np.float32)
        weights[:n] = 1.0
        return {"ids": ids, "labels": labels, "weights": weights, "example_id": element["example_id"]}

    def _packed_row(self, element: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        segments = element["ids_segment_ids"].astype(np.int32)
        real = segments > 0
        return {
            "ids": np.where(real, element["ids"], self._tok.pad_id).astype(np.int32),
            "labels": np.where(real, element["labels"], self._tok.pad_id).astype(np.int32),
            "weights": real.astype(np.float32),
            "segment_ids": segments,
            "positions": np.where(real, element["ids_positions"], 0).astype(np.int32),
        }

    def _rows(self, host: int) -> grain.IterDataset:
        ds = grain.MapDataset.range(len(self.documents))
        if self.repeat:
            ds = ds.shuffle(self.seed).repeat()
        ds = ds[host :: self.num_infeed_hosts].map(self._encode)
        if self.read_threads > 0:
            options = grain.ReadOptions(num_threads=self.read_threads, prefetch_buffer_size=4 * self.batch_size)
        else:
            options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
        rows = ds.to_iter_dataset(options)
        if self.packing:
            length = {"ids": self.seq_len, "labels": self.seq_len}
            return ConcatThenSplitIterDataset(rows, length_struct=length).map(self._packed_row)
        return rows.map(self._pad_row)

    def _make_iter(self) -> grain.DatasetIterator:
        return iter(self._rows(self.infeed_host_index).batch(self.batch_size, drop_remainder=False))

    # --- eval padding ------------------------------------------------------------------------

    def _host_rows(self, host: int) -> int:
        if not self.packing:
            return len(range(host, len(self.documents), self.num_infeed_hosts))
        return sum(1 for _ in self._rows(host))

    @property
    def num_batches(self) -> int | None:
        """Batches per eval pass, the same on every host; None for a repeating input."""
        if self.repeat:
            return None
        if self._rows_per_host is None:
            self._rows_per_host = [self._host_rows(h) for h in range(self.num_infeed_hosts)]
        return max(1, -(-max(self._rows_per_host) // self.batch_size))

    def _padding(self, n: int) -> Batch:
        batch = {
            "ids": np.full((n, self.seq_len), self._tok.pad_id, np.int32),
            "labels": np.full((n, self.seq_len), self._tok.pad_id, np.int32),
            "weights": np.zeros((n, self.seq_len), np.float32),
        }
        if self.packing:
            batch["segment_ids"] = np.zeros((n, self.seq_len), np.int32)
            batch["positions"] = np.zeros((n, self.seq_len), np.int32)
        else:
            batch["example_id"] = np.full((n,), -1, np.int64)
        return batch

    # --- BaseInput ---------------------------------------------------------------------------

    def get_next(self) -> Batch:
        num_batches = self.num_batches
        if num_batches is not None and self._batches >= num_batches:
            raise StopIteration
        try:
            batch = {k: np.asarray(v) for k, v in next(self._iter).items()}
        except StopIteration:
            if num_batches is None:
                raise RuntimeError("a repeating DocumentLMInput ran out of documents") from None
            batch = self._padding(self.batch_size)
        short = self.batch_size - batch["ids"].shape[0]
        if short:
            pad = self._padding(short)
            batch = {k: np.concatenate([v, pad[k]]) for k, v in batch.items()}
        self._batches += 1
        return batch

    def reset(self) -> None:
        self._iter = self._make_iter()
        self._batches = 0

    def get_state(self) -> dict[str, Any]:
        return {"grain": _jsonable(self._iter.get_state()), "batches": self._batches}

    def set_state(self, state: Mapping[str, Any]) -> None:
        name = type(self).__name__
        if not isinstance(state, Mapping) or set(state) != {"grain", "batches"}:
            raise ValueError(
                f"{name}.set_state expects the dict from {name}.get_state() (keys ['batches', 'grain']), got {state!r}."
            )
        batches = state["batches"]
        if isinstance(batches, bool) or not isinstance(batches, int) or batches < 0:
            raise ValueError(f"{name} state field 'batches' must be a non-negative int, got {batches!r}.")
        it = self._make_iter()
        try:
            it.set_state(_tuples(state["grain"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"state {dict(state)} does not fit this {name} ({e}); was it saved with a different "
                f"dataset, packing or host layout?"
            ) from None
        self._iter = it
        self._batches = batches
