"""Pax's LM experiment knobs as one frozen dataclass (`PaxLM`), and the `_smoke` shrinking.

`PaxLM` holds the UPPER_CASE knobs of Pax's `TransformerLmSpmdAdam`, lower-cased;
`PaxLM.build()` turns them into an equipax `ExperimentConfig`. The registered experiments are in
`equipax.launch.experiments.pax_lm`, which also lists the Pax knobs equipax does not express.
"""

import dataclasses
from typing import Literal

from equipax.core.configs import TransformerConfig
from equipax.core.learner_config import LearnerConfig, ScheduleConfig
from equipax.core.mesh_config import MeshConfig
from equipax.launch.configs.experiment import DataConfig, ExperimentConfig
from equipax.launch.configs.train import SampleConfig, TrainConfig
from equipax.models.configs import LMConfig

__all__ = ["C4_PATH", "PAX_NUM_TRAIN_STEPS", "PaxLM", "smoke", "smoke_description"]

# Where the C4 experiments look for C4-format shards (`c4-train.*`, `c4-validation.*`): a local or
# mounted directory, as nothing is downloaded at run time. Override with `--set data.path=DIR`.
C4_PATH = "/data/c4/en"

# Pax's task defaults (paxml tasks_lib.SingleTask.Train): num_train_steps=1e7,
# save_interval_steps=5000, save_max_to_keep=10, summary_interval_steps=100,
# eval_interval_steps=100.
PAX_NUM_TRAIN_STEPS = 10_000_000


@dataclasses.dataclass(frozen=True, kw_only=True)
class PaxLM:
    """The knobs of a Pax decoder-only LM experiment (names lower-cased from Pax's).

    Defaults are Pax's `TransformerLmSpmdAdam` (c4.py) over `TransformerLmSpmdAdafactor`
    (model_params.py). `dims_per_head=None` means `model_dims // num_heads`, as in Pax.
    """

    # Architecture (TransformerLmSpmdAdam over TransformerLmSpmdAdafactor).
    num_layers: int = 32
    model_dims: int = 1024
    hidden_dims: int = 1024 * 4
    num_heads: int = 16
    dims_per_head: int | None = None
    vocab_size: int = 32000
    activation: Literal["gelu", "relu", "silu"] = "relu"  # ACTIVATION_CLS = layers.ReLU
    use_gated_activation: bool = False
    use_bias: bool = False  # attention only in Pax
    norm_policy: Literal["pre"] = "pre"  # pre-LayerNorm
    atten_logit_cap: float | None = 50.0
    softmax_cap_logits: float | None = 30.0
    fprop_dtype: Literal["float32", "bfloat16"] = "float32"
    use_repeated_layer: bool = False
    checkpoint_policy: Literal["none", "full", "dots_saveable"] = "full"  # SAVE_NOTHING
    # Data (PERCORE_BATCH_SIZE x devices = global batch; MAX_SEQ_LEN).
    max_seq_len: int = 1024
    percore_batch_size: int = 16
    data_source: Literal["shakespeare", "synthetic", "c4"] = "synthetic"
    data_path: str = ""  # c4: the shard directory
    packed_input: bool = False  # PACKED_INPUT (c4 only: packing needs documents)
    # Mesh [replica, data, mdl] -> (data, fsdp, tensor).
    ici_mesh_shape: tuple[int, int, int] = (1, 1, 1)
    dcn_mesh_shape: tuple[int, int, int] = (1, 1, 1)
    # Optimizer: praxis optimizers.Adam with Pax's clipping and decoupled weight decay.
    learning_rate: float = 1e-3
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    adam_epsilon: float = 1e-6
    adam_clip_threshold: float | None = 1.0
    weight_decay: float = 1e-3
    clip_gradient_norm_to_value: float | None = 5.0
    # Schedule: LinearRampupExponentialDecay (LR_LRED_*).
    lr_lred_warmup: int = 4000
    lr_lred_decay_start: int = 4001
    lr_lred_decay_end: int = 300_000
    lr_lred_min_ratio: float = 0.1
    # Loop.
    num_train_steps: int = PAX_NUM_TRAIN_STEPS
    summary_interval_steps: int = 100
    eval_interval_steps: int = 100
    eval_loop_num_batches: int = 1  # 0: a full pass (Pax's reset_for_eval=True)
    checkpoint_every_n_steps: int = 5000
    checkpoint_max_to_keep: int = 10

    @property
    def head_dim(self) -> int:
        return self.dims_per_head or self.model_dims // self.num_heads

    def build(self, name: str, description: str) -> ExperimentConfig:
        """The equipax config of these Pax knobs."""
        if self.num_heads * self.head_dim != self.model_dims:
            # Pax's TransformerLmSpmdAdafactor.task() asserts the same.
            raise ValueError(
                f"{name}: num_heads x dims_per_head = {self.num_heads} x {self.head_dim} "
                f"!= model_dims {self.model_dims}."
            )
        return ExperimentConfig(
            name=name,
            description=description,
            model=LMConfig(
                vocab_size=self.vocab_size,
                max_seq_len=self.max_seq_len,
                transformer=TransformerConfig(
                    num_layers=self.num_layers,
                    model_dims=self.model_dims,
                    num_heads=self.num_heads,
                    head_dim=self.head_dim,
                    hidden_dims=self.hidden_dims,
                    activation=self.activation,
                    gated=self.use_gated_activation,
                    norm="layernorm",
                    use_bias=self.use_bias,
                    atten_logit_cap=self.atten_logit_cap,
                    scan_layers=self.use_repeated_layer,
                    # Pax applies CHECKPOINT_POLICY only to repeated (scanned) layers.
                    remat=self.checkpoint_policy if self.use_repeated_layer else "none",
                ),
                output_logit_cap=self.softmax_cap_logits,
                position="sinusoidal",
                dtype=self.fprop_dtype,
            ),
            data=DataConfig(
                source=self.data_source,
                path=self.data_path,
                packing=self.packed_input,
                # Pax's C4 eval: reset_for_eval=True, one full pass of the validation split.
                reset_for_eval=self.eval_loop_num_batches == 0,
                seq_len=self.max_seq_len,
                per_device_batch=self.percore_batch_size,
            ),
            learner=LearnerConfig(
                kind="pax_adam",
                b1=self.adam_beta1,
                b2=self.adam_beta2,
                eps=self.adam_epsilon,
                weight_decay=self.weight_decay,
                clip_gradient_norm=self.clip_gradient_norm_to_value,
                clip_update_rms=self.adam_clip_threshold,
                schedule=ScheduleConfig(
                    kind="linear_rampup_exponential_decay",
                    peak_learning_rate=self.learning_rate,
                    warmup_steps=self.lr_lred_warmup,
                    decay_start=self.lr_lred_decay_start,
                    decay_steps=self.lr_lred_decay_end,
                    final_fraction=self.lr_lred_min_ratio,
                ),
            ),
            train=TrainConfig(
                num_steps=self.num_train_steps,
                log_every=self.summary_interval_steps,
                eval_every=self.eval_interval_steps,
                eval_batches=self.eval_loop_num_batches,
                checkpoint_every=self.checkpoint_every_n_steps,
                keep_checkpoints=self.checkpoint_max_to_keep,
                sample=SampleConfig(tokens=0),
            ),
            mesh=MeshConfig(ici_mesh_shape=self.ici_mesh_shape, dcn_mesh_shape=self.dcn_mesh_shape),
        )


def smoke(
    knobs: PaxLM,
    *,
    ici_mesh_shape: tuple[int, int, int],
    dcn_mesh_shape: tuple[int, int, int] = (1, 1, 1),
    num_heads: int = 4,
) -> PaxLM:
    """The same experiment shrunk to seconds on 8 simulated CPU devices.

    Keeps the code path (activation, caps, scanned layers, remat, Pax Adam and its LRED schedule)
    and the mesh's pattern of axes > 1; shrinks layers, widths, vocabulary, sequence, batch and
    steps, reads synthetic tokens, and computes in float32 (bf16 matmuls are slow on CPU; use
    `--set model.dtype=bfloat16` to exercise the bf16 path).
    """
    d = 64
    return dataclasses.replace(
        knobs,
        num_layers=2,
        model_dims=d,
        hidden_dims=4 * d,
        num_heads=num_heads,
        dims_per_head=d // num_heads,
        vocab_size=384,
        fprop_dtype="float32",
        max_seq_len=32,
        percore_batch_size=2,
        data_source="synthetic",
        data_path="",
        packed_input=False,
        ici_mesh_shape=ici_mesh_shape,
        dcn_mesh_shape=dcn_mesh_shape,
        lr_lred_warmup=2,
        lr_lred_decay_start=3,
        lr_lred_decay_end=20,
        num_train_steps=4,
        summary_interval_steps=1,
        eval_interval_steps=4,
        eval_loop_num_batches=1,
        checkpoint_every_n_steps=4,
        checkpoint_max_to_keep=2,
    )


def smoke_description(parent: str) -> str:
    return f"{parent} shrunk to seconds on 8 CPU devices (--cpu-devices 8): same code path and mesh axes."
