"""The CNN tutorial's image classifier (AdvancedCNN, docs/tutorial_cnn.md): on its synthetic images,
and on digits."""

import dataclasses

from equipax.core.learner_config import LearnerConfig, ScheduleConfig
from equipax.core.mesh_config import MeshConfig
from equipax.launch.configs.experiment import ExperimentConfig, ImageDataConfig
from equipax.launch.configs.train import TrainConfig
from equipax.launch.experiments.registry import register
from equipax.models.configs import CNNConfig

__all__ = ["cnn_digits", "cnn_tutorial", "TUTORIAL_LEARNER"]

# The tutorial's learner: clip 1.0 -> AdamW (weight decay 1e-4); linear warmup over 50 steps to
# 1e-3, then cosine decay over 500 steps to 0.1 x 1e-3.
TUTORIAL_LEARNER = LearnerConfig(
    kind="adamw",
    weight_decay=1e-4,
    clip_gradient_norm=1.0,
    schedule=ScheduleConfig(
        kind="warmup_cosine", peak_learning_rate=1e-3, warmup_steps=50, decay_steps=500, final_fraction=0.1
    ),
)


@register
def cnn_tutorial() -> ExperimentConfig:
    """The tutorial as written: 5 epochs of batch 32 on 1000 random 32x32x3 images (200 to test).

    The labels are random, so test accuracy stays at chance (~0.1) however long it trains.
    """
    return ExperimentConfig(
        name="cnn_tutorial",
        description="The CNN tutorial's AdvancedCNN on its synthetic images (random labels).",
        model=CNNConfig(num_classes=10, in_channels=3),
        data=ImageDataConfig(
            source="synthetic",
            batch_size=32,
            num_train=1000,
            num_test=200,
            image_size=32,
            channels=3,
            num_classes=10,
            shuffle=False,
        ),
        learner=TUTORIAL_LEARNER,
        train=TrainConfig(num_epochs=5, log_every=10, eval_batches=0),
        # Data parallel over every device present (`--cpu-devices 4`, a GPU host, ...).
        mesh=MeshConfig(ici_mesh_shape=(-1, 1, 1)),
    )


@register
def cnn_digits() -> ExperimentConfig:
    """The same model and learner on the 1797 handwritten digits (80/20 split): >= 95% test accuracy."""
    base = cnn_tutorial()
    return dataclasses.replace(
        base,
        name="cnn_digits",
        description="The tutorial's AdvancedCNN on the 8x8 handwritten digits.",
        model=dataclasses.replace(base.model, in_channels=1),
        data=ImageDataConfig(source="digits", batch_size=32, test_fraction=0.2, shuffle=True),
        train=TrainConfig(num_epochs=10, log_every=10, eval_batches=0),
    )
