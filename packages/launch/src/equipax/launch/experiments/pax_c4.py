"""Pax's C4 experiments (paxml `tasks/lm/params/{c4,c4_multislice}.py`): 1B, 16B and the 22B on
one and two slices, with `_smoke` variants. The bases and what equipax does not express are in
`pax_lm.py`'s docstring.
"""

import dataclasses

from equipax.core.knobs import set_knob
from equipax.launch.configs.experiment import ExperimentConfig
from equipax.launch.experiments.pax_knobs import smoke, smoke_description
from equipax.launch.experiments.pax_lm import C4_SPMD_ADAM
from equipax.launch.experiments.registry import also_known_as, register

__all__ = [
    "c4_16b",
    "c4_16b_smoke",
    "c4_1b",
    "c4_1b_smoke",
    "c4_22b_1x",
    "c4_22b_1x_smoke",
    "c4_22b_2x",
    "c4_22b_2x_smoke",
    "C4_SPMD_16B_ADAM_32_REPLICAS",
    "C4_SPMD_1B_ADAM_4_REPLICAS",
    "C4_SPMD_22B_ADAM_1X_V4_128",
    "C4_SPMD_22B_ADAM_2X_V4_128",
]

# ---------------------------------------------------------------------------------------------
# c4_1b: c4.py C4Spmd1BAdam4Replicas(C4SpmdAdam).
#   NUM_LAYERS 13, MODEL_DIMS 2560, HIDDEN_DIMS 4x, NUM_HEADS 20, DIMS_PER_HEAD 128,
#   PERCORE_BATCH_SIZE 32, MAX_SEQ_LEN 1024, VOCAB_SIZE 32000 (one paxml revision comments it
#   out, inheriting 32128; the released one sets 32000), FPROP_DTYPE bf16, USE_REPEATED_LAYER,
#   SUMMARY_INTERVAL_STEPS 10, SAVE_NOTHING, ICI_MESH_SHAPE [1, 4, 1] (v4-8): global batch 128.
#   No num_train_steps: Pax's default 1e7 (C4Spmd1BAdam4ReplicasLimitSteps stops at 15000).
#   Not expressed: see the module docstring.
C4_SPMD_1B_ADAM_4_REPLICAS = dataclasses.replace(
    C4_SPMD_ADAM,
    num_layers=13,
    model_dims=2560,
    hidden_dims=2560 * 4,
    num_heads=20,
    dims_per_head=128,
    percore_batch_size=32,
    max_seq_len=1024,
    vocab_size=32000,
    fprop_dtype="bfloat16",
    use_repeated_layer=True,
    summary_interval_steps=10,
    checkpoint_policy="full",
    ici_mesh_shape=(1, 4, 1),
)


@also_known_as("tasks.lm.params.c4.C4Spmd1BAdam4Replicas")
@register
def c4_1b() -> ExperimentConfig:
    cfg = C4_SPMD_1B_ADAM_4_REPLICAS.build(
        "c4_1b", "Pax C4Spmd1BAdam4Replicas: 1B GPT on C4, FSDP over 4 devices (TPU v4-8), bf16."
    )
    # equipax's default over Pax's SAVE_NOTHING: remat="auto", which keeps full remat (this
    # experiment's own policy) unless a policy that recomputes less fits and its compiled step is
    # projected faster (docs/compile.md). At 6 layers on one TPU v5e it takes dots_saveable, 7.3%
    # faster on the chip (benchmarks/README.md). The larger C4 experiments keep full: on their
    # slices nothing cheaper fits. The smoke variant keeps Pax's policy (a CPU run would search).
    return set_knob(cfg, "model.transformer.remat", "auto")


@register
def c4_1b_smoke() -> ExperimentConfig:
    return smoke(C4_SPMD_1B_ADAM_4_REPLICAS, ici_mesh_shape=(1, 8, 1)).build("c4_1b_smoke", smoke_description("c4_1b"))


# ---------------------------------------------------------------------------------------------
# c4_16b: c4.py C4Spmd16BAdam32Replicas(C4SpmdAdam).
#   NUM_LAYERS 36, MODEL_DIMS 6144, HIDDEN_DIMS 4x, NUM_HEADS 48, DIMS_PER_HEAD 128,
#   PERCORE_BATCH_SIZE 16, MAX_SEQ_LEN 1024, VOCAB_SIZE 32000, bf16, USE_REPEATED_LAYER,
#   SUMMARY_INTERVAL_STEPS 10, SAVE_NOTHING, ICI_MESH_SHAPE [1, 16, 2] (v4-64: 32 devices,
#   16-way FSDP x 2-way tensor): global batch 512. num_train_steps: Pax's default 1e7.
#   Not expressed: see the module docstring.
C4_SPMD_16B_ADAM_32_REPLICAS = dataclasses.replace(
    C4_SPMD_ADAM,
    num_layers=36,
    model_dims=6144,
    hidden_dims=6144 * 4,
    num_heads=48,
    dims_per_head=128,
    percore_batch_size=16,
    max_seq_len=1024,
    vocab_size=32000,
    fprop_dtype="bfloat16",
    use_repeated_layer=True,
    summary_interval_steps=10,
    checkpoint_policy="full",
    ici_mesh_shape=(1, 16, 2),
)


@also_known_as("tasks.lm.params.c4.C4Spmd16BAdam32Replicas")
@register
def c4_16b() -> ExperimentConfig:
    return C4_SPMD_16B_ADAM_32_REPLICAS.build(
        "c4_16b", "Pax C4Spmd16BAdam32Replicas: 16B GPT on C4, 16-way FSDP x 2-way tensor (TPU v4-64), bf16."
    )


@register
def c4_16b_smoke() -> ExperimentConfig:
    return smoke(C4_SPMD_16B_ADAM_32_REPLICAS, ici_mesh_shape=(1, 4, 2)).build(
        "c4_16b_smoke", smoke_description("c4_16b")
    )


# ---------------------------------------------------------------------------------------------
# c4_22b_1x: c4_multislice.py C4Spmd22BAdam1xv4_128(C4Spmd22BAdamMaxText(C4SpmdAdam)).
#   NUM_LAYERS 48, MODEL_DIMS 6144, HIDDEN_DIMS 4x = 24576, NUM_HEADS 24, DIMS_PER_HEAD 256,
#   PERCORE_BATCH_SIZE 16, MAX_SEQ_LEN 1024, VOCAB_SIZE 32768, bf16, USE_REPEATED_LAYER,
#   SUMMARY_INTERVAL_STEPS 10, SAVE_NOTHING, ICI_MESH_SHAPE [1, 64, 1] (one v4-128 slice):
#   global batch 1024. num_train_steps: Pax's default 1e7 (the LimitSteps variant: 300).
#   Optimizer (TransformerLmSpmdAdam): Adam lr 1e-3, b1 0.9, b2 0.99, eps 1e-6, weight decay 1e-3,
#   global-norm clip 5.0, update clip_threshold 1.0; LRED warmup 4000, decay 4001 -> 300000 to 0.1.
#   Not expressed: see the module docstring.
C4_SPMD_22B_ADAM_1X_V4_128 = dataclasses.replace(
    C4_SPMD_ADAM,
    num_layers=48,
    model_dims=6144,
    hidden_dims=6144 * 4,
    num_heads=24,
    dims_per_head=256,
    percore_batch_size=16,
    max_seq_len=1024,
    vocab_size=32768,
    fprop_dtype="bfloat16",
    use_repeated_layer=True,
    summary_interval_steps=10,
    checkpoint_policy="full",
    ici_mesh_shape=(1, 64, 1),
)


def _seed_libtpu_args(cfg: ExperimentConfig) -> ExperimentConfig:
    """The seed's LIBTPU_INIT_ARGS for the multislice runs, as the `train.compiler.libtpu_init_args` knob."""
    from equipax.launch.hardware.compiler_flags import SEED_C4_22B_LIBTPU_INIT_ARGS

    compiler = dataclasses.replace(cfg.train.compiler, libtpu_init_args=SEED_C4_22B_LIBTPU_INIT_ARGS)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compiler=compiler))


@also_known_as("tasks.lm.params.c4_multislice.C4Spmd22BAdam1xv4_128")
@register
def c4_22b_1x() -> ExperimentConfig:
    return _seed_libtpu_args(
        C4_SPMD_22B_ADAM_1X_V4_128.build(
            "c4_22b_1x", "Pax C4Spmd22BAdam1xv4_128: 22B GPT on C4, 64-way FSDP on one v4-128 slice, bf16."
        )
    )


@register
def c4_22b_1x_smoke() -> ExperimentConfig:
    return smoke(C4_SPMD_22B_ADAM_1X_V4_128, ici_mesh_shape=(1, 8, 1), num_heads=2).build(
        "c4_22b_1x_smoke", smoke_description("c4_22b_1x")
    )


# ---------------------------------------------------------------------------------------------
# c4_22b_2x: c4_multislice.py C4Spmd22BAdam2xv4_128(C4Spmd22BAdam1xv4_128).
#   DCN_MESH_SHAPE [2, 1, 1]: two v4-128 slices, data parallel across slices (Pax replica ->
#   equipax data), 64-way FSDP within each: 128 devices, global batch 2048, 2,097,152 tokens/step.
#   Not expressed: Pax starts one command per slice; equipax one per host with jax.distributed.
C4_SPMD_22B_ADAM_2X_V4_128 = dataclasses.replace(C4_SPMD_22B_ADAM_1X_V4_128, dcn_mesh_shape=(2, 1, 1))


@also_known_as("tasks.lm.params.c4_multislice.C4Spmd22BAdam2xv4_128")
@register
def c4_22b_2x() -> ExperimentConfig:
    return _seed_libtpu_args(
        C4_SPMD_22B_ADAM_2X_V4_128.build(
            "c4_22b_2x", "Pax C4Spmd22BAdam2xv4_128: 22B GPT on C4, 2 slices x 64-way FSDP (2x v4-128), bf16."
        )
    )


@register
def c4_22b_2x_smoke() -> ExperimentConfig:
    return _seed_libtpu_args(
        smoke(C4_SPMD_22B_ADAM_2X_V4_128, ici_mesh_shape=(1, 4, 1), dcn_mesh_shape=(2, 1, 1), num_heads=2).build(
            "c4_22b_2x_smoke", smoke_description("c4_22b_2x")
        )
    )
