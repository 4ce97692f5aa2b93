"""A training job read from outside (`launch decode`, `launch eval`): never written to.

The job's `config.json` gives the experiment, `checkpoints/<step>/` the saved states. Steps are
listed from the directory names (orbax renames a step's folder into place only once it is
complete), so a job still training is read safely: no orbax `CheckpointManager` is opened on
it (opening one cleans up temporary folders, which would break the live run's save in flight).
Only the model (and its non-trained state) is restored, never the optimizer's moments, and the
restored arrays are checked against the checksums recorded when they were saved.
"""

import contextlib
import dataclasses
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import orbax.checkpoint as ocp

from equipax.core.knobs import ConfigError, from_json
from equipax.core.mesh import MeshConfig, build_mesh
from equipax.launch.configs.experiment import ExperimentConfig
from equipax.launch.jobdir.checksums import ALGORITHM, array_checksums, differences, unverified_warning
from equipax.launch.jobdir.orbax_quiet import QuietOrbaxErrors, quiet_process, restore_failure
from equipax.launch.program.program import Program
from equipax.launch.store.storage import COMMIT_MARKER, AnyPath, is_remote, job_path

__all__ = [
    "CheckpointUnreadable",
    "check_tokenizer",
    "checkpoint_steps",
    "load_config",
    "local_mesh",
    "MODEL_PARTS",
    "pick_step",
    "restore_model",
]

# The parts of the train state a trained model is: the optimizer state is never read.
MODEL_PARTS = (".model.", ".model_state.")


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def load_config(job_dir: AnyPath) -> ExperimentConfig:
    """The experiment a job directory trained (its `config.json`); ConfigError when there is none."""
    job_dir = job_path(job_dir)
    if not job_dir.is_dir():
        raise ConfigError(
            f"--job-log-dir {job_dir} does not exist; point it at the directory `launch run --job-log-dir` wrote."
        )
    path = job_dir / "config.json"
    if not path.exists():
        raise ConfigError(
            f"{job_dir} is not a training job's directory (no config.json); point "
            "--job-log-dir at the directory `launch run --job-log-dir` wrote."
        )
    try:
        return from_json(ExperimentConfig, path.read_text())
    except (ConfigError, ValueError) as e:
        raise ConfigError(f"{path} does not describe an experiment this version reads: {e}") from None


def checkpoint_steps(job_dir: AnyPath) -> list[int]:
    """The steps of the job's complete checkpoints, oldest first (temporary folders excluded)."""
    folder = job_path(job_dir) / "checkpoints"
    if not folder.is_dir():
        return []
    # In a store a step is complete once orbax has written its commit marker (no rename there).
    complete = (lambda p: (p / COMMIT_MARKER).exists()) if is_remote(folder) else (lambda p: True)
    return sorted(int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit() and complete(p))


def pick_step(job_dir: AnyPath, step: int | None) -> int:
    """`step`, or the newest checkpoint's; ConfigError when it does not exist."""
    steps = checkpoint_steps(job_dir)
    if not steps:
        raise ConfigError(
            f"{job_dir} has no checkpoint yet (nothing in {job_path(job_dir) / 'checkpoints'}). Wait for the "
            "run to save one (every train.checkpoint_every steps), or train it with `launch run`."
        )
    if step is None:
        return steps[-1]
    if step not in steps:
        raise ConfigError(
            f"{job_dir} has no checkpoint of step {step}; it has steps "
            f"{', '.join(map(str, steps))}. Pass one of them to --step, or leave --step out "
            "for the newest."
        )
    return step


def local_mesh(cfg: ExperimentConfig) -> tuple[ExperimentConfig, jax.sharding.Mesh, str]:
    """The job's mesh when this process has its devices, else one device.

    Returns:
        (the config with the mesh used, the mesh, a note for the user or "").
    """
    n = jax.device_count()
    try:
        fitted = cfg.for_devices(n)
        if fitted.mesh.num_devices == n:
            return fitted, build_mesh(fitted.mesh), ""
        stages = cfg.mesh.num_stages  # a pipelined model's (model.transformer.pipeline_stages)
        if stages > 1:  # its weights are stacked per stage: they restore onto the job's own mesh only
            raise ConfigError(
                f"The job trained a pipelined model (model.transformer.pipeline_stages={stages}) on "
                f"{cfg.mesh.num_devices} devices (mesh {cfg.mesh.shape}); this process has {n}. A "
                f"pipelined job is read on its own mesh: pass --cpu-devices {cfg.mesh.num_devices} "
                f"(simulated CPU devices), or run on a host with {cfg.mesh.num_devices} devices."
            )
        one = dataclasses.replace(cfg, mesh=MeshConfig())
    except ValueError as e:
        raise ConfigError(f"The job's experiment does not fit this host's devices: {e}") from None
    note = (
        f"note: the job trained on {cfg.mesh.num_devices} devices ({cfg.mesh.shape}); this process has "
        f"{n}, so the model is restored onto one device (pass --cpu-devices "
        f"{cfg.mesh.num_devices} to use the job's mesh on simulated CPU devices)."
    )
    return one, build_mesh(one.mesh, jax.devices()[:1]), note


def _is_abstract(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def _named(tree: Any, prefix: str) -> dict[str, Any]:
    """`{name: leaf}` of the abstract array leaves, named as the checkpoint names them."""
    flat, _ = jax.tree_util.tree_flatten_with_path(eqx.filter(tree, _is_abstract))
    return {prefix + jax.tree_util.keystr(path): leaf for path, leaf in flat}


def _fill(template: Any, prefix: str, flat: dict[str, Any]) -> Any:
    """`template` with each abstract array replaced by the restored array of its name."""
    arrays, static = eqx.partition(template, _is_abstract)
    paths, treedef = jax.tree_util.tree_flatten_with_path(arrays)
    filled = jax.tree_util.tree_unflatten(treedef, [flat[prefix + jax.tree_util.keystr(p)] for p, _ in paths])
    return eqx.combine(filled, static)


class _NoStepMetadataWarning(logging.Filter):
    """Reading the `state` item alone, orbax warns that the step's metadata file is not in it (and, when
    the metadata is damaged, that it could not get it: the restore then says so in one paragraph)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return "Metadata file does not exist" not in message and "Failed to get item metadata" not in message


@contextlib.contextmanager
def _quiet_orbax():
    """Orbax quiet while a checkpoint is read: no step-metadata warning, no logged tracebacks of a
    failed read, none of its read coroutines' or futures' leftovers (the failure is one paragraph)."""
    filters, logger = (_NoStepMetadataWarning(), QuietOrbaxErrors()), logging.getLogger("absl")
    quiet_process()
    for f in filters:
        logger.addFilter(f)
    try:
        yield
    finally:
        for f in filters:
            logger.removeFilter(f)


class CheckpointUnreadable(ConfigError):
    """A checkpoint's files do not restore, or differ from the checksums recorded when it was saved
    (damage, not a mismatch with the job's model): the job's other checkpoints may still serve."""


def restore_model(
    job_dir: AnyPath, step: int, program: Program, *, remedy: str | None = None, log: Callable[[str], object] = _stderr
) -> tuple[Any, Any]:
    """Restore the model and its non-trained state of checkpoint `step`, onto the shardings of
    `program` (`build_program`: its `abstract_model` and `abstract_model_state`). Only those
    arrays are read: the optimizer state saved beside them is never needed, not even its structure.

    Arguments:
        remedy: what the error of an unreadable checkpoint tells the user to do; default: pick
            another with `--step`, naming the job's other checkpoints.
        log: warnings go here (a checkpoint without checksums).

    Returns:
        (model, model_state).

    Raises:
        ConfigError: the checkpoint does not hold this model (other shapes).
        CheckpointUnreadable: it does not restore, or its arrays differ from the checksums recorded
            when it was saved.
    """
    job = job_path(job_dir)
    folder = (job if is_remote(job) else Path(job).absolute()) / "checkpoints" / str(step)
    if remedy is None:
        others = [s for s in checkpoint_steps(job_path(job_dir)) if s != step]
        remedy = (
            f"pick another with --step (this job also has step(s) {', '.join(map(str, others[-5:]))})"
            if others
            else "it is the job's only checkpoint: restore its files, or train the job again"
        )
    model, model_state = program.abstract_model, program.abstract_model_state
    wanted = _named(model, ".model") | _named(model_state, ".model_state")
    where = f"The checkpoint of step {step} in {folder.parent}"
    try:
        with _quiet_orbax(), ocp.PyTreeCheckpointer() as reader:
            saved = reader.metadata(folder / "state")
            saved = getattr(saved, "item_metadata", saved)
            if saved is None:  # orbax warns and gives none when its metadata is damaged
                raise CheckpointUnreadable(f"{where} does not restore (its array metadata does not read); {remedy}.")
            saved = dict(saved)
            diffs = [
                f"  {k}: checkpoint {tuple(saved[k].shape) if k in saved else 'missing'}, this model {tuple(v.shape)}"
                for k, v in wanted.items()
                if k not in saved or tuple(saved[k].shape) != tuple(v.shape)
            ]
            if diffs:
                raise ConfigError(
                    f"{where} does not hold this job's model ({len(diffs)} arrays differ):\n" + "\n".join(diffs[:10])
                )
            flat = reader.restore(
                folder / "state",
                args=ocp.args.PyTreeRestore(  # pyright: ignore[reportCallIssue]
                    item=wanted, restore_args=ocp.checkpoint_utils.construct_restore_args(wanted), partial_restore=True
                ),
            )
    except ConfigError:
        raise
    except Exception as e:
        raise CheckpointUnreadable(f"{where} does not restore ({restore_failure(e)}); {remedy}.") from None
    _verify(folder, step, dict(flat), remedy=remedy, log=log)
    return _fill(model, ".model", flat), _fill(model_state, ".model_state", flat)


def _verify(folder: AnyPath, step: int, flat: dict[str, Any], *, remedy: str, log: Callable[[str], object]) -> None:
    """CheckpointUnreadable unless the restored arrays have the checksums recorded at save time."""
    path = folder / "digests" / "metadata"
    if not path.exists():
        log(unverified_warning(step, folder.parent))
        return
    digests = json.loads(path.read_text())
    if digests.get("algorithm") != ALGORITHM:
        return
    recorded = {k: v for k, v in digests.get("arrays", {}).items() if k in flat}
    bad = differences(recorded, array_checksums(flat))
    if bad:
        raise CheckpointUnreadable(
            f"The checkpoint of step {step} in {folder.parent} is damaged: {len(bad)} array(s) differ from the "
            f"checksums recorded when it was saved ({', '.join(bad[:3])}); {remedy}."
        )


def check_tokenizer(cfg: ExperimentConfig, job_dir: AnyPath) -> None:
    """ConfigError when the job's own vocabulary file (its family's `vocabulary`, in the job
    directory) is missing: reading the job must never train a new one into its directory."""
    from equipax.launch.tasks import family

    job = job_path(job_dir)
    path = family(cfg).vocabulary(cfg, job)
    if path is not None and str(path.parent) == str(job) and not path.exists():
        raise ConfigError(
            f"{job_dir} has no {path.name} (the vocabulary the job trained with); copy it back from where the job ran."
        )
