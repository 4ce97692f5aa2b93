"""Long-context experiments: Llama 3.1 8B at 32K and 128K tokens per sequence with a `context`
mesh axis (docs/long_context.md), for `launch compile --topology` and real TPU slices.

Each chip holds 8,192 tokens: the sequence is split over the `context` axis (zigzag layout) into
`seq_len / context` = 8,192-token shares, and the global batch (`data.batch_size`) is one sequence
per (data x fsdp) group, so fewer sequences than chips. The weights are split over `fsdp` (no
weight is split over `context`). Full remat: the saved activations are then one residual stream
per layer. `launch compile --exp llama3_1_8b_32k --topology v5p-128 --compare-context` compiles
the step and the same step without context parallelism (the axis folded into fsdp) and reports
both programs' memory per chip; benchmarks/README.md, "Long-context experiments on TPU", has the
figures. `launch run` on such a slice waits on a `context` axis across hosts (a v5p host has 4
chips; docs/long_context.md, "Not yet"): until then it is exit 2 there.
"""

import dataclasses

from equipax.core.mesh_config import CONTEXT_AXES, MeshConfig
from equipax.launch.configs.experiment import ExperimentConfig
from equipax.launch.experiments.decoder_presets import full_size
from equipax.launch.experiments.llama_lms import LLAMA3_1_8B
from equipax.launch.experiments.registry import register
from equipax.models.configs import LMConfig

__all__ = ["TOKENS_PER_CHIP", "llama3_1_8b_128k", "llama3_1_8b_32k", "long_context"]

TOKENS_PER_CHIP = 8_192


def long_context(
    name: str, description: str, *, seq_len: int, fsdp: int, context: int, strategy: str
) -> ExperimentConfig:
    """Llama 3.1 8B on C4-format shards at `seq_len` tokens, mesh (data 1, fsdp, context, tensor 1),
    `fsdp` sequences per step (each split over the `context` axis)."""
    cfg = full_size(name, description, LLAMA3_1_8B, seq_len=seq_len, per_device_batch=1, ici=(1, fsdp, 1))
    model = cfg.model
    assert isinstance(model, LMConfig)
    transformer = dataclasses.replace(model.transformer, remat="full", context_parallel_strategy=strategy)
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(model, transformer=transformer),
        data=dataclasses.replace(cfg.data, per_device_batch=None, batch_size=fsdp),
        mesh=MeshConfig(ici_mesh_shape=(1, fsdp, context, 1), dcn_mesh_shape=(1, 1, 1, 1), axis_names=CONTEXT_AXES),
    )


@register
def llama3_1_8b_32k() -> ExperimentConfig:
    """Llama 3.1 8B at 32,768 tokens per sequence on 64 chips (a v5p-128 slice): FSDP 16 x context
    4, all-gather context attention (each chip gathers a layer's 32K keys and values: 64 MiB in
    bfloat16), 16 sequences (524K tokens) per step, 8,192 tokens per chip."""
    return long_context(
        "llama3_1_8b_32k",
        "Llama 3.1 8B at 32K context: FSDP 16 x context 4 (all-gather attention) on 64 chips.",
        seq_len=32_768,
        fsdp=16,
        context=4,
        strategy="all_gather",
    )


@register
def llama3_1_8b_128k() -> ExperimentConfig:
    """Llama 3.1 8B at its full 131,072-token context on 128 chips (a v5p-256 slice): FSDP 8 x
    context 16, ring attention (two 8K-token key/value blocks per chip at a time), 8 sequences (1M
    tokens) per step, 8,192 tokens per chip."""
    return long_context(
        "llama3_1_8b_128k",
        "Llama 3.1 8B at 128K context: FSDP 8 x context 16 (ring attention) on 128 chips.",
        seq_len=131_072,
        fsdp=8,
        context=16,
        strategy="ring",
    )
