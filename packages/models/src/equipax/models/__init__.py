"""equipax.models: model definitions built from equipax.core layers."""

from equipax.models.classifier import ImageClassificationTask, classification_loss, classification_metrics
from equipax.models.cnn import AdvancedCNN, CNNConfig, ResidualBlock, SelfAttention
from equipax.models.lm import LMConfig, TransformerLM, generate, lm_loss
from equipax.models.lm_task import LMTask

__all__ = [
    "AdvancedCNN",
    "CNNConfig",
    "ImageClassificationTask",
    "LMConfig",
    "LMTask",
    "ResidualBlock",
    "SelfAttention",
    "TransformerLM",
    "classification_loss",
    "classification_metrics",
    "generate",
    "lm_loss",
]
