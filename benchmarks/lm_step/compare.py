"""The equipax train step against the plain-JAX one (`benchmarks/baseline_lm.py`) on the same
parameters and batch: interleaved in one process (`compare_preset`), or each side alone in a
process of its own (`run_side`, which `isolated_compare` runs through `train_step.py --side`)."""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from benchmarks import baseline_lm
from benchmarks.lm_step.baseline import baseline_for, baseline_params
from benchmarks.lm_step.measure import (
    CompileTimer,
    model_flops_per_step,
    peak_hbm_bytes,
    peak_tflops,
    random_batch,
    summary,
    timed,
    trace_steps,
)
from benchmarks.lm_step.presets import Preset, preset_training
from equipax.core.flops import count_params

# The script `isolated_compare` runs each side in (`--side`, a process per side).
TRAIN_STEP_SCRIPT = Path(__file__).resolve().parents[1] / "train_step.py"


def side_figures(preset: Preset, times: Sequence[float], dispatch: Sequence[float]) -> dict[str, Any]:
    med = statistics.median(times)
    tokens = preset.batch_size * preset.seq_len
    peak = peak_tflops()
    model_flops = model_flops_per_step(preset)
    return {
        "step_s": summary(times),
        "dispatch_ms": statistics.median(dispatch) * 1e3,
        "tokens_per_s": tokens / med,
        "model_tflops_per_s": model_flops / med / 1e12,
        "mfu": model_flops / med / (peak * 1e12) if peak else None,
    }


def preset_record(preset: Preset, bcfg: Any, params: int) -> dict[str, Any]:
    """What a comparison's JSON says of its preset: size, work per step, the device's peak, both
    sides' remat, the attention kernel and the dtype (`bcfg`: the baseline's config)."""
    return {
        "description": preset.description,
        "params": params,
        "tokens_per_step": preset.batch_size * preset.seq_len,
        "model_flops_per_step": model_flops_per_step(preset),
        "peak_tflops": peak_tflops(),
        "remat": {"equipax": preset.model.transformer.remat, "baseline": bcfg.remat},
        "attention_impl": preset.model.transformer.attention_impl,
        "dtype": preset.model.dtype,
    }


def compare_preset(
    preset: Preset,
    *,
    steps: int,
    warmup: int,
    profile_dir: Path | None = None,
    profile_steps: int = 3,
    plain_remat: str | None = None,
) -> dict[str, Any]:
    """Time the equipax step against the plain-JAX baseline, interleaved, on the same batch.

    Both start from the same parameters (the baseline's are converted from the equipax model),
    so their first losses agree; each timed round runs one step of each, alternating which
    goes first. `ratio` is the median over rounds of baseline time / equipax time (> 1: equipax
    faster); `dispatch_ms` is the host time until the call returned (before the device is done).

    Arguments:
        preset: the model and batch.
        steps: timed rounds.
        warmup: untimed rounds after the compiling calls.
        profile_dir: if set, trace `profile_steps` steps of each side afterwards into
            `profile_dir/equipax` and `profile_dir/plain`.
        profile_steps: steps traced per side.
        plain_remat: the plain side's remat policy, if not the preset's.

    Returns:
        Per side (`equipax`, `baseline`): compile seconds, step and dispatch medians, tokens/s,
        MFU, first and last loss (and `trace`); plus `ratio`, `ratio_iqr`, `max_first_loss_diff`
        and the process's `peak_hbm_bytes` (both sides together: see `isolated_compare`).
    """
    bcfg = baseline_for(preset, remat=plain_remat)
    training = preset_training(preset)
    train_step, step_key = training.train_step, training.keys.step
    state = training.init_state()
    params = baseline_params(state.model)
    optimizer = baseline_lm.make_optimizer(bcfg, training.learner.schedule)
    opt_state = optimizer.init(params)
    base_step = baseline_lm.make_step(bcfg, optimizer)
    batch = random_batch(preset, jax.random.key(1))
    jax.block_until_ready((state, params, opt_state, batch))

    def run_equipax():
        nonlocal state
        state, metrics = train_step(state, batch, step_key)
        return metrics["loss"]

    def run_baseline():
        nonlocal params, opt_state
        params, opt_state, loss = base_step(params, opt_state, batch)
        return loss

    sides = {"equipax": run_equipax, "baseline": run_baseline}
    out: dict[str, dict[str, Any]] = {name: {} for name in sides}
    for name, fn in sides.items():
        with CompileTimer() as timer:
            loss, _, wall = timed(fn)
        out[name] |= {"compile_s": sum(timer.totals.values()), "first_step_s": wall, "first_loss": float(loss)}
    times: dict[str, list[float]] = {name: [] for name in sides}
    dispatch: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(warmup + steps):
        order = list(sides) if i % 2 == 0 else list(sides)[::-1]
        for name in order:
            loss, host_s, wall_s = timed(sides[name])
            if i >= warmup:
                times[name].append(wall_s)
                dispatch[name].append(host_s)
            out[name]["last_loss"] = float(loss)
    for name in sides:
        out[name] |= side_figures(preset, times[name], dispatch[name])
        if profile_dir is not None:
            where = profile_dir / preset.name / ("plain" if name == "baseline" else name)
            out[name]["trace"] = trace_steps(sides[name], where, profile_steps)
    ratios = [b / e for b, e in zip(times["baseline"], times["equipax"])]
    q1, q3 = np.percentile(ratios, [25, 75])
    return {
        **preset_record(preset, bcfg, count_params(state.model)),
        **out,
        "ratio": statistics.median(ratios),
        "ratio_iqr": float(q3 - q1),
        "max_first_loss_diff": abs(out["equipax"]["first_loss"] - out["baseline"]["first_loss"]),
        "peak_hbm_bytes": peak_hbm_bytes(),
        "mode": "interleaved",
        "steps": steps,
        "warmup": warmup,
    }


def run_side(
    preset: Preset,
    side: str,
    *,
    steps: int,
    warmup: int,
    profile_dir: Path | None = None,
    profile_steps: int = 3,
    plain_remat: str | None = None,
) -> dict[str, Any]:
    """One side of the comparison alone in this process (`--side`): build, compile, time, trace.

    The plain side starts from the equipax model's initial parameters (the same init key, so the
    same numbers), built without the equipax optimizer state, then freed: its peak memory is
    its own step's.

    Arguments:
        preset: the model and batch (remat and attention already resolved).
        side: "equipax" or "baseline".
        steps, warmup, profile_dir, profile_steps, plain_remat: as `compare_preset`.

    Returns:
        The side's figures (as one side of `compare_preset`) with `params` and `peak_hbm_bytes`.
    """
    import equinox as eqx

    training = preset_training(preset)
    batch = random_batch(preset, jax.random.key(1))
    if side == "equipax":
        train_step, step_key = training.train_step, training.keys.step
        state = training.init_state()
        n_params = count_params(state.model)

        def run():
            nonlocal state
            state, metrics = train_step(state, batch, step_key)
            return metrics["loss"]

    else:
        bcfg = baseline_for(preset, remat=plain_remat)
        model, _ = eqx.filter_jit(training.task.init)(training.keys.init)
        n_params = count_params(model)
        params = baseline_params(model)
        del model
        optimizer = baseline_lm.make_optimizer(bcfg, training.learner.schedule)
        opt_state = jax.jit(optimizer.init)(params)
        base_step = baseline_lm.make_step(bcfg, optimizer)

        def run():
            nonlocal params, opt_state
            params, opt_state, loss = base_step(params, opt_state, batch)
            return loss

    label = f"[{preset.name}:{'plain' if side == 'baseline' else side}]"
    print(f"{label} compiling and running the first step ...", file=sys.stderr, flush=True)
    with CompileTimer() as timer:
        loss, _, wall = timed(run)
    out: dict[str, Any] = {"compile_s": sum(timer.totals.values()), "first_step_s": wall, "first_loss": float(loss)}
    print(f"{label} first step {wall:.1f} s, loss {float(loss):.4f}; timing ...", file=sys.stderr, flush=True)
    times, dispatch = [], []
    for i in range(warmup + steps):
        loss, host_s, wall_s = timed(run)
        if i >= warmup:
            times.append(wall_s)
            dispatch.append(host_s)
    out["last_loss"] = float(loss)
    out |= side_figures(preset, times, dispatch)
    print(
        f"{label} {out['step_s']['median_s'] * 1e3:.1f} ms/step, {out['tokens_per_s']:,.0f} tokens/s",
        file=sys.stderr,
        flush=True,
    )
    out["peak_hbm_bytes"] = peak_hbm_bytes()
    if profile_dir is not None:
        where = profile_dir / preset.name / ("plain" if side == "baseline" else side)
        out["trace"] = trace_steps(run, where, profile_steps)
        print(f"{label} trace: {out['trace']}", file=sys.stderr, flush=True)
    out["params"] = n_params
    return out


def isolated_compare(preset_name: str, args: argparse.Namespace) -> dict[str, Any]:
    """`compare_preset` with each side in its own process of `train_step.py --side`, one after
    the other: on one accelerator chip the two train states do not fit together, and each side's
    peak HBM is then its own. This process never touches the device (a chip is held by one
    process at a time). `ratio` = plain median / equipax median (the sides are not paired)."""
    out: dict[str, Any] = {}
    remat = args.remat
    with tempfile.TemporaryDirectory() as tmp:
        for side in ("equipax", "baseline"):
            result = Path(tmp) / f"{side}.json"
            cmd = [sys.executable, str(TRAIN_STEP_SCRIPT), "--side", side, "--presets", preset_name]
            cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--out", str(result)]
            cmd += ["--no-warm-process", "--profile-steps", str(args.profile_steps)]
            for flag, value in (("--attention", args.attention), ("--dtype", args.dtype), ("--remat", remat)):
                if value is not None:
                    cmd += [flag, value]
            if args.plain_remat is not None:
                cmd += ["--plain-remat", args.plain_remat]
            for knob in args.set:
                cmd += ["--set", knob]
            if args.plain_float32_logits:
                cmd.append("--plain-float32-logits")
            if args.scan is not None:
                cmd.append("--scan" if args.scan else "--no-scan")
            if args.profile is not None:
                cmd += ["--profile", str(args.profile)]
            print(f"[{preset_name}] {side} in its own process ...", file=sys.stderr, flush=True)
            subprocess.run(cmd, check=True)
            out[side] = json.loads(result.read_text())
            # The plain side runs the policy "auto" chose for equipax (and the same kernel).
            remat = out[side]["remat"]["equipax"]
    e, b = out["equipax"], out["baseline"]
    return {
        **{k: e[k] for k in ("description", "params", "tokens_per_step", "model_flops_per_step", "peak_tflops")},
        "remat": {"equipax": e["remat"]["equipax"], "baseline": b["remat"]["baseline"]},
        "attention_impl": e["attention_impl"],
        "dtype": e["dtype"],
        "equipax": e["side"],
        "baseline": b["side"],
        "ratio": b["side"]["step_s"]["median_s"] / e["side"]["step_s"]["median_s"],
        "ratio_iqr": None,
        "max_first_loss_diff": abs(e["side"]["first_loss"] - b["side"]["first_loss"]),
        "mode": "isolated",
        "environment": e["environment"],
        "steps": args.steps,
        "warmup": args.warmup,
    }
