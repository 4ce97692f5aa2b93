"""`model.transformer.remat="auto"`: the fastest remat policy whose compiled train step fits, by
the compiled programs' cost, never one projected slower than the experiment's own policy.

The experiment's own policy is the one its registered experiment names (`own_policy`: "full",
Pax's SAVE_NOTHING and MaxText's default, where that is "auto" itself or the experiment is not
registered). It is compiled for the run's real target (the devices of `launch run`, or the TPU
topology / simulated devices of `launch compile`) together with the candidates that recompute less
(`equipax.launch.aot.remat_search`), several at once; each compiled program is priced by its roofline
(`equipax.launch.aot.hlo_cost`: every kernel at the device's peak FLOP/s or HBM bandwidth, loops
unrolled, splash attention's kernels counted). A candidate replaces the own policy only where it
fits the memory budget less a margin and is projected at least `MIN_GAIN` faster. The table is
printed and recorded (compile.json's `remat`, knobs.txt), and the choice is cached in the job
directory (`remat_auto.json`) and in the machine's cache (`remat/`, `EQUIPAX_CACHE_DIR`) per step
knobs (remat aside), mesh, devices, roofline, budget and JAX / jaxlib / libtpu versions: a second job
of the same experiment on the same kind of device compiles nothing to choose, nor does a run on a
TPU slice after `launch compile --topology` of that slice. docs/compile.md, "Choosing remat by
compiling".
"""

import contextlib
import dataclasses
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from equipax.core.configs import REMAT_POLICIES
from equipax.core.knobs import ConfigError, flatten, set_knob, to_dict
from equipax.launch.aot.compile_step import compile_step
from equipax.launch.aot.hlo_cost import Roofline, program_cost
from equipax.launch.aot.matrix_work import matrix_seconds
from equipax.launch.aot.memory_floor import memory_floor
from equipax.launch.aot.remat_search import Outcome, removed_share, search
from equipax.launch.configs.experiment import ExperimentConfig
from equipax.launch.store.storage import AnyPath, write_atomic

__all__ = [
    "CACHE_FILE",
    "candidate_policies",
    "choose_remat",
    "format_remat_table",
    "is_auto",
    "MIN_GAIN",
    "own_policy",
    "RematChoice",
]

KNOB = "model.transformer.remat"
CACHE_FILE = "remat_auto.json"
# A policy other than the experiment's own is taken only where projected this much faster: the
# projection's error on the chip (c4_1b at 6 layers on a TPU v5e, benchmarks/README.md:
# dots_saveable projected 7.5% faster than full, measured 7.3%; save_attention_out projected 0.3%
# and measured 1.4% slower).
MIN_GAIN = 0.03
# What the cached choices were made by (a change of the rule invalidates them).
# 2: int8 matmuls at the int8 rate; in-place copies of a stacked buffer free. 3: "save_context" a
# candidate, splash's residuals named (the policies that keep the context no longer rerun its
# forward kernel), and splash's kernels priced at batch 1 too. 4: "dots_with_context" a candidate.
# 5: a candidate whose traced matrix work is not MIN_GAIN below own's is not compiled. 6: that work
# counts splash's bfloat16 kernels and leaves out what no output needs.
_RULE = "roofline-6"
# Offloading to pinned host memory compiles where the backend has that memory space.
_OFFLOAD_PLATFORMS = ("tpu", "gpu", "cuda", "rocm")
# Data knobs that say where the tokens come from, not the step's shapes.
_DATA_SOURCES = ("path", "seed", "train_files", "eval_files", "vocab_path", "validation_plays")
GIB = 2**30


def is_auto(cfg: ExperimentConfig) -> bool:
    """Whether `cfg` asks for its remat policy to be chosen by compiling."""
    return flatten(cfg).get(KNOB) == "auto"


def candidate_policies(platform: str) -> tuple[str, ...]:
    """The policies `auto` tries on `platform`, least recomputation first."""
    return tuple(p for p in REMAT_POLICIES if p != "offload_attention_out" or platform in _OFFLOAD_PLATFORMS)


def own_policy(cfg: ExperimentConfig) -> str:
    """The policy `cfg`'s experiment has without "auto": the one its registered experiment names,
    "full" where that is "auto" or `cfg` is not a registered experiment."""
    from equipax.launch.experiments import registry

    try:
        named = registry.get_experiment(cfg.name)
    except ConfigError:
        return "full"
    remat = getattr(getattr(getattr(named, "model", None), "transformer", None), "remat", None)
    return remat if remat in REMAT_POLICIES else "full"


@dataclasses.dataclass(frozen=True)
class RematChoice:
    """What `choose_remat` found.

    Attributes:
        cfg: the experiment with the chosen policy in place of "auto".
        policy: the chosen policy.
        own: the experiment's own policy (`own_policy`).
        reason: why this one.
        table: one row per candidate (JSON-ready): policy, total_bytes (None = not compiled: it
            could not win), fits, flops, hbm_bytes, host_bytes, projected_step_s (the compiled
            program's roofline), compile_s, compiler_refused (XLA's out-of-memory refusal, if it refused).
        budget_bytes: the per-device budget, margin taken off.
        roofline: the device figures the projection used.
        cached: where the choice was read from ("job", "machine"; None: searched now).
        search_s: the search's seconds (0 when cached).
        compiled: the chosen candidate's compile (`equipax.launch.aot.compile_step.CompiledStep`) when it
            was compiled here, for the caller to reuse (its `training` runs the step compiled); None
            when cached.
        beside: the thread running `choose_remat`'s `beside` (None: not started), for the caller
            to join before it leaves what that work needs.
    """

    cfg: ExperimentConfig
    policy: str
    own: str
    reason: str
    table: list[dict[str, Any]]
    budget_bytes: int
    roofline: Roofline
    cached: str | None
    search_s: float = 0.0
    compiled: Any = None
    beside: threading.Thread | None = None

    def record(self) -> dict[str, Any]:
        """The JSON-ready record (compile.json's `remat`)."""
        return {"knob": KNOB, "policy": self.policy, "own": self.own, "reason": self.reason,
                "budget_bytes": self.budget_bytes, "roofline": dataclasses.asdict(self.roofline),
                "min_gain": MIN_GAIN, "cached": self.cached, "search_s": self.search_s,
                "candidates": self.table}  # fmt: skip


def _versions(platform: str) -> dict[str, str | None]:
    from importlib import metadata

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {
        "jax": jax.__version__,
        "jaxlib": version("jaxlib"),
        "libtpu": version("libtpu") if platform == "tpu" else None,
    }


def _cache_key(
    cfg: ExperimentConfig, mesh: jax.sharding.Mesh, own: str, roofline: Roofline, budget_gib: float, margin: float
) -> str:
    """What the choice depends on: the step's knobs (remat aside; not the run's length, logging or
    where its tokens come from), the own policy, the mesh and its devices (kind and coordinates),
    the roofline the programs are priced at, the budget (to 16 MiB: the allocator's limit a chip
    reports is what `launch compile` knows of it, `Accelerator.allocatable_gib`) and margin, and
    the compiler's versions. Not who asked: `launch compile --topology` and `launch run` on that
    slice make the same key."""
    knobs = to_dict(cfg)
    model = json.loads(json.dumps(knobs["model"], default=str))
    model.get("transformer", {}).pop("remat", None)
    data = {k: v for k, v in knobs["data"].items() if k not in _DATA_SOURCES}
    device = mesh.devices.flat[0]
    text = json.dumps(
        {
            "knobs": {
                "model": model,
                "data": data,
                "learner": knobs["learner"],
                "mesh": knobs["mesh"],
                "compiler": knobs["train"]["compiler"],
            },
            "own": own,
            "mesh": dict(mesh.shape),
            "device": [device.platform, device.device_kind],
            "coords": [getattr(d, "coords", None) for d in mesh.devices.flat],
            "roofline": dataclasses.asdict(roofline),
            "budget_gib_64ths": round(budget_gib * 64),
            "margin": margin,
            "versions": _versions(device.platform),
            "rule": [_RULE, MIN_GAIN],
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _read_job_cache(path: AnyPath | None) -> dict[str, Any]:
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # a damaged cache is recomputed, never an error
    return data if isinstance(data, dict) else {}


def _read_cache(job: AnyPath | None, key: str) -> tuple[dict[str, Any] | None, str | None]:
    """The cached entry of `key` and where it was (the job's file first: a job keeps its choice)."""
    from equipax.launch.store.machine_cache import content_cache

    hit = _read_job_cache(job).get(key)
    if isinstance(hit, dict) and hit.get("policy") in REMAT_POLICIES:
        return hit, "job"
    machine = content_cache("remat")
    payload = machine.get(key) if machine is not None else None
    try:
        hit = json.loads(payload) if payload is not None else None
    except ValueError:
        hit = None
    if isinstance(hit, dict) and hit.get("policy") in REMAT_POLICIES:
        return hit, "machine"
    return None, None


def _write_cache(job: AnyPath | None, key: str, entry: dict[str, Any]) -> None:
    from equipax.launch.store.machine_cache import content_cache

    machine = content_cache("remat")
    if machine is not None:
        machine.directory.mkdir(parents=True, exist_ok=True)
        machine.put(key, json.dumps(entry, sort_keys=True).encode())
    if job is None or jax.process_index() != 0:
        return
    data = _read_job_cache(job) | {key: entry}
    job.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(job, json.dumps(data, indent=2) + "\n")


def _workers() -> int:
    """Compiles at once: half the host's cores (XLA's compiles use more than one)."""
    return max(1, (os.cpu_count() or 2) // 2)


def choose_remat(
    cfg: ExperimentConfig,
    mesh: jax.sharding.Mesh,
    *,
    budget_gib: float,
    margin: float,
    roofline: Roofline,
    target: dict[str, Any] | None = None,
    cache: AnyPath | None = None,
    log: Callable[[str], object] = print,
    feeds_batches: bool = False,
    beside: Callable[[], object] | None = None,
) -> RematChoice:
    """Choose `cfg`'s remat policy by compiling its train step under the candidates.

    Arguments:
        cfg: an experiment whose `model.transformer.remat` is "auto".
        mesh: the mesh the step runs on (real devices, a TPU topology's, or simulated ones).
        budget_gib: memory per device.
        margin: the fraction of `budget_gib` kept free (a candidate fits at or under
            `budget_gib * (1 - margin)`).
        roofline: the device's figures the compiled programs are priced at.
        target: what the budget is for (recorded with the cached choice).
        cache: the job's `remat_auto.json` (None: only the machine's cache).
        log: progress messages.
        feeds_batches: as `build_training`'s: True where the chosen candidate's program
            (`RematChoice.compiled.training`) is the one the caller runs (`launch run`), so that
            its first step finds the step compiled.
        beside: work to run on a thread of its own while the candidates compile, where the choice
            is not cached (`launch run`: the compile of the state's initialisation, which no policy
            changes), started once the experiment's own policy is compiling; not waited for
            (`RematChoice.beside`), its errors dropped.

    Returns:
        The choice, with the table of candidates.

    Raises:
        ConfigError: no candidate fits (exit 2, naming the knob and the fixes).
    """
    from equipax.launch.program.training import build_training

    budget = int(budget_gib * (1 - margin) * GIB)
    own = own_policy(cfg)
    order = candidate_policies(mesh.devices.flat[0].platform)
    own = own if own in order else "full"
    key = _cache_key(cfg, mesh, own, roofline, budget_gib, margin)
    hit, where = _read_cache(cache, key)
    if hit is not None:
        policy = hit["policy"]
        if where == "machine":
            _write_cache(cache, key, hit)  # the job records the choice it runs with
        place = cache if where == "job" else "the machine's cache, EQUIPAX_CACHE_DIR"
        log(f"{KNOB}='auto' -> {policy!r} (cached in {place}; delete it to choose again)")
        return RematChoice(set_knob(cfg, KNOB, policy), policy, hit.get("own", own), hit.get("reason", ""),
                           hit.get("candidates", []), budget, roofline, cached=where)  # fmt: skip

    t0 = time.monotonic()
    thread = threading.Thread(target=_quietly(beside), name="equipax-remat-beside", daemon=True) if beside else None

    def under_way() -> None:
        # The work beside starts once the first phase's compiles are handed over: its tracing and
        # lowering, started with the search, held own's back (the chip: own's compile began 3.9 s
        # into the search), and started with own's, the next candidate's tracing (`none`'s 1.31 s
        # on the chip, 0.49 s alone; benchmarks/README.md, "ninth session").
        if thread is not None and thread.ident is None:
            thread.start()

    trainings: dict[str, Any] = {}

    def trace(policy: str) -> tuple[Any, float]:
        trainings[policy] = build_training(set_knob(cfg, KNOB, policy), mesh, feeds_batches=feeds_batches)
        t = time.monotonic()
        return trainings[policy].trace(), time.monotonic() - t

    def lower(traced: tuple[Any, float]) -> tuple[Any, float]:
        step, seconds = traced
        t = time.monotonic()
        return step.lower(), seconds + time.monotonic() - t

    def compile_(policy: str, lowered: tuple[Any, float]) -> tuple[Outcome, Any]:
        step = compile_step(trainings[policy], *lowered)
        fits = step.memory["total_bytes"] <= budget and "compiler_refused" not in step.memory
        cost = program_cost(step.compiled.as_text(), roofline) if step.compiled is not None else None
        outcome = Outcome(fits, cost.projected_s if cost is not None else None, total_bytes=step.memory["total_bytes"])
        return outcome, (step, cost)

    try:
        decision, outcomes, compiled, work, floors = search(
            order, own, trace=trace, work=lambda traced: matrix_seconds(traced[0].jaxpr, roofline), lower=lower,
            compile_=compile_, workers=_workers(), min_gain=MIN_GAIN, log=log,
            floor=lambda traced: memory_floor(traced[0].jaxpr, mesh.size), budget=budget, under_way=under_way,
        )  # fmt: skip
        table = [_row(p, outcomes.get(p), compiled.get(p), work.get(p), floors.get(p)) for p in order]
        if decision.policy is None:
            smallest = min((r for r in table if r["total_bytes"] is not None), key=lambda r: r["total_bytes"])
            raise ConfigError(
                f"{KNOB}='auto': no remat policy fits {budget / GIB:.3g} GiB per device ({budget_gib:g} GiB less "
                f"the {margin:.0%} margin); the smallest, {smallest['policy']!r}, needs "
                f"{smallest['total_bytes'] / GIB:.3g} GiB.\n"
                + format_remat_table(table, budget, own=own)
                + "\nUse more devices (a larger fsdp axis), a smaller data.per_device_batch or data.seq_len, or a "
                "larger budget (`launch compile --hbm-gib`, train.hbm_gib_per_device, train.hbm_margin)."
            )
    except BaseException:  # the caller gets no thread to join
        if thread is not None and thread.ident is not None:
            thread.join()
        raise
    policy = decision.policy
    search_s = time.monotonic() - t0
    entry = {"experiment": cfg.name, "target": target, "policy": policy, "own": own, "reason": decision.reason,
             "candidates": table}  # fmt: skip
    _write_cache(cache, key, entry)
    step = compiled[policy][0]
    return RematChoice(set_knob(cfg, KNOB, policy), policy, own, decision.reason, table, budget, roofline,
                       cached=None, search_s=search_s, compiled=step,
                       beside=thread if thread is not None and thread.ident is not None else None)  # fmt: skip


def _quietly(work: Callable[[], object]) -> Callable[[], None]:
    """`work`, its exceptions dropped (what it prepares is done again, and fails, where it is used)."""

    def run() -> None:
        with contextlib.suppress(Exception):
            work()

    return run


def _row(
    policy: str, outcome: Outcome | None, compiled: Any, matrix_s: float | None, floor_bytes: float | None
) -> dict[str, Any]:
    row: dict[str, Any] = {"policy": policy, "total_bytes": None, "fits": None, "flops": None, "hbm_bytes": None,
                           "host_bytes": None, "projected_step_s": None, "compile_s": None,
                           "matrix_s": matrix_s, "floor_bytes": floor_bytes}  # fmt: skip
    if outcome is None:
        return row
    if compiled is None:  # not compiled: its traced floor is over the budget
        row["fits"] = False
        return row
    step, cost = compiled
    row |= {"total_bytes": step.memory["total_bytes"], "fits": outcome.fits, "compile_s": step.lower_s + step.compile_s}
    if cost is not None:
        row |= {"flops": cost.flops, "hbm_bytes": cost.hbm_bytes, "host_bytes": cost.host_bytes,
                "projected_step_s": cost.projected_s}  # fmt: skip
    if "compiler_refused" in step.memory:
        row["compiler_refused"] = step.memory["compiler_refused"]
    return row


def format_remat_table(
    table: list[dict[str, Any]], budget_bytes: int, chosen: str | None = None, own: str | None = None
) -> str:
    """The candidates as a text table (the chosen one and the experiment's own marked)."""
    lines = [f"  {'remat':<26} {'GiB/device':>10}  {'fits':<5} {'TFLOP/step':>10} {'HBM GB/step':>11}  projected step"]
    for r in table:
        size = "-" if r["total_bytes"] is None else f"{r['total_bytes'] / GIB:.3g}"
        if r["total_bytes"] is None and r["fits"] is False and r.get("floor_bytes") is not None:
            size = f">={r['floor_bytes'] / GIB:.3g}"
        fits = "-" if r["fits"] is None else "yes" if r["fits"] else "no"
        flops = "-" if r.get("flops") is None else f"{r['flops'] / 1e12:.3g}"
        traffic = "-" if r.get("hbm_bytes") is None else f"{r['hbm_bytes'] / 1e9:.3g}"
        step = "-" if r.get("projected_step_s") is None else f"{r['projected_step_s']:.4g} s"
        name = r["policy"] + (" (own)" if r["policy"] == own else "")
        mark = "  <- chosen" if r["policy"] == chosen else ""
        lines.append(f"  {name:<26} {size:>10}  {fits:<5} {flops:>10} {traffic:>11}  {step}{mark}")
    note = "; '-': not compiled, not needed to decide" if any(r["fits"] is None for r in table) else ""
    if any(r["total_bytes"] is None and r["fits"] is False for r in table):
        note += "; '>=': not compiled, its traced arguments, residuals and gradients alone are over the budget"
    lines.append(f"  (budget {budget_bytes / GIB:.3g} GiB per device, the margin taken off{note})")
    mine = next((r.get("matrix_s") for r in table if r["policy"] == own), None)
    shares = {
        r["policy"]: removed_share(mine, r["matrix_s"])
        for r in table
        if mine and r.get("matrix_s") is not None and r["fits"] is None
    }
    passed = [f"{p} {share:.1%}" for p, share in shares.items() if share < MIN_GAIN]
    if passed:
        lines.append(f"  (not compiled, removing under {MIN_GAIN:.0%} of {own}'s matrix work: {', '.join(passed)})")
    return "\n".join(lines)
