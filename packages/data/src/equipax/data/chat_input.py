"""Chat SFT batches: conversations rendered with a chat template, weighted on the replies, packed.

Each conversation becomes one example of `len(tokens) - 1` positions (`ids = tokens[:-1]`,
`labels = tokens[1:]`, `weights = mask[1:]`: position t is trained to predict token t + 1 where that
token belongs to a reply). A conversation never straddles rows: one longer than `seq_len` is cut to
its first `seq_len` positions (`truncation="truncate"`) or skipped (`"drop"`); a cut that would keep
no reply token skips it too (it would train nothing). Both are counted (`stats`, and every train
record's `data_truncated` / `data_dropped`). With `packing=True` whole examples fill each row in
order (next fit: an example that does not fit the rest of the row starts the next one);
`segment_ids` number them 1, 2, ... (0 on padding) and `positions` restart at 0 in each, so
attention never crosses conversations and the row's weighted loss sum is the sum of its
conversations' (tests/data/test_chat_input.py).
"""

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from equipax.data.base import BaseInput, Batch, check_positive, check_state_keys
from equipax.data.chat import ChatError, ChatTemplate, Conversations, chat_example
from equipax.data.tokenizers import HFTokenizer

__all__ = ["ChatSFTInput"]

_STATS = ("conversations", "truncated", "dropped", "tokens", "row_tokens")


def _efficiency(stats: Mapping[str, int]) -> float:
    return stats["tokens"] / max(stats["row_tokens"], 1)


class ChatSFTInput(BaseInput):
    """Supervised fine-tuning batches from conversations (BaseInput semantics).

    Order: training (`repeat=True`) visits the conversations in a fresh seeded permutation every
    epoch, the same on every host; host `h` of `H` takes every H-th of it, so hosts never share a
    conversation within an epoch. Eval (`repeat=False`) is one ordered pass; every host emits
    `num_batches` batches (the most any host needs), padded with weight-0 rows.

    State (`get_state`): the position in this host's stream, the batch count and the `stats`
    counters: resuming replays nothing and skips nothing.

    **Arguments:**

    - `conversations`: the conversations (`read_conversations`), or a list of message lists.
    - `tokenizer`: the model's Hugging Face tokenizer.
    - `template`: the chat template (`ChatTemplate.for_tokenizer`).
    - `seq_len`: positions per row.
    - `packing`: pack conversations into rows (True) or one conversation per row (False).
    - `truncation`: `"truncate"` (keep the first `seq_len` positions) or `"drop"` conversations
      longer than a row.
    - `assistant_only_loss`: weight only the replies and their end-of-turn tokens (False: every token).
    - `batch_size`, `num_infeed_hosts`, `infeed_host_index`, `seed`, `repeat`: see `BaseInput`.
    """

    def __init__(
        self,
        conversations: Conversations | Sequence[Sequence[Mapping[str, Any]]],
        *,
        tokenizer: HFTokenizer,
        template: ChatTemplate,
        seq_len: int,
        batch_size: int,
        num_infeed_hosts: int = 1,
        infeed_host_index: int = 0,
        seed: int = 0,
        repeat: bool = True,
        packing: bool = True,
        truncation: Literal["truncate", "drop"] = "truncate",
        assistant_only_loss: bool = True,
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
        if truncation not in ("truncate", "drop"):
            raise ValueError(f"truncation must be 'truncate' or 'drop', got {truncation!r}.")
        if len(conversations) < num_infeed_hosts:
            raise ChatError(
                f"{len(conversations)} conversation(s) cannot feed {num_infeed_hosts} hosts: each host needs "
                "at least one."
            )
        self.conversations = conversations
        self.origins: Sequence[str] = (
            conversations.origins
            if isinstance(conversations, Conversations)
            else [f"conversation {i}" for i in range(len(conversations))]
        )
        self._tok = tokenizer
        self.template = template
        self.seq_len: int = int(seq_len)
        self.packing: bool = bool(packing)
        self.truncation: Literal["truncate", "drop"] = truncation
        self.assistant_only_loss: bool = bool(assistant_only_loss)
        self._per_host = len(range(infeed_host_index, len(conversations), num_infeed_hosts))
        self.example: Callable[[int], tuple[np.ndarray, np.ndarray, bool] | None] = functools.lru_cache(
            maxsize=1 << 16
        )(self._make_example)
        self._rows_per_host: list[int] | None = None
        self.reset()

    # --- examples ---------------------------------------------------------------------------

    def _make_example(self, index: int) -> tuple[np.ndarray, np.ndarray, bool] | None:
        """`(tokens, weights, truncated)` of conversation `index` cut to `seq_len + 1` tokens, or
        None when it is longer and `truncation="drop"`, or when the cut keeps no reply token
        (`self.example`: the same, cached).

        Raises:
            ChatError: the conversation does not render or has no reply to train on (naming it).
        """
        ex = chat_example(
            self._tok,
            self.template,
            self.conversations[index],
            where=self.origins[index],
            assistant_only_loss=self.assistant_only_loss,
        )
        cut = len(ex.ids) - 1 > self.seq_len
        if cut and self.truncation == "drop":
            return None
        ids, weights = ex.ids[: self.seq_len + 1], ex.weights[: self.seq_len + 1]
        if cut and not weights[1:].any():
            return None  # every reply starts past the row: it would train nothing, so it is dropped
        return ids, weights, cut

    def _order(self, epoch: int) -> np.ndarray:
        n = len(self.conversations)
        order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.repeat else np.arange(n)
        return order[self.infeed_host_index :: self.num_infeed_hosts]

    def _conversation_at(self, position: int) -> int | None:
        """The conversation at `position` of this host's stream; None past the end of an eval pass."""
        epoch, j = divmod(position, self._per_host)
        if epoch and not self.repeat:
            return None
        if self._orders[0] != epoch:
            self._orders = (epoch, self._order(epoch))
        return int(self._orders[1][j])

    # --- rows and batches --------------------------------------------------------------------

    def _next_row(self) -> dict[str, np.ndarray] | None:
        pieces: list[tuple[np.ndarray, np.ndarray]] = []
        used = skipped = 0
        while True:
            index = self._conversation_at(self._position)
            if index is None:
                break
            example = self.example(index)
            if example is None:
                self._position += 1
                self.stats["dropped"] += 1
                skipped += 1
                if skipped > self._per_host:
                    raise ChatError(
                        f"every conversation of this host's {self._per_host} is longer than seq_len={self.seq_len} "
                        "and is skipped (truncation='drop', or no reply token within the row): raise "
                        "data.seq_len, or set data.truncation='truncate' if the replies start within it."
                    )
                continue
            tokens, weights, cut = example
            if pieces and (not self.packing or used + len(tokens) - 1 > self.seq_len):
                break
            pieces.append((tokens, weights))
            used += len(tokens) - 1
            self._position += 1
            self.stats["conversations"] += 1
            self.stats["truncated"] += int(cut)
        if not pieces:
            return None
        row = self._empty_rows(1)
        row = {k: v[0] for k, v in row.items()}
        start = 0
        for segment, (tokens, weights) in enumerate(pieces, start=1):
            n = len(tokens) - 1
            row["ids"][start : start + n] = tokens[:-1]
            row["labels"][start : start + n] = tokens[1:]
            row["weights"][start : start + n] = weights[1:]
            if self.packing:
                row["segment_ids"][start : start + n] = segment
                row["positions"][start : start + n] = np.arange(n)
            start += n
        self.stats["tokens"] += start
        self.stats["row_tokens"] += self.seq_len
        return row

    def _empty_rows(self, n: int) -> dict[str, np.ndarray]:
        shape = (n, self.seq_len)
        rows = {
            "ids": np.full(shape, self._tok.pad_id, np.int32),
            "labels": np.full(shape, self._tok.pad_id, np.int32),
            "weights": np.zeros(shape, np.float32),
        }
        if self.packing:
            rows |= {"segment_ids": np.zeros(shape, np.int32), "positions": np.zeros(shape, np.int32)}
        return rows

    @property
    def num_batches(self) -> int | None:
        """Batches per eval pass, the same on every host (computed by packing every host's share
        once); None for a repeating input."""
        if self.repeat:
            return None
        if self._rows_per_host is None:
            counts = []
            for host in range(self.num_infeed_hosts):
                probe = ChatSFTInput(
                    self.conversations,
                    tokenizer=self._tok,
                    template=self.template,
                    seq_len=self.seq_len,
                    batch_size=1,
                    num_infeed_hosts=self.num_infeed_hosts,
                    infeed_host_index=host,
                    repeat=False,
                    packing=self.packing,
                    truncation=self.truncation,
                    assistant_only_loss=self.assistant_only_loss,
                )
                probe.example = self.example if host == self.infeed_host_index else probe.example
                rows = 0
                while probe._next_row() is not None:
                    rows += 1
                counts.append(rows)
            self._rows_per_host = counts
        return max(1, -(-max(self._rows_per_host) // self.batch_size))

    def packing_efficiency(self) -> float:
        """The share of the emitted rows' positions that hold conversation tokens (not padding)."""
        return _efficiency(self.stats)

    def counters(self) -> dict[str, int]:
        return dict(self.stats)

    def counter_metrics(self, totals: Mapping[str, int]) -> dict[str, int | float]:
        """`data_conversations`, `data_truncated`, `data_dropped`, `data_tokens`, `data_row_tokens`
        and `data_packing_efficiency` (tokens over row positions) of every host's stream so far."""
        return super().counter_metrics(totals) | {"data_packing_efficiency": _efficiency(totals)}

    # --- BaseInput ---------------------------------------------------------------------------

    def get_next(self) -> Batch:
        num_batches = self.num_batches
        if num_batches is not None and self._batches >= num_batches:
            raise StopIteration
        batch = self._empty_rows(self.batch_size)
        for r in range(self.batch_size):
            row = self._next_row()
            if row is None:
                break
            for k, v in row.items():
                batch[k][r] = v
        self._batches += 1
        return batch

    def reset(self) -> None:
        self._position = 0
        self._batches = 0
        self._orders: tuple[int, np.ndarray] = (0, self._order(0))
        self.stats: dict[str, int] = dict.fromkeys(_STATS, 0)

    def get_state(self) -> dict[str, Any]:
        return {"position": self._position, "batches": self._batches, **self.stats}

    def set_state(self, state: Mapping[str, Any]) -> None:
        values = check_state_keys(state, ("position", "batches", *_STATS), type(self).__name__)
        self._position, self._batches = values["position"], values["batches"]
        self.stats = {k: values[k] for k in _STATS}
