"""Chat supervised fine-tuning (docs/finetuning.md): a model imported from Hugging Face, trained on
conversations rendered with its chat template, the loss on the assistant replies only.

`llama3_2_chat_cpu` runs on a CPU in about a minute: the tiny Llama 3.2-shaped checkpoint of
tests/fixtures/hf/llama3_2 (`model.init_from`), the plays' dialogue as conversations
(`data.source="play_chat"`), rendered with the Llama 3 template on the chat fixture's tokenizer
(tests/fixtures/chat/llama3: the same 512-token size, with the template's special tokens); run it
from the repository root. `llama3_1_8b_chat_sft` is the full-size preset: Llama 3.1 8B on JSON-lines
conversations (`data.path`), on its pre-training mesh (FSDP over 64 chips), for `launch compile` and
real hardware; `llama3_1_8b_lora` the same with rank-16 LoRA adapters on every projection of the
frozen model (`model.lora`).
"""

import dataclasses

from equipax.core.learner_config import LearnerConfig, ScheduleConfig
from equipax.core.mesh_config import MeshConfig
from equipax.launch.configs.data import DataConfig
from equipax.launch.configs.experiment import ExperimentConfig
from equipax.launch.configs.train import SampleConfig, TrainConfig
from equipax.launch.experiments.decoder_presets import smoke
from equipax.launch.experiments.llama_lms import llama3_1_8b, llama3_2_1b
from equipax.launch.experiments.registry import register
from equipax.models.configs import LMConfig, LoRAConfig

__all__ = ["CHAT_PATH", "SFT_LEARNER", "llama3_1_8b_chat_sft", "llama3_1_8b_lora", "llama3_2_chat_cpu"]

CHAT_PATH = "/data/chat"

# Fine-tuning: AdamW, warmup then cosine decay from 2e-5, no weight decay, gradients clipped at 1.
SFT_LEARNER = LearnerConfig(
    kind="adamw",
    weight_decay=0.0,
    clip_gradient_norm=1.0,
    schedule=ScheduleConfig(kind="warmup_cosine", peak_learning_rate=2e-5, warmup_steps=50, decay_steps=2000),
)


@register
def llama3_2_chat_cpu() -> ExperimentConfig:
    """Chat SFT of the tiny Llama 3.2 fixture on the plays' dialogue (one CPU, 40 steps)."""
    base = smoke(llama3_2_1b())
    model = base.model
    assert isinstance(model, LMConfig)
    return ExperimentConfig(
        name="llama3_2_chat_cpu",
        description="Chat SFT of tests/fixtures/hf/llama3_2 on the plays' dialogue (Llama 3 template).",
        # RoPE: the fixture's weights serve any window; 256 positions hold most two-speech exchanges.
        model=dataclasses.replace(model, max_seq_len=256, init_from="hf:tests/fixtures/hf/llama3_2"),
        data=DataConfig(
            source="play_chat",
            tokenizer="huggingface",
            vocab_path="tests/fixtures/chat/llama3",
            chat_template="llama3",
            chat_turns=1,
            seq_len=256,
            batch_size=8,
            packing=True,
        ),
        learner=dataclasses.replace(
            SFT_LEARNER,
            schedule=dataclasses.replace(SFT_LEARNER.schedule, peak_learning_rate=3e-3, warmup_steps=5, decay_steps=40),
        ),
        train=TrainConfig(
            num_steps=40,
            log_every=10,
            eval_every=40,
            eval_batches=4,
            checkpoint_every=40,
            sample=SampleConfig(tokens=0),
        ),
        mesh=MeshConfig(),
    )


@register
def llama3_1_8b_chat_sft() -> ExperimentConfig:
    """Llama 3.1 8B chat SFT on JSON-lines conversations, FSDP over 64 chips (v5p-128).

    Start it from the instruct checkpoint, whose tokenizer holds the chat template:
    `--set model.init_from=hf:/models/Llama-3.1-8B-Instruct --set data.vocab_path=/models/Llama-3.1-8B-Instruct`.
    """
    base = llama3_1_8b()
    return dataclasses.replace(
        base,
        name="llama3_1_8b_chat_sft",
        description="Llama 3.1 8B chat SFT (loss on the replies, packed) on JSON-lines conversations in data.path.",
        data=DataConfig(
            source="chat",
            path=CHAT_PATH,
            train_files="train*.jsonl*",
            eval_files="eval*.jsonl*",
            tokenizer="huggingface",
            seq_len=8192,
            per_device_batch=1,
            packing=True,
        ),
        learner=SFT_LEARNER,
        train=TrainConfig(
            num_steps=2000,
            log_every=10,
            eval_every=200,
            eval_batches=20,
            checkpoint_every=200,
            sample=SampleConfig(tokens=0),
        ),
    )


@register
def llama3_1_8b_lora() -> ExperimentConfig:
    """`llama3_1_8b_chat_sft` with LoRA (rank 16, alpha 32, q/k/v/o/gate/up/down) on the frozen 8B model."""
    base = llama3_1_8b_chat_sft()
    model = base.model
    assert isinstance(model, LMConfig)
    lora = LoRAConfig(enabled=True, rank=16, alpha=32.0, targets=("q", "k", "v", "o", "gate", "up", "down"))
    return dataclasses.replace(
        base,
        name="llama3_1_8b_lora",
        description="Llama 3.1 8B LoRA (rank 16 on every projection) chat SFT on JSON-lines conversations.",
        model=dataclasses.replace(model, lora=lora),
        learner=dataclasses.replace(
            SFT_LEARNER, schedule=dataclasses.replace(SFT_LEARNER.schedule, peak_learning_rate=2e-4)
        ),
    )
