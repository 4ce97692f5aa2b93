"""What the Llama-style families share (Llama 2/3/3.1/3.2, Qwen3, Mistral): the block, the
recipe, the C4 setup of the full-size experiments and the `_smoke` shrinking.

A family is a configuration of the one decoder stack (`LMConfig`): `decoder_lm` writes out the
choices these families have in common (rotary positions, RMSNorm, SwiGLU, grouped-query attention
with separate query and key/value projections, no biases, no logit caps, no embedding multiplier)
and takes what differs as arguments (sizes, `rope_theta`, `rope_scaling`, tied embeddings, QK-norm,
a sliding window). docs/extending.md, "Adding a family", walks through one.
"""

import dataclasses

from equipax.core.configs import RopeScalingConfig, TransformerConfig
from equipax.core.learner_config import LearnerConfig, ScheduleConfig
from equipax.core.mesh_config import MeshConfig
from equipax.launch.configs.experiment import DataConfig, ExperimentConfig
from equipax.launch.configs.train import SampleConfig, TrainConfig
from equipax.launch.experiments.pax_knobs import C4_PATH
from equipax.models.configs import LMConfig

__all__ = ["decoder_lm", "full_size", "LLAMA_LEARNER", "smoke"]

# Meta's Llama recipe (Llama 2 paper, section 2.2): AdamW b1 0.9, b2 0.95, eps 1e-5, weight decay
# 0.1, 2000 warmup steps, cosine decay to 10% of the peak, gradient clipping at 1.0. The Qwen3 and
# Mistral experiments train with it too (their papers give no full recipe).
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


def decoder_lm(
    *,
    vocab_size: int,
    max_seq_len: int,
    num_layers: int,
    model_dims: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    hidden_dims: int,
    rope_theta: float,
    norm_eps: float = 1e-5,
    tie_embeddings: bool = False,
    rope_scaling: RopeScalingConfig | None = None,
    qk_norm: bool = False,
    sliding_window: int | None = None,
    scan_layers: bool = True,
    remat: str = "auto",
    dtype: str = "bfloat16",
    attention_impl: str = "auto",
) -> LMConfig:
    """A Llama-style decoder LM: `LMConfig` with the choices module docstring lists.

    Arguments:
        vocab_size, max_seq_len, num_layers, model_dims, num_heads, num_kv_heads, head_dim, hidden_dims: the
            sizes (`hidden_dims` is the SwiGLU width).
        rope_theta, rope_scaling: the rotary frequencies (`model.rope_theta`, `model.rope_scaling`).
        norm_eps: the RMSNorms' epsilon.
        tie_embeddings: reuse the input table for the output logits (its init is then N(0, 1/d)).
        qk_norm: RMSNorm over each head's queries and keys (Qwen3).
        sliding_window: each query sees itself and the `sliding_window - 1` tokens before it.
        scan_layers, remat, dtype, attention_impl: as `TransformerConfig` / `LMConfig` (remat
            "auto": the cheapest policy whose compiled step fits the device, docs/compile.md).

    Returns:
        The model config.
    """
    return LMConfig(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        transformer=TransformerConfig(
            num_layers=num_layers,
            model_dims=model_dims,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            hidden_dims=hidden_dims,
            activation="silu",
            gated=True,
            norm="rmsnorm",
            norm_eps=norm_eps,
            use_bias=False,
            fused_qkv=False,
            qk_norm=qk_norm,
            sliding_window=sliding_window,
            atten_logit_cap=None,
            scan_layers=scan_layers,
            remat=remat,  # pyright: ignore[reportArgumentType]
            attention_impl=attention_impl,  # pyright: ignore[reportArgumentType]
        ),
        output_logit_cap=None,
        position="rope",
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_embeddings=tie_embeddings,
        embedding_multiplier=None,
        # N(0, 1) input table (torchtitan's Llama init) when the output has its own projection; a
        # tied table is also the output projection, whose logits would then start with a standard
        # deviation of sqrt(model_dims) (a smoke's first loss 43 instead of log(vocab) = 6.2):
        # N(0, 1/model_dims) instead (0.022 at d 2048, about Hugging Face's 0.02).
        embedding_init_std=None if tie_embeddings else 1.0,
        dtype=dtype,  # pyright: ignore[reportArgumentType]
    )


def full_size(
    name: str,
    description: str,
    model: LMConfig,
    *,
    seq_len: int,
    per_device_batch: int,
    ici: tuple[int, int, int],
    num_steps: int = 500_000,
) -> ExperimentConfig:
    """A full-size experiment on C4-format shards (`data.path`), FSDP over one TPU slice.

    The published vocabulary size is the model's: `data.vocab_path` names a SentencePiece `.model`
    of that many pieces, or an empty one trains it on the shards (docs/data.md).
    """
    return ExperimentConfig(
        name=name,
        description=description,
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


def smoke(
    cfg: ExperimentConfig, ici: tuple[int, int, int] = (1, 8, 1), *, sliding_window: int | None = None
) -> ExperimentConfig:
    """`cfg` at toy size on 8 simulated devices: same block options and mesh axes, synthetic tokens.

    2 layers, d 64, 4 query heads of 16 (key/value heads in the family's ratio, at least 1),
    SwiGLU 128, vocabulary 512, sequences of 32, float32, full remat where the experiment's is
    "auto" (a toy step fits anywhere: "auto" would only compile the candidates to pick "none"),
    else the experiment's own policy. A sliding window is shrunk to
    `sliding_window` (below the sequence, so the window is exercised).
    """
    model = cfg.model
    assert isinstance(model, LMConfig)
    t = model.transformer
    group = t.num_heads // t.kv_heads
    window = t.sliding_window if sliding_window is None else sliding_window
    return dataclasses.replace(
        cfg,
        name=f"{cfg.name}_smoke",
        description=f"`{cfg.name}` at toy size (2 layers, d 64) on 8 devices.",
        model=dataclasses.replace(
            model,
            vocab_size=512,
            max_seq_len=32,
            dtype="float32",
            transformer=dataclasses.replace(
                t,
                num_layers=2,
                model_dims=64,
                num_heads=4,
                num_kv_heads=4 // min(group, 4),
                head_dim=16,
                hidden_dims=128,
                sliding_window=window,
                remat="full" if t.remat == "auto" else t.remat,
            ),
        ),
        data=DataConfig(source="synthetic", seq_len=32, per_device_batch=2),
        train=TrainConfig(
            num_steps=4, log_every=1, eval_every=4, eval_batches=1, checkpoint_every=4, sample=SampleConfig(tokens=0)
        ),
        mesh=MeshConfig(ici_mesh_shape=ici),
    )
