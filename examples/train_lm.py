"""Train a small language model with equipax as a library (no `launch`, no experiment registry).

Builds a `TransformerLM` from `equipax.models`, an optimizer from `equipax.core.optim`, and the
jitted train step from `equipax.core.step`, then trains on a toy next-token task (count upwards
modulo the vocabulary) and samples from the model. Run it:

    uv run python examples/train_lm.py --steps 200
"""

import argparse

import jax
import numpy as np

from equipax.core.nn import TransformerConfig
from equipax.core.optim import LearnerConfig, ScheduleConfig, make_learner
from equipax.core.step import LossFnTask, TrainState, init_train_state, make_eval_step, make_train_step
from equipax.core.task import Batch
from equipax.models import LMConfig, TransformerLM, generate, lm_loss


def counting_batch(rng: np.random.Generator, batch_size: int, seq_len: int, vocab: int) -> Batch:
    """Rows `s, s+1, s+2, ...` (mod vocab): the next token is always predictable."""
    starts = rng.integers(0, vocab, size=(batch_size, 1))
    tokens = (starts + np.arange(seq_len + 1)[None]) % vocab
    return {
        "ids": tokens[:, :-1].astype(np.int32),
        "labels": tokens[:, 1:].astype(np.int32),
        "weights": np.ones((batch_size, seq_len), np.float32),
    }


def main(steps: int = 200, seed: int = 0) -> float:
    """Train for `steps` steps; returns the final eval loss."""
    vocab, seq_len, batch_size = 64, 16, 8
    config = LMConfig(
        vocab_size=vocab,
        max_seq_len=seq_len,
        transformer=TransformerConfig(num_layers=2, model_dims=32, num_heads=2, head_dim=16, hidden_dims=64),
    )
    init_key, step_key = jax.random.split(jax.random.key(seed))
    model = TransformerLM(config, key=init_key)
    learner = make_learner(LearnerConfig(schedule=ScheduleConfig(peak_learning_rate=3e-3)))

    state: TrainState[TransformerLM] = init_train_state(model, learner.optimizer)
    task = LossFnTask(lm_loss)  # the plain loss function as the Task the steps take
    train_step = make_train_step(task, learner.optimizer, learner.schedule)
    eval_step = make_eval_step(task)

    rng = np.random.default_rng(seed)
    for step in range(1, steps + 1):
        state, metrics = train_step(state, counting_batch(rng, batch_size, seq_len, vocab), step_key)
        if step % 50 == 0 or step == steps:
            print(f"step {step}: loss {float(metrics['loss']):.3f}")

    # The model the state was built from is still the caller's (untrained) model.
    eval_batch = counting_batch(rng, batch_size, seq_len, vocab)
    before = eval_step(model, eval_batch)
    after = eval_step(state.model, eval_batch)
    loss_before = float(before["loss_sum"] / before["weight_sum"])
    loss_after = float(after["loss_sum"] / after["weight_sum"])
    print(f"eval loss: untrained {loss_before:.3f}, trained {loss_after:.3f}")

    # Token ids may be numpy arrays.
    logits = state.model(np.arange(8, dtype=np.int32)[None])
    print("logits", logits.shape, "sample", generate(state.model, np.array([3, 4, 5], np.int32), 5).tolist())
    return loss_after


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    main(steps=args.steps, seed=args.seed)
