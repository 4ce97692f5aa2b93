"""`model.transformer.remat="auto"`: the cheapest remat policy whose compiled train step fits.

Each candidate policy, from the least recomputation to the most (`REMAT_POLICIES`: none,
dots_saveable, save_attention_out, offload_attention_out where the backend has host memory
spaces, full), is lowered and compiled for the experiment's real target (the devices of
`launch run`, or the TPU topology / simulated devices of `launch compile`) until one fits the
memory budget less a margin: that one is chosen, since the candidates only get slower from there
(their recomputed FLOPs grow). The table (policy, bytes per device, fits, projected step time
from the model FLOPs plus the recomputed ones) is printed and recorded, and the choice is cached
in the job directory (`remat_auto.json`) per experiment and target, so a rerun compiles only the
chosen step. docs/compile.md, "Choosing remat by compiling", shows it.
"""

import dataclasses
import hashlib
import json
from collections.abc import Callable
from typing import Any

import jax

from equipax.core.configs import REMAT_POLICIES
from equipax.core.knobs import ConfigError, set_knob, to_dict
from equipax.launch.aot.compile_step import compile_step
from equipax.launch.configs.experiment import ExperimentConfig
from equipax.launch.jobdir.storage import AnyPath, write_atomic

__all__ = ["CACHE_FILE", "candidate_policies", "choose_remat", "format_remat_table", "is_auto", "RematChoice"]

KNOB = "model.transformer.remat"
CACHE_FILE = "remat_auto.json"
# Offloading to pinned host memory compiles where the backend has that memory space.
_OFFLOAD_PLATFORMS = ("tpu", "gpu", "cuda", "rocm")
GIB = 2**30


def is_auto(cfg: ExperimentConfig) -> bool:
    """Whether `cfg` asks for its remat policy to be chosen by compiling."""
    transformer = getattr(cfg.model, "transformer", None)
    return getattr(transformer, "remat", None) == "auto"


def candidate_policies(platform: str) -> tuple[str, ...]:
    """The policies `auto` tries on `platform`, least recomputation first."""
    return tuple(p for p in REMAT_POLICIES if p != "offload_attention_out" or platform in _OFFLOAD_PLATFORMS)


@dataclasses.dataclass(frozen=True)
class RematChoice:
    """What `choose_remat` found.

    Attributes:
        cfg: the experiment with the chosen policy in place of "auto".
        policy: the chosen policy.
        table: one row per candidate (JSON-ready): policy, total_bytes (None = not compiled: a
            cheaper one fits), fits, remat_flops_per_step, projected_step_s (None without a
            peak), compiler_refused (XLA's out-of-memory refusal, if it refused).
        budget_bytes: the per-device budget, margin taken off.
        cached: read from the job's `remat_auto.json` (nothing compiled).
        compiled: the chosen candidate's compile (`equipax.launch.aot.compile_step.CompiledStep`) when it
            was compiled here, for the caller to reuse; None when cached.
    """

    cfg: ExperimentConfig
    policy: str
    table: list[dict[str, Any]]
    budget_bytes: int
    cached: bool
    compiled: Any = None

    def record(self) -> dict[str, Any]:
        """The JSON-ready record (compile.json's `remat`)."""
        return {"knob": KNOB, "policy": self.policy, "budget_bytes": self.budget_bytes, "cached": self.cached,
                "candidates": self.table}  # fmt: skip


def _cache_key(cfg: ExperimentConfig, mesh: jax.sharding.Mesh, target: dict[str, Any]) -> str:
    """What the choice depends on: the step's knobs (not the run's length or logging), the mesh, the
    target and budget, and the JAX that compiled."""
    knobs = to_dict(cfg)
    step_knobs = {k: knobs[k] for k in ("model", "data", "learner", "mesh")} | {"compiler": knobs["train"]["compiler"]}
    device = mesh.devices.flat[0]
    text = json.dumps(
        {
            "knobs": step_knobs,
            "mesh": dict(mesh.shape),
            "device": [device.platform, device.device_kind],
            "target": target,
            "jax": jax.__version__,
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _read_cache(path: AnyPath | None) -> dict[str, Any]:
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # a damaged cache is recomputed, never an error
    return data if isinstance(data, dict) else {}


def _write_cache(path: AnyPath | None, key: str, entry: dict[str, Any]) -> None:
    if path is None or jax.process_index() != 0:
        return
    data = _read_cache(path) | {key: entry}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(data, indent=2) + "\n")


def choose_remat(
    cfg: ExperimentConfig,
    mesh: jax.sharding.Mesh,
    *,
    budget_gib: float,
    margin: float,
    peak_tflops: float | None,
    assumed_mfu: float = 0.5,
    target: dict[str, Any] | None = None,
    cache: AnyPath | None = None,
    log: Callable[[str], object] = print,
) -> RematChoice:
    """Compile `cfg`'s train step under each candidate policy (least recomputation first) until one fits.

    Arguments:
        cfg: an experiment whose `model.transformer.remat` is "auto".
        mesh: the mesh the step runs on (real devices, a TPU topology's, or simulated ones).
        budget_gib: memory per device.
        margin: the fraction of `budget_gib` kept free (a candidate fits at or under
            `budget_gib * (1 - margin)`).
        peak_tflops: per-device peak for the projected step times (None: FLOPs only).
        assumed_mfu: the MFU the projection assumes.
        target: what the budget is for (part of the cache key and the record).
        cache: the job's `remat_auto.json` (None: no cache).
        log: progress messages.

    Returns:
        The choice, with the table of candidates.

    Raises:
        ConfigError: no candidate fits (exit 2, naming the knob and the fixes).
    """
    from equipax.launch.tasks.lm_family import flops_per_token
    from equipax.launch.training.build import build_training

    budget = int(budget_gib * (1 - margin) * GIB)
    key = _cache_key(cfg, mesh, (target or {}) | {"budget_bytes": budget})
    hit = _read_cache(cache).get(key)
    if isinstance(hit, dict) and hit.get("policy") in REMAT_POLICIES:
        policy = hit["policy"]
        log(f"{KNOB}='auto' -> {policy!r} (cached in {cache}; delete it to choose again)")
        return RematChoice(set_knob(cfg, KNOB, policy), policy, hit.get("candidates", []), budget, cached=True)

    platform = mesh.devices.flat[0].platform
    tokens = cfg.global_batch_size * getattr(cfg.data, "seq_len", 0)
    table: list[dict[str, Any]] = []
    chosen: tuple[str, Any] | None = None
    for policy in candidate_policies(platform):
        candidate = set_knob(cfg, KNOB, policy)
        flops = flops_per_token(candidate)
        executed = (flops["training"] + flops["remat"]) * tokens
        row: dict[str, Any] = {
            "policy": policy,
            "total_bytes": None,
            "fits": None,
            "remat_flops_per_step": flops["remat"] * tokens,
            "projected_step_s": (
                executed / (mesh.size * peak_tflops * 1e12 * assumed_mfu) if peak_tflops is not None else None
            ),
        }
        table.append(row)
        if chosen is not None:
            continue  # a cheaper policy fits: listed, not compiled
        log(f"{KNOB}='auto': compiling with remat={policy!r}...")
        step = compile_step(build_training(candidate, mesh, feeds_batches=False))
        row["total_bytes"] = step.memory["total_bytes"]
        row["fits"] = step.memory["total_bytes"] <= budget and "compiler_refused" not in step.memory
        if "compiler_refused" in step.memory:
            row["compiler_refused"] = step.memory["compiler_refused"]
        if row["fits"]:
            chosen = (policy, step)
    if chosen is None:
        smallest = min(table, key=lambda r: r["total_bytes"])
        raise ConfigError(
            f"{KNOB}='auto': no remat policy fits {budget / GIB:.3g} GiB per device ({budget_gib:g} GiB less "
            f"the {margin:.0%} margin); the smallest, {smallest['policy']!r}, needs "
            f"{smallest['total_bytes'] / GIB:.3g} GiB.\n"
            + format_remat_table(table, budget)
            + "\nUse more devices (a larger fsdp axis), a smaller data.per_device_batch or data.seq_len, or a "
            "larger budget (`launch compile --hbm-gib`, train.hbm_gib_per_device, train.hbm_margin)."
        )
    policy, step = chosen
    choice = RematChoice(set_knob(cfg, KNOB, policy), policy, table, budget, cached=False, compiled=step)
    _write_cache(cache, key, {"experiment": cfg.name, "target": target, "policy": policy, "candidates": table})
    return choice


def _flops(n: float) -> str:
    for unit, size in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.3g} FLOP"


def format_remat_table(table: list[dict[str, Any]], budget_bytes: int, chosen: str | None = None) -> str:
    """The candidates as a text table (the chosen one marked)."""
    lines = [f"  {'remat':<22} {'GiB/device':>10}  {'fits':<5} {'recompute/step':>14}  projected step"]
    for r in table:
        size = "-" if r["total_bytes"] is None else f"{r['total_bytes'] / GIB:.3g}"
        fits = "-" if r["fits"] is None else "yes" if r["fits"] else "no"
        step = "-" if r.get("projected_step_s") is None else f"{r['projected_step_s']:.4g} s"
        mark = "  <- chosen" if r["policy"] == chosen else ""
        lines.append(f"  {r['policy']:<22} {size:>10}  {fits:<5} {_flops(r['remat_flops_per_step']):>14}  {step}{mark}")
    note = "; '-': not compiled, a cheaper one fits" if any(r["total_bytes"] is None for r in table) else ""
    lines.append(f"  (budget {budget_bytes / GIB:.3g} GiB per device, the margin taken off{note})")
    return "\n".join(lines)
