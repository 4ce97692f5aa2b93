"""Orbax checkpoints of the train state and the data iterator's state.

The train state (an Equinox module) is saved as a flat `{path: array}` dict of its array
leaves, so the checkpoint is readable without our classes and a shape mismatch can be
reported by name before anything is restored. Saves are asynchronous; orbax writes a step into
`<step>.orbax-checkpoint-tmp-*` and renames it when complete, so a killed save never shows up as
a restorable step (leftover temporary directories are removed when the next run starts). In an
object store (`gs://`, `s3://`: no atomic rename) orbax writes the step in place and its
`commit_success.txt` last (`orbax_s3.manager_options`); a step without that marker is never restored. A step
directory that still fails to restore (damaged files) is moved to `<job>/corrupt_checkpoints/` and
the previous step is used instead (`restore_latest`). Each checkpoint also records the checksum
of every array and JSON item it holds (`checksums.py`) and what the saved state means (`meta`:
experiment, tokenizer, data, batch; `equipax.launch.training.resume_checks` compares it); a
restore whose checksums do not match what was saved is treated like damaged files. A checkpoint may
hold the model alone, without the optimizer state (`launch convert hf-import`'s step 0): it restores
with `opt_state=None`, and the run starts the optimizer from its model (`Training.start_optimizer`).
"""

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import orbax.checkpoint as ocp

from equipax.core.knobs import ConfigError
from equipax.core.trees import flat_arrays, unflatten_into
from equipax.launch.cluster.distributed import barrier as barrier_all
from equipax.launch.failures import CheckpointSaveError
from equipax.launch.jobdir.checksums import (
    ALGORITHM,
    ChecksumMismatch,
    array_checksums,
    json_checksum,
    unverified_warning,
    verify,
)
from equipax.launch.jobdir.host_transfer import transfer_in_waves
from equipax.launch.jobdir.orbax_quiet import QuietOrbaxErrors, quiet_process, restore_failure
from equipax.launch.jobdir.save_errors import save_error
from equipax.launch.store.orbax_s3 import manager_options
from equipax.launch.store.storage import AnyPath, is_remote, job_path, move

__all__ = ["MIN_REPLICA_SLICE_BYTES", "Checkpointer", "read_json", "split_only_large_replicated_arrays"]

PyTree = Any

# Where a train state's optimizer state is in a checkpoint (`flat_arrays`' names start with it).
OPT_STATE = ".opt_state"


# A replicated array's copies are split among its replicas, each writing a part, only where a part
# holds at least this many bytes. Orbax's default splits every replicated array: each part is an
# eager slice on the device, a program compiled per shape and replica, at the first save of every
# process (on 8 CPU devices, a toy model's first checkpoint compiled hundreds of them: about 3 s of
# a 16 s run), and a part of a few kilobytes saves nothing in the write. Arrays whose parts reach
# the threshold are still written cooperatively by all their replicas (hosts), as before.
MIN_REPLICA_SLICE_BYTES = 1 << 20


def split_only_large_replicated_arrays() -> None:
    """Set `MIN_REPLICA_SLICE_BYTES` on orbax's own jax.Array handler (only on orbax's default
    handler: one a user registered is kept). What is written, and how it is read back, is
    unchanged; only which replica writes which bytes.

    The handler is tuned where it is, not replaced: registering a new one over the default makes
    orbax log `Type handler registry type "<class 'jax.Array'>" overriding jax.Array` (absl, a
    warning) in every process that checkpoints. An orbax whose handler keeps the setting under
    another name is left untuned (the saves are the same, the first one slower)."""
    handler = ocp.type_handlers.get_type_handler(jax.Array)
    if type(handler) is ocp.type_handlers.ArrayHandler and hasattr(handler, "_min_slice_bytes_for_replica_parallel"):
        handler._min_slice_bytes_for_replica_parallel = MIN_REPLICA_SLICE_BYTES  # pyright: ignore[reportAttributeAccessIssue]


class Checkpointer:
    """Save and restore (train state, data iterator state) under `directory`.

    Arguments:
        directory: the job's `checkpoints/` folder.
        keep: how many recent checkpoints to keep.
        meta: JSON-ready description of what the saved state means (saved with every checkpoint
            and handed to `restore_latest`'s `check_meta`).
    """

    def __init__(self, directory: AnyPath, *, keep: int, meta: dict[str, Any] | None = None) -> None:
        path = job_path(directory)
        self.directory: AnyPath = path if is_remote(path) else Path(path).absolute()
        self.meta: dict[str, Any] = dict(meta or {})
        self._in_flight: int | None = None  # the step of the asynchronous save not yet waited for
        self._saved_sums: tuple[tuple[int, ...], dict[str, str]] | None = None  # the last save's checksums
        self._closed = False
        self._quiet = QuietOrbaxErrors()
        logging.getLogger("absl").addFilter(self._quiet)
        quiet_process()  # for the process: orbax's callbacks and futures outlive this checkpointer
        split_only_large_replicated_arrays()
        transfer_in_waves()  # a TPU's copy to the host in waves that fit libtpu's buffer
        options = dict(max_to_keep=keep, create=True, enable_async_checkpointing=True, cleanup_tmp_directories=True)
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=manager_options(self.directory, **options),
            item_handlers={
                # Uncompressed: zstd saved ~8% of a float32 state's bytes for 1.7x the read time and up
                # to 3.5x the write time (benchmarks/README.md, "Start-up"); both kinds restore.
                "state": ocp.PyTreeCheckpointHandler(use_compression=False),
                "data": ocp.JsonCheckpointHandler(),
                "loop": ocp.JsonCheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler(),
                "digests": ocp.JsonCheckpointHandler(),
            },
        )

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(
        self, step: int, state: PyTree, data_state: dict[str, Any], loop_state: dict[str, Any] | None = None
    ) -> None:
        """Start an asynchronous save of `state`, `data_state` and `loop_state` at `step`.

        Raises:
            CheckpointSaveError: this save (or the previous, asynchronous one) could not be written.
        """
        self.wait()  # a failure of the previous asynchronous save is reported with its own step
        flat = flat_arrays(state)
        loop_state = loop_state or {}
        self._saved_sums = (_identity(flat), array_checksums(flat))
        digests = {
            "algorithm": ALGORITHM,
            "arrays": self._saved_sums[1],
            "data": json_checksum(data_state),
            "loop": json_checksum(loop_state),
            "meta": json_checksum(self.meta),
        }
        try:
            self._manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeSave(flat),  # pyright: ignore[reportCallIssue]
                    data=ocp.args.JsonSave(data_state),  # pyright: ignore[reportCallIssue]
                    loop=ocp.args.JsonSave(loop_state),  # pyright: ignore[reportCallIssue]
                    meta=ocp.args.JsonSave(self.meta),  # pyright: ignore[reportCallIssue]
                    digests=ocp.args.JsonSave(digests),  # pyright: ignore[reportCallIssue]
                ),
                force=True,
            )
        except Exception as e:
            raise self._save_error(step, e) from e
        self._in_flight = step

    def checksums(self, state: PyTree) -> dict[str, str]:
        """`array_checksums` of `state`'s arrays: those recorded by the last save when it saved these
        very arrays (the final state, saved at the last step), else computed now."""
        flat = flat_arrays(state)
        if self._saved_sums is not None and self._saved_sums[0] == _identity(flat):
            return self._saved_sums[1]
        return array_checksums(flat)

    def _save_error(self, step: int | None, e: Exception) -> CheckpointSaveError:
        try:
            self._manager.reload()
            intact = self._manager.latest_step()
        except Exception:
            intact = None
        return save_error(self.directory, step, e, intact=intact)

    def wait(self) -> None:
        """Block until every started save is complete on disk.

        Raises:
            CheckpointSaveError: the asynchronous save in flight failed (the message names its step).
        """
        step, self._in_flight = self._in_flight, None
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            raise self._save_error(step, e) from e

    def restore_latest(
        self,
        template: PyTree,
        *,
        log: Callable[[str], object] = print,
        check_meta: Callable[[dict[str, Any], int], None] | None = None,
    ) -> tuple[int, PyTree, dict[str, Any], dict[str, Any]] | None:
        """Restore the newest checkpoint that restores and verifies; None when there is none.

        A step that fails to restore (damaged or missing files) or whose content does not match
        the checksums recorded when it was saved is moved to `<job>/corrupt_checkpoints/` (kept
        for inspection, never deleted) and the next older step is tried, with a message. A shape
        mismatch is not damage: it raises ConfigError, as does `check_meta`.

        Arguments:
            template: a state of the structure, shapes and shardings to restore into.
            log: warnings go here.
            check_meta: called with the checkpoint's saved `meta` (when it has one) and its step
                before anything is restored; raises ConfigError when this run may not resume it.

        Returns:
            (step, state, data_state, loop_state).
        """
        for step in sorted(self._manager.all_steps(), reverse=True):
            try:
                meta = self._read_meta(step)
                if check_meta is not None and meta is not None:
                    check_meta(meta, step)
                self.check_compatible(step, template)
                state, data_state, loop_state = self._restore_verified(step, template)
            except ConfigError:
                raise
            except Exception as e:
                self._set_aside(step, e, log)
                continue
            if not self._has(step, "digests"):
                log(unverified_warning(step, self.directory))
            return step, state, data_state, loop_state
        return None

    def _has(self, step: int, item: str) -> bool:
        return (self.directory / str(step) / item).exists()

    def _read_json(self, step: int, item: str) -> dict[str, Any] | None:
        if not self._has(step, item):
            return None  # written before checkpoints had this item
        restored = self._manager.restore(step, args=ocp.args.Composite(**{item: ocp.args.JsonRestore()}))  # pyright: ignore[reportCallIssue]
        return dict(restored[item] or {})

    def _read_meta(self, step: int) -> dict[str, Any] | None:
        meta = self._read_json(step, "meta")
        digests = self._read_json(step, "digests")
        if meta is not None and digests is not None and digests.get("meta") not in (None, json_checksum(meta)):
            raise ChecksumMismatch("its meta item does not match the checksum recorded when it was saved")
        return meta

    def _set_aside(self, step: int, e: Exception, log: Callable[[str], object]) -> None:
        source = self.directory / str(step)
        target = self.directory.parent / "corrupt_checkpoints" / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
        if jax.process_index() == 0 and source.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            move(source, target)
        self._manager.reload()
        log(
            f"warning: the checkpoint of step {step} does not restore ({restore_failure(e)}); "
            f"moved it to {target} and trying the previous one."
        )

    def set_aside_from(self, step: int) -> tuple[int | None, list[int], str]:
        """Move the checkpoints of `step` and later to `<job>/unstable_checkpoints/` (kept, never
        deleted), so the newest one left is where a rerun resumes.

        Returns:
            (the newest checkpoint left or None, the steps moved, the folder they went to).
        """
        self.wait()
        target = self.directory.parent / "unstable_checkpoints"
        moved = [s for s in self.all_steps() if s >= step]
        if jax.process_index() == 0:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            for s in moved:
                target.mkdir(parents=True, exist_ok=True)
                move(self.directory / str(s), target / f"{s}-{stamp}")
        barrier_all("set_aside_unstable")
        self._manager.reload()
        return self._manager.latest_step(), moved, str(target)

    def _saved_arrays(self, step: int) -> dict[str, Any] | None:
        """`{name: array metadata}` of the checkpoint's state, or None where orbax has none."""
        meta = self._manager.item_metadata(step)
        saved = meta["state"] if meta is not None else None
        return None if saved is None else dict(saved)

    def check_compatible(self, step: int, template: PyTree) -> None:
        """Raise ConfigError naming every array whose shape/dtype differs from `template`."""
        saved = self._saved_arrays(step)
        if saved is None:
            return
        template = _as_saved(template, saved)
        expected = {k: (tuple(v.shape), str(v.dtype)) for k, v in flat_arrays(template).items()}
        found = {k: (tuple(v.shape), str(v.dtype)) for k, v in saved.items()}
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
        """Restore and verify the checkpoint at `step` into the structure and shardings of `template`.

        Returns:
            (state, data_state).

        Raises:
            ChecksumMismatch: what was read back differs from what was saved.
        """
        state, data_state, _ = self._restore_verified(step, template)
        return state, data_state

    def _restore_verified(self, step: int, template: PyTree) -> tuple[PyTree, dict[str, Any], dict[str, Any]]:
        self.check_compatible(step, template)
        saved = self._saved_arrays(step)
        template = template if saved is None else _as_saved(template, saved)
        abstract = {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in flat_arrays(template).items()
        }
        items: dict[str, Any] = {
            "state": ocp.args.PyTreeRestore(  # pyright: ignore[reportCallIssue]
                item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract)
            ),
            "data": ocp.args.JsonRestore(),
        }  # pyright: ignore[reportCallIssue]
        for name in ("loop", "digests"):  # absent from checkpoints written before they existed
            if self._has(step, name):
                items[name] = ocp.args.JsonRestore()  # pyright: ignore[reportCallIssue]
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        flat, data_state = dict(restored["state"]), dict(restored["data"])
        loop_state = dict(restored["loop"] or {}) if "loop" in items else {}
        if "digests" in items:
            verify(dict(restored["digests"] or {}), flat, data_state, loop_state)
        return unflatten_into(template, flat), data_state, loop_state

    def close(self) -> None:
        """Wait for the save in flight, then release orbax's manager (again: nothing)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            self._manager.close()
            logging.getLogger("absl").removeFilter(self._quiet)


def _as_saved(template: PyTree, saved: dict[str, Any]) -> PyTree:
    """`template` (a train state), with `opt_state=None` where the checkpoint holds the model alone
    (no optimizer-state array, where the template has some)."""
    has_optimizer = lambda names: any(k.startswith(OPT_STATE) for k in names)  # noqa: E731
    if has_optimizer(saved) or not has_optimizer(flat_arrays(template)):
        return template
    return eqx.tree_at(lambda s: s.opt_state, template, None)


def _identity(flat: dict[str, Any]) -> tuple[int, ...]:
    """Which array objects `flat` holds (alive while compared, so their ids are unique)."""
    return tuple(id(flat[k]) for k in sorted(flat))


def read_json(path: AnyPath) -> dict[str, Any] | None:
    """A JSON file's content, or None if it does not exist."""
    if not path.exists():
        return None
    return json.loads(path.read_text())
