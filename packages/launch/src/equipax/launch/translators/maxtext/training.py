"""MaxText's optimizer, schedule, steps, profiler and data keys <-> equipax's learner, train and
data knobs."""

from collections.abc import Mapping
from typing import Any

from equipax.launch.translators.maxtext.values import Skip, Values, one_of

__all__ = [
    "C4_TFDS",
    "data_to_equipax",
    "data_to_maxtext",
    "optimizer_to_equipax",
    "OPTIMIZERS",
    "profiler_to_equipax",
    "profiler_to_maxtext",
    "schedule_to_equipax",
    "schedule_to_maxtext",
    "steps_to_equipax",
    "tokenizer_to_equipax",
    "tokenizer_to_maxtext",
]

OPTIMIZERS = {"adamw": "adamw", "adam_pax": "pax_adam"}
C4_TFDS = "c4/en:3.1.0"  # base.yml's dataset_name


def schedule_to_equipax(v: Values) -> dict[str, Any]:
    kind = v.get("lr_schedule_type")
    if kind != "cosine":
        raise Skip(f"lr_schedule_type={kind!r}: equipax's warmup_cosine is MaxText's 'cosine'")
    steps = int(v.get("steps"))
    total = int(v.get("learning_rate_schedule_steps"))
    total = steps if total == -1 else total
    warmup = int(float(v.get("warmup_steps_fraction")) * total)  # MaxText rounds down
    if total <= warmup:
        raise Skip(f"a cosine of {total - warmup} steps after {warmup} warmup steps")
    if total < steps:
        v.notes.append(f"MaxText trains at learning rate 0 after step {total}; equipax stays at final_fraction x peak.")
    final = v.given.get("cosine_learning_rate_final_fraction")  # MaxText before 0.2's name
    return {
        "learner.schedule.kind": "warmup_cosine",
        "learner.schedule.peak_learning_rate": float(v.get("learning_rate")),
        "learner.schedule.warmup_steps": warmup,
        "learner.schedule.decay_steps": total - warmup,
        "learner.schedule.final_fraction": float(v.get("learning_rate_final_fraction") if final is None else final),
    }


def schedule_to_maxtext(k: Mapping[str, Any]) -> dict[str, Any]:
    if k["learner.schedule.kind"] != "warmup_cosine":
        raise Skip(f"learner.schedule.kind={k['learner.schedule.kind']!r}: MaxText's schedule is warmup + cosine")
    total = k["learner.schedule.warmup_steps"] + k["learner.schedule.decay_steps"]
    return {
        "learning_rate": k["learner.schedule.peak_learning_rate"],
        "lr_schedule_type": "cosine",
        "learning_rate_schedule_steps": total,
        "warmup_steps_fraction": k["learner.schedule.warmup_steps"] / total,
        "learning_rate_final_fraction": k["learner.schedule.final_fraction"],
    }


def profiler_to_equipax(v: Values) -> dict[str, Any]:
    kind = v.given.get("profiler", "xplane" if v.given.get("enable_profiler") else "")
    if kind not in ("", "xplane"):
        raise Skip(f"profiler={kind!r}: equipax traces with jax.profiler (xplane); run nsys around `launch run`")
    out: dict[str, Any] = {"train.profile.steps": int(v.get("profiler_steps")) if kind else 0}
    if kind:
        out["train.profile.start_step"] = int(v.get("skip_first_n_steps_for_profiler")) + 1
        out["train.profile.all_processes"] = bool(v.given.get("upload_all_profiler_results", False))
    return out


def profiler_to_maxtext(k: Mapping[str, Any]) -> dict[str, Any]:
    if not k["train.profile.steps"]:
        return {"profiler": ""}
    start = k["train.profile.start_step"] or 2
    return {
        "profiler": "xplane",
        "skip_first_n_steps_for_profiler": start - 1,
        "profiler_steps": k["train.profile.steps"],
        "upload_all_profiler_results": k["train.profile.all_processes"],
    }


def steps_to_equipax(v: Values) -> dict[str, Any]:
    steps = int(v.given["steps"])
    steps = steps if steps != -1 else int(v.get("learning_rate_schedule_steps"))
    if steps <= 0:
        raise Skip("steps=-1 needs learning_rate_schedule_steps > 0")
    return {"train.num_steps": steps}


def optimizer_to_equipax(v: Values) -> dict[str, Any]:
    kind = one_of("opt_type", OPTIMIZERS)(v.given["opt_type"])
    out: dict[str, Any] = {"learner.kind": kind}
    if kind == "adamw":
        out["learner.clip_update_rms"] = None  # pax_adam's alone; AdamW refuses it
    return out


def data_to_equipax(v: Values) -> dict[str, Any]:
    kind = v.given.get("dataset_type", "synthetic")
    name = str(v.given.get("dataset_name", C4_TFDS))
    if kind == "synthetic":
        v.notes.append("dataset_type=synthetic: also set data.packing=False (synthetic tokens are not packed).")
        return {"data.source": "synthetic", "data.packing": False}
    if kind in ("tfds", "c4") and name.startswith("c4/"):  # `c4`: MaxText before 0.2
        out: dict[str, Any] = {"data.source": "c4", "data.packing": bool(v.given.get("packing", True))}
        if v.given.get("dataset_path"):
            out["data.path"] = str(v.given["dataset_path"])
        return out
    raise Skip(f"dataset_type={kind!r}, dataset_name={name!r}: translated are synthetic and tfds C4 ({C4_TFDS})")


def data_to_maxtext(k: Mapping[str, Any]) -> dict[str, Any]:
    if k["data.source"] == "synthetic":
        return {"dataset_type": "synthetic"}
    if k["data.source"] != "c4":
        raise Skip(f"data.source={k['data.source']!r}: MaxText reads synthetic tokens or C4")
    return {
        "dataset_type": "tfds",
        "dataset_name": C4_TFDS,
        "dataset_path": k["data.path"],
        "packing": k["data.packing"],
    }


def tokenizer_to_equipax(v: Values) -> dict[str, Any]:
    kind = v.given.get("tokenizer_type", "sentencepiece")
    path = str(v.given.get("tokenizer_path") or "")
    if kind not in ("sentencepiece", "huggingface"):
        raise Skip(f"tokenizer_type={kind!r}: equipax reads SentencePiece and Hugging Face tokenizers")
    if not path:
        raise Skip("no tokenizer_path: the base experiment's tokenizer is kept")
    return {"data.tokenizer": kind, "data.vocab_path": path}


def tokenizer_to_maxtext(k: Mapping[str, Any]) -> dict[str, Any]:
    if k["data.tokenizer"] not in ("sentencepiece", "huggingface") or not k["data.vocab_path"]:
        raise Skip(
            f"data.tokenizer={k['data.tokenizer']!r}, data.vocab_path={k['data.vocab_path']!r}: MaxText reads a "
            "tokenizer file (equipax trains a SentencePiece vocabulary where none is given)"
        )
    return {"tokenizer_type": k["data.tokenizer"], "tokenizer_path": k["data.vocab_path"]}
