"""Train-step benchmark: compile time, step time, tokens/s, model FLOP/s and MFU of the LM.

Runs the real train step (`equipax.launch.program.training.build_training`: the step `launch run`
executes, with the LM Task, the learner and the in-graph non-finite skip) on a fixed random
batch, so the figures cover grad + optimizer update + metrics and nothing of the input pipeline.
MFU is model FLOPs (analytic, `equipax.core.flops`, PaLM definition, no remat) per second over a
peak: the rate of a jitted f32 `a @ b` measured in the same run, and a theoretical peak given on
the command line (default: 156.5 GFLOP/s, a 2-core AVX2 Zen 3's f32 peak; benchmarks/README.md).

    uv run python benchmarks/train_step.py --presets default,20m,deep12 --steps 10 --warmup 2

Importable: `main(argv) -> dict` returns what it writes to `--out`.

The parts (benchmarks/lm_step/): the presets and their knob overrides (`presets`), timing one
step alone and what each side records (`measure`), the plain-JAX side's config and parameters
(`baseline`), the side-by-side comparison (`compare`) and the printed tables (`tables`); this
script is the command line over them.
"""

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file, `python benchmarks/train_step.py`: the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax

from benchmarks import op_profile
from benchmarks.lm_step.baseline import baseline_for
from benchmarks.lm_step.compare import compare_preset, isolated_compare, preset_record, run_side
from benchmarks.lm_step.measure import benchmark_preset, environment, measure_matmul
from benchmarks.lm_step.presets import (
    PRESETS,
    Preset,
    preset_config,
    resolve_attention,
    resolve_auto_remat,
    with_overrides,
)
from benchmarks.lm_step.tables import compare_table, table

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "train_step.json"
COMPARE_OUT = Path(__file__).resolve().parent / "results" / "train_step_compare.json"
# 2 cores x 32 f32 FLOP/cycle (2 AVX2 FMA units x 8 lanes x 2) x 2.445 GHz (benchmarks/README.md).
THEORETICAL_PEAK_GFLOPS = 156.5


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Benchmark the equipax LM train step (step time, tokens/s, model FLOP/s, MFU)."
    )
    p.add_argument(
        "--presets",
        default="default,20m,deep12",
        help=f"comma-separated presets, from {', '.join(PRESETS)} (default: %(default)s)",
    )
    p.add_argument("--steps", type=int, default=10, help="timed steps per preset")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after the compiling one")
    p.add_argument(
        "--scan",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="override TransformerConfig.scan_layers for every preset (default: keep the preset's)",
    )
    p.add_argument(
        "--remat",
        choices=("none", "full", "dots_saveable", "auto"),
        default=None,
        help="override model.transformer.remat for every preset, on both sides of --compare (auto: "
        "chosen by compiling, as `launch run` does; the plain side then runs the chosen policy) "
        "(default: keep the preset's)",
    )
    p.add_argument(
        "--plain-remat",
        choices=("none", "full", "dots_saveable", "dots_all_saveable"),
        default=None,
        help="--compare: the plain side's remat policy if not equipax's (dots_all_saveable: JAX's "
        "dots_saveable, which also saves the attention matmuls)",
    )
    p.add_argument(
        "--attention",
        choices=("xla", "splash", "auto"),
        default=None,
        help="override model.transformer.attention_impl on both sides (splash: TPU only; auto: what "
        "equipax picks on this platform) (default: keep the preset's)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="override model.dtype (the compute dtype; weights stay float32) on both sides",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KNOB=VALUE",
        help="an equipax knob for the experiment, as `launch run --set` takes it (repeatable), e.g. "
        "train.check_update_norm=False; the plain side has no knobs",
    )
    p.add_argument(
        "--plain-float32-logits",
        action="store_true",
        help="--compare: the plain side's XLA attention keeps its q.k logits in float32 out of the "
        "matmul, as equipax's does (default: rounded to the compute dtype before the softmax)",
    )
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="--compare: after timing, trace --profile-steps steps of each side with jax.profiler into "
        "DIR/<preset>/{equipax,plain} and print the per-op comparison (benchmarks/op_profile.py)",
    )
    p.add_argument("--profile-steps", type=int, default=3, help="steps traced per side with --profile")
    p.add_argument("--top", type=int, default=25, help="ops listed per preset with --profile")
    p.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--compare: run each side in its own process, one after the other (default: on for the "
        "chip presets, whose two train states do not fit one chip together; off = interleaved)",
    )
    p.add_argument("--side", choices=("equipax", "baseline"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--matmul-n", type=int, default=2048, help="size of the peak-rate matmul")
    p.add_argument("--matmul-repeats", type=int, default=5, help="timed peak-rate matmuls")
    p.add_argument(
        "--theoretical-peak-gflops",
        type=float,
        default=THEORETICAL_PEAK_GFLOPS,
        help="theoretical f32 peak of the machine for the second MFU (default: %(default)s, "
        "2-core Zen 3 of benchmarks/README.md); 0 to omit",
    )
    p.add_argument(
        "--warm-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compile and run one step of the 'tiny' preset first, unreported, so the first "
        "preset's compile time does not carry the process's one-time XLA start-up (~1.5 s)",
    )
    p.add_argument(
        "--compare",
        action="store_true",
        help="time the equipax step against the plain-JAX baseline (benchmarks/baseline_lm.py), "
        "interleaved in this process, and print the ratio per preset",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"JSON results file (default: {DEFAULT_OUT}, or {COMPARE_OUT} with --compare)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print a table, write the JSON results.

    Arguments:
        argv: command-line arguments (without the program name); None reads `sys.argv`.

    Returns:
        The results written to `--out`: `presets` (per preset, each with its `matmul`),
        `jax_version`, `device_kind`, `date` and the settings.
    """
    args = _parser().parse_args(argv)
    names = [n.strip() for n in args.presets.split(",") if n.strip()]
    unknown = [n for n in names if n not in PRESETS]
    if unknown or not names:
        raise SystemExit(f"--presets: expected names from {list(PRESETS)}, found {unknown or names!r}.")
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit(f"--steps must be >= 1 and --warmup >= 0; got {args.steps}, {args.warmup}.")

    if args.side is not None:
        return _main_side(args, names)
    if args.compare and _isolate(args, names):
        # This process must not open the device: each side's process needs it to itself.
        return _main_compare(args, names, isolate=True)
    device = jax.devices()[0]
    theo = args.theoretical_peak_gflops or None
    if args.warm_process:
        benchmark_preset(PRESETS["tiny"](), steps=1, warmup=0)
    if args.compare:
        return _main_compare(args, names, isolate=False)
    per_preset: dict[str, Any] = {}
    for name in dict.fromkeys(names):
        preset = _resolved(name, args)
        print(f"[{name}] {preset.description} ...", file=sys.stderr, flush=True)
        # The peak is measured next to each preset: on a shared machine the load drifts.
        matmul = measure_matmul(args.matmul_n, repeats=args.matmul_repeats)
        r = benchmark_preset(preset, steps=args.steps, warmup=args.warmup)
        r["matmul"] = matmul
        r["mfu_vs_measured"] = r["model_gflops_per_s"] / matmul["gflops"]
        r["mfu_vs_theoretical"] = r["model_gflops_per_s"] / theo if theo else None
        if theo and matmul["gflops"] > theo:
            print(
                f"[{name}] measured matmul {matmul['gflops']:.1f} GFLOP/s exceeds "
                f"--theoretical-peak-gflops={theo}: the peak is for another machine; pass "
                "this machine's peak (cores x FLOP/cycle x GHz).",
                file=sys.stderr,
            )
        per_preset[name] = r

    results = {
        "benchmark": "train_step",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax_version": jax.__version__,
        "backend": jax.default_backend(),
        "device_kind": device.device_kind,
        "num_devices": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "settings": {
            "steps": args.steps,
            "warmup": args.warmup,
            "scan_override": args.scan,
            "remat_override": args.remat,
            "warm_process": args.warm_process,
        },
        "theoretical_peak_gflops": theo,
        "matmul_n": args.matmul_n,
        "presets": per_preset,
    }
    print(table(results))
    return _write(results, args.out or DEFAULT_OUT)


def _resolved(name: str, args: argparse.Namespace) -> Preset:
    """The preset with the command line's overrides, "auto" attention and remat resolved."""
    preset = PRESETS[name]()
    preset = with_overrides(preset, scan=args.scan, remat=args.remat, attention=args.attention, dtype=args.dtype)
    if args.set:
        from equipax.core.knobs import apply_overrides

        cfg, _ = apply_overrides(preset_config(preset), args.set)
        # Both sides take the batch shape from the preset: `--set data.per_device_batch=16` (or
        # data.seq_len) changes it for the plain side too.
        seq_len = getattr(cfg.data, "seq_len", preset.seq_len)
        preset = dataclasses.replace(
            preset, model=cfg.model, experiment=cfg, batch_size=cfg.global_batch_size, seq_len=seq_len
        )
    if args.plain_float32_logits:
        preset = dataclasses.replace(preset, plain_float32_logits=True)
    return resolve_auto_remat(resolve_attention(preset))


def _isolate(args: argparse.Namespace, names: list[str]) -> bool:
    return args.isolate if args.isolate is not None else any(PRESETS[n]().chip for n in names)


def _main_side(args: argparse.Namespace, names: list[str]) -> dict[str, Any]:
    """One side of one preset in this process (what `isolated_compare` runs), JSON to --out."""
    if len(names) != 1 or args.out is None:
        raise SystemExit("--side runs one preset and needs --out.")
    preset = _resolved(names[0], args)
    bcfg = baseline_for(preset, remat=args.plain_remat)
    side = run_side(
        preset,
        args.side,
        steps=args.steps,
        warmup=args.warmup,
        profile_dir=args.profile,
        profile_steps=args.profile_steps,
        plain_remat=args.plain_remat,
    )
    results = {**preset_record(preset, bcfg, side["params"]), "side": side, "environment": environment()}
    return _write(results, args.out)


def _main_compare(args: argparse.Namespace, names: list[str], *, isolate: bool) -> dict[str, Any]:
    per_preset = {}
    for name in dict.fromkeys(names):
        if isolate:
            print(f"[{name}] equipax vs plain JAX, each in its own process ...", file=sys.stderr, flush=True)
            per_preset[name] = isolated_compare(name, args)
            continue
        preset = _resolved(name, args)
        print(f"[{name}] {preset.description}: equipax vs plain JAX ...", file=sys.stderr, flush=True)
        per_preset[name] = compare_preset(
            preset,
            steps=args.steps,
            warmup=args.warmup,
            profile_dir=args.profile,
            profile_steps=args.profile_steps,
            plain_remat=args.plain_remat,
        )
    env = next(iter(per_preset.values()))["environment"] if isolate else environment()
    results = {
        "benchmark": "train_step_compare",
        **env,
        "settings": {
            "steps": args.steps,
            "warmup": args.warmup,
            "scan_override": args.scan,
            "remat_override": args.remat,
            "plain_remat": args.plain_remat,
            "equipax_knobs": args.set,
            "plain_float32_logits": args.plain_float32_logits,
            "attention_override": args.attention,
            "dtype_override": args.dtype,
            "isolate": isolate,
        },
        "presets": per_preset,
    }
    print(compare_table(results))
    if args.profile is not None:
        results["op_profiles"] = {}
        for name, r in per_preset.items():
            traces = {label: r[side].get("trace") for label, side in (("equipax", "equipax"), ("plain", "baseline"))}
            if not all(traces.values()):
                print(f"[{name}] no trace file found: {traces}", file=sys.stderr)
                continue
            summary = op_profile.compare_traces(traces, steps=args.profile_steps, top=args.top)
            print(f"\n[{name}] per-op device time (benchmarks/op_profile.py)")
            print(op_profile.format_comparison(summary))
            out = args.profile / name / "op_profile.json"
            out.write_text(json.dumps(summary, indent=2) + "\n")
            results["op_profiles"][name] = str(out)
    return _write(results, args.out or COMPARE_OUT)


def _write(results: dict[str, Any], out: Path) -> dict[str, Any]:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return results


if __name__ == "__main__":
    main()
