"""equipax.models: model definitions built from equipax.core layers.

KV-cache decoding lives in `equipax.models.decode` (imported from there: its `decode` function
would otherwise shadow the module).

The names below are imported on first access, not with the package: `equipax.models.configs`
(the config classes) has no JAX, and building or printing an experiment should not pay for
importing it (benchmarks/README.md, "CLI latency").
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from equipax.models.classifier import ImageClassificationTask, classification_loss, classification_metrics
    from equipax.models.cnn import AdvancedCNN, ResidualBlock, SelfAttention
    from equipax.models.configs import CNNConfig, LMConfig, LoRAConfig, RopeScalingConfig, cnn_param_count
    from equipax.models.lm import TransformerLM, generate, lm_loss
    from equipax.models.lm_task import LMTask
    from equipax.models.lora import LoRAAdapter, LoRALM

# Where each public name is defined.
_HOMES = {
    "AdvancedCNN": "cnn",
    "CNNConfig": "configs",
    "ImageClassificationTask": "classifier",
    "LMConfig": "configs",
    "LMTask": "lm_task",
    "LoRAAdapter": "lora",
    "LoRAConfig": "configs",
    "LoRALM": "lora",
    "ResidualBlock": "cnn",
    "RopeScalingConfig": "configs",
    "SelfAttention": "cnn",
    "TransformerLM": "lm",
    "classification_loss": "classifier",
    "classification_metrics": "classifier",
    "cnn_param_count": "configs",
    "generate": "lm",
    "lm_loss": "lm",
}

__all__ = [
    "AdvancedCNN",
    "CNNConfig",
    "ImageClassificationTask",
    "LMConfig",
    "LMTask",
    "LoRAAdapter",
    "LoRAConfig",
    "LoRALM",
    "ResidualBlock",
    "RopeScalingConfig",
    "SelfAttention",
    "TransformerLM",
    "classification_loss",
    "classification_metrics",
    "cnn_param_count",
    "generate",
    "lm_loss",
]


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
