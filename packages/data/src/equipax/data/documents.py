"""Language-model inputs over a collection of documents: a global shuffle and host-count-free packing."""

from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from jaxtyping import Int, Integer

from equipax.data.base import Batch, Documents, check_positive
from equipax.data.global_order import GlobalOrderInput, epoch_permutation
from equipax.data.tokenizers import Tokenizer

__all__ = ["DocumentLMInput", "packed_row_spans"]

_CACHED_DOCUMENTS = 512  # encoded documents kept: neighbouring packed rows share documents


def packed_row_spans(starts: Int[np.ndarray, " docs_plus_one"], row: int, seq_len: int) -> list[tuple[int, int, int]]:
    """The pieces of packed row `row`: `(j, begin, end)`, tokens `[begin, end)` of the j-th document.

    `starts` is the prefix sum of the documents' lengths in reading order (`starts[0] = 0`,
    `starts[-1]` = all tokens); the row covers tokens `[row * seq_len, (row + 1) * seq_len)` of
    their concatenation, found by binary search: the layout of a row is a function of its global
    position alone.
    """
    lo, hi = row * seq_len, min((row + 1) * seq_len, int(starts[-1]))
    j = int(np.searchsorted(starts, lo, side="right")) - 1
    spans = []
    while lo < hi:
        end = min(hi, int(starts[j + 1]))
        if end > lo:
            spans.append((j, lo - int(starts[j]), end - int(starts[j])))
        lo = end
        j += 1
    return spans


class DocumentLMInput(GlobalOrderInput):
    """LM batches from documents: each document is `[bos] + encode(text) + [eos]`.

    The order is global (`equipax.data.global_order`): training reads every epoch's shuffle of the
    documents (drawn from `(seed, epoch)`, the same on every host), eval reads them in order once;
    host h reads its contiguous rows of each global batch. Rows:

    - `packing=True`: an epoch's documents, in its order, are concatenated and cut into rows of
      `seq_len` tokens (the last row of an epoch is padded); a row's pieces are found from the
      prefix sum of the documents' token counts (`packed_row_spans`), so the packed layout is a
      function of the global row alone, never of the number of hosts. Each row carries
      `segment_ids` (1, 2, ... per document piece, 0 on padding) and `positions` (restarting at 0
      in every segment), which the LM uses to mask attention across documents. The token counts
      are computed once, at construction (one encoding pass over the documents), unless given as
      `lengths` (a job caches them: `equipax.launch` keeps them in the job directory).
    - `packing=False`: each document is one row, cut to `seq_len` tokens and padded (weight 0);
      `example_id` is the document's index.

    Eval (`repeat=False`): `num_batches` global batches cover every row once; rows past the data
    are padding with weight 0, so the pass gives the same sums at any host count.

    State (`get_state`): `{"row", "global_batch", "rows_per_epoch"}`, the same on every host.

    **Arguments:**

    - `documents`: a random-access sequence of texts (a list, or `TextShards`).
    - `tokenizer`: encodes texts; its `pad_id`, `bos_id`, `eos_id` are used.
    - `seq_len`: tokens per row.
    - `packing`: pack documents into rows (True) or one document per row (False).
    - `read_threads`: threads reading and encoding the documents of a batch (0 or 1: the calling
      thread; more help where the tokenizer releases the GIL, as Hugging Face tokenizers do).
    - `lengths`: the documents' token counts as `document_lengths()` returns them, computed
      before (packing only). A few documents spread over the set are encoded again to check them:
      counts from another dataset or tokenizer raise `ValueError`.
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
        lengths: Integer[np.ndarray, " docs"] | None = None,
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
        if read_threads < 0:
            raise ValueError(f"read_threads must be >= 0, got {read_threads}.")
        self.documents = documents
        self.seq_len: int = int(seq_len)
        self.packing: bool = bool(packing)
        self.read_threads: int = int(read_threads)
        self._tok = tokenizer
        self._encoded: OrderedDict[int, np.ndarray] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self._lengths: np.ndarray | None = None if lengths is None else self._checked_lengths(lengths)
        self._starts: tuple[int, np.ndarray] | None = None
        self._order: tuple[int, np.ndarray] | None = None
        self._init_order(len(documents))
        if self.packing:
            self._init_order(-(-int(self.document_lengths().sum()) // self.seq_len))

    # --- documents ---------------------------------------------------------------------------

    def _encode_one(self, index: int) -> np.ndarray:
        tokens = [self._tok.bos_id, *self._tok.encode(self.documents[int(index)]), self._tok.eos_id]
        return np.asarray(tokens, np.int32)

    def _encode_all(self, indices: Iterable[int]) -> list[np.ndarray]:
        wanted = list(indices)
        if self.read_threads > 1 and len(wanted) > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.read_threads, thread_name_prefix="DocumentLMInput")
            return list(self._pool.map(self._encode_one, wanted))
        return [self._encode_one(i) for i in wanted]

    def encoded(self, indices: Iterable[int]) -> dict[int, np.ndarray]:
        """`bos + tokens + eos` of each document in `indices` (a small cache keeps recent ones)."""
        wanted = list(dict.fromkeys(int(i) for i in indices))
        missing = [i for i in wanted if i not in self._encoded]
        for i, tokens in zip(missing, self._encode_all(missing), strict=True):
            self._encoded[i] = tokens
        for i in wanted:
            self._encoded.move_to_end(i)
        while len(self._encoded) > max(_CACHED_DOCUMENTS, len(wanted)):
            self._encoded.popitem(last=False)
        return {i: self._encoded[i] for i in wanted}

    def document_lengths(self) -> Int[np.ndarray, " docs"]:
        """Tokens each document contributes to packed rows (`len(encode(text)) + 1`), computed once."""
        if self._lengths is None:
            n, step = len(self.documents), 256
            lengths = np.empty(n, np.int64)
            for lo in range(0, n, step):
                chunk = self._encode_all(range(lo, min(lo + step, n)))
                lengths[lo : lo + len(chunk)] = [len(t) - 1 for t in chunk]
            self._lengths = lengths
        return self._lengths

    def _checked_lengths(self, lengths: Integer[np.ndarray, " docs"]) -> np.ndarray:
        lengths = np.asarray(lengths, np.int64)
        n = len(self.documents)
        if lengths.shape != (n,) or (lengths < 1).any():
            raise ValueError(
                f"lengths must hold one positive token count per document ({n}); got shape {lengths.shape}."
            )
        probe = sorted({0, n // 3, (2 * n) // 3, n - 1})
        for i, tokens in zip(probe, self._encode_all(probe), strict=True):
            if len(tokens) - 1 != lengths[i]:
                raise ValueError(
                    f"lengths[{i}] = {lengths[i]}, but document {i} encodes to {len(tokens) - 1} tokens: the counts "
                    "were computed for another dataset or tokenizer."
                )
        return lengths

    def document_order(self, epoch: int) -> Int[np.ndarray, " docs"]:
        """Document indices in the order `epoch` reads them (identity for an eval pass)."""
        if not self.repeat:
            return np.arange(len(self.documents), dtype=np.int64)
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, epoch_permutation(self.seed, epoch, len(self.documents)))
        return self._order[1]

    def _epoch_starts(self, epoch: int) -> np.ndarray:
        if self._starts is None or self._starts[0] != epoch:
            lengths = self.document_lengths()[self.document_order(epoch)]
            self._starts = (epoch, np.concatenate([[0], np.cumsum(lengths)]))
        return self._starts[1]

    # --- rows --------------------------------------------------------------------------------

    def _read_rows(self, positions: Integer[np.ndarray, " n"]) -> Batch:
        epochs, offsets = np.divmod(np.asarray(positions, np.int64), self.rows_per_epoch)
        if not self.packing:
            docs = np.array([self.document_order(int(e))[o] for e, o in zip(epochs, offsets)], np.int64)
            return self._unpacked(docs)
        batch = self._blank(len(offsets))
        for r, (e, o) in enumerate(zip(epochs.tolist(), offsets.tolist())):
            starts, order = self._epoch_starts(e), self.document_order(e)
            spans = packed_row_spans(starts, o, self.seq_len)
            tokens = self.encoded(order[j] for j, _, _ in spans)
            at = 0
            for segment, (j, begin, end) in enumerate(spans, start=1):
                t, n = tokens[int(order[j])], end - begin
                batch["ids"][r, at : at + n] = t[begin:end]
                batch["labels"][r, at : at + n] = t[begin + 1 : end + 1]
                batch["segment_ids"][r, at : at + n] = segment
                batch["positions"][r, at : at + n] = np.arange(n)
                at += n
            batch["weights"][r, :at] = 1.0
        return batch

    def _unpacked(self, docs: Int[np.ndarray, " n"]) -> Batch:
        batch = self._blank(len(docs))
        tokens = self.encoded(docs.tolist())
        for r, d in enumerate(docs.tolist()):
            t = tokens[d]
            n = min(len(t) - 1, self.seq_len)
            batch["ids"][r, :n], batch["labels"][r, :n] = t[:n], t[1 : n + 1]
            batch["weights"][r, :n] = 1.0
        batch["example_id"] = docs.copy()
        return batch

    def _padding(self, n: int) -> Batch:
        return self._blank(n)

    def _blank(self, n: int) -> dict[str, np.ndarray]:
        """`n` padding rows, to fill in."""
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
