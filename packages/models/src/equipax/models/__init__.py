"""equipax.models: model definitions built from equipax.core layers."""

from equipax.models.classifier import classification_loss, classification_metrics
from equipax.models.cnn import AdvancedCNN, CNNConfig, ResidualBlock, SelfAttention
from equipax.models.lm import LMConfig, TransformerLM, generate, lm_loss

__all__ = [
    "AdvancedCNN",
    "CNNConfig",
    "LMConfig",
    "ResidualBlock",
    "SelfAttention",
    "TransformerLM",
    "classification_loss",
    "classification_metrics",
    "generate",
    "lm_loss",
]
