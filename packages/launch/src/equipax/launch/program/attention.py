"""What a program's softmax attention runs as on its mesh, for the run's record (knobs.txt's note,
compile.json's `attention`): the kernel its task was built with (`attention_impl="auto"` resolved
once for the mesh's platform, the training sequence length and dtype:
`equipax.core.nn.fused_attention.resolve_attention`)."""

from typing import Any

from jax.sharding import Mesh

from equipax.core.mesh_config import CONTEXT
from equipax.core.nn.fused_attention import attention_kernel, mesh_platform
from equipax.launch.configs.experiment import ExperimentConfig, as_lm, is_lm

__all__ = ["ATTENTION_KNOB", "attention_record"]

ATTENTION_KNOB = "model.transformer.attention_impl"


def attention_record(cfg: ExperimentConfig, mesh: Mesh) -> dict[str, Any] | None:
    """What the train step's attention runs as on `mesh` (`attention_kernel`: "auto" resolved for
    the mesh's platform, the training sequence length and dtype), JSON-ready (compile.json's
    `attention`, knobs.txt's note); None for a model without softmax attention."""
    if not is_lm(cfg):
        return None
    lm = as_lm(cfg)
    transformer, platform = lm.model.transformer, mesh_platform(mesh)
    seq_len, dtype = lm.data.seq_len, lm.model.dtype
    context = int(dict(mesh.shape).get(CONTEXT, 1))
    kernel = attention_kernel(transformer, platform, seq_len=seq_len, dtype=dtype, context=context)
    if kernel is None:
        return None
    return {"knob": ATTENTION_KNOB, "value": transformer.attention_impl, "kernel": kernel, "platform": platform,
            "seq_len": seq_len, "dtype": dtype}  # fmt: skip
