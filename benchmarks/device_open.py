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


def run_child(mode: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT=")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"device_open.py: the {mode!r} child failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT=") :])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds of the three processes (medians reported)")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)
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
