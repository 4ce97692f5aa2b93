"""Small language models on the complete works of Shakespeare (the default experiment)."""

import dataclasses

from equipax.core.configs import TransformerConfig
from equipax.core.learner_config import LearnerConfig, ScheduleConfig
from equipax.launch.configs.experiment import DataConfig, ExperimentConfig, as_lm
from equipax.launch.configs.train import TrainConfig
from equipax.launch.experiments.registry import register
from equipax.models.configs import LMConfig

__all__ = ["shakespeare_tiny", "shakespeare_tiny_linear"]


@register
def shakespeare_tiny() -> ExperimentConfig:
    """A 2.2M-parameter LM on 36 plays (Hamlet and The Tempest held out); 3-4 min on 2 CPU cores."""
    return ExperimentConfig(
        name="shakespeare_tiny",
        description="Small LM on Shakespeare; the default experiment.",
        model=LMConfig(
            vocab_size=2048,
            max_seq_len=128,
            transformer=TransformerConfig(
                num_layers=4,
                model_dims=192,
                num_heads=4,
                head_dim=48,
                hidden_dims=768,
                activation="gelu",
                scan_layers=False,
                remat="none",
            ),
        ),
        data=DataConfig(source="shakespeare", tokenizer="sentencepiece", seq_len=128, batch_size=16),
        learner=LearnerConfig(
            kind="adamw",
            weight_decay=1e-4,
            clip_gradient_norm=1.0,
            schedule=ScheduleConfig(
                kind="warmup_cosine", peak_learning_rate=3e-3, warmup_steps=50, decay_steps=400, final_fraction=0.1
            ),
        ),
        train=TrainConfig(num_steps=450, log_every=20, eval_every=150, eval_batches=16, checkpoint_every=150),
    )


@register
def shakespeare_tiny_linear() -> ExperimentConfig:
    """The default experiment with linear (elu + 1) attention instead of softmax."""
    model = as_lm(shakespeare_tiny()).model
    assert isinstance(model, LMConfig)
    return dataclasses.replace(
        shakespeare_tiny(),
        name="shakespeare_tiny_linear",
        description="The default experiment with linear (elu + 1) attention.",
        model=dataclasses.replace(model, transformer=dataclasses.replace(model.transformer, attention="linear")),
    )
