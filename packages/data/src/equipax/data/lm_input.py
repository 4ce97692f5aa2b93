"""Language-model inputs over a token stream cut into fixed windows, and corpus helpers."""

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from jaxtyping import Int, Integer

from equipax.data.base import BaseInput, Batch, check_positive, check_state_keys
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


class TokenWindowInput(BaseInput):
    """Non-overlapping windows of `seq_len + 1` tokens from one token stream; example i = window i.

    Training (`repeat=True`): every epoch draws a permutation of all windows from `(seed, epoch)`,
    the same on every host; host h takes positions h, h + num_infeed_hosts, ... of it, so hosts
    never share a window within an epoch. Batches run on across epoch boundaries, forever.

    Eval (`repeat=False`): host h reads windows h, h + num_infeed_hosts, ... in order, once. Every
    host emits `num_batches` batches (set by the host with the most windows); missing rows are
    padding with weight 0. Then StopIteration until `reset()`.

    State is `{"epoch": int, "position": int}`: the next unread position in this host's part.

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
        if repeat and self.num_windows < self.num_infeed_hosts:
            raise ValueError(
                f"{self.num_windows} windows of {self.seq_len + 1} tokens cannot give each of "
                f"{self.num_infeed_hosts} hosts a training example; use more text or a smaller seq_len."
            )
        self._windows = stream[: self.num_windows * (self.seq_len + 1)].astype(np.int32)
        self._windows = self._windows.reshape(self.num_windows, self.seq_len + 1)
        self._pad_id = tokenizer.pad_id if tokenizer is not None else 0
        self._epoch = 0
        self._position = 0
        self._part_cache: tuple[int, np.ndarray] | None = None

    @property
    def num_batches(self) -> int | None:
        """Batches per eval pass (the same on every host); None for a repeating input."""
        if self.repeat:
            return None
        max_per_host = -(-self.num_windows // self.num_infeed_hosts)
        return -(-max_per_host // self.batch_size)

    def _host_part(self, epoch: int) -> np.ndarray:
        """Window indices this host reads in `epoch`, in order."""
        if self._part_cache is not None and self._part_cache[0] == epoch:
            return self._part_cache[1]
        order = np.arange(self.num_windows, dtype=np.int64)
        if self.repeat:
            order = np.random.default_rng([self.seed, epoch]).permutation(order)
        part = order[self.infeed_host_index :: self.num_infeed_hosts]
        self._part_cache = (epoch, part)
        return part

    def get_next(self) -> Batch:
        if not self.repeat:
            num_batches = self.num_batches
            assert num_batches is not None
            if self._position >= num_batches * self.batch_size:
                raise StopIteration
            part = self._host_part(0)
            picks = part[self._position : self._position + self.batch_size]
            self._position += self.batch_size
        else:
            chunks = []
            need = self.batch_size
            while need > 0:
                part = self._host_part(self._epoch)
                chunk = part[self._position : self._position + need]
                chunks.append(chunk)
                need -= len(chunk)
                self._position += len(chunk)
                if self._position >= len(part):
                    self._epoch += 1
                    self._position = 0
            picks = np.concatenate(chunks)
        return lm_batch(self._windows[picks], picks, batch_size=self.batch_size, pad_id=self._pad_id)

    def reset(self) -> None:
        self._epoch = 0
        self._position = 0

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "position": self._position}

    def set_state(self, state: Mapping[str, Any]) -> None:
        fields = check_state_keys(state, ("epoch", "position"), type(self).__name__)
        limit = len(self._host_part(fields["epoch"])) if self.repeat else (self.num_batches or 0) * self.batch_size
        if fields["position"] > limit or (not self.repeat and fields["epoch"] != 0):
            raise ValueError(
                f"state {dict(state)} does not fit this input (host {self.infeed_host_index} of "
                f"{self.num_infeed_hosts}, {self.num_windows} windows); was it saved from a "
                f"different dataset, seq_len or host layout?"
            )
        self._epoch = fields["epoch"]
        self._position = fields["position"]


def build_lm_texts_tokens(texts: Iterable[str], tokenizer: Tokenizer) -> Int[np.ndarray, " stream"]:
    """Encode each document and concatenate them, each followed by `tokenizer.eos_id`.

    **Returns:** the int32 token stream to feed `TokenWindowInput`.
    """
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
