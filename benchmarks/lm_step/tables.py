"""The tables the train-step benchmark prints: the step figures of each preset (`table`) and the
equipax-vs-plain-JAX comparison (`compare_table`), from the results it writes as JSON."""

from typing import Any


def table(results: dict[str, Any]) -> str:
    theo = results["theoretical_peak_gflops"]
    headers = [
        "preset",
        "params",
        "scan",
        "remat",
        "tok/step",
        "compile s",
        "step ms",
        "IQR ms",
        "tokens/s",
        "model GFLOP/s",
        "matmul GFLOP/s",
        "MFU meas",
        "MFU theo",
    ]
    rows = []
    for name, r in results["presets"].items():
        rows.append(
            [
                name,
                f"{r['params'] / 1e6:.2f}M",
                "y" if r["config"]["scan_layers"] else "n",
                r["config"]["remat"],
                f"{r['tokens_per_step']}",
                f"{r['compile_s']:.2f}",
                f"{r['step_s']['median_s'] * 1e3:.1f}",
                f"{r['step_s']['iqr_s'] * 1e3:.1f}",
                f"{r['tokens_per_s']:,.0f}",
                f"{r['model_gflops_per_s']:.1f}",
                f"{r['matmul']['gflops']:.1f}",
                f"{r['mfu_vs_measured']:.1%}",
                f"{r['mfu_vs_theoretical']:.1%}" if r["mfu_vs_theoretical"] is not None else "-",
            ]
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    lines = [fmt.format(*headers), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*row) for row in rows]
    lines.append(
        f"matmul GFLOP/s: jitted f32 a @ b, n={results['matmul_n']}, measured before each preset; "
        f"MFU meas = model GFLOP/s / that" + (f"; MFU theo = model GFLOP/s / {theo:.1f}" if theo else "")
    )
    return "\n".join(lines)


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def compare_table(results: dict[str, Any]) -> str:
    headers = [
        "preset",
        "params",
        "remat eqx/plain",
        "attn",
        "dtype",
        "equipax ms (IQR)",
        "plain ms (IQR)",
        "equipax tok/s",
        "plain tok/s",
        "ratio (IQR)",
        "MFU eqx/plain",
        "peak HBM GiB eqx/plain",
        "compile s eqx/plain",
        "dispatch ms eqx/plain",
        "first loss eqx/plain",
    ]
    rows = []
    for name, r in results["presets"].items():
        e, b = r["equipax"], r["baseline"]
        if r["mode"] == "isolated":
            hbm = f"{_gib(e.get('peak_hbm_bytes'))}/{_gib(b.get('peak_hbm_bytes'))}"
        else:
            hbm = f"{_gib(r.get('peak_hbm_bytes'))} (both)"
        mfu = "-" if e["mfu"] is None else f"{e['mfu']:.1%}/{b['mfu']:.1%}"
        iqr = "-" if r["ratio_iqr"] is None else f"{r['ratio_iqr']:.3f}"
        rows.append(
            [
                name,
                f"{r['params'] / 1e6:.2f}M",
                f"{r['remat']['equipax']}/{r['remat']['baseline']}",
                r["attention_impl"],
                r["dtype"],
                f"{e['step_s']['median_s'] * 1e3:.1f} ({e['step_s']['iqr_s'] * 1e3:.1f})",
                f"{b['step_s']['median_s'] * 1e3:.1f} ({b['step_s']['iqr_s'] * 1e3:.1f})",
                f"{e['tokens_per_s']:,.0f}",
                f"{b['tokens_per_s']:,.0f}",
                f"{r['ratio']:.3f} ({iqr})",
                mfu,
                hbm,
                f"{e['compile_s']:.2f}/{b['compile_s']:.2f}",
                f"{e['dispatch_ms']:.2f}/{b['dispatch_ms']:.2f}",
                f"{e['first_loss']:.4f}/{b['first_loss']:.4f}",
            ]
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    lines = [fmt.format(*headers), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*row) for row in rows]
    lines.append(
        "ratio: plain-JAX step time / equipax step time (> 1: equipax faster); interleaved: median over "
        "paired rounds, isolated: ratio of the medians. MFU: equipax.core.flops training FLOPs (PaLM, no "
        "remat) over the device's datasheet peak."
    )
    return "\n".join(lines)
