"""The Llama family (RoPE, SwiGLU, grouped-query attention, RMSNorm): Llama 2, 3, 3.1 and 3.2 as
configurations of the one decoder stack (`decoder_presets.decoder_lm`).

`shakespeare_llama_tiny` is the default experiment's data, learner and loop with a Llama model of
the same width and depth (it trains in the same few minutes on a CPU). The others are the
published architectures at full size, for `launch compile` and for real hardware: they read
C4-format shards (`data.path`, built with `launch data prepare` or any directory of `c4-train.*` /
`c4-validation.*` JSON-lines shards) with the published vocabulary size: `data.vocab_path` names a
SentencePiece `.model` of that many pieces (Llama 2's own `tokenizer.model` is one; Llama 3's
tokenizer is tiktoken BPE, which equipax does not read, so point it at a 128,256-piece
SentencePiece model, or leave it empty to train one on the shards). What sets the versions apart:

- Llama 3 over 2: a 128,256-token vocabulary, `rope_theta` 500,000, grouped-query attention (8
  key/value heads) at 8B;
- Llama 3.1: the same 8B with `rope_scaling` (the "llama3" rule: factor 8, low/high frequency
  factors 1 and 4, original context 8192) for a 131,072-token context;
- Llama 3.2 1B and 3B: smaller, tied input/output embeddings, `rope_scaling` factor 32.

`*_smoke` variants keep the block options and mesh axes at toy size, for 8 simulated CPU devices;
`llama3_8b_pipeline_smoke` runs the Llama block in 2 pipeline stages there.
"""

import dataclasses

from equipax.core.configs import RopeScalingConfig
from equipax.core.mesh_config import PIPELINE_AXES, MeshConfig
from equipax.launch.configs.experiment import ExperimentConfig
from equipax.launch.experiments.decoder_presets import decoder_lm, full_size, smoke
from equipax.launch.experiments.registry import register
from equipax.launch.experiments.shakespeare_lms import shakespeare_tiny
from equipax.models.configs import LMConfig

__all__ = [
    "LLAMA2_7B",
    "llama2_7b",
    "llama2_7b_smoke",
    "LLAMA3_1_8B",
    "llama3_1_8b",
    "llama3_1_8b_smoke",
    "LLAMA3_2_1B",
    "llama3_2_1b",
    "llama3_2_1b_smoke",
    "LLAMA3_2_3B",
    "llama3_2_3b",
    "llama3_2_3b_smoke",
    "LLAMA3_8B",
    "llama3_8b",
    "llama3_8b_pipeline_smoke",
    "llama3_8b_smoke",
    "shakespeare_llama_tiny",
]

LLAMA2_7B = decoder_lm(
    vocab_size=32_000,
    max_seq_len=4096,
    num_layers=32,
    model_dims=4096,
    num_heads=32,
    num_kv_heads=32,
    head_dim=128,
    hidden_dims=11_008,
    rope_theta=10_000.0,
)

LLAMA3_8B = decoder_lm(
    vocab_size=128_256,
    max_seq_len=8192,
    num_layers=32,
    model_dims=4096,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    hidden_dims=14_336,
    rope_theta=500_000.0,
)

LLAMA3_1_8B = dataclasses.replace(
    LLAMA3_8B,
    max_seq_len=131_072,
    rope_scaling=RopeScalingConfig(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192),
)

_LLAMA3_2_SCALING = RopeScalingConfig(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192)

LLAMA3_2_1B = decoder_lm(
    vocab_size=128_256,
    max_seq_len=131_072,
    num_layers=16,
    model_dims=2048,
    num_heads=32,
    num_kv_heads=8,
    head_dim=64,
    hidden_dims=8192,
    rope_theta=500_000.0,
    rope_scaling=_LLAMA3_2_SCALING,
    tie_embeddings=True,
)

LLAMA3_2_3B = decoder_lm(
    vocab_size=128_256,
    max_seq_len=131_072,
    num_layers=28,
    model_dims=3072,
    num_heads=24,
    num_kv_heads=8,
    head_dim=128,
    hidden_dims=8192,
    rope_theta=500_000.0,
    rope_scaling=_LLAMA3_2_SCALING,
    tie_embeddings=True,
)


@register
def shakespeare_llama_tiny() -> ExperimentConfig:
    """`shakespeare_tiny` with a Llama-style model of the same shape: 4 layers, d 192, 4 query
    heads sharing 2 key/value heads, SwiGLU 512 (the FLOPs of GELU 768), untied output.

    Final eval loss after the 450 steps (`launch run --exp X`, result.json's final_eval_loss,
    deterministic on CPU): shakespeare_tiny 4.4225; this experiment 4.2207 with the input
    embedding initialised N(0, 1) (`model.embedding_init_std=1.0`, torchtitan's Llama init),
    against 4.4300 with N(0, 1/model_dims) (std 0.072, the GPT's table without its
    sqrt(model_dims) multiplier), and 4.4363 with that init at peak learning rate 5e-3. With
    pre-norm blocks whose projections start at variance 1/fan_in, each block adds a unit-RMS
    update to the residual stream, which a 0.072 embedding leaves with little of the token.
    """
    return dataclasses.replace(
        shakespeare_tiny(),
        name="shakespeare_llama_tiny",
        description="Llama-style LM (RoPE, SwiGLU, GQA, RMSNorm) on Shakespeare.",
        model=decoder_lm(
            vocab_size=2048,
            max_seq_len=128,
            num_layers=4,
            model_dims=192,
            num_heads=4,
            num_kv_heads=2,
            head_dim=48,
            hidden_dims=512,
            rope_theta=10_000.0,
            scan_layers=False,
            remat="none",
            dtype="float32",
            attention_impl="xla",
        ),
    )


@register
def llama2_7b() -> ExperimentConfig:
    """Llama 2 7B (6,738,415,616 parameters) on C4, FSDP over 32 chips (a v4-64 or v5p-64 slice)."""
    return full_size(
        "llama2_7b",
        "Llama 2 7B on C4-format shards; --set data.vocab_path=<Llama 2 tokenizer.model>.",
        LLAMA2_7B,
        seq_len=4096,
        per_device_batch=4,
        ici=(1, 32, 1),
    )


@register
def llama3_8b() -> ExperimentConfig:
    """Llama 3 8B (8,030,261,248 parameters; GQA 32/8) on C4, FSDP over 64 chips (a v5p-128 slice)."""
    return full_size(
        "llama3_8b",
        "Llama 3 8B on C4-format shards; --set data.vocab_path=<128256-piece SentencePiece model>.",
        LLAMA3_8B,
        seq_len=8192,
        per_device_batch=2,
        ici=(1, 64, 1),
    )


@register
def llama3_1_8b() -> ExperimentConfig:
    """Llama 3.1 8B (8,030,261,248 parameters; llama3 RoPE scaling x8) on C4, FSDP over 64 chips (v5p-128)."""
    return full_size(
        "llama3_1_8b",
        "Llama 3.1 8B (RoPE scaling for a 128K context) on C4-format shards.",
        LLAMA3_1_8B,
        seq_len=8192,
        per_device_batch=2,
        ici=(1, 64, 1),
    )


@register
def llama3_2_1b() -> ExperimentConfig:
    """Llama 3.2 1B (1,235,814,400 parameters; tied embeddings) on C4, FSDP over 4 chips (v5p-8)."""
    return full_size(
        "llama3_2_1b",
        "Llama 3.2 1B (tied embeddings, RoPE scaling x32) on C4-format shards.",
        LLAMA3_2_1B,
        seq_len=8192,
        per_device_batch=4,
        ici=(1, 4, 1),
    )


@register
def llama3_2_3b() -> ExperimentConfig:
    """Llama 3.2 3B (3,212,749,824 parameters; tied embeddings) on C4, FSDP over 8 chips (v5p-16)."""
    return full_size(
        "llama3_2_3b",
        "Llama 3.2 3B (tied embeddings, RoPE scaling x32) on C4-format shards.",
        LLAMA3_2_3B,
        seq_len=8192,
        per_device_batch=4,
        ici=(1, 8, 1),
    )


@register
def llama2_7b_smoke() -> ExperimentConfig:
    """`llama2_7b`'s code path (FSDP, scanned layers, remat) at toy size on 8 CPU devices."""
    return smoke(llama2_7b())


@register
def llama3_8b_smoke() -> ExperimentConfig:
    """`llama3_8b`'s code path (FSDP, GQA 4/1, scanned layers, remat) at toy size on 8 CPU devices."""
    return smoke(llama3_8b())


@register
def llama3_1_8b_smoke() -> ExperimentConfig:
    """`llama3_1_8b`'s code path (RoPE scaling, GQA, FSDP) at toy size on 8 CPU devices."""
    return smoke(llama3_1_8b())


@register
def llama3_2_1b_smoke() -> ExperimentConfig:
    """`llama3_2_1b`'s code path (tied embeddings, RoPE scaling, GQA) at toy size on 8 CPU devices."""
    return smoke(llama3_2_1b())


@register
def llama3_2_3b_smoke() -> ExperimentConfig:
    """`llama3_2_3b`'s code path (tied embeddings, RoPE scaling, GQA) at toy size on 8 CPU devices."""
    return smoke(llama3_2_3b())


@register
def llama3_8b_pipeline_smoke() -> ExperimentConfig:
    """`llama3_8b_smoke` in 2 pipeline stages (GPipe, 4 microbatches) x 2-way FSDP x 2-way tensor
    on 8 CPU devices: the Llama block through the same pipeline as Pax's GPT3-XL."""
    cfg = smoke(llama3_8b())
    model = cfg.model
    assert isinstance(model, LMConfig)
    transformer = dataclasses.replace(model.transformer, num_layers=4, pipeline_stages=2, pipeline_microbatches=4)
    return dataclasses.replace(
        cfg,
        name="llama3_8b_pipeline_smoke",
        description="`llama3_8b_smoke` in 2 pipeline stages x 2-way FSDP x 2-way tensor on 8 devices.",
        model=dataclasses.replace(model, transformer=transformer),
        mesh=MeshConfig(ici_mesh_shape=(2, 1, 2, 2), dcn_mesh_shape=(1, 1, 1, 1), axis_names=PIPELINE_AXES),
    )
