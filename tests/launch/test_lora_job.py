"""A LoRA chat SFT job end to end on the tiny Llama 3.2 fixture: import, train on the committed
conversations (packed, long ones truncated), resume exactly (adapters, optimizer state, the position
in the conversation stream and its counts in metrics.jsonl), export merged (== base + scale *
lora_B @ lora_A of the PEFT export, in Hugging Face layout) and as a PEFT adapter."""

import json
import shutil
from pathlib import Path

import numpy as np

from helpers.cli import invoke
from helpers.toy import persistent_compile_cache

FIXTURE = Path(__file__).parents[1] / "fixtures" / "hf" / "llama3_2"
LORA = [
    "model.lora.enabled=true",
    "model.lora.rank=4",
    "model.lora.alpha=8.0",
    "model.lora.targets=('q', 'k', 'v', 'o', 'gate', 'up', 'down')",
    "data.source=chat",
    "data.path=tests/fixtures/chat/sft",
    "data.train_files=train.jsonl",
    "data.eval_files=eval.jsonl",
    "data.vocab_path=tests/fixtures/chat/llama3",
    "data.packing=true",
    "data.seq_len=96",
    "data.batch_size=4",
    "learner.schedule.peak_learning_rate=0.01",
]
RUN = [
    "--set",
    "train.log_every=1",
    "--set",
    "train.eval_every=3",
    "--set",
    "train.eval_batches=1",
    "--set",
    "train.sample.tokens=0",
]


def _read(path: Path) -> dict[str, np.ndarray]:
    from equipax.models.hf.safetensors import SafetensorsFile

    f = SafetensorsFile(path)
    return {name: np.asarray(f.read(name), np.float32) for name in f.tensors}


def _train_records(job: Path) -> list[dict[str, float]]:
    lines = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    return [
        {k: v for k, v in r.items() if k == "step" or k.startswith("data_")} for r in lines if r["split"] == "train"
    ]


def _reference_counts(data: dict, steps: int) -> list[dict[str, float]]:
    """Step k's counts from the data library's own input, built here and stepped k batches."""
    from equipax.data import ChatSFTInput, ChatTemplate, HFTokenizer, read_conversations

    tok = HFTokenizer.load(Path(data["vocab_path"]))
    inp = ChatSFTInput(
        read_conversations([Path(data["path"]) / data["train_files"]]),
        tokenizer=tok,
        template=ChatTemplate.for_tokenizer(tok, data["chat_template"], end_of_turn=data["end_of_turn"] or None),
        seq_len=data["seq_len"],
        batch_size=data["batch_size"],
        seed=data["seed"],
        packing=True,
    )
    out = []
    for step in range(1, steps + 1):
        inp.get_next()
        out.append({"step": step} | inp.counter_metrics(inp.counters()))
    return out


def _import(job: Path) -> None:
    code, out = invoke("convert", "hf-import", FIXTURE, "--out", job, *[a for s in LORA for a in ("--set", s)])
    assert code == 0, out


def test_lora_job_trains_adapters_resumes_exactly_and_exports_merged_and_peft(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _import(straight)
    steps = ["--set", "train.checkpoint_every=1"]
    with persistent_compile_cache(tmp_path / "jax-cache"):  # the two runs compile the same programs once
        code, out = invoke("run", "--job-log-dir", straight, "--set", "train.num_steps=3", *steps, *RUN)
        assert code == 0, out
        # Stopped after step 1: the uninterrupted job as a run killed right after its checkpoint of
        # step 1 left it (checkpoints 2-3 and result.json gone; the records of steps 2-3 stay, and the
        # resumed run drops them). The checkpoint a `train.num_steps=1` run writes, without that run.
        shutil.copytree(straight, resumed)
        for later in ("2", "3"):
            shutil.rmtree(resumed / "checkpoints" / later)
        (resumed / "result.json").unlink()
        code, out = invoke("run", "--job-log-dir", resumed, "--set", "train.num_steps=3", *steps, *RUN)
    assert code == 0 and "Resumed from step 1" in out, out
    digests = [json.loads((j / "result.json").read_text())["state_digest"] for j in (straight, resumed)]
    assert digests[0] == digests[1]  # adapters, their optimizer state and the data position resume exactly

    # The input's running counts are in every train record (all hosts' sums, metrics.jsonl and
    # TensorBoard): they grow with the steps, a resume continues them, and the last equals result.json's.
    records = [_train_records(j) for j in (straight, resumed)]
    assert records[0] == records[1]
    counts = records[0]
    assert [r["step"] for r in counts] == [1, 2, 3]
    assert counts == _reference_counts(json.loads((straight / "config.json").read_text())["data"], steps=3)
    # seq_len 96 cuts long conversations, and skips those whose reply starts past it
    assert counts[-1]["data_truncated"] > 0 and counts[-1]["data_dropped"] > 0
    chat = json.loads((straight / "result.json").read_text())["chat_data"]
    assert {k: counts[-1][f"data_{k}"] for k in ("conversations", "truncated", "dropped")} == {
        k: chat[k] for k in ("conversations", "truncated", "dropped")
    }
    assert counts[-1]["data_packing_efficiency"] == counts[-1]["data_tokens"] / counts[-1]["data_row_tokens"]
    assert round(counts[-1]["data_packing_efficiency"], 4) == chat["packing_efficiency"]

    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    assert invoke("convert", "hf-export", "--job-log-dir", straight, "--out", merged)[0] == 0
    code, out = invoke("convert", "hf-export", "--job-log-dir", straight, "--out", adapter, "--peft")
    assert code == 0, out
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
    assert config["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    assert config["base_model_name_or_path"] == str(FIXTURE.absolute())
    base, got, lora = (
        _read(FIXTURE / "model.safetensors"),
        _read(merged / "model.safetensors"),
        _read(adapter / "adapter_model.safetensors"),
    )
    assert len(lora) == 2 * 7 * 2  # A and B of 7 projections in 2 layers
    adapted = 0
    for name, w in base.items():
        a = lora.get(f"base_model.model.{name.removesuffix('.weight')}.lora_A.weight")
        if a is None:
            np.testing.assert_array_equal(got[name], w, err_msg=name)  # the frozen base, bit-identical
            continue
        b = lora[f"base_model.model.{name.removesuffix('.weight')}.lora_B.weight"]
        assert a.shape == (4, w.shape[1]) and b.shape == (w.shape[0], 4)
        assert np.abs(b).max() > 0  # trained (B starts at zero)
        np.testing.assert_allclose(got[name], w + (8.0 / 4) * b @ a, rtol=1e-5, atol=1e-6, err_msg=name)
        adapted += 1
    assert adapted == 14


def test_peft_export_of_a_full_fine_tune_is_refused(tmp_path):
    job = tmp_path / "job"
    assert invoke("convert", "hf-import", FIXTURE, "--out", job, "--set", "data.source=synthetic")[0] == 0
    code, out = invoke("convert", "hf-export", "--job-log-dir", job, "--out", tmp_path / "x", "--peft")
    assert code == 2 and "--peft exports LoRA adapters" in out, out
    assert not (tmp_path / "x").exists()
