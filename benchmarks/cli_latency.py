"""CLI latency: whole-process wall time of `launch` commands that do not train.

Each command runs as a fresh `python -m equipax.launch.cli ...` process (what `uv run launch`
executes, without uv's own start-up), `--repeats` times, commands interleaved round by round so
that a change in the machine's load hits all of them alike. Reports the median and the range, the
load average before and after, and which heavy modules each command imported (it must be none
of JAX, grain, orbax: see the "CLI latency" section of benchmarks/README.md).

    uv run python benchmarks/cli_latency.py --repeats 5
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

COMMANDS: dict[str, list[str]] = {
    "--help": ["--help"],
    "list": ["list"],
    "show --exp shakespeare_tiny": ["show", "--exp", "shakespeare_tiny"],
    "show --exp nosuch (error)": ["show", "--exp", "nosuch"],
    "run --set nosuch=1 (error)": ["run", "--exp", "shakespeare_tiny", "--set", "nosuch=1"],
}
HEAVY = ("jax", "grain", "orbax", "optax", "equinox")
# Runs the CLI, then reports which heavy top-level modules it imported (after the command's exit).
PROBE = (
    "import atexit, sys\n"
    "atexit.register(lambda: print('HEAVY=' + ','.join(sorted({m.split('.')[0] for m in sys.modules}"
    " & set(sys.argv[1].split(',')))), file=sys.stderr))\n"
    "heavy = sys.argv.pop(1)\n"
    "from equipax.launch.cli import main\n"
    "sys.argv[0] = 'launch'\n"
    "main()\n"
)


def run_once(args: list[str]) -> tuple[float, str]:
    """Wall seconds of one whole process, and the heavy modules it imported."""
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", PROBE, ",".join(HEAVY), *args], capture_output=True, text=True)
    wall = time.perf_counter() - t
    heavy = next((ln[6:] for ln in proc.stderr.splitlines() if ln.startswith("HEAVY=")), "?")
    return wall, heavy


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5, help="processes per command (median reported)")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)
    load_before = os.getloadavg()
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    heavy: dict[str, str] = {}
    for _ in range(args.repeats):
        for name, cmd in COMMANDS.items():
            wall, imported = run_once(cmd)
            times[name].append(wall)
            heavy[name] = imported
    load_after = os.getloadavg()
    results = {
        "load_before": load_before,
        "load_after": load_after,
        "repeats": args.repeats,
        "commands": {
            name: {"median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts), "heavy_imports": heavy[name]}
            for name, ts in times.items()
        },
    }
    print(f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f}; {args.repeats} processes each")
    print(f"{'command':32s} {'median s':>9s} {'min s':>7s} {'max s':>7s}  heavy imports")
    for name, r in results["commands"].items():
        print(f"{name:32s} {r['median_s']:9.2f} {r['min_s']:7.2f} {r['max_s']:7.2f}  {r['heavy_imports'] or 'none'}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
