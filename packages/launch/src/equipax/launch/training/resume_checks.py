"""Which knobs may change when a job resumes, and the check that refuses the others.

Every checkpoint records what its saved state means (`resume_meta`): the experiment, the knobs that
decide which examples the data iterator's saved position points at and which token ids the
parameters were trained on, a fingerprint of the training shards and of the vocabulary (the task
family's `data_fingerprint`), and the number of hosts. Resuming compares that record with the new
run (`check_resume`) and refuses, listing every difference, where the saved state would be misread;
the model's shapes are checked separately (`Checkpointer.check_compatible`). Knobs not listed here
(learner, loop, eval, mesh) may change on resume, and so may the number of hosts and devices where
the training input's order is global (`BaseInput.global_state`): the model and optimizer state are
restored onto the new mesh and the data continues in the same order. docs/errors.md ("Resuming with
changed knobs") has the table.
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from equipax.core.knobs import ConfigError, flatten
from equipax.launch.cluster.distributed import host_state
from equipax.launch.configs.experiment import ExperimentConfig
from equipax.launch.store.storage import AnyPath

if TYPE_CHECKING:
    from equipax.data import BaseInput

__all__ = ["check_resume", "describe_layout", "layout_change", "restore_data_state", "resume_meta", "SAFE_DATA_KNOBS"]

# Data knobs a resumed run may change: they touch evaluation, or only the training of a
# vocabulary the job already has. Every other `data.*` knob is part of the saved state's meaning.
SAFE_DATA_KNOBS = frozenset(
    {
        "eval_files",
        "reset_for_eval",
        "max_malformed_fraction",
        "allow_partial_shards",
        "tokenizer_max_sentences",
        "num_test",
        "batch_size",
        "per_device_batch",
    }
)


# Model knobs that choose how the same function is computed, or (init_from) where a run with no
# checkpoint starts: like the mesh, free to change on resume without a note.
_HOW_COMPUTED = (
    "model.init_from",
    "model.transformer.remat",
    "model.transformer.attention_impl",
    "model.transformer.scan_layers",
    "model.transformer.tensor_parallel",
    "model.transformer.pipeline_",
    "model.transformer.context_parallel_",
)


def _model_knobs(cfg: ExperimentConfig) -> dict[str, Any]:
    """The model's knobs that define the function its parameters were trained as, JSON-ready."""
    knobs = {f"model.{k}": v for k, v in flatten(cfg.model).items()}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in knobs.items() if not k.startswith(_HOW_COMPUTED)}


def resume_meta(
    cfg: ExperimentConfig,
    fingerprint: Mapping[str, Any],
    *,
    hosts: int,
    global_state: bool = False,
    layout: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What a checkpoint of this run means, JSON-ready (saved with each checkpoint).

    Arguments:
        cfg: the experiment.
        fingerprint: the task family's `data_fingerprint` of the experiment and job directory
            (more knobs to compare, the training shards', the vocabulary's).
        hosts: the number of processes.
        global_state: the training input's state is the same on every host (a global data order,
            `BaseInput.global_state`): the number of hosts may change on resume. Otherwise each host
            has its own saved position and the number of hosts is one of the knobs.
        layout: where the run is (`{"processes", "devices", "mesh"}`): recorded, not compared.
    """
    data = {f"data.{k}": v for k, v in dataclasses.asdict(cfg.data).items() if k not in SAFE_DATA_KNOBS}
    knobs = {
        **data,
        "global batch (data.batch_size or data.per_device_batch x devices)": cfg.global_batch_size,
        **fingerprint.get("knobs", {}),
    }
    if not global_state:
        knobs["hosts (processes)"] = hosts
    return {
        "experiment": cfg.name,
        "knobs": {k: list(v) if isinstance(v, tuple) else v for k, v in knobs.items()},
        "model": _model_knobs(cfg),
        "train_shards": fingerprint.get("train_shards"),
        "vocabulary": fingerprint.get("vocabulary"),
        "layout": dict(layout or {"processes": hosts}),
    }


def describe_layout(layout: dict[str, Any]) -> str:
    """`4 devices in 1 process, mesh data=2 fsdp=2` (the axes of size 1 left out)."""
    processes = layout.get("processes", "?")
    text = f"{layout.get('devices', '?')} devices in {processes} process{'es' if processes != 1 else ''}"
    axes = " ".join(f"{k}={v}" for k, v in (layout.get("mesh") or {}).items() if v != 1)
    return text + (f", mesh {axes or '1 device'}" if "mesh" in layout else "")


def layout_change(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """`"... (checkpoint: ...)"` when the checkpoint was written on another layout, else None."""
    old = saved.get("layout")
    if not old or old == current.get("layout"):
        return None
    return f"{describe_layout(current['layout'])} (the checkpoint was written on {describe_layout(old)})"


def check_resume(
    saved: dict[str, Any], current: dict[str, Any], *, step: int, where: AnyPath, allow_new_data_order: bool = False
) -> tuple[list[str], bool]:
    """Refuse to resume a checkpoint whose saved state this run would misread.

    Arguments:
        saved: the checkpoint's `resume_meta`.
        current: this run's `resume_meta`.
        step: the checkpoint's step (for the message).
        where: the checkpoint directory (for the message).
        allow_new_data_order: accept the data differences (`launch run --allow-new-data-order`):
            the model and optimizer state are restored and the data starts a new order.

    Returns:
        (notes on accepted differences, e.g. moved data with the same shards; whether the data
        state must be dropped because the data changed under `allow_new_data_order`).

    Raises:
        ConfigError: another experiment's checkpoint, or knobs that change the state's meaning
            differ (and `allow_new_data_order` is off); the message lists every difference.
    """
    if saved.get("experiment") not in (None, current["experiment"]):
        raise ConfigError(
            f"The checkpoints in {where} were written by experiment {saved['experiment']!r}, not "
            f"{current['experiment']!r}; resuming one from the other would be wrong. Point --job-log-dir at "
            f"a new directory to start {current['experiment']!r} fresh, or run --exp {saved['experiment']} "
            "to resume that job."
        )
    notes = _model_changes(saved, current, step=step)
    old, new = saved.get("knobs", {}), current["knobs"]
    diffs = {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)}
    if "hosts (processes)" not in new:  # this run's data order is global: the host count is free
        diffs.pop("hosts (processes)", None)
    same_shards = saved.get("train_shards") is not None and saved.get("train_shards") == current["train_shards"]
    if "data.path" in diffs and same_shards:
        notes.append(
            f"data.path changed ({diffs.pop('data.path')[0]!r} -> {new['data.path']!r}) but holds "
            "the same training shards (names and sizes): resuming."
        )
    elif saved.get("train_shards") != current["train_shards"] and "data.path" not in diffs:
        diffs["training shards under data.path (names and sizes)"] = ("as saved", "changed")
    if saved.get("vocabulary") != current["vocabulary"] and not {"data.tokenizer", "data.vocab_path"} & set(diffs):
        diffs["the vocabulary file (data.vocab_path or the job's tokenizer.model / tokenizer.json)"] = (
            "as saved",
            "changed",
        )
    if not diffs:
        return notes, False
    lines = "\n".join(f"  {k}: {a!r} -> {b!r}" for k, (a, b) in diffs.items())
    if allow_new_data_order:
        changed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diffs.items())
        notes.append(
            f"--allow-new-data-order: the data changed ({changed}); the model and optimizer state of step "
            f"{step} are restored and the data starts a new order from its beginning (recorded in the "
            "checkpoints' meta, data_order_changes)."
        )
        return notes, True
    raise ConfigError(
        f"The checkpoint at step {step} in {where} cannot be resumed with these knobs: they change what its "
        f"saved data position or token ids mean, so the run would mix two datasets. Differences "
        f"(checkpoint -> this run):\n{lines}\nRestore these knobs (the job's config.json records them), point "
        "--job-log-dir at a new directory to start fresh, or pass --allow-new-data-order to keep the model "
        "and optimizer state and start the data in a new order. Learner, train.*, eval and mesh knobs, and "
        'the number of hosts and devices, may change on resume (docs/errors.md, "Resuming with changed knobs").'
    )


def _model_changes(saved: dict[str, Any], current: dict[str, Any], *, step: int) -> list[str]:
    """A note naming the model knobs that changed since the checkpoint (those that keep its shapes:
    the others are refused by `Checkpointer.check_compatible`); none for a checkpoint that did not
    record them."""
    old, new = saved.get("model"), current.get("model", {})
    if old is None:
        return []
    changed = [
        f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)
    ]
    if not changed:
        return []
    return [
        f"the model changed since the checkpoint of step {step} ({'; '.join(changed)}). Its parameters keep "
        "their shapes, so they are restored, but they were trained as the model the checkpoint's knobs "
        "describe: set those knobs back unless the change is meant."
    ]


def restore_data_state(
    inp: "BaseInput",
    data_state: dict[str, Any],
    *,
    moved: bool,
    allow_new_data_order: bool,
    log: Callable[[str], object],
) -> bool:
    """Put the checkpoint's data state into the training input. A state this input cannot take
    (another global batch, another dataset, a per-host state of an earlier version) is a
    ConfigError naming the way out, or, with `allow_new_data_order`, a note: the input keeps its
    start (a new order). Returns whether the data starts a new order."""
    try:
        inp.set_state(host_state(data_state))
        return False
    except ValueError as e:
        if allow_new_data_order:
            log(f"note: --allow-new-data-order: {e} The data starts a new order.")
            return True
        where = " on this layout" if moved else ""
        raise ConfigError(
            f"The checkpoint's data state does not fit this run's training input{where}: {e} Restore the "
            "knobs it was saved with, pass --allow-new-data-order to keep the model and optimizer state "
            "and start the data in a new order, or point --job-log-dir at a new directory."
        ) from None
