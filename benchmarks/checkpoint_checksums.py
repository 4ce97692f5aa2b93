"""What checkpoint checksums cost: save and restore of a preset's train state, with and without them.

Every checkpoint records a checksum of each saved array (`equipax.launch.jobdir.checksums`: by
numpy for arrays in the host's memory, CPU devices included; by a small device program on
accelerators) and verifies it on restore. This measures, on a `benchmarks/train_step.py`
preset (default: 20m, the ~20M-parameter LM with its Adam state), the time of:
  - computing the checksums of the whole state (warm: on an accelerator, the small device program
    is compiled once), and the device program alone on the same arrays, first call (compile
    included) and warm (on CPU devices `array_checksums` itself takes numpy),
  - a checkpoint save, from the call until the asynchronous write is on disk (with checksums),
  - a restore with verification, and the same restore with verification switched off.
Prints a table and writes JSON:

    uv run python benchmarks/checkpoint_checksums.py --preset 20m --repeats 5 \
        --out benchmarks/results/checkpoint_checksums.json

`--save-path MB` instead times the end of a run's save path on a state of MB megabytes of
float32 normal numbers in 10 arrays (the device program sums them: what an accelerator runs):
the checksums, a checkpoint save as `launch run` writes it (uncompressed) against orbax's default
zstd, their restores, `np.save` of the same bytes with a `sync` (the disk's own speed), and a
SHA-256 of every byte on the host (what the final digest cost before it hashed the checksums).
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file, `python benchmarks/checkpoint_checksums.py`: the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax


def _median_s(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(preset_name: str, *, repeats: int) -> dict[str, Any]:
    """Median seconds of each operation on `preset_name`'s initial train state."""
    import equipax.launch.jobdir.checkpoints as ckpt_module
    from benchmarks.lm_step.presets import PRESETS, preset_training
    from equipax.core.trees import flat_arrays
    from equipax.launch.jobdir.checkpoints import Checkpointer
    from equipax.launch.jobdir.checksums import array_checksums

    training = preset_training(PRESETS[preset_name]())
    state = training.init_state()
    flat = flat_arrays(state)
    nbytes = sum(x.nbytes for x in flat.values())
    import numpy as np

    from equipax.launch.jobdir.checksums import _checksums

    # The device program on the same arrays (what accelerators run; on CPU devices `array_checksums`
    # takes numpy): its first call, compile included, then warm.
    leaves = [flat[k] for k in sorted(flat)]
    t0 = time.perf_counter()
    np.asarray(_checksums(leaves))
    program_first_s = time.perf_counter() - t0
    program_s = _median_s(lambda: np.asarray(_checksums(leaves)), repeats)
    array_checksums(flat)  # compile (accelerators)
    checksum_s = _median_s(lambda: array_checksums(flat), repeats)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Checkpointer(Path(tmp) / "checkpoints", keep=2)
        step = iter(range(1, 10_000))

        def save() -> None:
            ckpt.save(next(step), state, {"position": 0})
            ckpt.wait()

        save()  # warm
        save_s = _median_s(save, repeats)
        latest = ckpt.latest_step()
        assert latest is not None
        ckpt.restore(latest, state)  # warm
        restore_s = _median_s(lambda: jax.block_until_ready(ckpt.restore(latest, state)), repeats)
        verify = ckpt_module.verify  # the restore's checksum check, switched off to time it
        ckpt_module.verify = lambda *args: None
        try:
            unverified_s = _median_s(lambda: jax.block_until_ready(ckpt.restore(latest, state)), repeats)
        finally:
            ckpt_module.verify = verify
        ckpt.close()
    return {
        "preset": preset_name,
        "device": jax.devices()[0].device_kind,
        "arrays": len(flat),
        "state_mb": round(nbytes / 1e6, 1),
        "repeats": repeats,
        "checksums_s": round(checksum_s, 4),
        "checksums_gb_per_s": round(nbytes / checksum_s / 1e9, 2),
        "device_program_first_call_s": round(program_first_s, 4),
        "device_program_warm_s": round(program_s, 4),
        "save_with_checksums_s": round(save_s, 4),
        "checksums_share_of_save": round(checksum_s / save_s, 3),
        "restore_verified_s": round(restore_s, 4),
        "restore_unverified_s": round(unverified_s, 4),
        "verify_share_of_restore": round((restore_s - unverified_s) / restore_s, 3),
    }


def save_path(mb: int, *, repeats: int) -> dict[str, Any]:
    """Median seconds of the save path's parts on a state of `mb` megabytes (module docstring)."""
    import hashlib
    import os

    import numpy as np
    import orbax.checkpoint as ocp

    from equipax.launch.jobdir import checksums
    from equipax.launch.jobdir.checkpoints import Checkpointer

    key = jax.random.key(0)
    rows = mb * 2**20 // 4 // 10 // 1024
    state = {f"a{i}": jax.random.normal(jax.random.fold_in(key, i), (rows, 1024)) for i in range(10)}
    jax.block_until_ready(state)
    nbytes = sum(x.nbytes for x in state.values())
    checksums.HOST_CHECKSUM_MAX_BYTES = 0  # the device program, as on an accelerator
    checksums.array_checksums(state)  # compile
    out: dict[str, Any] = {"state_mb": round(nbytes / 1e6, 1), "repeats": repeats}
    out["checksums_s"] = _median_s(lambda: checksums.array_checksums(state), repeats)

    def sha256() -> None:
        h = hashlib.sha256()
        for k in sorted(state):
            h.update(np.asarray(state[k]).tobytes())

    out["host_sha256_s"] = _median_s(sha256, repeats)
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()}
    with tempfile.TemporaryDirectory() as tmp:
        host = jax.device_get(state)

        def raw() -> None:
            for k, v in host.items():
                np.save(Path(tmp) / f"{k}.npy", v)
            os.sync()

        out["np_save_sync_s"] = _median_s(raw, repeats)
        step = iter(range(1, 10_000))
        ckpt = Checkpointer(Path(tmp) / "uncompressed", keep=1)
        out["save_s"] = _median_s(lambda: (ckpt.save(next(step), state, {}), ckpt.wait()), repeats)
        latest = ckpt.latest_step()
        out["restore_s"] = _median_s(lambda: jax.block_until_ready(ckpt.restore(latest, abstract)), repeats)
        ckpt.close()
        zstd = ocp.CheckpointManager(
            Path(tmp) / "zstd",
            options=ocp.CheckpointManagerOptions(max_to_keep=1, create=True),
            item_handlers={"state": ocp.StandardCheckpointHandler()},
        )
        args = ocp.args.Composite(state=ocp.args.StandardSave(state))  # pyright: ignore[reportCallIssue]
        out["zstd_save_s"] = _median_s(lambda: (zstd.save(next(step), args=args), zstd.wait_until_finished()), repeats)
        restore = ocp.args.Composite(state=ocp.args.StandardRestore(abstract))  # pyright: ignore[reportCallIssue]
        zlatest = zstd.latest_step()
        out["zstd_restore_s"] = _median_s(
            lambda: jax.block_until_ready(zstd.restore(zlatest, args=restore)["state"]), repeats
        )
        zstd.close()
        for name in ("uncompressed", "zstd"):
            files = (f for f in (Path(tmp) / name).rglob("*") if f.is_file())
            out[f"{name}_mb_on_disk"] = round(sum(f.stat().st_size for f in files) / 1e6, 1)
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="20m")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--save-path", type=int, default=None, metavar="MB", help="time the save path instead")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    a = p.parse_args()
    figures = save_path(a.save_path, repeats=a.repeats) if a.save_path else measure(a.preset, repeats=a.repeats)
    for k, v in figures.items():
        print(f"{k:28s} {v}")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
