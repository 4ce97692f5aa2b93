"""Pax's pipelined GPT3-XL on C4 (paxml `tasks/lm/params/c4.py`), over a `stage` mesh axis.

The Pax README trains "GPT3-XL" on a TPU v4-128 (64 chips) with
`--exp=tasks.lm.params.c4.C4SpmdPipelineGpt3SmallAdam64Replicas`. paxml renamed that class
`C4SpmdPipelineGpt3SmallAdam8Replicas` (commit b96c1e9) and shrank its mesh to 8 chips. Its
chain of classes and where each knob below comes from:

    TransformerLmSpmdPipelineAdafactor (model_params.py)   pipeline knobs, mesh axis order
    -> TransformerLmSpmdPipelineAdam (c4.py)               Adam, LRED schedule, PACKED_INPUT
    -> C4SpmdPipelineAdam (c4.py, + C4UnsupervisedDataset)  C4 data
    -> C4SpmdPipelineGpt3AdamOrgHP (c4.py)                  GPT-3 paper hyperparameters
    -> C4SpmdPipelineGpt3SmallAdam8Replicas (c4.py)         the 1.3B-class "GPT3-XL" sizes

Knob by knob (Pax name -> equipax knob; value):

- NUM_STAGES 2 (8Replicas) / 4 (64Replicas) -> model.transformer.pipeline_stages = 4 here, the
  README's 64-chip run (see the mesh below); the smoke uses 2 like 8Replicas.
- MICROBATCH_SIZE 8 (8Replicas) / 16 (64Replicas) -> pipeline_microbatch_size = 16: with 4-way
  data parallelism inside a stage that keeps 4 examples per device per microbatch, as 8Replicas
  had with 2-way; 512 / 16 = 32 microbatches, a bubble of 3 / 35 = 8.6%.
  NUM_MICROBATCHES None -> pipeline_microbatches = None (one of the two is set, as in Pax).
- CIRCULAR_REPEAT 1 -> pipeline_schedule = "gpipe", pipeline_repeats = 1.
- ICI_MESH_SHAPE [stage, replica, data, mdl] = [2, 1, 2, 2] (8 chips) -> mesh.axis_names
  (stage, data, fsdp, tensor) (Pax replica -> data, data -> fsdp, mdl -> tensor). Scaled to 64
  chips as the README's 64Replicas had it: [4, 1, 4, 4] = 4 stages x 4-way FSDP x 4-way tensor.
  DCN_MESH_SHAPE [1, 1, 1, 1] (one slice).
- PERCORE_BATCH_SIZE 64 on 8 chips = global batch 512 -> data.per_device_batch = 8 on 64 chips,
  the same 512 (Pax counts every chip, stages included, as here).
- NUM_LAYERS 24, MODEL_DIMS 3072, HIDDEN_DIMS 4 x 3072, NUM_HEADS 24, DIMS_PER_HEAD 128,
  VOCAB_SIZE 51200, MAX_SEQ_LEN 2048 (OrgHP), FPROP_DTYPE bf16, GELU (approximate, as
  configure_gpt3_task sets; jax.nn.gelu's default), ATTEN_LOGIT_CAP -1 -> atten_logit_cap None,
  softmax soft_cap_logits None (configure_gpt3_task) -> output_logit_cap None,
  attention use_bias True (configure_gpt3_task) -> use_bias True.
- USE_REPEATED_LAYER False -> scan_layers False (a stage's layers are unrolled);
  CHECKPOINT_POLICY SAVE_NOTHING (applied by Pax around each pipeline stage) -> remat "full"
  per layer.
- Adam: LEARNING_RATE 2e-4 (8Replicas), ADAM_BETA1 0.9, ADAM_BETA2 0.95, ADAM_EPSILON 1e-8,
  ADAM_CLIP_THRESHOLD -1 (off) -> learner.clip_update_rms None, WEIGHT_DECAY 0.1,
  CLIP_GRADIENT_NORM_TO_VALUE 1.0.
- LR_SCHEDULE linear_rampup_cosine_decay: LR_COS_WARMUP 265, LR_COS_DECAY_START 266,
  LR_COS_DECAY_END 108600, LR_COS_MIN_RATIO 0.1, LR_COS_MAX 1.0 -> schedule.kind
  "warmup_cosine", warmup_steps 265, decay_steps 108600 - 266, final_fraction 0.1.
- EVAL_INTERVAL_STEPS 10, SUMMARY_INTERVAL_STEPS 5, CHECKPOINT_EVERY_N_STEPS 200,
  CHECKPOINT_MAX_TO_KEEP 1000 (8Replicas); C4 eval is one full pass of the validation split;
  PACKED_INPUT True -> data.packing True. num_train_steps: Pax's default 1e7.

Not expressed:

- PIPELINE_BROADCAST_INPUTS False and STREAM_IO False: equipax's pipeline all-gathers its input
  microbatches over `stage` (what broadcast-free, non-streamed Pax does) and has no streaming.
- EMB_W_DATA_DIMS ('replica', 'data'): the embedding is sharded like every other weight
  (embed over fsdp, vocab over tensor; docs/sharding.md), not per experiment.
- TRAINABLE_POSITION_EMB True (a learned position table of 16384 rows): equipax has sinusoidal
  positions or none; this uses sinusoidal. The embedding's scale_sqrt_depth False: equipax
  always multiplies the embedding by sqrt(model_dims).
- LAYERNORM_EPSILON 1e-5: equipax's LayerNorm uses 1e-6 (no knob).
- Gaussian(0.006) initialisers, internal_enable_per_dim_scale False (equipax never has the
  per-dim scale, so this one matches), the softmax feed-forward without bias, GPT_EOS_ID and
  the early-stopping target TARGET_LOG_PPLX 2.69, COMBINE_QKV (equipax always fuses QKV):
  see pax_lm.py's module docstring for the Pax knobs no equipax experiment expresses.
"""

import dataclasses

from equipax.core.learner_config import ScheduleConfig
from equipax.core.mesh_config import PIPELINE_AXES, MeshConfig
from equipax.launch.configs.experiment import ExperimentConfig
from equipax.launch.experiments.pax_knobs import C4_PATH, PaxLM, smoke, smoke_description
from equipax.launch.experiments.registry import also_known_as, register

__all__ = [
    "c4_gpt3_xl_pipeline",
    "c4_gpt3_xl_pipeline_smoke",
    "C4_SPMD_PIPELINE_GPT3_SMALL_ADAM",
    "GPT3_XL_PIPELINE_64",
    "PaxPipeline",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PaxPipeline:
    """The knobs Pax's pipelined LM adds to `PaxLM` (TransformerLmSpmdPipelineAdafactor's)."""

    num_stages: int
    microbatch_size: int | None = None
    num_microbatches: int | None = None
    circular_repeat: int = 1
    # [stage, replica, data, mdl] -> (stage, data, fsdp, tensor).
    ici_mesh_shape: tuple[int, int, int, int]
    dcn_mesh_shape: tuple[int, int, int, int] = (1, 1, 1, 1)
    # linear_rampup_cosine_decay (LR_COS_*).
    lr_cos_warmup: int = 265
    lr_cos_decay_start: int = 266
    lr_cos_decay_end: int = 108_600
    lr_cos_min_ratio: float = 0.1

    def build(self, knobs: PaxLM, name: str, description: str) -> ExperimentConfig:
        """`knobs` built as usual, then pipelined over a 4-axis mesh with a cosine schedule."""
        base = knobs.build(name, description)
        transformer = dataclasses.replace(
            base.model.transformer,  # pyright: ignore[reportAttributeAccessIssue]
            pipeline_stages=self.num_stages,
            pipeline_microbatch_size=self.microbatch_size,
            pipeline_microbatches=self.num_microbatches,
            pipeline_schedule="circular" if self.circular_repeat > 1 else "gpipe",
            pipeline_repeats=self.circular_repeat,
            # Pax applies CHECKPOINT_POLICY to each stage even without repeated layers.
            remat=knobs.checkpoint_policy,
        )
        schedule = ScheduleConfig(
            kind="warmup_cosine",
            peak_learning_rate=knobs.learning_rate,
            warmup_steps=self.lr_cos_warmup,
            decay_steps=self.lr_cos_decay_end - self.lr_cos_decay_start,
            final_fraction=self.lr_cos_min_ratio,
        )
        return dataclasses.replace(
            base,
            model=dataclasses.replace(base.model, transformer=transformer),
            learner=dataclasses.replace(base.learner, schedule=schedule),
            mesh=MeshConfig(
                ici_mesh_shape=self.ici_mesh_shape, dcn_mesh_shape=self.dcn_mesh_shape, axis_names=PIPELINE_AXES
            ),
        )


# C4SpmdPipelineGpt3SmallAdam8Replicas's model, data and optimizer knobs (module docstring).
C4_SPMD_PIPELINE_GPT3_SMALL_ADAM = PaxLM(
    num_layers=24,
    model_dims=3072,
    hidden_dims=3072 * 4,
    num_heads=24,
    dims_per_head=128,
    vocab_size=51200,
    activation="gelu",
    use_bias=True,
    atten_logit_cap=None,
    softmax_cap_logits=None,
    fprop_dtype="bfloat16",
    use_repeated_layer=False,
    checkpoint_policy="full",
    max_seq_len=2048,
    percore_batch_size=8,  # x 64 chips = 512 (8Replicas: 64 x 8 chips)
    data_source="c4",
    data_path=C4_PATH,
    packed_input=True,
    learning_rate=2.0e-4,
    adam_beta1=0.9,
    adam_beta2=0.95,
    adam_epsilon=1e-8,
    adam_clip_threshold=None,
    weight_decay=0.1,
    clip_gradient_norm_to_value=1.0,
    summary_interval_steps=5,
    eval_interval_steps=10,
    eval_loop_num_batches=0,
    checkpoint_every_n_steps=200,
    checkpoint_max_to_keep=1000,
)

# The README's 64-chip run: 4 stages x 4-way FSDP x 4-way tensor (64Replicas' mesh).
GPT3_XL_PIPELINE_64 = PaxPipeline(num_stages=4, microbatch_size=16, ici_mesh_shape=(4, 1, 4, 4))


@also_known_as("tasks.lm.params.c4.C4SpmdPipelineGpt3SmallAdam64Replicas")
@register
def c4_gpt3_xl_pipeline() -> ExperimentConfig:
    return GPT3_XL_PIPELINE_64.build(
        C4_SPMD_PIPELINE_GPT3_SMALL_ADAM,
        "c4_gpt3_xl_pipeline",
        "Pax C4SpmdPipelineGpt3SmallAdam64Replicas: (the README's; now ...8Replicas) GPT3-XL on C4, 4 "
        "pipeline stages x 4-way FSDP x 4-way tensor on 64 chips (TPU v4-128), 32 microbatches, bf16.",
    )


@register
def c4_gpt3_xl_pipeline_smoke() -> ExperimentConfig:
    # 8Replicas' own mesh [2, 1, 2, 2] on 8 CPU devices: 2 stages of 2 layers, 4 microbatches of
    # 4 (2 per data-parallel device), 10 steps on the bundled Shakespeare text (uniform synthetic
    # tokens only teach the unigram) so that the loss visibly falls (6.6 -> 5.2).
    knobs = dataclasses.replace(
        smoke(C4_SPMD_PIPELINE_GPT3_SMALL_ADAM, ici_mesh_shape=(1, 1, 1)),
        data_source="shakespeare",
        num_layers=4,
        num_train_steps=10,
        learning_rate=3e-3,
        summary_interval_steps=5,
        eval_interval_steps=10,
        checkpoint_every_n_steps=10,
    )
    pipeline = PaxPipeline(
        num_stages=2,
        microbatch_size=4,
        ici_mesh_shape=(2, 1, 2, 2),
        lr_cos_warmup=3,
        lr_cos_decay_start=4,
        lr_cos_decay_end=10,
    )
    return pipeline.build(knobs, "c4_gpt3_xl_pipeline_smoke", smoke_description("c4_gpt3_xl_pipeline"))
