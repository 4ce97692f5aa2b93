"""equipax.models: model definitions built from equipax.core layers."""

from equipax.models.lm import LMConfig, TransformerLM, generate, lm_loss

__all__ = ["LMConfig", "TransformerLM", "generate", "lm_loss"]
