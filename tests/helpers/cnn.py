"""A tiny AdvancedCNN, random images and one stateful train step of it, shared by the model's
tests and the launcher's checkpoint tests (the `one_step` fixture in conftest.py)."""

import numpy as np


def tiny_cnn_config(**overrides):
    from equipax.models import CNNConfig

    return CNNConfig(
        **{
            "in_channels": 1,
            "stem_channels": 4,
            "stage_channels": (8, 16),
            "blocks_per_stage": 1,
            "num_heads": 2,
            "hidden_dims": 16,
            **overrides,
        }
    )


def tiny_cnn(key, **overrides):
    import equinox as eqx

    from equipax.models import AdvancedCNN

    return eqx.nn.make_with_state(AdvancedCNN)(tiny_cnn_config(**overrides), key=key)


def tiny_cnn_task():
    """The Task of `tiny_cnn()` on 8x8 grey images (`images()`)."""
    from equipax.models import ImageClassificationTask

    return ImageClassificationTask(tiny_cnn_config(), (8, 8, 1))


def images(n=4, size=8, channels=1, seed=0):
    import jax.numpy as jnp

    return jnp.asarray(np.random.default_rng(seed).normal(size=(n, size, size, channels)), jnp.float32)


def one_step():
    """(initial state, state after one train step, metrics, batch, optimizer) of a tiny CNN."""
    import jax

    from equipax.core.optim import LearnerConfig, make_learner, make_schedule
    from equipax.core.step import init_train_state, make_train_step

    model, model_state = tiny_cnn(jax.random.key(0))
    learner = LearnerConfig()
    optimizer = make_learner(learner).optimizer
    fresh_model, fresh_state = tiny_cnn(jax.random.key(0))
    initial = init_train_state(fresh_model, optimizer, model_state=fresh_state)
    state = init_train_state(model, optimizer, model_state=model_state)
    batch = {"images": images(n=8), "labels": np.arange(8, dtype=np.int32) % 10, "weights": np.ones((8,), np.float32)}
    step = make_train_step(tiny_cnn_task(), optimizer, make_schedule(learner.schedule))
    state, metrics = step(state, batch, jax.random.key(1))
    return initial, state, metrics, batch, optimizer
