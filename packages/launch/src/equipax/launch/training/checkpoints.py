"""Orbax checkpoints of the train state and the data iterator's state.

The train state (an Equinox module) is saved as a flat `{path: array}` dict of its array
leaves, so the checkpoint is readable without our classes and a shape mismatch can be
reported by name before anything is restored. Saves are asynchronous; orbax writes a step into
`<step>.orbax-checkpoint-tmp-*` and renames it when complete, so a killed save never shows up as
a restorable step (leftover temporary directories are removed when the next run starts). A step
directory that still fails to restore (damaged files) is moved to `<job>/corrupt_checkpoints/` and
the previous step is used instead (`restore_latest`).
"""

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np
import orbax.checkpoint as ocp

from equipax.core.config import ConfigError

PyTree = Any


class CheckpointSaveError(Exception):
    """Writing a checkpoint failed (disk full, permissions); the message says what is intact."""


def _flat_arrays(tree: PyTree) -> dict[str, Any]:
    arrays = eqx.filter(tree, eqx.is_array)
    flat, _ = jax.tree_util.tree_flatten_with_path(arrays)
    return {jax.tree_util.keystr(path): leaf for path, leaf in flat}


def _unflatten_into(template: PyTree, flat: dict[str, Any]) -> PyTree:
    arrays, static = eqx.partition(template, eqx.is_array)
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(arrays)
    leaves = [flat[jax.tree_util.keystr(p)] for p, _ in leaves_with_path]
    return eqx.combine(jax.tree_util.tree_unflatten(treedef, leaves), static)


class Checkpointer:
    """Save and restore (train state, data iterator state) under `directory`.

    Arguments:
        directory: the job's `checkpoints/` folder.
        keep: how many recent checkpoints to keep.
    """

    def __init__(self, directory: Path, *, keep: int):
        self.directory = Path(directory).absolute()
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                 enable_async_checkpointing=True,
                                                 cleanup_tmp_directories=True),
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "data": ocp.JsonCheckpointHandler(),
                "loop": ocp.JsonCheckpointHandler(),
            },
        )

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state: PyTree, data_state: dict[str, Any],
             loop_state: dict[str, Any] | None = None) -> None:
        """Start an asynchronous save of `state`, `data_state` and `loop_state` at `step`.

        Raises:
            CheckpointSaveError: this save (or the previous, asynchronous one) could not be written.
        """
        try:
            self._manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(_flat_arrays(state)),  # pyright: ignore[reportCallIssue]
                    data=ocp.args.JsonSave(data_state),  # pyright: ignore[reportCallIssue]
                    loop=ocp.args.JsonSave(loop_state or {}),  # pyright: ignore[reportCallIssue]
                ),
                force=True,
            )
        except Exception as e:
            raise self._save_error(step, e) from e

    def _save_error(self, step: int | None, e: Exception) -> CheckpointSaveError:
        try:
            self._manager.reload()
            intact = self._manager.latest_step()
        except Exception:
            intact = None
        what = f"the checkpoint of step {step}" if step is not None else "a checkpoint"
        kept = (f"The newest complete checkpoint, step {intact}, is intact" if intact is not None
                else "No complete checkpoint exists yet")
        return CheckpointSaveError(
            f"Could not write {what} to {self.directory}: {type(e).__name__}: {e}. {kept}. Free disk "
            "space (or fix the directory's permissions) and run the same command again to resume."
        )

    def wait(self) -> None:
        """Block until every started save is complete on disk."""
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            raise self._save_error(None, e) from e

    def restore_latest(
        self, template: PyTree, *, log: Callable[[str], object] = print
    ) -> tuple[int, PyTree, dict[str, Any], dict[str, Any]] | None:
        """Restore the newest checkpoint that restores; None when there is none.

        A step that fails to restore (damaged or missing files) is moved to
        `<job>/corrupt_checkpoints/` (kept for inspection, never deleted) and the next older
        step is tried, with a message. A shape mismatch is not damage: it raises ConfigError.

        Returns:
            (step, state, data_state, loop_state).
        """
        for step in sorted(self._manager.all_steps(), reverse=True):
            try:
                self.check_compatible(step, template)
            except ConfigError:
                raise
            except Exception as e:
                self._set_aside(step, e, log)
                continue
            try:
                state, data_state = self.restore(step, template)
                loop_state = self._restore_loop(step)
            except ConfigError:
                raise
            except Exception as e:
                self._set_aside(step, e, log)
                continue
            return step, state, data_state, loop_state
        return None

    def _restore_loop(self, step: int) -> dict[str, Any]:
        if not (self.directory / str(step) / "loop").exists():
            return {}  # written before the loop item existed
        restored = self._manager.restore(
            step, args=ocp.args.Composite(loop=ocp.args.JsonRestore()))  # pyright: ignore[reportCallIssue]
        return dict(restored["loop"] or {})

    def _set_aside(self, step: int, e: Exception, log: Callable[[str], object]) -> None:
        source = self.directory / str(step)
        target = self.directory.parent / "corrupt_checkpoints" / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
        if jax.process_index() == 0 and source.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(source), str(target))
        self._manager.reload()
        first = (str(e).strip().splitlines() or [""])[0][:200]
        log(f"warning: the checkpoint of step {step} does not restore ({type(e).__name__}: {first}); "
            f"moved it to {target} and trying the previous one.")

    def check_compatible(self, step: int, template: PyTree) -> None:
        """Raise ConfigError naming every array whose shape/dtype differs from `template`."""
        meta = self._manager.item_metadata(step)
        saved = meta["state"] if meta is not None else None
        if saved is None:
            return
        expected = {k: (tuple(v.shape), str(v.dtype)) for k, v in _flat_arrays(template).items()}
        found = {k: (tuple(v.shape), str(v.dtype)) for k, v in dict(saved).items()}
        diffs = []
        for k in sorted(set(expected) | set(found)):
            e, f = expected.get(k), found.get(k)
            if e != f:
                diffs.append(f"  {k}: checkpoint {f or 'missing'}, this config {e or 'missing'}")
        if diffs:
            shown = "\n".join(diffs[:10]) + ("\n  ..." if len(diffs) > 10 else "")
            raise ConfigError(
                f"The checkpoint at step {step} in {self.directory} was written by a model with "
                f"different shapes ({len(diffs)} arrays differ):\n{shown}\n"
                "Point --job-log-dir at a new directory to start fresh, or restore the knobs "
                "recorded in that job's config.json."
            )

    def restore(self, step: int, template: PyTree) -> tuple[PyTree, dict[str, Any]]:
        """Restore the checkpoint at `step` into the structure and shardings of `template`.

        Returns:
            (state, data_state).
        """
        self.check_compatible(step, template)
        flat_template = _flat_arrays(template)
        abstract = {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
            for k, v in flat_template.items()
        }
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract),  # pyright: ignore[reportCallIssue]
                data=ocp.args.JsonRestore(),  # pyright: ignore[reportCallIssue]
            ),
        )
        state = _unflatten_into(template, dict(restored["state"]))
        return state, dict(restored["data"])

    def close(self) -> None:
        self.wait()
        self._manager.close()


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON file's content, or None if it does not exist."""
    if not path.exists():
        return None
    return json.loads(path.read_text())


def tree_digest(tree: PyTree) -> str:
    """A short hash of all array leaves (to compare runs bit for bit in logs/tests)."""
    import hashlib

    h = hashlib.sha256()
    for k, v in sorted(_flat_arrays(tree).items()):
        h.update(k.encode())
        if isinstance(v, jax.Array) and not v.is_fully_addressable:
            # Sharded across processes: every process gathers the whole array (a collective).
            from jax.experimental import multihost_utils

            v = multihost_utils.process_allgather(v, tiled=True)
        h.update(np.asarray(v).tobytes())
    return h.hexdigest()[:16]
