"""The logit-parity gate of every Hugging Face conversion, and `model.init_from=hf:DIR`.

`gate` compares a model's float32 logits on fixed tokens with the numpy reference of a Hugging
Face directory (`equipax.models.hf.reference`, which reads only its config.json and weights) and
refuses (ConfigError: exit 2) above `KL_LIMIT`, naming the tensors when the files themselves hold
NaN or inf (the input's fault, not the conversion's). `check_architecture` refuses a checkpoint whose
config.json describes another model than the experiment's (`architecture_diffs`: the knobs that
differ). `init_from_hf` is the start of a run with `model.init_from=hf:DIR` and no checkpoint: the
weights read into the model's shardings (`equipax.launch.tasks.lm_family.LMFamily.init_state`).
"""

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from equipax.core.knobs import ConfigError
from equipax.models.configs import LMConfig
from equipax.models.hf.config import lm_config_from_hf, read_hf_config

if TYPE_CHECKING:
    from equipax.core.step import TrainState

__all__ = ["architecture_diffs", "check_architecture", "gate", "init_from_hf", "KL_LIMIT", "shaped_like"]

KL_LIMIT = 1e-6  # nats per token: equipax's logits vs the numpy reference of the Hugging Face files

_ARCHITECTURE = (
    "vocab_size",
    "position",
    "rope_theta",
    "rope_scaling",
    "tie_embeddings",
    "embedding_multiplier",
    "output_logit_cap",
)
_BLOCK = (
    "num_layers",
    "model_dims",
    "num_heads",
    "kv_heads",
    "head_dim",
    "hidden_dims",
    "activation",
    "gated",
    "norm",
    "norm_eps",
    "use_bias",
    "qk_norm",
    "sliding_window",
    "atten_logit_cap",
    "attention",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "shared_expert_intermediate_size",
    "num_hidden_groups",
)


def architecture_diffs(model: LMConfig, hf: LMConfig) -> list[tuple[str, Any, Any]]:
    """`(knob, model's value, hf's value)` for every architecture knob where `model` is not `hf`
    (the knobs that change what the weights compute; not layouts, dtypes or training knobs)."""
    diffs = [
        (f"model.{k}", getattr(model, k), getattr(hf, k)) for k in _ARCHITECTURE if getattr(model, k) != getattr(hf, k)
    ]
    return diffs + [
        (f"model.transformer.{k}", getattr(model.transformer, k), getattr(hf.transformer, k))
        for k in _BLOCK
        if getattr(model.transformer, k) != getattr(hf.transformer, k)
    ]


def check_architecture(model: LMConfig, directory: Path) -> LMConfig:
    """The Hugging Face directory's model config; ConfigError listing every architecture knob of
    `model` that differs from it (a checkpoint of another model or family)."""
    hf = lm_config_from_hf(read_hf_config(directory), where=str(Path(directory) / "config.json"))
    diffs = architecture_diffs(model, hf)
    if diffs:
        lines = "\n".join(f"  {k}: this experiment {a!r}, {directory} {b!r}" for k, a, b in diffs)
        raise ConfigError(
            f"The Hugging Face model in {directory} is another architecture than this experiment's model "
            f"({len(diffs)} knob(s) differ):\n{lines}\nSet those knobs to the checkpoint's values, or start from "
            f"`launch convert hf-import {directory} --out JOB`, which takes them from its config.json."
        )
    return hf


def _as_float32(model: Any) -> Any:
    """The same arrays as a float32 model (the gate compares float32 logits)."""
    import equinox as eqx
    import jax

    from equipax.models.lm import TransformerLM

    cfg = dataclasses.replace(model.cfg, dtype="float32")
    abstract = eqx.filter_eval_shape(lambda: TransformerLM(cfg, key=jax.random.key(0)))
    return jax.tree_util.tree_unflatten(jax.tree.structure(abstract), jax.tree.leaves(model))


def _nonfinite_tensors(directory: Path) -> list[str]:
    """The tensors of the Hugging Face directory holding NaN or inf (read in chunks of rows)."""
    import numpy as np

    from equipax.models.hf.safetensors import HFCheckpoint

    ckpt, bad = HFCheckpoint(directory), []
    for name in ckpt.names():
        info = ckpt.info(name)
        rows = info.shape[0] if info.shape else 1
        step = max(1, (64 << 20) // max(1, (info.end - info.begin) // rows))  # about 64 MiB a read
        for start in range(0, rows, step):
            part = ckpt.read(name, (slice(start, start + step),) if info.shape else ())
            if not np.isfinite(part.astype(np.float32)).all():
                bad.append(name)
                break
    return bad


def gate(model: Any, directory: Path, what: str, *, rounded_to: str = "float32", broken: str | None = None) -> float:
    """The KL of `model` against the reference of `directory`; ConfigError above `KL_LIMIT`. When
    the KL is not finite because the files hold NaN or inf, the error names those tensors and says
    `broken` (what to do about the input; default: the checkpoint in `directory` is damaged)."""
    import jax
    import jax.numpy as jnp

    from equipax.models.hf.weights import parity_kl

    model = _as_float32(model)
    if rounded_to != "float32":  # what the files hold: the model's weights rounded to that dtype
        dtype = jnp.dtype(rounded_to)
        model = jax.tree.map(lambda a: a.astype(dtype).astype(jnp.float32) if isinstance(a, jax.Array) else a, model)
    kl = parity_kl(model, directory)
    bad = [] if math.isfinite(kl) else _nonfinite_tensors(directory)
    if bad:
        listed = ", ".join(repr(n) for n in bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise ConfigError(
            f"{what} refused: {len(bad)} Hugging Face tensor(s) hold NaN or inf ({listed}), so any model read from "
            "them computes NaN logits; this is the weights' problem, not the conversion's. "
            + (broken or f"The checkpoint in {directory} is damaged: use an intact copy (download it again).")
            + " Nothing was written."
        )
    if not kl <= KL_LIMIT:
        raise ConfigError(
            f"{what} refused: equipax's logits and the numpy reference of the Hugging Face files differ by KL "
            f"{kl:.3g} nats/token on the gate's fixed tokens (limit {KL_LIMIT:g}). The conversion would compute "
            "other numbers than the checkpoint; nothing was written. Rerun with --debug and report it."
        )
    return kl


def shaped_like(model: Any, template: Any) -> Any:
    """`model`'s arrays in the structure of `template`, the same model built for a task (whose
    attention kernel is resolved for its mesh: `with_resolved_attention`); `template`'s own arrays
    may be abstract."""
    import jax

    return jax.tree_util.tree_unflatten(jax.tree.structure(template), jax.tree.leaves(model))


def init_from_hf(
    model_cfg: LMConfig, state: "TrainState[Any]", model_sharding: Any, *, log: Callable[[str], object]
) -> "TrainState[Any]":
    """`model.init_from=hf:DIR`: `state` with the model's weights read from DIR in the model's
    shardings (`model_sharding`), behind the parity gate (called when a run starts with no
    checkpoint); the weights take the place of the state's (`shaped_like` its model)."""
    import equinox as eqx

    from equipax.models.hf.weights import load_lm

    assert model_cfg.init_from is not None
    directory = Path(model_cfg.init_from.removeprefix("hf:"))
    check_architecture(model_cfg, directory)
    lora = model_cfg.lora.enabled  # the weights are the frozen base of the adapters
    model = load_lm(directory, model_cfg, model_sharding.base if lora else model_sharding)
    kl = gate(model, directory, f"model.init_from={model_cfg.init_from}")
    log(f"Initialised from {directory} (parity gate: KL {kl:.2e} nats/token, limit {KL_LIMIT:g}).")
    where = (lambda s: s.model.base) if lora else (lambda s: s.model)
    return eqx.tree_at(where, state, shaped_like(model, where(state)))
