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

The order is global (`equipax.data.global_order`): an epoch's rows are the next-fit packing of
that epoch's shuffle of every conversation, a function of `(seed, epoch)` alone, and host h reads
its contiguous rows of each global batch; so the global batches, and a resume on another number
of hosts, are the same whatever the number of hosts.
"""

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import numpy as np
from jaxtyping import Int, Integer

from equipax.data.base import Batch, check_positive
from equipax.data.chat import ChatError, ChatTemplate, Conversations, chat_example
from equipax.data.global_order import GlobalOrderInput, epoch_permutation
from equipax.data.tokenizers import HFTokenizer

__all__ = ["ChatSFTInput"]

_STATS = ("conversations", "truncated", "dropped", "tokens", "row_tokens")


class _EpochPlan(NamedTuple):
    """One epoch's rows: row r holds conversations `members[starts[r]:starts[r + 1]]`; `stats[r]`
    counts its conversations, truncated ones, dropped ones and tokens (the first four `_STATS`)."""

    members: Int[np.ndarray, " kept"]
    starts: Int[np.ndarray, " rows_plus_one"]
    stats: Int[np.ndarray, "rows 4"]

    @property
    def rows(self) -> int:
        return len(self.starts) - 1


def _efficiency(stats: Mapping[str, int]) -> float:
    return stats["tokens"] / max(stats["row_tokens"], 1)


class ChatSFTInput(GlobalOrderInput):
    """Supervised fine-tuning batches from conversations (BaseInput semantics, global order).

    Order: training (`repeat=True`) packs every epoch's seeded permutation of the conversations,
    the same on every host, into rows; global row p is found from the rows of the epochs before
    it (their counts differ: the packing depends on the order). Host h reads rows
    `[N * G + h * b, N * G + (h + 1) * b)` of global batch N. Eval (`repeat=False`) is one ordered
    pass of `num_batches` global batches, padded with weight-0 rows.

    State (`get_state`): GlobalOrderInput's `{"row", "global_batch", "rows_per_epoch"}` (the
    rows of epoch 0), the same on every host: resuming replays nothing and skips nothing, on any
    number of hosts. `stats` counts what this host has read (recomputed from the plan on resume).

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
        if len(conversations) == 0:
            raise ChatError("conversations is empty: an input needs at least one conversation.")
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
        self.example: Callable[[int], tuple[np.ndarray, np.ndarray, bool] | None] = functools.lru_cache(
            maxsize=1 << 16
        )(self._make_example)
        self._plans: list[_EpochPlan] = []
        self._first_rows: list[int] = [0]  # the global row where each planned epoch starts, then the end
        self._init_order(self._plan(0).rows)
        self.stats: dict[str, int] = dict.fromkeys(_STATS, 0)

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

    def _plan(self, epoch: int) -> _EpochPlan:
        """The rows of `epoch` (computed once per epoch, in order: a global row's epoch is found
        from the rows of the epochs before it)."""
        while len(self._plans) <= epoch:
            e = len(self._plans)
            n = len(self.conversations)
            order = epoch_permutation(self.seed, e, n) if self.repeat else np.arange(n, dtype=np.int64)
            self._plans.append(self._pack(order))
            self._first_rows.append(self._first_rows[-1] + self._plans[-1].rows)
        return self._plans[epoch]

    def _pack(self, order: np.ndarray) -> _EpochPlan:
        """Next fit over `order`: whole examples fill each row in turn; a dropped conversation is
        counted in the row that follows it (the epoch's last row for trailing ones)."""
        members: list[int] = []
        starts: list[int] = []
        stats: list[list[int]] = []
        used = dropped = 0
        for index in order.tolist():
            example = self.example(index)
            if example is None:
                dropped += 1
                continue
            tokens, _, cut = example
            n = len(tokens) - 1
            if not starts or not self.packing or used + n > self.seq_len:
                starts.append(len(members))
                stats.append([0, 0, 0, 0])
                used = 0
            members.append(index)
            used += n
            stats[-1][0] += 1
            stats[-1][1] += int(cut)
            stats[-1][2] += dropped
            stats[-1][3] += n
            dropped = 0
        if not starts:
            why = (
                "skipped (truncation='drop'): raise data.seq_len, or set data.truncation='truncate' to train on "
                "their first seq_len tokens"
                if self.truncation == "drop"
                else "skipped because its cut keeps no reply token (every assistant reply starts past the row): "
                "raise data.seq_len, or shorten what comes before the first reply (system prompt, first question)"
            )
            raise ChatError(
                f"every one of the {len(order)} conversations is longer than seq_len={self.seq_len} and is {why}."
            )
        stats[-1][2] += dropped
        return _EpochPlan(
            np.asarray(members, np.int64), np.asarray([*starts, len(members)], np.int64), np.asarray(stats, np.int64)
        )

    def _locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(epoch, row within the epoch) of each global row."""
        last = int(positions.max(initial=0))
        while self._first_rows[-1] <= last:
            self._plan(len(self._plans))
        first = np.asarray(self._first_rows, np.int64)
        epochs = np.searchsorted(first, positions, side="right") - 1
        return epochs, positions - first[epochs]

    def _row_stats(self, positions: np.ndarray) -> dict[str, int]:
        """The `stats` counters of the rows at global `positions`."""
        totals: dict[str, int] = dict.fromkeys(_STATS, 0)
        if positions.size == 0:
            return totals
        epochs, rows = self._locate(positions)
        summed = sum(self._plans[int(e)].stats[rows[epochs == e]].sum(axis=0) for e in np.unique(epochs))
        for name, value in zip(_STATS[:4], np.asarray(summed).tolist(), strict=True):
            totals[name] = int(value)
        totals["row_tokens"] = int(positions.size) * self.seq_len
        return totals

    # --- rows and batches --------------------------------------------------------------------

    def _read_rows(self, positions: Integer[np.ndarray, " n"]) -> Batch:
        positions = np.asarray(positions, np.int64)
        batch = self._empty_rows(len(positions))
        for r, (e, o) in enumerate(zip(*self._locate(positions), strict=True)):
            plan = self._plans[int(e)]
            start = 0
            for segment, index in enumerate(plan.members[plan.starts[o] : plan.starts[o + 1]].tolist(), start=1):
                example = self.example(index)
                assert example is not None  # the plan holds only kept examples
                tokens, weights, _ = example
                n = len(tokens) - 1
                batch["ids"][r, start : start + n] = tokens[:-1]
                batch["labels"][r, start : start + n] = tokens[1:]
                batch["weights"][r, start : start + n] = weights[1:]
                if self.packing:
                    batch["segment_ids"][r, start : start + n] = segment
                    batch["positions"][r, start : start + n] = np.arange(n)
                start += n
        for name, value in self._row_stats(positions).items():
            self.stats[name] += value
        return batch

    def _padding(self, n: int) -> Batch:
        return self._empty_rows(n)

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

    def packing_efficiency(self) -> float:
        """The share of the emitted rows' positions that hold conversation tokens (not padding)."""
        return _efficiency(self.stats)

    def counters(self) -> dict[str, int]:
        return dict(self.stats)

    def counter_metrics(self, totals: Mapping[str, int]) -> dict[str, int | float]:
        """`data_conversations`, `data_truncated`, `data_dropped`, `data_tokens`, `data_row_tokens`
        and `data_packing_efficiency` (tokens over row positions) of every host's stream so far."""
        return super().counter_metrics(totals) | {"data_packing_efficiency": _efficiency(totals)}

    # --- state -----------------------------------------------------------------------------

    def reset(self) -> None:
        super().reset()
        self.stats: dict[str, int] = dict.fromkeys(_STATS, 0)

    def set_state(self, state: Mapping[str, Any]) -> None:
        """The global row cursor (GlobalOrderInput); the counters are those of the rows this host
        read before it, recomputed from the plan."""
        super().set_state(state)
        batches = np.arange(self._row // self.global_batch_size, dtype=np.int64)
        positions = (batches[:, None] * self.global_batch_size + self.host_positions(0)[None, :]).ravel()
        if not self.repeat:
            positions = positions[positions < self.rows_per_epoch]
        self.stats = self._row_stats(positions)
