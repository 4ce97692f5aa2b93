"""Where a train step's device time goes: per-op totals from a `jax.profiler` Perfetto trace.

Reads the `perfetto_trace.json.gz` (Chrome trace JSON) that `jax.profiler.trace(dir,
create_perfetto_trace=True)` writes under `dir/plugins/profile/<run>/` and sums the device's
XLA op events: on TPU/GPU the ops thread ("XLA Ops") of the device processes ("/device:TPU:0"),
on CPU the events that carry an `hlo_op` argument (XLA:CPU's thunks, on its client thread).
For each trace: the device time per step, per XLA module, per op kind (the op name without its
`.N` suffix, with the HLO category where the trace has one) and the top ops by time.
`train_step.py --compare --profile DIR` prints two side by side (equipax vs plain JAX).

    python3 benchmarks/op_profile.py TRACE_A [TRACE_B] --steps 3 --top 25 [--out summary.json]

Imports only the standard library: it runs wherever the trace was copied to.
"""

import argparse
import collections
import gzip
import json
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["compare_traces", "find_trace", "format_comparison", "summarize_trace"]

# Argument names under which TPU/GPU traces give an op's HLO category.
_CATEGORY_ARGS = ("hlo_category", "category", "tf_op_type", "type")
_LONG_NAME_ARGS = ("long_name", "hlo_op_long_name", "expression")


def find_trace(path: str | Path) -> Path:
    """The trace file at `path`: the file itself, or the newest `perfetto_trace.json.gz` under it."""
    path = Path(path)
    if path.is_file():
        return path
    found = sorted(path.rglob("perfetto_trace.json.gz"), key=lambda f: f.stat().st_mtime)
    if not found:
        raise FileNotFoundError(
            f"no perfetto_trace.json.gz under {path} (jax.profiler.trace(..., create_perfetto_trace=True))"
        )
    return found[-1]


def _load_events(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data.get("traceEvents", []) if isinstance(data, dict) else list(data)


def _kind(name: str) -> str:
    """`fusion.123` -> `fusion`, `convolution.4.remat` -> `convolution.remat`: the op without its number."""
    return re.sub(r"\.\d+", "", name) or name


def _op_events(events: Sequence[Mapping[str, Any]]) -> tuple[list[Mapping[str, Any]], str, dict[str, Any]]:
    """The device's op events, a line saying where they were found, and the processes/threads seen."""
    processes: dict[Any, str] = {}
    threads: dict[tuple[Any, Any], str] = {}
    for e in events:
        if e.get("ph") != "M":
            continue
        name = str(e.get("args", {}).get("name", ""))
        if e.get("name") == "process_name":
            processes[e.get("pid")] = name
        elif e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = name
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    seen = {
        "processes": sorted(set(processes.values())),
        "threads": sorted({f"{processes.get(p, p)} / {t}" for (p, _), t in threads.items()}),
    }
    devices = {p for p, n in processes.items() if n.startswith("/device:") and "CUSTOM" not in n}
    if devices:
        op_threads = {k for k, n in threads.items() if k[0] in devices and n == "XLA Ops"}
        if op_threads:
            ops = [e for e in complete if (e.get("pid"), e.get("tid")) in op_threads]
            where = ", ".join(sorted(processes[p] for p in devices)) + ' / "XLA Ops"'
            return ops, where, seen
    ops = [e for e in complete if "hlo_op" in e.get("args", {})]
    return ops, 'events with an "hlo_op" argument (host XLA ops)', seen


def _module_events(events: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Total microseconds per XLA module from a device's "XLA Modules" thread (TPU/GPU), if any."""
    processes = {e.get("pid"): e.get("args", {}).get("name", "") for e in events if e.get("name") == "process_name"}
    threads = {
        (e.get("pid"), e.get("tid")): e.get("args", {}).get("name", "")
        for e in events
        if e.get("name") == "thread_name"
    }
    keys = {k for k, n in threads.items() if n == "XLA Modules" and str(processes.get(k[0], "")).startswith("/device:")}
    totals: dict[str, float] = collections.defaultdict(float)
    for e in events:
        if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in keys:
            totals[re.sub(r"\(\d+\)$", "", str(e.get("name")))] += float(e["dur"])
    return dict(totals)


def _self_times(ops: Sequence[Mapping[str, Any]]) -> list[float]:
    """Each op event's duration less that of the op events nested in it on the same thread (a
    `while` or `call` op encloses its body's ops on XLA:CPU): the sums then count each moment once."""
    self_us = [float(e["dur"]) for e in ops]
    by_thread: dict[tuple[Any, Any], list[int]] = collections.defaultdict(list)
    for i, e in enumerate(ops):
        by_thread[(e.get("pid"), e.get("tid"))].append(i)
    for indices in by_thread.values():
        indices.sort(key=lambda i: (float(ops[i]["ts"]), -float(ops[i]["dur"])))
        stack: list[int] = []
        for i in indices:
            start = float(ops[i]["ts"])
            while stack and float(ops[stack[-1]]["ts"]) + float(ops[stack[-1]]["dur"]) <= start:
                stack.pop()
            if stack:
                self_us[stack[-1]] -= float(ops[i]["dur"])
            stack.append(i)
    return [max(t, 0.0) for t in self_us]


def summarize_trace(path: str | Path, *, steps: int, top: int = 25) -> dict[str, Any]:
    """Per-step device time of one trace, by module, by op kind and by op.

    Arguments:
        path: a `perfetto_trace.json.gz`, or a folder holding one (the newest is read).
        steps: steps traced (the totals are divided by it).
        top: ops listed.

    Returns:
        `trace`, `source` (where the op events were found), `device_ms_per_step` (sum of the op
        events' self times: nested ops counted once), `modules_ms_per_step` (from the ops'
        `hlo_module`, or the device's module events), `by_kind` and `top_ops` (each with
        `ms_per_step`, `count_per_step`, `share`, `category`), and `seen` (the trace's processes
        and threads, to look at when empty).
    """
    trace = find_trace(path)
    events = _load_events(trace)
    ops, where, seen = _op_events(events)
    durations = _self_times(ops)
    total = sum(durations)
    by_op: dict[str, dict[str, Any]] = {}
    by_kind: dict[str, dict[str, Any]] = {}
    by_module: dict[str, float] = collections.defaultdict(float)
    for e, dur in zip(ops, durations):
        args = e.get("args", {})
        name = str(args.get("hlo_op", e.get("name")))
        category = next((str(args[k]) for k in _CATEGORY_ARGS if k in args), "")
        op = by_op.setdefault(name, {"name": name, "category": category, "us": 0.0, "count": 0})
        op["us"] += dur
        op["count"] += 1
        long_name = next((str(args[k]) for k in _LONG_NAME_ARGS if k in args), "")
        if long_name and "long_name" not in op:
            op["long_name"] = long_name[:200]
        kind = f"{_kind(name)} [{category}]" if category else _kind(name)
        k = by_kind.setdefault(kind, {"kind": kind, "us": 0.0, "count": 0})
        k["us"] += dur
        k["count"] += 1
        if "hlo_module" in args:
            by_module[str(args["hlo_module"])] += dur
    modules = dict(by_module) or _module_events(events)

    def per_step(row: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in row.items() if k not in ("us", "count")}
        return out | {
            "ms_per_step": row["us"] / 1e3 / steps,
            "count_per_step": row["count"] / steps,
            "share": row["us"] / total if total else 0.0,
        }

    ranked = sorted(by_op.values(), key=lambda r: -r["us"])
    return {
        "trace": str(trace),
        "source": where,
        "steps": steps,
        "op_events": len(ops),
        "device_ms_per_step": total / 1e3 / steps,
        "modules_ms_per_step": {m: us / 1e3 / steps for m, us in sorted(modules.items(), key=lambda kv: -kv[1])},
        "by_kind": [per_step(r) for r in sorted(by_kind.values(), key=lambda r: -r["us"])],
        "top_ops": [per_step(r) for r in ranked[:top]],
        "seen": seen,
    }


def compare_traces(traces: Mapping[str, str | Path], *, steps: int, top: int = 25) -> dict[str, Any]:
    """`summarize_trace` of each labelled trace (e.g. `{"equipax": ..., "plain": ...}`)."""
    return {label: summarize_trace(path, steps=steps, top=top) for label, path in traces.items()}


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    fmt = "  ".join(f"{{:<{widths[0]}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return [fmt.format(*headers), fmt.format(*("-" * w for w in widths)), *(fmt.format(*r) for r in rows)]


def format_comparison(summary: Mapping[str, Mapping[str, Any]], *, kinds: int = 15) -> str:
    """The summaries as text: totals, op kinds side by side, then each side's top ops."""
    labels = list(summary)
    lines = []
    for label in labels:
        s = summary[label]
        modules = ", ".join(f"{m} {ms:.2f}" for m, ms in list(s["modules_ms_per_step"].items())[:3])
        lines.append(
            f"{label}: {s['device_ms_per_step']:.2f} ms of device ops per step ({s['op_events']} events over "
            f"{s['steps']} steps; {s['source']}); modules ms/step: {modules or '-'}"
        )
        if not s["op_events"]:
            lines.append(f"  no device op events; processes: {s['seen']['processes']}")
            lines.append(f"  threads: {s['seen']['threads']}")
    all_kinds: dict[str, float] = collections.defaultdict(float)
    per_label = {label: {k["kind"]: k for k in summary[label]["by_kind"]} for label in labels}
    for label in labels:
        for kind, k in per_label[label].items():
            all_kinds[kind] = max(all_kinds[kind], k["ms_per_step"])
    rows = []
    for kind in sorted(all_kinds, key=lambda k: -all_kinds[k])[:kinds]:
        cells = [kind]
        for label in labels:
            k = per_label[label].get(kind)
            cells.append("-" if k is None else f"{k['ms_per_step']:.2f} ({k['count_per_step']:.0f})")
        if len(labels) == 2:
            a, b = (per_label[x].get(kind, {}).get("ms_per_step", 0.0) for x in labels)
            cells.append(f"{a - b:+.2f}")
        rows.append(cells)
    diff = [f"{labels[0]} - {labels[1]}"] if len(labels) == 2 else []
    lines += ["", "by op kind, ms per step (ops per step):"]
    lines += _table(["kind", *labels, *diff], rows)
    for label in labels:
        lines += ["", f"{label}: top ops by device time"]
        rows = [
            [
                o["name"][:60],
                o["category"][:24],
                f"{o['ms_per_step']:.3f}",
                f"{o['count_per_step']:.0f}",
                f"{o['share']:.1%}",
                o.get("long_name", "")[:90],
            ]
            for o in summary[label]["top_ops"]
        ]
        lines += _table(["op", "category", "ms/step", "n/step", "share", "long name"], rows)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Summarise one or two traces (labelled by their position: A, B, or --labels)."""
    p = argparse.ArgumentParser(description="Per-op device time of jax.profiler Perfetto traces.")
    p.add_argument("traces", nargs="+", help="perfetto_trace.json.gz files or folders holding them")
    p.add_argument("--labels", default=None, help="comma-separated labels (default: equipax,plain)")
    p.add_argument("--steps", type=int, default=1, help="steps in each trace")
    p.add_argument("--top", type=int, default=25, help="ops listed per trace")
    p.add_argument("--out", type=Path, default=None, help="JSON summary file")
    args = p.parse_args(argv)
    labels = args.labels.split(",") if args.labels else ["equipax", "plain", "c", "d"][: len(args.traces)]
    if len(labels) != len(args.traces):
        raise SystemExit(f"--labels: {len(labels)} labels for {len(args.traces)} traces")
    summary = compare_traces(dict(zip(labels, args.traces)), steps=args.steps, top=args.top)
    print(format_comparison(summary))
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return summary


if __name__ == "__main__":
    main()
