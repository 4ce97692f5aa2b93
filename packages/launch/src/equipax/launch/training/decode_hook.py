"""Sampling during training (`DecodeHook`, Pax's `--decode_during_train`): every
`train.decode.every` steps the model continues `train.decode.prompts` with the KV cache
(`equipax.launch.inference.sampling.decode_texts`, the same code as `launch decode`)."""

from typing import Any

import jax

from equipax.launch.inference.sampling import decode_texts, encode_prompts
from equipax.launch.training.hooks import Hook, RunContext, StepContext

__all__ = ["DecodeHook"]


class DecodeHook(Hook):
    """Every `train.decode.every` steps: continue `train.decode.prompts` by `train.decode.tokens`
    tokens with the KV cache; written to metrics.jsonl (split "decode") and as TensorBoard text.
    Its output is the samples' records."""

    name: str = "decode"
    waits_for_device: bool = True

    def __init__(self, every: int) -> None:
        self.every = every
        self.tokenizer: Any | None = None

    def start(self, run: RunContext) -> None:
        self.tokenizer = run.inputs.extra.get("tokenizer")
        if self.every and self.tokenizer is not None:
            max_seq_len = run.cfg.model.max_seq_len  # pyright: ignore[reportAttributeAccessIssue]
            encode_prompts(self.tokenizer, run.cfg.train.decode.prompts, max_seq_len)  # bad prompts: exit 2 now

    def due(self, ctx: StepContext) -> bool:
        return self.tokenizer is not None and super().due(ctx)

    def after_step(self, ctx: StepContext) -> list[dict[str, Any]]:
        run, train = ctx.run, ctx.run.cfg.train
        key = jax.random.fold_in(run.training.keys.sample, ctx.step)
        samples = decode_texts(
            ctx.state.model,
            self.tokenizer,
            train.decode.prompts,
            max_new_tokens=train.decode.tokens,
            temperature=train.decode.temperature,
            key=key,
        )
        for i, sample in enumerate(samples):
            run.writer.write(ctx.step, "decode", {"prompt_index": i, **sample.record()})
            run.writer.add_text("decode", f"prompt_{i}", sample.prompt + sample.text, ctx.step)
        run.log(f"step {ctx.step}: decode {samples[0].prompt!r} -> {samples[0].text[:120]!r}")
        return [sample.record() for sample in samples]
