"""equipax.models: model definitions built from equipax.core layers.

KV-cache decoding lives in `equipax.models.decode` (imported from there: its `decode` function
would otherwise shadow the module).
"""

from equipax.models.classifier import ImageClassificationTask, classification_loss, classification_metrics
from equipax.models.cnn import AdvancedCNN, CNNConfig, ResidualBlock, SelfAttention
from equipax.models.lm import LanguageModel, LMConfig, TransformerLM, generate, lm_loss
from equipax.models.llama import LlamaConfig, LlamaLM, llama_flops_per_token, llama_param_counts
from equipax.models.lm_task import LMTask

__all__ = [
    "AdvancedCNN",
    "CNNConfig",
    "ImageClassificationTask",
    "LMConfig",
    "LMTask",
    "LanguageModel",
    "LlamaConfig",
    "LlamaLM",
    "ResidualBlock",
    "SelfAttention",
    "TransformerLM",
    "classification_loss",
    "classification_metrics",
    "generate",
    "llama_flops_per_token",
    "llama_param_counts",
    "lm_loss",
]
