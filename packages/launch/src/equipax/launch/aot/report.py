"""Ahead-of-time compile of an experiment's exact train step, for hardware you don't have.

`launch compile` builds the experiment's full mesh, either of a real TPU topology's devices
(`--topology`, compiled by XLA:TPU from libtpu; `equipax.launch.hardware.tpu`) or of fake CPU devices
(set before JAX starts), builds the train state abstractly (no array is allocated), lowers and
compiles the real step, and reports parameters, per-device memory (one stage's share for a
pipelined model, with its stages, microbatches and bubble: `equipax.launch.aot.pipeline_report`), model
FLOPs, ideal step times on a target accelerator, the collectives XLA inserted, and the compile's
own cost.
"""

import hashlib
import re
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh

from equipax.core.knobs import ConfigError, flatten
from equipax.core.mesh import build_mesh
from equipax.launch.aot.compile_step import compile_step, per_device_bytes
from equipax.launch.aot.context_report import comparison_lines
from equipax.launch.aot.hlo_cost import Roofline
from equipax.launch.aot.memory import MEMORY_NOTES
from equipax.launch.aot.pipeline_report import pipeline_lines, pipeline_section
from equipax.launch.aot.remat import choose_remat, format_remat_table, is_auto
from equipax.launch.configs.experiment import ExperimentConfig
from equipax.launch.hardware.accelerators import Accelerator
from equipax.launch.program.attention import attention_record
from equipax.launch.program.training import build_training
from equipax.launch.tasks import family

__all__ = [
    "check_compile_devices",
    "COLLECTIVES",
    "compile_report",
    "count_collectives",
    "count_custom_calls",
    "count_matmuls",
    "format_report",
    "GIB",
    "stablehlo_fingerprint",
]

GIB = 2**30


# send/recv: XLA:TPU moves data between slices (over DCN) with them.
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all", "send", "recv")


def count_collectives(hlo_text: str) -> dict[str, int]:
    """How many of each collective op the compiled HLO holds (async start ops count once)."""
    counts = {}
    for op in COLLECTIVES:
        # `all-gather(`, or the async pair `all-gather-start(` ... `all-gather-done(`.
        counts[op] = len(re.findall(rf"\b{op}(?:-start)?\(", hlo_text))
    return counts


def count_matmuls(hlo_text: str) -> dict[str, int]:
    """Matmuls in a compiled program (XLA:TPU writes one as a `convolution`, XLA:CPU as a `dot`; an op
    in a loop body counts once): `total`, and `int8`, those of int8 operands (`model.quantization=
    "int8"`): an s8 first operand, or an s32 result (XLA:TPU may convert the sums in the op itself,
    XLA:CPU may feed it a converted copy)."""
    types = dict(re.findall(r"%([\w.-]+) = (\w+)\[", hlo_text))
    ops = re.findall(r"= (\w+)\[[^\n=]*? (?:convolution|dot)\(%([\w.-]+)", hlo_text)
    return {"total": len(ops), "int8": sum(1 for out, lhs in ops if out == "s32" or types.get(lhs) == "s8")}


def count_custom_calls(stablehlo_text: str) -> dict[str, int]:
    """Custom calls in a lowered program by target: fused kernels (`tpu_custom_call` = a Pallas/Mosaic
    kernel such as splash attention; `__cudnn$fmha...` = cuDNN attention) and XLA helpers."""
    counts: dict[str, int] = {}
    for name in re.findall(r"custom_call @([\w$.-]+)", stablehlo_text):
        counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))


def stablehlo_fingerprint(lowered: Any) -> str:
    """SHA-256 of a lowered program's StableHLO text (equal programs, equal fingerprints)."""
    return hashlib.sha256(lowered.as_text().encode()).hexdigest()


def compile_report(
    cfg: ExperimentConfig,
    *,
    target: Accelerator,
    hbm_gib: float | None = None,
    assumed_mfu: float = 0.5,
    mesh: Mesh | None = None,
    topology: dict[str, Any] | None = None,
    log: Callable[[str], object] = print,
    cache: Path | None = None,
    init: bool = False,
) -> dict[str, Any]:
    """Lower and compile `cfg`'s train step (the one `launch run` executes) on `mesh`.

    Arguments:
        cfg: the experiment.
        target: the accelerator the numbers are projected onto.
        hbm_gib: memory budget per device (default: `train.hbm_gib_per_device`, else what the
            target's allocator allows where measured, else its HBM).
        assumed_mfu: model FLOPs utilisation for the "realistic" step time.
        mesh: the mesh to compile for (default: `build_mesh(cfg.mesh)` on this process's devices).
        topology: what the mesh's devices are, when they are a real TPU topology (reported as is).
        log: progress messages.
        cache: the job's `remat_auto.json`, where `remat="auto"` keeps its choice (None: none).
        init: also compile the train state's initialisation as `launch run` does
            (`Training.compile_init`), for JAX's persistent compilation cache; its seconds are
            the report's `compile.init_s`.

    Returns:
        The report (JSON-ready); with `remat="auto"`, the report of the chosen policy's step and
        the candidates (`remat`).
    """
    host_rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    mesh = mesh or build_mesh(cfg.mesh)
    budget = (
        hbm_gib if hbm_gib is not None else cfg.train.hbm_gib_per_device or target.allocatable_gib or target.hbm_gib
    )
    remat = None
    if is_auto(cfg):
        target_info = {"name": target.name, "topology": topology, "budget_gib": budget}
        remat = choose_remat(
            cfg, mesh, budget_gib=budget, margin=cfg.train.hbm_margin,
            roofline=Roofline.of(target, cfg.train.peak_tflops_per_device),
            target=target_info, cache=cache, log=log,
        )  # fmt: skip
        cfg = remat.cfg
    if remat is not None and remat.compiled is not None:
        step = remat.compiled  # the chosen candidate was just compiled: not again
    else:
        log(f"Tracing the train state of {cfg.name} abstractly (nothing is allocated)...")
        training = build_training(cfg, mesh, feeds_batches=False)
        log(f"Lowering and compiling the train step for {mesh.size} devices {dict(mesh.shape)}...")
        step = compile_step(training)
    lowered, compiled, memory, state = step.lowered, step.compiled, step.memory, step.training.abstract_state
    init_s = None
    if init:
        log("Compiling the train state's initialisation...")
        t0 = time.monotonic()
        step.training.compile_init()
        init_s = time.monotonic() - t0
    host_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    device = mesh.devices.flat[0]
    numbers = family(cfg).numbers(cfg)
    report: dict[str, Any] = {
        "experiment": cfg.name,
        "devices": mesh.size,
        "mesh": dict(mesh.shape),
        "target": {"name": target.name, "peak_tflops": target.peak_tflops, "hbm_gib": target.hbm_gib},
        "params": {
            "total": numbers["params_total"],
            "embedding": numbers.get("params_embedding"),
            "per_layer": numbers.get("params_per_layer"),
            "per_device_param_bytes": per_device_bytes(state.model),
            "per_device_optimizer_bytes": per_device_bytes(state.opt_state),
        },
        "pipeline": pipeline_section(numbers),  # None unless pipeline_stages > 1
        "memory_per_device": {
            **memory,
            "budget_gib": budget,
            "fits": memory["total_bytes"] <= budget * GIB and "compiler_refused" not in memory,
            "note": MEMORY_NOTES.get(device.platform, MEMORY_NOTES["cpu"]),
        },
        "flops": None,
        "projection": None,
        "collectives": count_collectives(compiled.as_text()) if compiled is not None else None,
        "matmuls": count_matmuls(compiled.as_text()) if compiled is not None else None,
        "custom_calls": count_custom_calls(lowered.as_text()),
        "stablehlo_sha256": stablehlo_fingerprint(lowered),
        "compile": {
            "lower_s": step.lower_s,
            "compile_s": step.compile_s,
            "compile_cpu_s": step.compile_cpu_s,
            "init_s": init_s,
            "host_peak_rss_gib": host_rss * 1024 / GIB,
            "host_rss_growth_gib": (host_rss - host_rss0) * 1024 / GIB,
            "backend": device.platform,
            "device_kind": device.device_kind,
        },
        "topology": topology,
        "remat": remat.record() if remat is not None else None,
        "attention": attention_record(cfg, mesh),
    }
    if "model_flops_per_step" in numbers:
        report["flops"], report["projection"] = _flops_and_projection(cfg, numbers, mesh.size, target, assumed_mfu)
    return report


def _flops_and_projection(
    cfg: ExperimentConfig, numbers: dict[str, Any], devices: int, target: Accelerator, assumed_mfu: float
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Model FLOPs (PaLM: no remat) and the step time they imply on `target`."""
    from equipax.launch.tasks.lm_family import flops_per_token  # the families with model FLOPs are LMs

    flops = flops_per_token(cfg)
    step_flops, tokens_per_step = numbers["model_flops_per_step"], numbers["tokens_per_step"]
    peak_step_s = step_flops / (devices * target.peak_tflops * 1e12)
    # model.quantization int8 / fp8: the block's projections, forward and backward, run quantized
    # (docs/quantization.md); the peak above stays the bf16 one, as MFU is counted.
    quantization = flatten(cfg).get("model.quantization", "none")
    projections = flops.get("qkv_projection", 0.0) + flops.get("output_projection", 0.0) + flops.get("mlp", 0.0)
    quantized = projections / flops["forward"] if quantization in ("int8", "fp8") and flops["forward"] else 0.0
    return {
        "model_flops_per_token": flops["training"],
        # N = the parameters one token uses (a mixture of experts' active ones).
        "six_n_per_token": 6.0 * numbers.get("params_active", numbers["params_total"]),
        "attention_flops_per_token": 3.0 * flops["attention"],
        "remat_flops_per_token": flops["remat"],
        "model_flops_per_step": step_flops,
        "tokens_per_step": tokens_per_step,
        "quantization": quantization,
        "quantized_flops_share": quantized,
    }, {
        "ideal_step_s": peak_step_s,
        "ideal_tokens_per_s": tokens_per_step / peak_step_s,
        "assumed_mfu": assumed_mfu,
        "step_s_at_assumed_mfu": peak_step_s / assumed_mfu,
        "tokens_per_s_at_assumed_mfu": tokens_per_step / peak_step_s * assumed_mfu,
    }


def check_compile_devices(cfg: ExperimentConfig) -> None:
    """Raise ConfigError if this process cannot hold the experiment's mesh."""
    if jax.device_count() != cfg.mesh.num_devices:
        raise ConfigError(
            f"launch compile needs {cfg.mesh.num_devices} devices for {cfg.name} but this process "
            f"has {jax.device_count()}; JAX had already started. Run `launch compile` in a fresh "
            "process (it simulates the mesh with CPU devices by itself)."
        )


def format_report(r: dict[str, Any]) -> str:
    """A readable multi-line summary of `compile_report`'s output."""
    p, m, f, pr, c = r["params"], r["memory_per_device"], r["flops"], r["projection"], r["compile"]
    t = r["target"]
    params = f"  params        {p['total'] / 1e9:.3f}e9 total"
    if p["embedding"] is not None:
        params += f", {p['embedding'] / 1e6:.1f}M embedding, {p['per_layer'] / 1e6:.1f}M per layer"
    topo = r.get("topology")
    where = (
        f"{topo['num_slices']} x {topo['slice']} ({topo['topology']}, {c['device_kind']})"
        if topo
        else f"simulated {c['backend']} devices"
    )
    peak = f"; {c['backend'].upper()} heap peak {m['peak_bytes'] / GIB:.2f} GiB + code" if m.get("peak_bytes") else ""
    lines = [
        f"{r['experiment']} on {r['devices']} devices {r['mesh']}: {where}",
        f"  target        {t['name']}: {t['peak_tflops']:.0f} TFLOP/s bf16, {t['hbm_gib']:.0f} GiB HBM per chip",
        params,
        f"  per device    params {p['per_device_param_bytes'] / GIB:.2f} GiB, optimizer state "
        f"{p['per_device_optimizer_bytes'] / GIB:.2f} GiB" + (", one stage's share" if r.get("pipeline") else ""),
        *(pipeline_lines(r["pipeline"]) if r.get("pipeline") else []),
        f"  XLA memory    arguments {m['argument_bytes'] / GIB:.2f} GiB, outputs {m['output_bytes'] / GIB:.2f} "
        f"GiB (aliased {m['alias_bytes'] / GIB:.2f}), temporaries {m['temp_bytes'] / GIB:.2f} GiB, "
        f"code {m.get('generated_code_bytes', 0) / GIB:.2f} GiB",
        f"                total {m['total_bytes'] / GIB:.2f} GiB of {m['budget_gib']:g} GiB: "
        + ("fits" if m["fits"] else "DOES NOT FIT")
        + peak,
        f"                ({m['note']})",
    ]
    if "compiler_refused" in m:
        lines.insert(-1, f"                the compiler refused the program: {m['compiler_refused']}")
    if r.get("without_context"):
        lines += comparison_lines(r, r["without_context"])
    if (attention := r.get("attention")) and attention["value"] == "auto":
        lines += [
            f"  attention     auto -> {attention['kernel']} ({attention['platform']}, seq {attention['seq_len']})"
        ]
    if r.get("remat"):
        remat = r["remat"]
        how = f"cached in the {remat['cached']}'s cache" if remat["cached"] else f"{remat['search_s']:.1f} s"
        lines += [f"  remat         auto -> {remat['policy']}: {remat['reason']} ({how})"]
        if remat["candidates"]:
            lines += [format_remat_table(remat["candidates"], remat["budget_bytes"], remat["policy"], remat["own"])]
            roof = remat["roofline"]
            int8 = f" (int8 {roof['int8_peak_flops'] / 1e12:.0f} TOP/s)" if roof.get("int8_peak_flops") else ""
            lines += [f"                (projected at {roof['peak_flops'] / 1e12:.0f} TFLOP/s{int8} and "
                      f"{roof['hbm_bytes_per_s'] / 1e9:.0f} GB/s of HBM, {roof['name']}: each kernel of the "
                      "compiled program at its roofline)"]  # fmt: skip
    if cache := r.get("cache"):
        n = cache["programs_written"]
        written = "programs written to" if n is None else f"{n} programs written to" if n else "all already in"
        on = f"{topo['num_slices']} x {topo['slice']}" if topo else "these devices"
        lines += [
            f"  cache         {written} {cache['dir']} (JAX's compilation cache: `launch run` of this experiment "
            f"on {on} with the same JAX, jaxlib and libtpu loads them instead of compiling)"
        ]
    if f is not None and pr is not None:
        lines += [
            f"  model FLOPs   {f['model_flops_per_token'] / 1e9:.2f} GFLOP/token (6N = "
            f"{f['six_n_per_token'] / 1e9:.2f}, attention {f['attention_flops_per_token'] / 1e9:.2f}), "
            f"{f['model_flops_per_step'] / 1e15:.2f} PFLOP/step; remat adds "
            f"{f['remat_flops_per_token'] / 1e9:.2f} GFLOP/token (not in MFU)",
            *(
                [
                    f"  quantized     {f['quantized_flops_share']:.0%} of the model FLOPs in "
                    f"{f['quantization']} (model.quantization; the peak below is the bf16 one)"
                    + (
                        f"; {r['matmuls']['int8']} of the program's {r['matmuls']['total']} matmuls int8"
                        if r.get("matmuls")
                        else ""
                    )
                ]
                if f.get("quantized_flops_share")
                else []
            ),
            f"  at peak       {pr['ideal_step_s']:.3f} s/step, {pr['ideal_tokens_per_s']:,.0f} tokens/s",
            f"  at {pr['assumed_mfu']:.0%} MFU    {pr['step_s_at_assumed_mfu']:.3f} s/step, "
            f"{pr['tokens_per_s_at_assumed_mfu']:,.0f} tokens/s",
        ]
    collectives = r["collectives"]
    lines += [
        "  collectives   "
        + (
            ", ".join(f"{k} {v}" for k, v in collectives.items())
            if collectives is not None
            else "(none: the program was not compiled)"
        ),
        "  custom calls  " + (", ".join(f"{k} {v}" for k, v in r.get("custom_calls", {}).items()) or "none"),
        f"  program       StableHLO sha256 {r['stablehlo_sha256'][:16]}... (the step `launch run` executes)",
        f"  compile       lower {c['lower_s']:.1f} s + compile {c['compile_s']:.1f} s "
        f"({c.get('compile_cpu_s', 0):.0f} s CPU) by XLA:{c['backend'].upper()}, "
        f"host peak RSS {c['host_peak_rss_gib']:.2f} GiB",
    ]
    return "\n".join(lines)
