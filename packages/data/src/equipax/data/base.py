"""The input interface every equipax input implements (Pax `BaseInput` semantics)."""

import abc
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from equipax.core.task import Batch
from equipax.data.metrics import DecodeMetric, MultipleChoiceSet, exact_match, token_f1
from equipax.data.tokenizers import Tokenizer

__all__ = ["BaseInput", "Batch", "Documents", "check_positive", "check_state_keys"]


@runtime_checkable
class Documents(Protocol):
    """A random-access collection of texts: a `list[str]`, or `TextShards` over files on disk.

    A protocol rather than `Sequence[str]` on purpose: a runtime type checker (beartype, on in
    the test suite) samples one *random item* of a `Sequence[str]` argument, which for
    `TextShards` is a disk read, and a corrupt record then surfaced as a type-check error instead
    of the `DataError` naming the file. Checking this protocol never reads a document.
    """

    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> str: ...


def check_positive(name: str, value: int) -> None:
    """Raise a ValueError naming `name` unless `value` is a positive int."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")


class BaseInput(abc.ABC):
    """A per-host stream of batches: leading dim is the per-host `batch_size`.

    Each host builds its own input with its own `infeed_host_index` (the JAX process index, or
    the one the hosts of a context group share: `equipax.core.infeed.host_infeed`); the global
    batch is `batch_size * num_infeed_hosts`. Training inputs (`repeat=True`) never end and
    different infeed hosts never emit the same examples. Eval inputs (`repeat=False`) make one
    pass, every host emitting the same number of batches, then raise StopIteration; `reset()`
    starts the pass again. `get_state()`/`set_state()` resume exactly where a run left off.

    **Arguments:**

    - `batch_size`: examples per host per batch.
    - `num_infeed_hosts`: number of hosts feeding distinct rows (the JAX process count over
      the processes that share each index).
    - `infeed_host_index`: this host's index in `[0, num_infeed_hosts)`.
    - `seed`: data seed; the same on every host (host differences come from the index).
    - `repeat`: True for training (endless), False for one eval pass.
    - `tokenizer`: used by `ids_to_strings`; None prints raw ids.
    """

    # True where `get_state()` is the same on every host (a global data order): a run saves it
    # once and may resume it on another number of hosts; False: each host saves its own.
    global_state: bool = False

    def __init__(
        self,
        *,
        batch_size: int,
        num_infeed_hosts: int = 1,
        infeed_host_index: int = 0,
        seed: int = 0,
        repeat: bool = True,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        check_positive("batch_size", batch_size)
        check_positive("num_infeed_hosts", num_infeed_hosts)
        if (
            isinstance(infeed_host_index, bool)
            or not isinstance(infeed_host_index, (int, np.integer))
            or not 0 <= infeed_host_index < num_infeed_hosts
        ):
            raise ValueError(
                f"infeed_host_index must be an int in [0, num_infeed_hosts={num_infeed_hosts}), "
                f"got {infeed_host_index!r}. Pass the mesh's (equipax.core.infeed.host_infeed(mesh))."
            )
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}.")
        self.batch_size: int = int(batch_size)
        self.num_infeed_hosts: int = int(num_infeed_hosts)
        self.infeed_host_index: int = int(infeed_host_index)
        self.seed: int = int(seed)
        self.repeat: bool = bool(repeat)
        self.tokenizer = tokenizer

    @property
    def global_batch_size(self) -> int:
        """Examples per step over all hosts: `batch_size * num_infeed_hosts`."""
        return self.batch_size * self.num_infeed_hosts

    @abc.abstractmethod
    def get_next(self) -> Batch:
        """Return the next per-host batch; raise StopIteration at the end of a `repeat=False` pass."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Restart from the beginning (used for eval inputs, never for training)."""

    @abc.abstractmethod
    def get_state(self) -> dict[str, Any]:
        """Return a small JSON-serialisable state for exact resume with `set_state`."""

    @abc.abstractmethod
    def set_state(self, state: Mapping[str, Any]) -> None:
        """Restore a state from `get_state`: the following batches are those the original would emit next."""

    def counters(self) -> dict[str, int]:
        """Running counts of what this host's stream has emitted so far (a chat input: conversations,
        truncated, dropped, tokens and row positions), kept in its `get_state`. The run sums them
        over hosts into every train record through `counter_metrics`. None by default."""
        return {}

    def counter_metrics(self, totals: Mapping[str, int]) -> dict[str, int | float]:
        """The train record's fields for `counters` summed over every host: `data_<name>` each."""
        return {f"data_{k}": int(v) for k, v in totals.items()}

    def decode_metrics(self) -> tuple[DecodeMetric, ...]:
        """The metrics `launch decode --split eval` computes on what is decoded from this input:
        `metric(targets, predictions) -> {name: value}` each (SeqIO's `predict_metric_fns`;
        `equipax.data.metrics`). Override to add your own; default: exact match and token F1."""
        return (exact_match, token_f1)

    def multiple_choice(self) -> MultipleChoiceSet | None:
        """A multiple-choice set that `launch eval` scores each checkpoint on (per-choice
        log-likelihoods through the set's score metrics, SeqIO's `score_metric_fns`), beside the
        loss; None (the default) for none. `launch eval --multiple-choice NAME` names a built-in set."""
        return None

    def ids_to_strings(self, ids: np.ndarray, lengths: Sequence[int] | np.ndarray | None = None) -> list[str]:
        """Decode a `[batch, seq]` (or `[seq]`) array of token ids to one string per row.

        **Arguments:**

        - `ids`: token ids.
        - `lengths`: optional number of valid tokens in each row; the rest is dropped.

        **Returns:** one string per row; raw ids joined by spaces when there is no tokenizer.
        """
        rows = np.asarray(ids)
        if rows.ndim == 1:
            rows = rows[None, :]
        if rows.ndim != 2:
            raise ValueError(f"ids must be [batch, seq] or [seq], got shape {rows.shape}.")
        if lengths is not None and len(lengths) != rows.shape[0]:
            raise ValueError(f"lengths has {len(lengths)} entries but ids has {rows.shape[0]} rows.")
        out = []
        for i, row in enumerate(rows):
            valid = row if lengths is None else row[: int(lengths[i])]
            tokens = [int(t) for t in valid]
            if self.tokenizer is None:
                out.append(" ".join(map(str, tokens)))
            else:
                out.append(self.tokenizer.decode(tokens))
        return out

    def __iter__(self) -> "BaseInput":
        return self

    def __next__(self) -> Batch:
        return self.get_next()


def check_state_keys(state: Mapping[str, Any], expected: Sequence[str], owner: str) -> dict[str, int]:
    """Validate that `state` holds exactly the non-negative int fields `expected`."""
    if not isinstance(state, Mapping) or set(state) != set(expected):
        got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(
            f"{owner}.set_state expects a dict with keys {sorted(expected)}, got {got}. "
            f"Pass the dict returned by {owner}.get_state()."
        )
    out = {}
    for k in expected:
        v = state[k]
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"{owner} state field {k!r} must be a non-negative int, got {v!r}.")
        out[k] = int(v)
    return out
