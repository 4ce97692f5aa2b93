"""Sampling text from a language model with the KV cache, for `launch decode` and for sampling
during training (`equipax.launch.training.decode_hook.DecodeHook`, Pax's `--decode_during_train`).

`decode_texts` tokenizes the prompts with the job's tokenizer, right-pads them into one batch
with per-row lengths, runs `equipax.models.decode.decode` (prefill + one jitted token loop) and
detokenizes each row up to its end. The batch's width is padded up to a power of two
(`padded_width`): the decode program is compiled per width, so batches of prompts of other
lengths reuse one program instead of compiling their own (on a TPU, an XLA compile of the whole
decode loop each). Its timing leaves compilation out (JAX reports compile time through
`jax.monitoring`), so `seconds_per_token` is the decode loop's own speed.
"""

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from equipax.core.knobs import ConfigError
from equipax.launch.aot.compile_events import CompileEvents

__all__ = ["decode_texts", "encode_prompts", "host_array", "host_arrays", "padded_width", "Sample"]


@dataclasses.dataclass(frozen=True)
class Sample:
    """One prompt's continuation.

    Attributes:
        prompt: the prompt text.
        text: the generated text (the prompt excluded).
        tokens: the generated token ids (up to and including EOS).
        seconds_per_token: wall time of one step of the batch's decode loop (prefill included,
            compilation excluded), the same for every row of a batch.
    """

    prompt: str
    text: str
    tokens: list[int]
    seconds_per_token: float

    def record(self) -> dict[str, Any]:
        """JSON-ready."""
        return dataclasses.asdict(self)


def encode_prompts(tokenizer: Any, prompts: Sequence[str], max_seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of `prompts`, right-padded into `[batch width]`, and each row's length.

    Raises:
        ConfigError: a prompt is empty (no tokens) or leaves no room for a new token.
    """
    rows = []
    for i, text in enumerate(prompts):
        ids = tokenizer.encode(text) if text.strip() else []
        where = f"prompt {i + 1} ({text[:40]!r})" if len(prompts) > 1 else f"the prompt {text[:40]!r}"
        if not ids:
            raise ConfigError(f"{where} is empty: give some text to continue (e.g. --prompt 'ROMEO:').")
        if len(ids) >= max_seq_len:
            raise ConfigError(
                f"{where} is {len(ids)} tokens, but the model reads at most max_seq_len={max_seq_len} tokens "
                f"(prompt + generated): shorten it to at most {max_seq_len - 1} tokens."
            )
        rows.append(ids)
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), tokenizer.pad_id, np.int32)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    return ids, np.asarray([len(r) for r in rows], np.int32)


def padded_width(width: int, *, max_seq_len: int, max_new_tokens: int) -> int:
    """The width a batch of prompts `width` tokens wide is right-padded to: the next power of two
    from 16, so that prompts of other lengths share a compiled program (the padding is masked
    and overwritten as tokens come: the samples do not change); never so wide that fewer than
    `max_new_tokens` fit in `max_seq_len`, and never below `width`."""
    bucket = max(16, 1 << (width - 1).bit_length())
    return max(width, min(bucket, max_seq_len - max_new_tokens))


def host_array(x: jax.Array) -> np.ndarray:
    """`x` as one numpy array on every process (gathered where it spans processes)."""
    return host_arrays(x)[0]


def host_arrays(*xs: jax.Array) -> tuple[np.ndarray, ...]:
    """Each of `xs` as one numpy array on every process (gathered where one spans processes); all
    of them read in one wait where every one is this process's alone."""
    if all(x.is_fully_addressable for x in xs):
        return tuple(np.asarray(x) for x in jax.device_get(xs))
    from jax.experimental import multihost_utils  # sharded over processes: every process gathers them

    return tuple(np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in xs)


def decode_texts(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    key: Any = None,
    eos_id: int | None = None,
) -> list[Sample]:
    """Continue each prompt by up to `max_new_tokens` tokens (fewer where the model's
    `max_seq_len` leaves less room after that prompt, whatever the others' lengths; a row stops
    after `eos_id`, default the tokenizer's EOS).

    Arguments:
        model: a `TransformerLM` (any family).
        tokenizer: the job's tokenizer (`training.lm_inputs.build_tokenizer`).
        prompts: the texts to continue, decoded together as one batch.
        max_new_tokens, temperature, top_k, top_p, key: as `equipax.models.decode.decode`.

    Returns:
        One `Sample` per prompt, in order.
    """
    from equipax.models.decode import decode

    max_seq_len = model.cfg.max_seq_len
    ids, lengths = encode_prompts(tokenizer, prompts, max_seq_len)
    width = padded_width(ids.shape[1], max_seq_len=max_seq_len, max_new_tokens=max_new_tokens)
    ids = np.pad(ids, ((0, 0), (0, width - ids.shape[1])), constant_values=tokenizer.pad_id)
    new = min(max_new_tokens, max_seq_len - 1)  # the most any row can get; each row gets its own room
    start = time.monotonic()
    with CompileEvents() as compiling:
        # From the host: the lengths are checked there, and the call copies both to the device.
        tokens, counts = decode(
            model,
            ids,
            lengths,
            max_new_tokens=new,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            eos_id=tokenizer.eos_id if eos_id is None else eos_id,
            pad_id=tokenizer.pad_id,
            key=key,
        )
        tokens, counts = host_arrays(tokens, counts)
    seconds = max(time.monotonic() - start - compiling.seconds, 0.0)
    per_token = seconds / max(int(counts.max()), 1)
    samples = []
    for prompt, row, n in zip(prompts, tokens.tolist(), counts.tolist()):
        row = row[:n]
        # model.vocab_size may exceed the tokenizer's: ids past it were never a target, no text decodes.
        text = tokenizer.decode([i for i in row if i < tokenizer.vocab_size and i != tokenizer.eos_id])
        samples.append(Sample(prompt=prompt, text=text, tokens=row, seconds_per_token=per_token))
    return samples
