"""One decoder stack for every LM family: no second model class, attention module, kernel file or
decode path comes back, and nothing branches on model classes outside config and registration
code (models/ and launch/tasks dispatch through the modules and `cfg.kind`)."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "packages"


def test_no_second_stack_attention_or_decode_copy():
    gone = ["core/src/equipax/core/nn/gqa_attention.py", "models/src/equipax/models/llama.py"]
    assert not [p for p in gone if (SRC / p).exists()]
    text = "\n".join(p.read_text() for p in SRC.rglob("*.py"))
    for name in (
        "class LlamaLM",
        "class LlamaConfig",
        "class LlamaBlock",
        "class GroupedQueryAttention",
        "class CausalSelfAttention",
        "def gqa_attention",
        "_MASK_VALUE =",
    ):
        assert name not in text, name
    assert text.count("MASK_VALUE = ") == 1  # the one mask value (equipax.core.nn.attention_masks)


def test_no_isinstance_on_model_classes_in_models_or_launch_tasks():
    models = r"(TransformerLM|TransformerStack|PipelinedStack|TransformerBlock|Attention|AdvancedCNN|LMTask)"
    problems = []
    for folder in (
        SRC / "models" / "src" / "equipax" / "models",
        SRC / "launch" / "src" / "equipax" / "launch" / "tasks",
    ):
        for path in sorted(folder.rglob("*.py")):
            if re.search(rf"isinstance\([^)]*\b{models}\b", path.read_text()):
                problems.append(str(path.relative_to(REPO)))
    assert not problems, problems
