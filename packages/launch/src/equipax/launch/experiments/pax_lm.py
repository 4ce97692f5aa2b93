"""Pax's language-model experiments (paxml `tasks/lm/params/{lm_cloud,c4,c4_multislice}.py`).

Each Pax experiment class is a `PaxLM` value: the UPPER_CASE knobs of the Pax class, lower-cased,
with the defaults of Pax's `TransformerLmSpmdAdam` (c4.py, on top of model_params.py's
`TransformerLmSpmdAdafactor`). Pax's class inheritance is `dataclasses.replace`; `build()` turns
the knobs into an equipax `ExperimentConfig`. Pax's mesh axes `[replica, data, mdl]` are equipax's
`(data, fsdp, tensor)`.

Pax knobs no experiment here can express (same for all of them; each experiment lists its own):

- `PACKED_INPUT=True` is `data.packing=True` for C4 (documents packed into rows with segment
  ids); synthetic inputs have no documents to pack, so lm_cloud_* and the smokes leave it off.
- Pax's C4 pipeline (seqio task `c4_lm_v301_gpt` from TFDS `c4/en:3.0.1` on GCS, the
  SentencePiece model `c4_en_301_5Mexp2_spm.model`): equipax reads C4-format shards from the local
  or mounted directory `data.path` (default `C4_PATH` below; `--set data.path=...`) and trains a
  `model.vocab_size`-piece SentencePiece vocabulary unless `--set data.vocab_path=...` names one.
- Per-layer details of praxis that equipax's `TransformerConfig` has no separate knob for:
  attention `internal_enable_per_dim_scale=True` (a learned per-head-dim query scale; equipax
  scales queries by 1/sqrt(head_dim)), `TransformerFeedForward.has_bias=True` and praxis
  LayerNorm's bias (equipax's `use_bias` switches all biases together, so Pax's attention-only
  `USE_BIAS=False` is expressed as no biases anywhere: 48 x (24576 + 2 x 6144) + 32768 ~ 1.8M
  fewer parameters on the 22B, 0.008%), the tied softmax's output bias.
- Initialisers (`softmax_tpl.params_init = Gaussian(1/sqrt(MODEL_DIMS))`, Xavier elsewhere):
  equipax has its own initialisation, not a knob.
- `ADAM_EPSILON_ROOT=0.0` (equipax's Adam has no inner epsilon: it is 0), `LR_LRED_MAX=1.0` (a
  multiplier of LEARNING_RATE: peak_learning_rate = LEARNING_RATE x 1.0), Adam's
  `sharded_adam`/`maybe_inf_to_nan`, `TRAINING_OPTIMIZED_SHARDING` (equipax's sharding rules are
  fixed, see docs/sharding.md), `PROFILER_*`, `repeat_prefix_sep`, C4's seqio task names,
  shuffle buffer, `eos_id` and input seeds (equipax takes `data.seed`).
- `CHECKPOINT_POLICY`: SAVE_NOTHING -> `remat="full"`; Pax applies it only with repeated layers.
  SAVE_DOT_FOR_MLPERF_200B (C4SpmdAdam's default, overridden by every subclass here) has no
  equipax equivalent.
"""

import dataclasses

from equipax.launch.configs.experiment import ExperimentConfig
from equipax.launch.experiments.pax_knobs import C4_PATH, PaxLM, smoke, smoke_description
from equipax.launch.experiments.registry import also_known_as, register

__all__ = [
    "C4_SPMD_ADAM",
    "lm_cloud_2b",
    "lm_cloud_2b_smoke",
    "LM_CLOUD_SPMD",
    "LM_CLOUD_SPMD_2B_LIMIT_STEPS",
    "lm_cloud_transformer",
    "LM_CLOUD_TRANSFORMER_ADAM",
    "LM_CLOUD_TRANSFORMER_ADAM_LIMIT_STEPS",
    "lm_cloud_transformer_smoke",
    "TRANSFORMER_LM_SPMD_ADAM",
]


# ---------------------------------------------------------------------------------------------
# Bases, as in Pax.

# c4.py TransformerLmSpmdAdam: the defaults of PaxLM.
TRANSFORMER_LM_SPMD_ADAM = PaxLM()

# lm_cloud.py LmCloudSpmd(TransformerLmSpmdAdafactor, SyntheticDataset), whose task() calls
# model_params.set_default_adam(LEARNING_RATE=2.5e-4, WEIGHT_DECAY=1e-3): Adam b1 0.9, b2 0.99,
# clip_gradient_norm_to_value 5.0, praxis Adam defaults eps 1e-6 and clip_threshold 1.0, LRED
# 4000 / 4001 / 300000 / 0.1 (set_default_adam's defaults; the Adafactor DECAY_END=100000 is
# replaced). TransformerLmSpmdAdafactor: VOCAB_SIZE 32000, DIMS_PER_HEAD 128 (NUM_HEADS =
# MODEL_DIMS / 128), FPROP_DTYPE bf16, SOFTMAX_CAP_LOGITS 30, ATTEN_LOGIT_CAP 50.
# SyntheticDataset: PERCORE_BATCH_SIZE 16, MAX_SEQ_LEN 1024.
LM_CLOUD_SPMD = dataclasses.replace(
    TRANSFORMER_LM_SPMD_ADAM,
    num_layers=10,
    model_dims=2048,
    hidden_dims=2048 * 4,
    num_heads=2048 // 128,
    dims_per_head=128,
    activation="gelu",
    fprop_dtype="bfloat16",
    use_repeated_layer=True,
    checkpoint_policy="full",
    learning_rate=2.5e-4,
)

# model_params.py TransformerLmPmapAdam + lm_cloud.py LmCloudTransformerAdam: pmap, i.e. pure
# data parallelism (params replicated). TransformerLmPmapAdam sets no softmax cap
# (FullSoftmax.soft_cap_logits defaults to 0.0 = off), no fprop_dtype (float32), ReLU,
# USE_REPEATED_LAYER False (so no remat), ATTEN_LOGIT_CAP 50, set_default_adam(1e-3, 1e-3,
# decay_end=300000). No mesh knob: Pax pmaps over all local devices; the seed README runs it on a
# TPU v4-8 (4 devices), here (4, 1, 1) over (data, fsdp, tensor).
LM_CLOUD_TRANSFORMER_ADAM = dataclasses.replace(
    TRANSFORMER_LM_SPMD_ADAM,
    num_layers=32,
    vocab_size=32000,
    num_heads=16,
    model_dims=1024,
    hidden_dims=1024 * 4,
    activation="relu",
    softmax_cap_logits=None,
    fprop_dtype="float32",
    use_repeated_layer=False,
    checkpoint_policy="none",
    learning_rate=1e-3,
    ici_mesh_shape=(4, 1, 1),
)

# c4.py C4SpmdAdam(TransformerLmSpmdAdam, C4UnsupervisedDataset): GELU, VOCAB_SIZE 32128,
# CHECKPOINT_EVERY_N_STEPS 1000; C4 eval is one full pass (reset_for_eval=True).
C4_SPMD_ADAM = dataclasses.replace(
    TRANSFORMER_LM_SPMD_ADAM,
    num_layers=24,
    num_heads=32,
    model_dims=2048,
    hidden_dims=2048 * 4,
    vocab_size=32128,
    activation="gelu",
    checkpoint_every_n_steps=1000,
    data_source="c4",
    data_path=C4_PATH,
    packed_input=True,
    max_seq_len=1024,
    eval_loop_num_batches=0,
)


# ---------------------------------------------------------------------------------------------
# lm_cloud_2b: lm_cloud.py LmCloudSpmd2BLimitSteps(LmCloudSpmd2B(LmCloudSpmd)).
#   PERCORE_BATCH_SIZE 8, NUM_LAYERS 18, MODEL_DIMS 3072, HIDDEN_DIMS 4x, (NUM_HEADS 3072/128 =
#   24 x DIMS_PER_HEAD 128), CHECKPOINT_POLICY SAVE_NOTHING, ICI_MESH_SHAPE [1, 4, 1],
#   num_train_steps 300; synthetic data. Global batch 8 x 4 = 32 on a v4-8.
#   Not expressed: see the module docstring.
LM_CLOUD_SPMD_2B_LIMIT_STEPS = dataclasses.replace(
    LM_CLOUD_SPMD,
    percore_batch_size=8,
    num_layers=18,
    model_dims=3072,
    hidden_dims=3072 * 4,
    num_heads=3072 // 128,
    dims_per_head=128,
    checkpoint_policy="full",
    ici_mesh_shape=(1, 4, 1),
    num_train_steps=300,
)


@also_known_as("tasks.lm.params.lm_cloud.LmCloudSpmd2BLimitSteps")
@register
def lm_cloud_2b() -> ExperimentConfig:
    return LM_CLOUD_SPMD_2B_LIMIT_STEPS.build(
        "lm_cloud_2b", "Pax LmCloudSpmd2BLimitSteps: 2B LM, FSDP over 4 devices, synthetic data, 300 steps."
    )


@register
def lm_cloud_2b_smoke() -> ExperimentConfig:
    return smoke(LM_CLOUD_SPMD_2B_LIMIT_STEPS, ici_mesh_shape=(1, 8, 1)).build(
        "lm_cloud_2b_smoke", smoke_description("lm_cloud_2b")
    )


# ---------------------------------------------------------------------------------------------
# lm_cloud_transformer: lm_cloud.py LmCloudTransformerAdamLimitSteps(LmCloudTransformerAdam).
#   NUM_LAYERS 10 (LmCloudTransformerAdam: 32), VOCAB_SIZE 32000, NUM_HEADS 16, MODEL_DIMS 1024,
#   HIDDEN_DIMS 4x, DROPOUT_PROB 0, LEARNING_RATE 1e-3, WEIGHT_DECAY 1e-3, ReLU, float32,
#   num_train_steps 2000; SyntheticDataset PERCORE_BATCH_SIZE 16, MAX_SEQ_LEN 1024.
#   Not expressed: Pax's pmap partitioner itself (equipax runs the same jitted step with the
#   params replicated over `data`: numerically the same data parallelism); COMBINE_QKV is not set
#   by TransformerLmPmapAdam (separate Q/K/V projections; equipax fuses them: same math and
#   parameter count); INPUT_DROPOUT_PROB/DROPOUT_PROB 0 (equipax has no dropout in the LM);
#   PACKED_INPUT (module docstring).
LM_CLOUD_TRANSFORMER_ADAM_LIMIT_STEPS = dataclasses.replace(
    LM_CLOUD_TRANSFORMER_ADAM, num_layers=10, num_train_steps=2000
)


@also_known_as("tasks.lm.params.lm_cloud.LmCloudTransformerAdamLimitSteps")
@register
def lm_cloud_transformer() -> ExperimentConfig:
    return LM_CLOUD_TRANSFORMER_ADAM_LIMIT_STEPS.build(
        "lm_cloud_transformer",
        "Pax LmCloudTransformerAdamLimitSteps: pure data-parallel (pmap) 10-layer ReLU LM, fp32, 2000 steps.",
    )


@register
def lm_cloud_transformer_smoke() -> ExperimentConfig:
    return smoke(LM_CLOUD_TRANSFORMER_ADAM_LIMIT_STEPS, ici_mesh_shape=(8, 1, 1)).build(
        "lm_cloud_transformer_smoke", smoke_description("lm_cloud_transformer")
    )
