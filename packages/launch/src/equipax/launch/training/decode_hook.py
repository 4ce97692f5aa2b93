"""Sampling during training (`DecodeHook`, Pax's `--decode_during_train`): every
`train.decode_every` steps the model continues `train.decode_prompts` with the KV cache
(`equipax.launch.inference.sampling.decode_texts`, the same code as `launch decode`)."""

from typing import TYPE_CHECKING, Any

import jax

from equipax.launch.inference.sampling import decode_texts, encode_prompts
from equipax.launch.training.hooks import Hook

if TYPE_CHECKING:
    from equipax.launch.training.loop import Run

__all__ = ["DecodeHook"]


class DecodeHook(Hook):
    """Every `train.decode_every` steps: continue `train.decode_prompts` by `train.decode_tokens`
    tokens with the KV cache; written to metrics.jsonl (split "decode") and as TensorBoard text."""

    def __init__(self, run: "Run", log: Any) -> None:
        self.log = log  # the LogHook: its pending record is written before the decode's time counts
        train = run.cfg.train
        self.every: int = train.decode_every
        self.tokenizer: Any | None = run.inputs.extra.get("tokenizer")
        if self.every and self.tokenizer is not None:
            max_seq_len = run.cfg.model.max_seq_len  # pyright: ignore[reportAttributeAccessIssue]
            encode_prompts(self.tokenizer, train.decode_prompts, max_seq_len)  # bad prompts: exit 2 before training

    def after_step(self, run: "Run", step: int, state: Any, metrics: dict[str, Any]) -> None:
        if not self.every or self.tokenizer is None or step % self.every:
            return
        train = run.cfg.train
        self.log.flush(run)
        key = jax.random.fold_in(run.training.keys.sample, step)
        samples = decode_texts(state.model, self.tokenizer, train.decode_prompts, max_new_tokens=train.decode_tokens,
                               temperature=train.decode_temperature, key=key)
        for i, sample in enumerate(samples):
            run.writer.write(step, "decode", {"prompt_index": i, **sample.record()})
            run.writer.add_text("decode", f"prompt_{i}", sample.prompt + sample.text, step)
        run.progress.message(f"step {step}: decode {samples[0].prompt!r} -> {samples[0].text[:120]!r}")
        run.timer.restart(step)  # keep decode time out of the next step-time reading
