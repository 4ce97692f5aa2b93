"""Ahead-of-time compile of an experiment's exact train step, for hardware you don't have.

`launch compile` simulates the experiment's full mesh with fake CPU devices (set before JAX
starts), builds the train state abstractly (no array is allocated), lowers and compiles the
real step, and reports parameters, per-device memory, model FLOPs, ideal step times on a
target accelerator, the collectives XLA inserted, and the compile's own cost.
"""

import dataclasses
import functools
import math
import re
import resource
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from equipax.core.config import ConfigError
from equipax.core.flops import lm_param_counts, transformer_lm_flops_per_token
from equipax.core.mesh import build_mesh
from equipax.core.optim import make_learner, make_schedule
from equipax.core.partition import batch_sharding, train_state_shardings
from equipax.core.step import init_train_state, make_train_step
from equipax.launch.experiments.config import ExperimentConfig
from equipax.models.lm import TransformerLM, lm_loss

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Target:
    """An accelerator: dense bf16 peak per chip and HBM per chip."""

    name: str
    peak_tflops: float
    hbm_gib: float


TARGETS = {
    t.name: t
    for t in (
        Target("tpu-v4", 275.0, 32.0),
        Target("tpu-v5e", 197.0, 16.0),
        Target("tpu-v5p", 459.0, 95.0),
        Target("tpu-v6e", 918.0, 32.0),
        Target("h100", 989.0, 80.0),
        Target("h200", 989.0, 141.0),
    )
}

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")


def count_collectives(hlo_text: str) -> dict[str, int]:
    """How many of each collective op the compiled HLO holds (async start ops count once)."""
    counts = {}
    for op in COLLECTIVES:
        # `all-gather(`, or the async pair `all-gather-start(` ... `all-gather-done(`.
        counts[op] = len(re.findall(rf"\b{op}(?:-start)?\(", hlo_text))
    return counts


def _per_device_bytes(abstract: Any) -> int:
    total = 0
    for leaf in jax.tree.leaves(abstract):
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            continue
        shard = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shard) * jnp.dtype(leaf.dtype).itemsize
    return total


def _abstract_with_shardings(tree: Any, shardings: Any) -> Any:
    arrays, static = eqx.partition(tree, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    placed = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), arrays, shardings)
    return eqx.combine(placed, static)


def compile_report(
    cfg: ExperimentConfig,
    *,
    target: Target,
    hbm_gib: float | None = None,
    assumed_mfu: float = 0.5,
    mesh: Mesh | None = None,
    log=print,
) -> dict[str, Any]:
    """Lower and compile `cfg`'s train step on `mesh` (default: built from the config).

    Arguments:
        cfg: the experiment.
        target: the accelerator the numbers are projected onto.
        hbm_gib: memory budget per device (default: the target's HBM).
        assumed_mfu: model FLOPs utilisation for the "realistic" step time.
        mesh: the mesh to compile for (default: `build_mesh(cfg.mesh)` on this process's devices).
        log: progress messages.

    Returns:
        The report (JSON-ready).
    """
    host_rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    mesh = mesh or build_mesh(cfg.mesh)
    optimizer = make_learner(cfg.learner)
    schedule = make_schedule(cfg.learner.schedule)

    def make_state(key):
        return init_train_state(TransformerLM(cfg.model, key=key), optimizer)

    log(f"Tracing the train state of {cfg.name} abstractly (nothing is allocated)...")
    abstract = eqx.filter_eval_shape(make_state, jax.random.key(0))
    shardings = train_state_shardings(abstract, optimizer, mesh)
    state = _abstract_with_shardings(abstract, shardings)
    data_sharding = batch_sharding(mesh)
    batch_shape = (cfg.global_batch_size, cfg.data.seq_len)
    batch = {
        "ids": jax.ShapeDtypeStruct(batch_shape, jnp.int32, sharding=data_sharding),
        "labels": jax.ShapeDtypeStruct(batch_shape, jnp.int32, sharding=data_sharding),
        "weights": jax.ShapeDtypeStruct(batch_shape, jnp.float32, sharding=data_sharding),
    }
    key = jax.eval_shape(lambda: jax.random.key(0))
    step = make_train_step(functools.partial(lm_loss, mesh=mesh), optimizer, schedule,
                           state_sharding=shardings, batch_sharding=data_sharding)

    log(f"Lowering and compiling the train step for {mesh.size} devices {dict(mesh.shape)}...")
    t0 = time.monotonic()
    lowered = step.lower(state, batch, key)
    t_lower = time.monotonic() - t0
    compiled = lowered.compile()
    t_compile = time.monotonic() - t0 - t_lower
    host_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    mem = compiled.memory_analysis()
    memory = {
        "argument_bytes": int(getattr(mem, "argument_size_in_bytes", 0)),
        "output_bytes": int(getattr(mem, "output_size_in_bytes", 0)),
        "alias_bytes": int(getattr(mem, "alias_size_in_bytes", 0)),
        "temp_bytes": int(getattr(mem, "temp_size_in_bytes", 0)),
        "generated_code_bytes": int(getattr(mem, "generated_code_size_in_bytes", 0)),
    }
    # Donated state aliases its outputs: count those bytes once.
    memory["total_bytes"] = (memory["argument_bytes"] + memory["output_bytes"] - memory["alias_bytes"]
                             + memory["temp_bytes"])
    budget = hbm_gib if hbm_gib is not None else target.hbm_gib
    fits = memory["total_bytes"] <= budget * GIB

    params = lm_param_counts(cfg.model.transformer, cfg.model.vocab_size)
    flops = transformer_lm_flops_per_token(cfg.model.transformer, vocab_size=cfg.model.vocab_size,
                                           seq_len=cfg.data.seq_len)
    tokens_per_step = cfg.global_batch_size * cfg.data.seq_len
    step_flops = flops["training"] * tokens_per_step
    peak_step_s = step_flops / (mesh.size * target.peak_tflops * 1e12)
    report = {
        "experiment": cfg.name,
        "devices": mesh.size,
        "mesh": dict(mesh.shape),
        "target": dataclasses.asdict(target),
        "params": {
            "total": params["total"],
            "embedding": params["embedding"],
            "per_layer": params["per_layer"],
            "per_device_param_bytes": _per_device_bytes(state.model),
            "per_device_optimizer_bytes": _per_device_bytes(state.opt_state),
        },
        "memory_per_device": {
            **memory,
            "budget_gib": budget,
            "fits": fits,
            "note": ("XLA:CPU's temporaries are an upper bound for an accelerator (no HBM-aware "
                     "scheduling or fusion of the accelerator backend)."),
        },
        "flops": {
            "model_flops_per_token": flops["training"],
            "six_n_per_token": 6.0 * params["total"],
            "attention_flops_per_token": 3.0 * flops["attention"],
            "remat_flops_per_token": flops["remat"],
            "model_flops_per_step": step_flops,
            "tokens_per_step": tokens_per_step,
        },
        "projection": {
            "ideal_step_s": peak_step_s,
            "ideal_tokens_per_s": tokens_per_step / peak_step_s,
            "assumed_mfu": assumed_mfu,
            "step_s_at_assumed_mfu": peak_step_s / assumed_mfu,
            "tokens_per_s_at_assumed_mfu": tokens_per_step / peak_step_s * assumed_mfu,
        },
        "collectives": count_collectives(compiled.as_text()),
        "compile": {
            "lower_s": t_lower,
            "compile_s": t_compile,
            "host_peak_rss_gib": host_rss * 1024 / GIB,
            "host_rss_growth_gib": (host_rss - host_rss0) * 1024 / GIB,
            "backend": jax.devices()[0].platform,
        },
    }
    return report


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
    lines = [
        f"{r['experiment']} on {r['devices']} devices {r['mesh']} (target {t['name']}: "
        f"{t['peak_tflops']:.0f} TFLOP/s bf16, {t['hbm_gib']:.0f} GiB HBM per chip)",
        f"  params        {p['total'] / 1e9:.3f}e9 total, {p['embedding'] / 1e6:.1f}M embedding, "
        f"{p['per_layer'] / 1e6:.1f}M per layer",
        f"  per device    params {p['per_device_param_bytes'] / GIB:.2f} GiB, optimizer state "
        f"{p['per_device_optimizer_bytes'] / GIB:.2f} GiB",
        f"  XLA memory    arguments {m['argument_bytes'] / GIB:.2f} GiB, outputs {m['output_bytes'] / GIB:.2f} "
        f"GiB (aliased {m['alias_bytes'] / GIB:.2f}), temporaries {m['temp_bytes'] / GIB:.2f} GiB",
        f"                total {m['total_bytes'] / GIB:.2f} GiB of {m['budget_gib']:.0f} GiB: "
        + ("fits" if m["fits"] else "DOES NOT FIT"),
        f"                ({m['note']})",
        f"  model FLOPs   {f['model_flops_per_token'] / 1e9:.2f} GFLOP/token (6N = "
        f"{f['six_n_per_token'] / 1e9:.2f}, attention {f['attention_flops_per_token'] / 1e9:.2f}), "
        f"{f['model_flops_per_step'] / 1e15:.2f} PFLOP/step; remat adds "
        f"{f['remat_flops_per_token'] / 1e9:.2f} GFLOP/token (not in MFU)",
        f"  at peak       {pr['ideal_step_s']:.3f} s/step, {pr['ideal_tokens_per_s']:,.0f} tokens/s",
        f"  at {pr['assumed_mfu']:.0%} MFU    {pr['step_s_at_assumed_mfu']:.3f} s/step, "
        f"{pr['tokens_per_s_at_assumed_mfu']:,.0f} tokens/s",
        "  collectives   " + ", ".join(f"{k} {v}" for k, v in r["collectives"].items()),
        f"  compile       lower {c['lower_s']:.1f} s + compile {c['compile_s']:.1f} s on {c['backend']}, "
        f"host peak RSS {c['host_peak_rss_gib']:.2f} GiB",
    ]
    return "\n".join(lines)
