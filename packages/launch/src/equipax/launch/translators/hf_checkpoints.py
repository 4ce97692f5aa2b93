"""Hugging Face model directories to job directories and back (`launch convert hf-import`,
`hf-export`) and `model.init_from=hf:DIR`, each behind the logit-parity gate.

Import reads config.json into the experiment's model (`equipax.models.hf.config`), builds the
train state in the experiment's shardings with each device's shard read from the safetensors
byte ranges it owns (`equipax.models.hf.weights.load_lm`), and saves it as the job's step-0
checkpoint. Export restores a checkpoint (any mesh: FSDP, tensor, pipeline stages) and writes the
Hugging Face tensors one at a time. Both then compare the model's logits on fixed tokens with the
numpy reference of the Hugging Face files (`equipax.models.hf.reference`), which reads only
config.json and the weights, and refuse to finish when the KL exceeds `KL_LIMIT`. Output goes to
a temporary directory beside the target and is renamed into place only when complete and checked:
a refused or interrupted conversion leaves nothing at the target.
"""

import contextlib
import dataclasses
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from equipax.core.configs import LearnerConfig, MeshConfig, ScheduleConfig
from equipax.core.knobs import ConfigError, apply_overrides, format_knobs, to_json
from equipax.launch.configs.experiment import DataConfig, ExperimentConfig, as_lm
from equipax.launch.configs.train import TrainConfig
from equipax.models.configs import LMConfig
from equipax.models.hf.config import hf_config_from_lm, lm_config_from_hf, model_type_of, read_hf_config

__all__ = [
    "DEFAULT_SHARD_BYTES",
    "check_architecture",
    "export_job",
    "FINETUNE_LEARNER",
    "import_job",
    "init_from_hf",
    "KL_LIMIT",
    "TOKENIZER_FILES",
]

KL_LIMIT = 1e-6  # nats per token: equipax's logits vs the numpy reference of the Hugging Face files
DEFAULT_SHARD_BYTES = 5 * 2**30  # save_pretrained's default max_shard_size ("5GB")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# An imported job fine-tunes: AdamW at a constant 1e-5, no weight decay, gradients clipped at 1.
FINETUNE_LEARNER = LearnerConfig(
    kind="adamw", weight_decay=0.0, clip_gradient_norm=1.0, schedule=ScheduleConfig(peak_learning_rate=1e-5)
)
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
)


def check_architecture(model: LMConfig, directory: Path) -> LMConfig:
    """The Hugging Face directory's model config; ConfigError listing every architecture knob of
    `model` that differs from it (a checkpoint of another model or family)."""
    hf = lm_config_from_hf(read_hf_config(directory), where=str(Path(directory) / "config.json"))
    diffs = [
        (f"model.{k}", getattr(model, k), getattr(hf, k)) for k in _ARCHITECTURE if getattr(model, k) != getattr(hf, k)
    ]
    diffs += [
        (f"model.transformer.{k}", getattr(model.transformer, k), getattr(hf.transformer, k))
        for k in _BLOCK
        if getattr(model.transformer, k) != getattr(hf.transformer, k)
    ]
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


def _gate(model: Any, directory: Path, what: str, *, rounded_to: str = "float32") -> float:
    """The KL of `model` against the reference of `directory`; ConfigError above `KL_LIMIT`."""
    import jax
    import jax.numpy as jnp

    from equipax.models.hf.weights import parity_kl

    model = _as_float32(model)
    if rounded_to != "float32":  # what the files hold: the model's weights rounded to that dtype
        dtype = jnp.dtype(rounded_to)
        model = jax.tree.map(lambda a: a.astype(dtype).astype(jnp.float32) if isinstance(a, jax.Array) else a, model)
    kl = parity_kl(model, directory)
    if not kl <= KL_LIMIT:
        raise ConfigError(
            f"{what} refused: equipax's logits and the numpy reference of the Hugging Face files differ by KL "
            f"{kl:.3g} nats/token on the gate's fixed tokens (limit {KL_LIMIT:g}). The conversion would compute "
            "other numbers than the checkpoint; nothing was written. Rerun with --debug and report it."
        )
    return kl


@contextlib.contextmanager
def staged(target: Path) -> Iterator[Path]:
    """A temporary directory beside `target`, renamed to `target` when the block succeeds (removed
    when it fails); `target` must not exist or be an empty directory."""
    target = Path(target)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConfigError(
            f"--out {target} already exists and is not empty; choose a new directory (nothing is overwritten)."
        )
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as e:
        raise ConfigError(
            f"Cannot write next to --out {target} ({e.strerror or e}); choose a writable place."
        ) from None
    try:
        yield tmp
        if target.exists():
            target.rmdir()
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _copy_tokenizer(source: Path, target: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)
            copied.append(name)
    return copied


def imported_experiment(directory: Path, sets: list[str]) -> tuple[ExperimentConfig, dict[str, str]]:
    """The experiment of an imported job: the checkpoint's model, the model's own tokenizer on the
    Shakespeare plays (synthetic tokens without a tokenizer.json), the fine-tuning learner, one device;
    then `sets` (`--set KNOB=VALUE`) on top. Architecture knobs must stay the checkpoint's."""
    hf = read_hf_config(directory)
    model = lm_config_from_hf(hf, where=str(directory / "config.json"))
    seq_len = min(128, model.max_seq_len)
    has_tokenizer = (directory / "tokenizer.json").is_file()
    data = (
        DataConfig(source="shakespeare", tokenizer="huggingface", seq_len=seq_len, batch_size=8)
        if has_tokenizer
        else DataConfig(source="synthetic", seq_len=seq_len, batch_size=8)
    )
    cfg = ExperimentConfig(
        name=f"hf_{hf['model_type']}",
        description=f"Fine-tuning the Hugging Face {hf['model_type']} model imported from {directory}.",
        model=model,
        data=data,
        learner=FINETUNE_LEARNER,
        train=TrainConfig(num_steps=100, log_every=10, eval_every=100, eval_batches=4, checkpoint_every=100),
        mesh=MeshConfig(),
    )
    try:
        cfg, sources = apply_overrides(cfg, sets)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_architecture(as_lm(cfg).model, directory)
    return cfg, sources


def import_job(directory: Path, out: Path, sets: list[str], *, log: Callable[[str], object]) -> ExperimentConfig:
    """`launch convert hf-import DIR --out JOB`: a job directory (config.json, knobs.txt, the
    tokenizer, a step-0 checkpoint) that `launch run`, `decode` and `eval` read as any job's."""
    import equinox as eqx
    import jax

    from equipax.core.mesh import build_mesh
    from equipax.core.step import init_train_state
    from equipax.launch.cluster.distributed import gather_host_states
    from equipax.launch.jobdir.checkpoints import Checkpointer
    from equipax.launch.jobdir.resume import resume_meta
    from equipax.launch.tasks import family
    from equipax.launch.training.build import build_training
    from equipax.launch.training.loop import build_run_mesh
    from equipax.models.hf.weights import load_lm

    directory, out = Path(directory), Path(out)
    if jax.process_count() > 1:
        raise ConfigError("launch convert hf-import runs in one process (its mesh may span that host's devices).")
    cfg, sources = imported_experiment(directory, sets)
    try:
        cfg = cfg.for_devices(jax.device_count())
    except ValueError as e:
        raise ConfigError(str(e)) from None
    n = cfg.mesh.num_devices  # a mesh smaller than the host's devices: its first n (as decode does)
    mesh = build_mesh(cfg.mesh, jax.devices()[:n]) if n < jax.device_count() else build_run_mesh(cfg)
    training = build_training(cfg, mesh)
    model = load_lm(directory, as_lm(cfg).model, training.state_sharding.model)
    kl = _gate(model, directory, "The import")
    # The step-0 state around the loaded model, in its shardings (no random init compiled or run).
    state = eqx.filter_jit(
        lambda m: eqx.filter_shard(init_train_state(m, training.learner.optimizer), training.state_sharding)
    )(model)
    log(f"Parity gate: KL {kl:.2e} nats/token against the reference of {directory} (limit {KL_LIMIT:g}).")
    with staged(out) as tmp:
        copied = _copy_tokenizer(directory, tmp)
        (tmp / "config.json").write_text(to_json(cfg) + "\n")
        (tmp / "knobs.txt").write_text(format_knobs(cfg, sources))
        source = {"source": str(directory.absolute()), "kl": kl, "kl_limit": KL_LIMIT, "tokenizer": copied}
        (tmp / "hf_import.json").write_text(json.dumps(source, indent=2) + "\n")
        inputs = family(cfg).build_inputs(cfg, tmp, log=log)  # the tokenizer loads; the data's start state
        checkpointer = Checkpointer(
            tmp / "checkpoints", keep=cfg.train.keep_checkpoints, meta=resume_meta(cfg, tmp, hosts=1)
        )
        try:
            checkpointer.save(0, state, gather_host_states(inputs.train.get_state()), loop_state={})
        finally:
            checkpointer.close()
    return cfg


def init_from_hf(training: Any, state: Any, *, log: Callable[[str], object]) -> Any:
    """`model.init_from=hf:DIR`: `state` with the model's weights read from DIR in the train state's
    shardings, behind the parity gate (called when a run starts with no checkpoint)."""
    import equinox as eqx

    from equipax.models.hf.weights import load_lm

    model_cfg = as_lm(training.cfg).model
    assert model_cfg.init_from is not None
    directory = Path(model_cfg.init_from.removeprefix("hf:"))
    check_architecture(model_cfg, directory)
    model = load_lm(directory, model_cfg, training.state_sharding.model)
    kl = _gate(model, directory, f"model.init_from={model_cfg.init_from}")
    log(f"Initialised from {directory} (parity gate: KL {kl:.2e} nats/token, limit {KL_LIMIT:g}).")
    return eqx.tree_at(lambda s: s.model, state, model)


def export_job(
    job_dir: Path,
    step: int | None,
    out: Path,
    *,
    dtype: str = "float32",
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    log: Callable[[str], object],
) -> list[str]:
    """`launch convert hf-export --job-log-dir J --out DIR`: the checkpoint as a Hugging Face model
    directory (safetensors with `{"format": "pt"}`, the index when sharded, config.json with both
    rotary schemas, generation_config.json, the job's Hugging Face tokenizer if it has one)."""
    from equipax.data import HFTokenizer
    from equipax.launch.inference.trained_job import load_config, local_mesh, pick_step, restore_model
    from equipax.launch.tasks.lm_data import tokenizer_path
    from equipax.launch.training.build import build_training
    from equipax.models.hf.weights import hf_tensors, write_hf_weights

    job_dir, out = Path(job_dir), Path(out)
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"--dtype must be float32, bfloat16 or float16; got {dtype!r}.")
    cfg = load_config(job_dir)
    if cfg.kind != "lm":
        raise ConfigError(f"{job_dir} trained a {cfg.kind} model; only language models export to Hugging Face.")
    model_type_of(as_lm(cfg).model)  # refuses what has no Hugging Face equivalent before anything loads
    step = pick_step(job_dir, step)
    fitted, mesh, note = local_mesh(cfg)
    if note:
        log(note)
    model, _ = restore_model(job_dir, step, build_training(fitted, mesh).abstract_state)
    tok_path = tokenizer_path(as_lm(cfg), job_dir) if as_lm(cfg).data.tokenizer == "huggingface" else None
    if tok_path is None and (job_dir / TOKENIZER_FILES[0]).is_file():  # imported, then trained on synthetic ids
        tok_path = job_dir / TOKENIZER_FILES[0]
    tok = HFTokenizer.load(tok_path) if tok_path is not None else None
    ids = {} if tok is None else {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id}
    hf = hf_config_from_lm(as_lm(cfg).model, dtype=dtype, **ids)
    with staged(out) as tmp:
        files = write_hf_weights(tmp, hf_tensors(model, dtype=dtype), shard_bytes=shard_bytes)
        (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        generation = {"_from_model_config": True, **ids}
        if tok is not None:
            generation["pad_token_id"] = tok.pad_id
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        files += ["config.json", "generation_config.json"]
        if tok_path is not None:
            files += _copy_tokenizer(tok_path.parent, tmp)
        kl = _gate(model, tmp, "The export", rounded_to=dtype)
        log(f"Parity gate: KL {kl:.2e} nats/token, equipax vs the reference of the written files (limit {KL_LIMIT:g}).")
    return files
