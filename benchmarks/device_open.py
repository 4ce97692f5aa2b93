"""Opening the devices while `launch run` imports its training code: the overlap measured.

`launch run`'s "devices" phase is two pieces of work: importing the training code (orbax, the
models, the summaries) and starting JAX's backend (opening the accelerator). `launch run` starts
the backend on a background thread (`equipax.launch.cluster.devices.open_devices_early`) before
the imports. Each round runs three fresh processes, one after another (an accelerator takes one
program at a time), each timing from its first line (after `import jax`):

- `devices alone`: `jax.devices()` only (the backend's start by itself);
- `in turn`: the imports, then `jax.device_count()` (as before the change);
- `overlapped`: `open_devices_early()`, the imports, then `jax.device_count()` (as now).

Reports the median of each piece per mode (seconds) and writes them as JSON:

    uv run python benchmarks/device_open.py --rounds 3 --out /tmp/device_open.json

With `--variants`, each round instead runs `devices alone` once per environment named (`default`
for none; `NAME=VALUE[,NAME=VALUE]` otherwise: libtpu's settings, say
`TPU_PREMAPPED_BUFFER_SIZE=268435456`), in turn, and adds what the setting may cost: arrays of
each `--transfer-mib` size put on the device and read back one at a time, then `--many` arrays
of 256 MiB at once (as a checkpoint moves a state; the second of two of each, timed), and the
process's exit (its wall time after its last line):

    python3.11 benchmarks/device_open.py --rounds 2 --variants default TPU_PREMAPPED_BUFFER_SIZE=268435456
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file, `python benchmarks/device_open.py`: the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.records import header, write_json

CHILD = """
import json, sys, time
import jax
t0 = time.perf_counter()
mode = sys.argv[1]
if mode == "overlapped":
    from equipax.launch.cluster.devices import open_devices_early
    open_devices_early()
t1 = time.perf_counter()
if mode != "devices alone":
    import equipax.launch.training.loop  # what `launch run` imports before it needs the devices
t2 = time.perf_counter()
n = jax.device_count()
t3 = time.perf_counter()
print("RESULT=" + json.dumps({"imports_s": t2 - t1, "devices_wait_s": t3 - t2, "total_s": t3 - t0,
                              "devices": n, "platform": jax.devices()[0].platform}))
"""

MODES = ("devices alone", "in turn", "overlapped")

# `--variants`: the backend's start alone, then a transfer each way, every time from the
# process's own start (`time.time()`, so the parent can count the exit too).
VARIANT_CHILD = """
import json, os, sys, time
import numpy as np
import jax
t_import = time.time()
devices = jax.devices()
t_open = time.time()
moves = {}
for size in [int(x) for x in sys.argv[1].split(",")] + [-int(sys.argv[2])]:  # -N: N arrays of 256 MiB at once
    count, mib = (1, size) if size > 0 else (-size, 256)
    host = [np.full((mib * 2**20 // 4,), i, np.float32) for i in range(count)]
    for _ in range(2):  # the second of two, timed
        t0 = time.time(); x = jax.device_put(host, devices[0]); jax.block_until_ready(x); t1 = time.time()
        back = jax.device_get(x); t2 = time.time()
    moves[f"{mib} MiB" if count == 1 else f"{count} x {mib} MiB"] = {"to_device_s": t1 - t0, "to_host_s": t2 - t1}
    del host, x, back
print("RESULT=" + json.dumps({"import_jax_at": t_import, "open_s": t_open - t_import, "moves": moves,
                              "env": {name: os.environ.get(name) for name in sys.argv[3].split(",") if name},
                              "last_line_at": time.time(), "devices": len(devices),
                              "platform": devices[0].platform, "kind": devices[0].device_kind}))
"""


def parse_variant(text: str) -> dict[str, str]:
    """`default` -> {}; `A=1,B=2` -> {"A": "1", "B": "2"}."""
    if text == "default":
        return {}
    pairs = [item.split("=", 1) for item in text.split(",")]
    if any(len(pair) != 2 or not pair[0] for pair in pairs):
        raise SystemExit(f"device_open.py: --variants takes `default` or NAME=VALUE[,NAME=VALUE]; got {text!r}")
    return dict(pairs)


def run_variant(text: str, transfer_mib: str, many: int) -> dict:
    import time

    started = time.time()
    names = ",".join(parse_variant(text))
    got = _child(text, [VARIANT_CHILD, transfer_mib, str(many), names], parse_variant(text))
    ended = time.time()
    imported, last_line = got.pop("import_jax_at"), got.pop("last_line_at")
    return {**got, "start_to_import_s": imported - started, "exit_s": ended - last_line, "wall_s": ended - started}


def main_variants(variants: list[str], rounds: int, transfer_mib: str, many: int, out: Path | None) -> dict:
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(rounds):
        for v in variants:
            runs[v].append(run_variant(v, transfer_mib, many))
            print(f"round {r + 1}/{rounds} {v}: {runs[v][-1]}", flush=True)
    keys = ("start_to_import_s", "open_s", "exit_s", "wall_s")
    moves = list(runs[variants[0]][0]["moves"])
    medians = {
        v: {
            **{k: statistics.median(x[k] for x in runs[v]) for k in keys},
            **{
                f"{m} {way}": statistics.median(x["moves"][m][f"to_{way}_s"] for x in runs[v])
                for m in moves
                for way in ("device", "host")
            },
        }
        for v in variants
    }
    print(f"medians of {rounds} (s):")
    for v in variants:
        print(f"  {v}: " + ", ".join(f"{k.removesuffix('_s')} {val:.2f}" for k, val in medians[v].items()))
    result = {
        **header(),
        "transfer_mib": transfer_mib,
        "many": many,
        "rounds": rounds,
        "medians": medians,
        "runs": runs,
    }
    return write_json(out, result)


def _child(label: str, args: list[str], env: dict[str, str] | None = None) -> dict:
    """`python -c args[0] args[1:]` in a fresh process (`env` added to this one's environment): its
    `RESULT=` line, or SystemExit naming `label` with the child's stderr."""
    import os

    proc = subprocess.run(
        [sys.executable, "-c", *args], capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})}
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT=")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"device_open.py: the {label!r} child failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT=") :])


def run_child(mode: str) -> dict:
    return _child(mode, [CHILD, mode])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds of the three processes (medians reported)")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    p.add_argument("--variants", nargs="+", default=None, help="environments to open the devices under (see above)")
    p.add_argument(
        "--transfer-mib", default="64,256,1024", help="with --variants: the arrays moved each way (MiB, one at a time)"
    )
    p.add_argument("--many", type=int, default=8, help="with --variants: then this many arrays of 256 MiB at once")
    args = p.parse_args(argv)
    if args.variants:
        return main_variants(args.variants, args.rounds, args.transfer_mib, args.many, args.out)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in MODES:
            runs[mode].append(run_child(mode))
            print(f"round {r + 1}/{args.rounds} {mode}: {runs[mode][-1]}", flush=True)
    keys = ("imports_s", "devices_wait_s", "total_s")
    medians = {m: {k: statistics.median(x[k] for x in runs[m]) for k in keys} for m in MODES}
    print(f"{'mode':<14} {'imports':>8} {'devices wait':>13} {'total':>8}  (s, medians of {args.rounds})")
    for m in MODES:
        row = medians[m]
        print(f"{m:<14} {row['imports_s']:8.2f} {row['devices_wait_s']:13.2f} {row['total_s']:8.2f}")
    result = {
        **header(),
        "platform": runs["devices alone"][0]["platform"],
        "devices": runs["devices alone"][0]["devices"],
        "rounds": args.rounds,
        "medians": medians,
        "runs": runs,
    }
    return write_json(args.out, result)


if __name__ == "__main__":
    main()
