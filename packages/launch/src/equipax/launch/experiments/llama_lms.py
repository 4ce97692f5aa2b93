"""Llama-style decoders (RoPE, SwiGLU, grouped-query attention, RMSNorm, untied embeddings).

`shakespeare_llama_tiny` is the default experiment's data, learner and loop with a Llama model of
the same width and depth (it trains in the same few minutes on a CPU). `llama2_7b` and
`llama3_8b` are the published architectures at full size, for `launch compile` and for real
hardware: they read C4-format shards (`data.path`, built with `launch data prepare` or any
directory of `c4-train.*` / `c4-validation.*` JSON-lines shards) with the published vocabulary
size: `data.vocab_path` names a SentencePiece `.model` of that many pieces (Llama 2's own
`tokenizer.model` is one; Llama 3's tokenizer is tiktoken BPE, which equipax does not read, so
point it at a 128,256-piece SentencePiece model, or leave it empty to train one on the shards).
`*_smoke` variants keep the mesh axes at toy size, for 8 simulated CPU devices.
"""

import dataclasses

from equipax.core.configs import LearnerConfig, MeshConfig, ScheduleConfig
from equipax.launch.configs.experiment import DataConfig, ExperimentConfig
from equipax.launch.configs.train import SampleConfig, TrainConfig
from equipax.launch.experiments.pax_knobs import C4_PATH
from equipax.launch.experiments.registry import register
from equipax.launch.experiments.shakespeare_lms import shakespeare_tiny
from equipax.models.configs import LlamaConfig

__all__ = [
    "LLAMA2_7B",
    "llama2_7b",
    "llama2_7b_smoke",
    "LLAMA3_8B",
    "llama3_8b",
    "llama3_8b_smoke",
    "LLAMA_LEARNER",
    "shakespeare_llama_tiny",
]

# Meta's Llama recipe (Llama 2 paper, section 2.2): AdamW b1 0.9, b2 0.95, eps 1e-5, weight decay
# 0.1, 2000 warmup steps, cosine decay to 10% of the peak, gradient clipping at 1.0.
LLAMA_LEARNER = LearnerConfig(
    kind="adamw",
    b1=0.9,
    b2=0.95,
    eps=1e-5,
    weight_decay=0.1,
    clip_gradient_norm=1.0,
    schedule=ScheduleConfig(
        kind="warmup_cosine", peak_learning_rate=3e-4, warmup_steps=2000, decay_steps=500_000, final_fraction=0.1
    ),
)

LLAMA2_7B = LlamaConfig(
    vocab_size=32_000,
    max_seq_len=4096,
    num_layers=32,
    model_dims=4096,
    num_heads=32,
    num_kv_heads=32,
    head_dim=128,
    hidden_dims=11_008,
    rope_theta=10_000.0,
    norm_eps=1e-5,
    scan_layers=True,
    remat="full",
    dtype="bfloat16",
)

LLAMA3_8B = LlamaConfig(
    vocab_size=128_256,
    max_seq_len=8192,
    num_layers=32,
    model_dims=4096,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    hidden_dims=14_336,
    rope_theta=500_000.0,
    norm_eps=1e-5,
    scan_layers=True,
    remat="full",
    dtype="bfloat16",
)


@register
def shakespeare_llama_tiny() -> ExperimentConfig:
    """`shakespeare_tiny` with a Llama-style model of the same shape: 4 layers, d 192, 4 query
    heads sharing 2 key/value heads, SwiGLU 512 (the FLOPs of GELU 768), untied output.

    Final eval loss after the 450 steps (`launch run --exp X`, result.json's final_eval_loss,
    deterministic on CPU): shakespeare_tiny 4.4225; this experiment 4.2207 with the input
    embedding initialised N(0, 1) (`LlamaConfig.embedding_init_std=1.0`, torchtitan's Llama
    init), against 4.4300 with N(0, 1/model_dims) (std 0.072, the GPT's table without its
    sqrt(model_dims) multiplier), and 4.4363 with that init at peak learning rate 5e-3. With
    pre-norm blocks whose projections start at variance 1/fan_in, each block adds a unit-RMS
    update to the residual stream, which a 0.072 embedding leaves with little of the token.
    """
    base = shakespeare_tiny()
    return dataclasses.replace(
        base,
        name="shakespeare_llama_tiny",
        description="Llama-style LM (RoPE, SwiGLU, GQA, RMSNorm) on Shakespeare.",
        model=LlamaConfig(
            vocab_size=2048,
            max_seq_len=128,
            num_layers=4,
            model_dims=192,
            num_heads=4,
            num_kv_heads=2,
            head_dim=48,
            hidden_dims=512,
            scan_layers=False,
        ),
    )


def _full_size(
    model: LlamaConfig, *, seq_len: int, per_device_batch: int, ici: tuple[int, int, int], num_steps: int
) -> dict:
    return dict(
        model=model,
        data=DataConfig(
            source="c4",
            path=C4_PATH,
            tokenizer="sentencepiece",
            seq_len=seq_len,
            per_device_batch=per_device_batch,
            packing=True,
        ),
        learner=dataclasses.replace(
            LLAMA_LEARNER, schedule=dataclasses.replace(LLAMA_LEARNER.schedule, decay_steps=num_steps)
        ),
        train=TrainConfig(
            num_steps=num_steps,
            log_every=100,
            eval_every=1000,
            eval_batches=50,
            checkpoint_every=1000,
            sample=SampleConfig(tokens=0),
        ),
        mesh=MeshConfig(ici_mesh_shape=ici),
    )


@register
def llama2_7b() -> ExperimentConfig:
    """Llama 2 7B (6,738,415,616 parameters) on C4, FSDP over 32 chips (a v4-64 or v5p-64 slice)."""
    return ExperimentConfig(
        name="llama2_7b",
        description="Llama 2 7B on C4-format shards; --set data.vocab_path=<Llama 2 tokenizer.model>.",
        **_full_size(LLAMA2_7B, seq_len=4096, per_device_batch=4, ici=(1, 32, 1), num_steps=500_000),
    )


@register
def llama3_8b() -> ExperimentConfig:
    """Llama 3 8B (8,030,261,248 parameters; GQA 32/8) on C4, FSDP over 64 chips (a v5p-128 slice)."""
    return ExperimentConfig(
        name="llama3_8b",
        description="Llama 3 8B on C4-format shards; --set data.vocab_path=<128256-piece SentencePiece model>.",
        **_full_size(LLAMA3_8B, seq_len=8192, per_device_batch=2, ici=(1, 64, 1), num_steps=500_000),
    )


def _smoke(cfg: ExperimentConfig, ici: tuple[int, int, int]) -> ExperimentConfig:
    """`cfg` at toy size on 8 simulated devices, same mesh axes, synthetic tokens."""
    model = cfg.model
    assert isinstance(model, LlamaConfig)
    group = model.num_heads // model.num_kv_heads
    return dataclasses.replace(
        cfg,
        name=f"{cfg.name}_smoke",
        description=f"`{cfg.name}` at toy size (2 layers, d 64) on 8 devices.",
        model=dataclasses.replace(
            model,
            vocab_size=512,
            max_seq_len=32,
            num_layers=2,
            model_dims=64,
            num_heads=4,
            num_kv_heads=4 // min(group, 4),
            head_dim=16,
            hidden_dims=128,
            dtype="float32",
        ),
        data=DataConfig(source="synthetic", seq_len=32, per_device_batch=2),
        train=TrainConfig(
            num_steps=4, log_every=1, eval_every=4, eval_batches=1, checkpoint_every=4, sample=SampleConfig(tokens=0)
        ),
        mesh=MeshConfig(ici_mesh_shape=ici),
    )


@register
def llama2_7b_smoke() -> ExperimentConfig:
    """`llama2_7b`'s code path (FSDP, scanned layers, remat) at toy size on 8 CPU devices."""
    return _smoke(llama2_7b(), (1, 8, 1))


@register
def llama3_8b_smoke() -> ExperimentConfig:
    """`llama3_8b`'s code path (FSDP, GQA 4/1, scanned layers, remat) at toy size on 8 CPU devices."""
    return _smoke(llama3_8b(), (1, 8, 1))
