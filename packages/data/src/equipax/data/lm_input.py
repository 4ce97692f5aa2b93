"""Language-model inputs over a token stream cut into fixed windows, and corpus helpers."""

from collections.abc import Iterable
from typing import Any

import numpy as np
from jaxtyping import Int, Integer

from equipax.data.base import Batch, check_positive
from equipax.data.content_cache import ContentCache, content_key
from equipax.data.global_order import GlobalOrderInput, epoch_permutation
from equipax.data.tokenizers import Tokenizer

__all__ = ["build_lm_texts_tokens", "lm_batch", "TokenWindowInput", "unigram_entropy"]


def lm_batch(
    windows: Integer[np.ndarray, "n seq_plus_one"],
    example_ids: Integer[np.ndarray, " n"],
    *,
    batch_size: int,
    pad_id: int,
) -> Batch:
    """Build an LM batch from `n <= batch_size` windows of `seq + 1` tokens.

    Rows past `n` are padding: `pad_id` tokens, weight 0 and example_id -1.

    **Returns:** `{"ids", "labels"}` int32 `[batch, seq]` (labels are ids shifted left by one,
    the next-token targets), `"weights"` float32 `[batch, seq]`, `"example_id"` int64 `[batch]`.
    """
    n, width = windows.shape
    padded = np.full((batch_size, width), pad_id, dtype=np.int32)
    padded[:n] = windows
    weights = np.zeros((batch_size, width - 1), dtype=np.float32)
    weights[:n] = 1.0
    ids = np.full((batch_size,), -1, dtype=np.int64)
    ids[:n] = example_ids
    return {"ids": padded[:, :-1].copy(), "labels": padded[:, 1:].copy(), "weights": weights, "example_id": ids}


class TokenWindowInput(GlobalOrderInput):
    """Non-overlapping windows of `seq_len + 1` tokens from one token stream; example i = window i.

    The order is global (`equipax.data.global_order`): training (`repeat=True`) reads every
    epoch's permutation of all windows, drawn from `(seed, epoch)`, as one stream cut into global
    batches that run on across epoch boundaries, forever; host h reads its contiguous rows
    `[h * batch_size, (h + 1) * batch_size)` of each global batch. The global batches are the same
    whatever the number of hosts. Eval (`repeat=False`): the windows in order, once, in
    `num_batches` global batches; rows past the last window are padding with weight 0. Then
    StopIteration until `reset()`.

    State is `{"row", "global_batch", "rows_per_epoch"}` (the next global row), the same on every host.

    **Arguments:**

    - `tokens`: the 1-D token stream (e.g. from `build_lm_texts_tokens`). A trailing partial window is dropped.
    - `seq_len`: tokens per example; each window holds one extra token for the last label.
    - `batch_size`, `num_infeed_hosts`, `infeed_host_index`, `seed`, `repeat`, `tokenizer`: see `BaseInput`.
      Padding rows use `tokenizer.pad_id` (0 without a tokenizer).
    """

    def __init__(
        self,
        tokens: Integer[np.ndarray, " stream"],
        *,
        seq_len: int,
        batch_size: int,
        num_infeed_hosts: int = 1,
        infeed_host_index: int = 0,
        seed: int = 0,
        repeat: bool = True,
        tokenizer: Tokenizer | None = None,
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
        stream = np.asarray(tokens)
        if stream.ndim != 1:
            raise ValueError(f"tokens must be a 1-D token stream, got shape {stream.shape}.")
        self.seq_len: int = int(seq_len)
        self.num_windows: Any = stream.shape[0] // (self.seq_len + 1)
        if self.num_windows == 0:
            raise ValueError(
                f"tokens has {stream.shape[0]} tokens, fewer than one window of seq_len + 1 = "
                f"{self.seq_len + 1}; use more text or a smaller seq_len."
            )
        self._windows = stream[: self.num_windows * (self.seq_len + 1)].astype(np.int32)
        self._windows = self._windows.reshape(self.num_windows, self.seq_len + 1)
        self._pad_id = tokenizer.pad_id if tokenizer is not None else 0
        self._order_cache: tuple[int, np.ndarray] | None = None
        self._init_order(self.num_windows)

    def window_order(self, epoch: int) -> Int[np.ndarray, " windows"]:
        """Window indices in the order `epoch` reads them (identity for an eval pass)."""
        if not self.repeat:
            return np.arange(self.num_windows, dtype=np.int64)
        if self._order_cache is None or self._order_cache[0] != epoch:
            self._order_cache = (epoch, epoch_permutation(self.seed, epoch, self.num_windows))
        return self._order_cache[1]

    def window_indices(self, positions: Integer[np.ndarray, " n"]) -> Int[np.ndarray, " n"]:
        """The window at each global position."""
        epochs, offsets = np.divmod(np.asarray(positions, np.int64), self.num_windows)
        out = np.empty(len(offsets), np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self.window_order(int(e))[offsets[sel]]
        return out

    def _read_rows(self, positions: Integer[np.ndarray, " n"]) -> Batch:
        picks = self.window_indices(positions)
        return lm_batch(self._windows[picks], picks, batch_size=len(picks), pad_id=self._pad_id)

    def _padding(self, n: int) -> Batch:
        empty = np.zeros((0, self.seq_len + 1), np.int32)
        return lm_batch(empty, np.zeros((0,), np.int64), batch_size=n, pad_id=self._pad_id)


def build_lm_texts_tokens(
    texts: Iterable[str], tokenizer: Tokenizer, *, cache: ContentCache | None = None
) -> Int[np.ndarray, " stream"]:
    """Encode each document and concatenate them, each followed by `tokenizer.eos_id`.

    `cache`: where streams encoded before are kept by a digest of the texts and
    `tokenizer.fingerprint()` (everything that decides the ids); an equal digest reads the kept
    stream instead of encoding again. None: always encode.

    **Returns:** the int32 token stream to feed `TokenWindowInput`.
    """
    texts = list(texts)
    if cache is None:
        return _encode(texts, tokenizer)
    key = content_key("lm-texts-tokens", tokenizer.fingerprint(), texts)
    kept = cache.get(key)
    if kept is not None:
        return np.frombuffer(kept, dtype="<i4").astype(np.int32)
    stream = _encode(texts, tokenizer)
    cache.put(key, stream.astype("<i4").tobytes())
    return stream


def _encode(texts: list[str], tokenizer: Tokenizer) -> Int[np.ndarray, " stream"]:
    pieces: list[int] = []
    for text in texts:
        pieces.extend(tokenizer.encode(text))
        pieces.append(tokenizer.eos_id)
    return np.asarray(pieces, dtype=np.int32)


def unigram_entropy(tokens: Integer[np.ndarray, " stream"], vocab_size: int) -> float:
    """Entropy in nats of the tokens' unigram distribution.

    This is the loss of the best context-free predictor: a trained LM's loss must fall below it.
    """
    check_positive("vocab_size", vocab_size)
    flat = np.asarray(tokens).reshape(-1)
    if flat.size == 0:
        raise ValueError("tokens is empty; the unigram entropy is undefined.")
    if flat.min() < 0 or flat.max() >= vocab_size:
        raise ValueError(f"tokens must lie in [0, vocab_size={vocab_size}), found range [{flat.min()}, {flat.max()}].")
    counts = np.bincount(flat, minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / flat.size
    return float(-(p * np.log(p)).sum())
