"""`launch bench attention`: forward time and memory of softmax vs linear attention by length.

One attention layer on random `[batch seq heads head_dim]` inputs, as in the linear-attention
article (d_k = 64, batch 32, N = 128..6000, 100 forward passes). Each implementation is
compiled once per length (compile time excluded), run once to warm up, then timed
`repeats` times. Memory is reported three ways, since XLA's `memory_analysis()` reports
no temporaries for a fully fused softmax: XLA's temp bytes, an analytic working-set
estimate (inputs, output and the big intermediates, e.g. the `[batch heads N N]` logits),
and the measured growth of the process' peak resident memory during one call (Linux).
Lengths whose estimate exceeds the memory limit are skipped, and XLA resource-exhausted
errors are caught: both are reported, not crashed on.
"""

import functools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from equipax.core.knobs import ConfigError, to_dict

# The config lives with the registered experiment, in a module without JAX.
from equipax.launch.experiments.attention_bench import IMPLEMENTATIONS, AttentionBenchConfig

__all__ = ["estimate_bytes", "results_table", "run_attention_bench"]

BASELINE = "softmax"
RESULT_FILE = "attention_bench.json"
PLOT_FILE = "attention_bench.png"


def _kernel(name: str, cfg: AttentionBenchConfig) -> Callable[..., Any]:
    from equipax.core.nn import (
        dot_product_attention,
        jax_nn_attention,
        linear_attention,
        reference_attention,
        reference_linear_attention,
    )

    fns: dict[str, Callable[..., Any]] = {
        "softmax_reference": reference_attention,
        "softmax": dot_product_attention,
        "softmax_jax_nn": jax_nn_attention,
        "linear": functools.partial(linear_attention, chunk_size=cfg.chunk_size),
        "linear_reference": reference_linear_attention,
    }
    return functools.partial(fns[name], causal=cfg.causal)


def estimate_bytes(name: str, cfg: AttentionBenchConfig, seq_len: int) -> int:
    """Analytic float32 working set of one forward call: inputs, output, big intermediates.

    Arguments:
        name: implementation name.
        cfg: benchmark config.
        seq_len: sequence length N.

    Returns:
        Bytes: `4 (q, k, v, out) + 2 (phi(q), phi(k))` `[batch N heads head_dim]` arrays,
        plus the `[batch heads N N]` logits for quadratic kernels, or the `d x d` state and
        one chunk's `[chunk chunk]` block for linear attention.
    """
    b, h, d, n = cfg.batch_size, cfg.num_heads, cfg.head_dim, seq_len
    io = 6 * b * n * h * d * 4
    quadratic = IMPLEMENTATIONS[name][1] * b * h * n * n * 4
    if name == "linear":
        c = min(cfg.chunk_size, n) if cfg.causal else 0
        return io + b * h * (d * d + c * c) * 4 * 2
    return io + quadratic


def _available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _rss_kib() -> dict[str, int]:
    out = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(("VmHWM:", "VmRSS:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0])
    except OSError:
        pass
    return out


def _peak_rss_delta(call: Callable[[], Any]) -> int | None:
    """Growth of peak resident memory over the current RSS during `call()` (Linux only)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    except OSError:
        call()
        return None
    before = _rss_kib()
    call()
    after = _rss_kib()
    if "VmRSS" not in before or "VmHWM" not in after:
        return None
    return max(after["VmHWM"] - before["VmRSS"], 0) * 1024


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in str(e) or "Out of memory" in str(e)


def _measure(name: str, cfg: AttentionBenchConfig, qkv: tuple[Any, ...]) -> dict[str, Any]:
    import jax

    t0 = time.perf_counter()
    compiled = jax.jit(_kernel(name, cfg)).lower(*qkv).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    rss = _peak_rss_delta(lambda: compiled(*qkv).block_until_ready())
    times = []
    for _ in range(cfg.repeats):
        t0 = time.perf_counter()
        compiled(*qkv).block_until_ready()
        times.append((time.perf_counter() - t0) * 1e3)
    return {
        "status": "ok",
        "compile_s": compile_s,
        "time_ms": {
            "mean": statistics.fmean(times),
            "std": statistics.stdev(times) if len(times) > 1 else 0.0,
            "median": statistics.median(times),
            "min": min(times),
        },
        "xla_temp_bytes": None if mem is None else int(mem.temp_size_in_bytes),
        "rss_peak_delta_bytes": rss,
    }


def _check_out_dir(out_dir: Path) -> None:
    """Create `out_dir`, or raise ConfigError saying why it cannot hold the results."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".{RESULT_FILE}.probe"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        what = "is a file" if out_dir.is_file() else f"cannot be created or written ({e.strerror or type(e).__name__})"
        raise ConfigError(
            f"The output directory {str(out_dir)!r} {what}; the benchmark writes {RESULT_FILE} and "
            f"{PLOT_FILE} into a directory. Pass --out (or --job-log-dir) naming a new or writable directory."
        ) from None


def run_attention_bench(cfg: AttentionBenchConfig, out_dir: Path, *, console: Console | None = None) -> dict[str, Any]:
    """Run the benchmark; write `attention_bench.json` and `attention_bench.png` to `out_dir`.

    Arguments:
        cfg: benchmark config.
        out_dir: output directory (created).
        console: where the progress and table go (`None`: a fresh stdout console).

    Returns:
        The JSON-ready results (also written to `out_dir / attention_bench.json`).
    """
    import jax
    import jax.random as jr

    from equipax.launch.jobdir.plots import NO_MATPLOTLIB, plot_attention_bench

    out_dir = Path(out_dir)
    _check_out_dir(out_dir)  # before the work, which can take minutes
    console = console or Console(soft_wrap=True)
    available = _available_bytes()
    limit = int(cfg.memory_limit_gb * 2**30) if cfg.memory_limit_gb is not None else available
    # The baseline for speed-ups: the LM's softmax path if measured, else the first softmax.
    softmaxes = [i for i in cfg.implementations if IMPLEMENTATIONS[i][0] == "softmax"]
    baseline = BASELINE if BASELINE in softmaxes else (softmaxes[0] if softmaxes else None)
    rows: list[dict[str, Any]] = []
    for n in cfg.seq_lens:
        shape = (cfg.batch_size, n, cfg.num_heads, cfg.head_dim)
        keys = jr.split(jr.fold_in(jr.key(cfg.seed), n), 3)
        qkv = tuple(jr.normal(k, shape) for k in keys)
        for name in cfg.implementations:
            row: dict[str, Any] = {
                "seq_len": n,
                "implementation": name,
                "family": IMPLEMENTATIONS[name][0],
                "analytic_bytes": estimate_bytes(name, cfg, n),
            }
            # Without a configured limit, what is available now (other processes come and go).
            point_limit = limit if cfg.memory_limit_gb is not None else _available_bytes()
            if point_limit is not None and row["analytic_bytes"] > point_limit:
                row.update(
                    status="skipped",
                    reason=(f"needs ~{row['analytic_bytes'] / 2**30:.1f} GiB, limit {point_limit / 2**30:.1f} GiB"),
                )
            else:
                console.print(f"seq {n:>6}  {name:<18}", end=" ", highlight=False)
                try:
                    row.update(_measure(name, cfg, qkv))
                    console.print(f"{row['time_ms']['median']:10.3f} ms", highlight=False)
                except Exception as e:
                    if not _is_oom(e):
                        raise
                    row.update(status="out_of_memory", reason=str(e).splitlines()[0][:200])
                    console.print("out of memory", highlight=False)
            rows.append(row)
        del qkv
    by_key = {(r["seq_len"], r["implementation"]): r for r in rows if r["status"] == "ok"}
    for r in rows:
        base = by_key.get((r["seq_len"], baseline)) if baseline else None
        r["speedup_vs_baseline"] = (
            base["time_ms"]["median"] / r["time_ms"]["median"] if base and r["status"] == "ok" else None
        )
    result = {
        "config": to_dict(cfg),
        "device": jax.devices()[0].device_kind,
        "platform": jax.devices()[0].platform,
        "jax_version": jax.__version__,
        "memory_limit_bytes": limit,
        "baseline": baseline,
        "results": rows,
    }
    (out_dir / RESULT_FILE).write_text(json.dumps(result, indent=2) + "\n")
    plot = plot_attention_bench(result, out_dir / PLOT_FILE) or f"no plot: {NO_MATPLOTLIB}"
    console.print(results_table(result))
    console.print(f"Wrote {out_dir / RESULT_FILE} and {plot}", highlight=False)
    return result


def _mib(x: int | None) -> str:
    return "-" if x is None else f"{x / 2**20:,.1f}"


def results_table(result: dict[str, Any]) -> Table:
    """The benchmark results as a rich table (times in ms, memory in MiB).

    Arguments:
        result: what `run_attention_bench` returns.

    Returns:
        A table with one row per (length, implementation).
    """
    cfg = result["config"]
    title = (
        f"Attention forward, batch {cfg['batch_size']}, heads {cfg['num_heads']}, "
        f"head_dim {cfg['head_dim']}, {'causal' if cfg['causal'] else 'non-causal'}, "
        f"{cfg['repeats']} repeats, {result['device']}; times in ms, memory in MiB"
    )
    table = Table(title=title)
    for col in (
        "seq",
        "implementation",
        "mean",
        "std",
        "median",
        f"x vs {result['baseline']}",
        "XLA temp",
        "estimate",
        "RSS peak",
    ):
        table.add_column(
            col, justify="left" if col == "implementation" else "right", min_width=len(col), overflow="fold"
        )
    for r in result["results"]:
        if r["status"] != "ok":
            table.add_row(
                str(r["seq_len"]),
                r["implementation"],
                f"{r['status']}: {r['reason']}",
                "",
                "",
                "",
                "",
                _mib(r["analytic_bytes"]),
                "",
            )
            continue
        t, s = r["time_ms"], r["speedup_vs_baseline"]
        table.add_row(
            str(r["seq_len"]),
            r["implementation"],
            f"{t['mean']:.3f}",
            f"{t['std']:.3f}",
            f"{t['median']:.3f}",
            "-" if s is None else f"{s:.2f}",
            _mib(r["xla_temp_bytes"]),
            _mib(r["analytic_bytes"]),
            _mib(r["rss_peak_delta_bytes"]),
        )
    return table
