"""Regenerate the docs site's figures from real runs of the project's own commands.

    uv run python docs/figures/make_figures.py                  # every figure (~15 min on 2 CPU cores)
    uv run python docs/figures/make_figures.py quickstart cnn   # some of them
    uv run python docs/figures/make_figures.py --list

Each figure runs its command(s) (the `launch` CLI, a benchmark script) into `runs/figures/NAME/`,
then draws `docs/figures/NAME.png` (or `.svg`) from what the command wrote, and records the
command, the date and the machine in `docs/figures/figures.json`. The page that shows a figure
names the command in its caption (tests/docs/test_docs_site.py checks both). Figures are small PNGs
(dpi 100, palette-quantised) or text SVG: tens of KB each.
"""

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORK = ROOT / "runs" / "figures"
MANIFEST = HERE / "figures.json"


@dataclass(frozen=True)
class Figure:
    """A docs figure: its file name, the page that shows it, the commands that make its data (as a
    reader would type them, from the repository root), and how to draw it from their output."""

    file: str
    page: str
    commands: tuple[str, ...]
    draw: Callable[[Path, Path], None]  # (work dir, output file)


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 10, "axes.titlesize": 11, "figure.dpi": 100})
    return plt


def save_png(fig: Any, path: Path) -> None:
    """Write `fig` as a small PNG: a 256-colour palette keeps a line chart at tens of KB."""
    from PIL import Image

    plt = _plt()
    fig.tight_layout()
    tmp = path.with_suffix(".rgba.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    with Image.open(tmp) as im:
        im.convert("RGB").quantize(colors=256, dither=Image.Dither.NONE).save(path, optimize=True)
    tmp.unlink()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _series(records: list[dict[str, Any]], split: str, field: str) -> tuple[list[float], list[float]]:
    pts = sorted(
        (r["step"], r[field]) for r in records if r.get("split") == split and isinstance(r.get(field), (int, float))
    )
    return [p[0] for p in pts], [p[1] for p in pts]


def draw_quickstart(work: Path, out: Path) -> None:
    """The default run: train/eval loss (the LM's loss is its log-perplexity) and next-token
    accuracy against step, with the unigram entropy of the training tokens for reference."""
    plt = _plt()
    job = work / "job"
    records = read_jsonl(job / "metrics.jsonl")
    result = json.loads((job / "result.json").read_text())
    fig, (ax_l, ax_a) = plt.subplots(1, 2, figsize=(9, 3.6))
    for split, style in (("train", "-"), ("eval", "o-")):
        ax_l.plot(*_series(records, split, "loss"), style, label=f"{split}")
        ax_a.plot(*_series(records, split, "accuracy"), style, label=f"{split}")
    entropy = result.get("unigram_entropy")
    if entropy is not None:
        ax_l.axhline(entropy, color="grey", ls="--", lw=1, label=f"unigram entropy {entropy:.2f}")
    ax_l.set_ylabel("loss = log-perplexity (nats/token)")
    ax_l.set_title("loss and log-perplexity")
    ax_a.set_ylabel("next-token accuracy")
    ax_a.set_title("accuracy")
    for ax in (ax_l, ax_a):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{result.get('experiment', 'shakespeare_tiny')}: eval on held-out plays", fontsize=11)
    save_png(fig, out)


def draw_cnn(work: Path, out: Path) -> None:
    """The CNN tutorial's figure, as the run itself drew it (`plots/history.png`), made small."""
    from PIL import Image

    with Image.open(work / "job" / "plots" / "history.png") as im:
        im = im.convert("RGB")
        im = im.resize((im.width * 3 // 4, im.height * 3 // 4), Image.Resampling.LANCZOS)
        im.quantize(colors=256, dither=Image.Dither.NONE).save(out, optimize=True)


def draw_attention(work: Path, out: Path) -> None:
    """`launch bench attention`'s own plot (`attention_bench.png`), made small."""
    from PIL import Image

    with Image.open(work / "bench" / "attention_bench.png") as im:
        im.convert("RGB").quantize(colors=256, dither=Image.Dither.NONE).save(out, optimize=True)


def draw_bubble(work: Path, out: Path) -> None:
    """benchmarks/pipeline_bubble.py: measured step time vs the bubble formula's prediction, each
    relative to the same stages and schedule at the most microbatches."""
    plt = _plt()
    result = json.loads((work / "pipeline_bubble.json").read_text())
    rows = result["rows"]
    groups = list(dict.fromkeys((r["stages"], r["schedule"], r["repeats"]) for r in rows))
    fig, axes = plt.subplots(1, len(groups), figsize=(2.4 * len(groups), 3.4), sharey=True, squeeze=False)
    for ax, (stages, schedule, repeats) in zip(axes[0], groups):
        sel = sorted(
            (r for r in rows if (r["stages"], r["schedule"], r["repeats"]) == (stages, schedule, repeats)),
            key=lambda r: r["microbatches"],
        )
        ms = [r["microbatches"] for r in sel]
        x = range(len(sel))
        ax.bar(
            [i - 0.2 for i in x],
            [r["predicted_vs_most_microbatches"] for r in sel],
            0.4,
            color="#bbbbbb",
            label="formula",
        )
        ax.bar(
            [i + 0.2 for i in x],
            [r["measured_vs_most_microbatches"] for r in sel],
            0.4,
            color="#1f77b4",
            label="measured",
        )
        ax.set_xticks(list(x), [f"M={m}" for m in ms])
        ax.axhline(1.0, color="black", lw=0.6)
        name = schedule + (f" R={repeats}" if repeats > 1 else "")
        ax.set_title(f"S={stages}, {name}")
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].set_ylabel("step time / step time at M=8")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"pipeline bubble: c4_gpt3_xl_pipeline_smoke on {result['devices']}", fontsize=10)
    save_png(fig, out)


def h200_rows(readme: str) -> tuple[str, list[tuple[str, float, float, float]]]:
    """`(heading, [(variant, step s, TFLOP/s, MFU %)])` of the c4_1b train-step table under the
    "Measured: one NVIDIA H200" heading of benchmarks/README.md."""
    m = re.search(r"^### (Measured: one NVIDIA H200[^\n]*)\n(.*?)(?=^##)", readme, re.M | re.S)
    if m is None:
        raise SystemExit("benchmarks/README.md has no '### Measured: one NVIDIA H200' section")
    rows = []
    for line in m.group(2).splitlines():
        cells = [c.strip().strip("*") for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[4].endswith("%") and cells[1][:1].isdigit():
            variant = cells[0].replace("`", "")
            rows.append((variant, float(cells[1]), float(cells[3]), float(cells[4].rstrip("%"))))
    if not rows:
        raise SystemExit("no c4_1b train-step rows (variant | step s | tokens/s | TFLOP/s | MFU) in the H200 section")
    return m.group(1), rows


def draw_h200(work: Path, out: Path) -> None:
    """The H200 train-step figures recorded in benchmarks/README.md: MFU per variant."""
    plt = _plt()
    heading, rows = h200_rows((ROOT / "benchmarks" / "README.md").read_text())
    fig, ax = plt.subplots(figsize=(8, 2.8))
    names = [r[0] for r in rows][::-1]
    mfu = [r[3] for r in rows][::-1]
    bars = ax.barh(names, mfu, color=["#1f77b4" if "bf16" in n else "#999999" for n in names])
    for bar, (_, step, tflops, m) in zip(bars, rows[::-1]):
        ax.text(
            bar.get_width() + 0.8,
            bar.get_y() + bar.get_height() / 2,
            f"{m:.1f}%: {tflops:.0f} TFLOP/s, {step:.3f} s/step",
            va="center",
            fontsize=9,
        )
    ax.set_xlim(0, max(mfu) * 1.75)
    ax.set_xlabel("MFU (model FLOPs / 989 TFLOP/s datasheet bf16 peak)")
    ax.set_title(
        "c4_1b train step (1.1B params, 32 x 1024 tokens, full remat)\n" + heading.split(": ", 1)[1], fontsize=10
    )
    ax.grid(alpha=0.3, axis="x")
    save_png(fig, out)


def draw_architecture(work: Path, out: Path) -> None:
    sys.path.insert(0, str(HERE))
    from architecture import architecture_svg

    out.write_text(architecture_svg())


CLI = "uv run launch"
FIGURES = {
    "quickstart": Figure(
        "quickstart_loss.png",
        "quickstart.md",
        (f"{CLI} run --job-log-dir runs/figures/quickstart/job",),
        draw_quickstart,
    ),
    "cnn": Figure(
        "cnn_history.png",
        "tutorial_cnn.md",
        (f"{CLI} run --exp cnn_digits --job-log-dir runs/figures/cnn/job",),
        draw_cnn,
    ),
    "attention": Figure(
        "attention_speedup.png",
        "attention.md",
        (f"{CLI} bench attention --seq 128,256,512,1024,2048,4096 --repeats 5 --out runs/figures/attention/bench",),
        draw_attention,
    ),
    "bubble": Figure(
        "pipeline_bubble.png",
        "pipeline.md",
        (
            "uv run python benchmarks/pipeline_bubble.py --steps 8 --rounds 4 --warmup 2 "
            "--out runs/figures/bubble/pipeline_bubble.json",
        ),
        draw_bubble,
    ),
    "h200": Figure("h200_mfu.png", "attention.md", (), draw_h200),
    "architecture": Figure("architecture.svg", "index.md", (), draw_architecture),
}
# What a figure without a command is drawn from.
SOURCES = {
    "h200": "benchmarks/README.md (the measured H200 table)",
    "architecture": "the code: docs/figures/architecture.py reads the packages' modules and imports",
}


def _argv(command: str) -> list[str]:
    """A reader's command as this interpreter runs it (no nested `uv run`)."""
    words = command.split()
    if words[:3] == ["uv", "run", "launch"]:
        return [sys.executable, "-m", "equipax.launch.cli", *words[3:]]
    if words[:3] == ["uv", "run", "python"]:
        return [sys.executable, *words[3:]]
    raise ValueError(command)


def make(name: str, *, draw_only: bool = False) -> dict[str, Any]:
    fig = FIGURES[name]
    work = WORK / name
    if fig.commands and not draw_only:
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        for command in fig.commands:
            print(f"[{name}] {command}", flush=True)
            subprocess.run(_argv(command), cwd=ROOT, check=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out = HERE / fig.file
    fig.draw(work, out)
    print(f"[{name}] wrote {out.relative_to(ROOT)} ({out.stat().st_size / 1024:.0f} KB)", flush=True)
    import jax

    return {
        "file": fig.file,
        "page": fig.page,
        "commands": list(fig.commands),
        "source": SOURCES.get(name, "the commands' output under runs/figures/" + name),
        "regenerate": f"uv run python docs/figures/make_figures.py {name}",
        "made": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} CPU cores ({_cpu()}), jax {jax.__version__}",
    }


def _cpu() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    m = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    return m.group(1).strip() if m else platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("names", nargs="*", help=f"figures (default: all): {', '.join(FIGURES)}")
    parser.add_argument("--list", action="store_true", help="list the figures and their commands")
    parser.add_argument(
        "--draw-only", action="store_true", help="redraw from the output already under runs/figures/ (no commands run)"
    )
    args = parser.parse_args()
    unknown = [n for n in args.names if n not in FIGURES]
    if unknown:
        parser.error(f"unknown figure(s) {unknown}; known: {', '.join(FIGURES)}")
    if args.list:
        for name, fig in FIGURES.items():
            print(f"{name:13} {fig.file:22} {fig.page:16} {'; '.join(fig.commands) or SOURCES[name]}")
        return
    for name in args.names or list(FIGURES):
        entry = make(name, draw_only=args.draw_only)
        # Read the manifest afresh: another run of this script may have written it meanwhile.
        manifest = json.loads(MANIFEST.read_text()) if MANIFEST.exists() else {}
        if args.draw_only and name in manifest:  # the data, and so the run's date, are unchanged
            entry["made"], entry["machine"] = manifest[name]["made"], manifest[name]["machine"]
        manifest[name] = entry
        MANIFEST.write_text(json.dumps(dict(sorted(manifest.items())), indent=2) + "\n")


if __name__ == "__main__":
    main()
