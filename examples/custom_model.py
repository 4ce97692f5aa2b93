"""Train your own Equinox model with equipax's train step: a small MLP regression.

The model is any `eqx.Module`; the loss is a plain function `loss_fn(model, batch, *, key) ->
(loss, aux)`, given to the step as a Task with `LossFnTask(loss_fn)` (`equipax.core.step`). The
learner, the jitted step (grad + update + metrics, state donated) and the sharding helpers come
from `equipax.core`. Run it:

    uv run python examples/custom_model.py --steps 300
"""

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from equipax.core.nn import Linear
from equipax.core.optim import LearnerConfig, ScheduleConfig, make_learner
from equipax.core.step import LossFnTask, init_train_state, make_train_step
from equipax.core.task import Batch


class MLP(eqx.Module):
    """`x -> w2 @ gelu(w1 @ x)`, batched over the leading dimension."""

    hidden: Linear
    out: Linear

    def __init__(self, in_dims: int, hidden_dims: int, *, key: PRNGKeyArray) -> None:
        k1, k2 = jax.random.split(key)
        self.hidden = Linear(in_dims, hidden_dims, use_bias=True, key=k1)
        self.out = Linear(hidden_dims, 1, use_bias=True, key=k2)

    def __call__(self, x: Float[Array, "batch features"]) -> Float[Array, " batch"]:
        return self.out(jax.nn.gelu(self.hidden(x)))[..., 0]


def loss_fn(model: MLP, batch: Batch, *, key: PRNGKeyArray | None) -> tuple[Array, dict[str, Array]]:
    """Mean squared error; `key` is unused (no dropout) but part of the contract."""
    del key
    pred = model(jnp.asarray(batch["x"]))
    err = pred - jnp.asarray(batch["y"])
    mse = jnp.mean(err**2)
    return mse, {"max_abs_error": jnp.max(jnp.abs(err))}


def make_batch(rng: np.random.Generator, batch_size: int) -> Batch:
    """`y = sin(3 x0) + x1^2` on uniform inputs."""
    x = rng.uniform(-1, 1, size=(batch_size, 2)).astype(np.float32)
    return {"x": x, "y": (np.sin(3 * x[:, 0]) + x[:, 1] ** 2).astype(np.float32)}


def main(steps: int = 300, seed: int = 0) -> tuple[float, float]:
    """Train; returns `(first loss, last loss)`."""
    init_key, step_key = jax.random.split(jax.random.key(seed))
    model = MLP(2, 64, key=init_key)
    learner = make_learner(LearnerConfig(schedule=ScheduleConfig(peak_learning_rate=1e-2)))
    state = init_train_state(model, learner.optimizer)
    train_step = make_train_step(LossFnTask(loss_fn), learner.optimizer, learner.schedule)

    rng = np.random.default_rng(seed)
    first = last = float("nan")
    for step in range(1, steps + 1):
        state, metrics = train_step(state, make_batch(rng, 64), step_key)
        last = float(metrics["loss"])
        first = last if step == 1 else first
        if step % 100 == 0 or step == steps:
            print(f"step {step}: mse {last:.4f} grad_norm {float(metrics['grad_norm']):.3f}")
    print(f"trained MLP: mse {first:.4f} -> {last:.4f}; untrained model still usable: {model.out.weight.shape}")
    return first, last


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    main(steps=args.steps, seed=args.seed)
