"""Hugging Face model directories to job directories and back (`launch convert hf-import`,
`hf-export`), each behind the logit-parity gate (`equipax.launch.tasks.hf_parity`, which also has `model.init_from`).

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
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from equipax.core.knobs import ConfigError, apply_overrides, format_knobs, to_json
from equipax.core.learner_config import LearnerConfig, ScheduleConfig
from equipax.core.mesh_config import MeshConfig
from equipax.launch.configs.experiment import DataConfig, ExperimentConfig, as_lm, is_lm
from equipax.launch.configs.train import TrainConfig
from equipax.launch.store.storage import AnyPath
from equipax.launch.tasks.hf_parity import KL_LIMIT, architecture_diffs, gate, shaped_like
from equipax.models.hf.config import export_type_of, hf_config_from_lm, lm_config_from_hf, read_hf_config

__all__ = [
    "DEFAULT_SHARD_BYTES",
    "export_job",
    "FINETUNE_LEARNER",
    "import_job",
    "imported_experiment",
    "staged",
    "TOKENIZER_FILES",
]

DEFAULT_SHARD_BYTES = 5 * 2**30  # save_pretrained's default max_shard_size ("5GB")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
# An imported job fine-tunes: AdamW at a constant 1e-5, no weight decay, gradients clipped at 1.
FINETUNE_LEARNER = LearnerConfig(
    kind="adamw", weight_decay=0.0, clip_gradient_norm=1.0, schedule=ScheduleConfig(peak_learning_rate=1e-5)
)


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


def _base_model(job_dir: Path, init_from: str | None) -> str:
    """Where a job's base model came from: `model.init_from`, or the directory `hf-import` read."""
    if init_from:
        return init_from.removeprefix("hf:")
    try:
        return str(json.loads((job_dir / "hf_import.json").read_text())["source"])
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def _copy_tokenizer(source: AnyPath, target: Path) -> list[str]:
    """The tokenizer files `source` has, copied to `target`; none without a tokenizer.json."""
    if not (source / TOKENIZER_FILES[0]).exists():
        return []
    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            (target / name).write_bytes((source / name).read_bytes())
            copied.append(name)
    return copied


def imported_experiment(directory: Path, sets: list[str]) -> tuple[ExperimentConfig, dict[str, str]]:
    """The experiment of an imported job: the checkpoint's model, the model's own tokenizer on the
    Shakespeare plays, the fine-tuning learner, one device; then `sets` (`--set KNOB=VALUE`) on top.
    Architecture knobs must stay the checkpoint's. The tokenizer is the directory's tokenizer.json,
    or `data.vocab_path`'s; without either, ConfigError (a vocabulary trained anew would give the
    pretrained embeddings' ids other meanings)."""
    hf = read_hf_config(directory)
    model = lm_config_from_hf(hf, where=str(directory / "config.json"))
    seq_len = min(128, model.max_seq_len)
    data = DataConfig(source="shakespeare", tokenizer="huggingface", seq_len=seq_len, batch_size=8)
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
    if not (directory / TOKENIZER_FILES[0]).is_file() and not as_lm(cfg).data.vocab_path:
        raise ConfigError(
            f"{directory} has no {TOKENIZER_FILES[0]}: the imported job would have no tokenizer for the pretrained "
            "embeddings (a vocabulary trained anew gives their ids other meanings). Put the model's "
            f"{TOKENIZER_FILES[0]} and {TOKENIZER_FILES[1]} in {directory} (e.g. `huggingface-cli download REPO "
            f"{TOKENIZER_FILES[0]} {TOKENIZER_FILES[1]} --local-dir {directory}`), or pass "
            "--set data.vocab_path=PATH (a tokenizer.json or the directory holding it)."
        )
    diffs = architecture_diffs(as_lm(cfg).model, model)
    if diffs:
        changed = ", ".join(f"--set {k}={a!r} (the checkpoint's: {b!r})" for k, a, b in diffs)
        raise ConfigError(
            f"hf-import takes the model's architecture from {directory / 'config.json'}, which the weights were "
            f"trained for: {changed} would compute something else with them. Drop that --set (data, learner, "
            "train, mesh and model.lora knobs may be set)."
        )
    return cfg, sources


def import_job(directory: Path, out: Path, sets: list[str], *, log: Callable[[str], object]) -> ExperimentConfig:
    """`launch convert hf-import DIR --out JOB`: a job directory (config.json, knobs.txt, the
    tokenizer, a step-0 checkpoint of the model alone) that `launch run`, `decode` and `eval` read
    as any job's (`launch run` starts the optimizer from it, as a fresh run would)."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from equipax.core.mesh import build_mesh, check_device_count
    from equipax.core.step import TrainState
    from equipax.launch.cluster.distributed import gather_host_states
    from equipax.launch.jobdir.checkpoints import Checkpointer
    from equipax.launch.program.program import build_program
    from equipax.launch.tasks import family
    from equipax.launch.training.resume_checks import resume_meta
    from equipax.models.hf.weights import load_lm
    from equipax.models.lm_task import LMTask

    directory, out = Path(directory), Path(out)
    if jax.process_count() > 1:
        raise ConfigError("launch convert hf-import runs in one process (its mesh may span that host's devices).")
    cfg, sources = imported_experiment(directory, sets)
    try:
        cfg = cfg.for_devices(jax.device_count())
    except ValueError as e:
        raise ConfigError(str(e)) from None
    n = cfg.mesh.num_devices  # a mesh smaller than the host's devices: its first n (as decode does)
    if n > jax.device_count():
        check_device_count(cfg.mesh, jax.device_count(), hint=" (pass --cpu-devices N on a CPU host)")
    mesh = build_mesh(cfg.mesh, jax.devices()[:n])
    program = build_program(cfg, mesh)
    lora = as_lm(cfg).model.lora.enabled
    shardings = program.model_sharding
    model = load_lm(directory, as_lm(cfg).model, shardings.base if lora else shardings)
    kl = gate(model, directory, "The import")
    # The loaded model (with LoRA: adapters over it) in its shardings (no random init of the model
    # compiled or run), saved as a step-0 train state without an optimizer state.
    task = program.task
    assert isinstance(task, LMTask)
    model = shaped_like(model, program.abstract_model.base if lora else program.abstract_model)
    model = eqx.filter_jit(lambda m: eqx.filter_shard(task.adapt(m, program.keys.init), shardings))(model)
    state = TrainState(step=jnp.zeros((), jnp.int32), model=model, opt_state=None)
    log(f"Parity gate: KL {kl:.2e} nats/token against the reference of {directory} (limit {KL_LIMIT:g}).")
    with staged(out) as tmp:
        copied = _copy_tokenizer(directory, tmp)
        (tmp / "config.json").write_text(to_json(cfg) + "\n")
        (tmp / "knobs.txt").write_text(format_knobs(cfg, sources))
        source = {"source": str(directory.absolute()), "kl": kl, "kl_limit": KL_LIMIT, "tokenizer": copied}
        (tmp / "hf_import.json").write_text(json.dumps(source, indent=2) + "\n")
        fam = family(cfg)
        inputs = fam.build_inputs(cfg, tmp, mesh=mesh, log=log)  # the tokenizer loads; the data's start state
        checkpointer = Checkpointer(
            tmp / "checkpoints",
            keep=cfg.train.keep_checkpoints,
            meta=resume_meta(cfg, fam.data_fingerprint(cfg, tmp), hosts=1, global_state=inputs.train.global_state),
        )
        try:
            checkpointer.save(
                0,
                state,
                gather_host_states(inputs.train.get_state(), global_state=inputs.train.global_state),
                loop_state={},
            )
        finally:
            checkpointer.close()
    return cfg


def export_job(
    job_dir: Path,
    step: int | None,
    out: Path,
    *,
    dtype: str = "float32",
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    peft: bool = False,
    log: Callable[[str], object],
) -> list[str]:
    """`launch convert hf-export --job-log-dir J --out DIR`: the checkpoint as a Hugging Face model
    directory (safetensors with `{"format": "pt"}`, the index when sharded, config.json with both
    rotary schemas, generation_config.json, the job's Hugging Face tokenizer if it has one). A LoRA
    job exports its merged weights, or with `peft` its adapters as a PEFT adapter directory
    (`adapter_model.safetensors`, `adapter_config.json`, the tokenizer) for the base model."""
    from equipax.data import HFTokenizer
    from equipax.launch.inference.trained_job import load_config, local_mesh, pick_step, restore_model
    from equipax.launch.program.program import build_program
    from equipax.launch.tasks.lm_data import tokenizer_path
    from equipax.models.hf.peft import write_peft_adapter
    from equipax.models.hf.weights import hf_tensors, write_hf_weights
    from equipax.models.lora import LoRALM

    job_dir, out = Path(job_dir), Path(out)
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"--dtype must be float32, bfloat16 or float16; got {dtype!r}.")
    cfg = load_config(job_dir)
    if not is_lm(cfg):
        raise ConfigError(f"{job_dir} trained a {cfg.kind} model; only language models export to Hugging Face.")
    export_type_of(as_lm(cfg).model)  # refuses what has no Hugging Face equivalent before anything loads
    step = pick_step(job_dir, step)
    fitted, mesh, note = local_mesh(cfg)
    if note:
        log(note)
    model, _ = restore_model(job_dir, step, build_program(fitted, mesh))
    if peft and not isinstance(model, LoRALM):
        raise ConfigError(
            f"--peft exports LoRA adapters, but {job_dir} trained the whole model (model.lora.enabled=False); "
            "export it without --peft."
        )
    tok_path = tokenizer_path(as_lm(cfg), job_dir) if as_lm(cfg).data.tokenizer == "huggingface" else None
    if tok_path is None and (job_dir / TOKENIZER_FILES[0]).is_file():  # imported, then trained on synthetic ids
        tok_path = job_dir / TOKENIZER_FILES[0]
    tok = HFTokenizer.load(tok_path) if tok_path is not None else None
    ids = {} if tok is None else {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id}
    hf = hf_config_from_lm(as_lm(cfg).model, dtype=dtype, **ids)
    if isinstance(model, LoRALM):
        if peft:
            with staged(out) as tmp:
                base = _base_model(job_dir, as_lm(cfg).model.init_from)
                files = write_peft_adapter(tmp, model, base)
                if tok_path is not None:
                    files += _copy_tokenizer(tok_path.parent, tmp)
            log(
                f"Wrote the LoRA adapters of step {step} (rank {model.config.rank}, {len(model.adapters)} projections)."
            )
            return files
        model = model.merged()
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
        broken = (
            f"Step {step} of {job_dir} holds non-finite weights, or weights past --dtype {dtype}'s range (float16 "
            "stops at 65504): export another --step, or a wider --dtype."
        )
        kl = gate(model, tmp, "The export", rounded_to=dtype, broken=broken)
        log(f"Parity gate: KL {kl:.2e} nats/token, equipax vs the reference of the written files (limit {KL_LIMIT:g}).")
    return files
