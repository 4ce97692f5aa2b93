"""Headless plots of a run's metrics (matplotlib, Agg backend).

matplotlib is a dependency of equipax-launch, but a host set up with only what a run needs (a TPU
image with the wheels of benchmarks/tpu/wheels.sh) may lack it: each plot function then draws
nothing and returns None, and its caller says so once (`NO_MATPLOTLIB`); the run is not stopped
for a picture."""

from typing import Any

from equipax.launch.store.storage import AnyPath, job_path, write_atomic

__all__ = ["NO_MATPLOTLIB", "plot_attention_bench", "plot_classifier_history", "plot_loss"]

NO_MATPLOTLIB = "matplotlib is not installed here, so no plot was drawn (`pip install matplotlib` draws them)."


def _pyplot() -> Any | None:
    """`matplotlib.pyplot` on the headless Agg backend, imported at the first plot, not with this
    module: about 0.2 s of CPU that a process drawing no plot (every process of a multi-host run
    but process 0, a run that stops on an error) does not pay. None where matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: AnyPath) -> AnyPath:
    """Lay out, write `fig` as PNG to `path` (creating folders; in a store, one object) and free it."""
    import io

    path = job_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt = _pyplot()
    assert plt is not None  # a figure exists, so matplotlib does
    plt.close(fig)
    write_atomic(path, png.getvalue())
    return path


def plot_loss(records: list[dict[str, Any]], path: AnyPath, *, title: str = "") -> AnyPath | None:
    """Train and eval loss against step, from metrics.jsonl records; writes a PNG.

    Arguments:
        records: metrics.jsonl records (`step`, `split`, `loss`).
        path: the PNG to write (parent directories are created).
        title: figure title.

    Returns:
        The path written (None where matplotlib is missing: `NO_MATPLOTLIB`).
    """
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    for split, style in (("train", "-"), ("eval", "o-")):
        pts = [
            (r["step"], r["loss"])
            for r in records
            if r.get("split") == split and isinstance(r.get("loss"), (int, float))
        ]
        if pts:
            xs, ys = zip(*sorted(pts))
            ax.plot(xs, ys, style, label=f"{split} loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_attention_bench(result: dict[str, Any], path: AnyPath) -> AnyPath | None:
    """Log-log forward time vs sequence length per implementation; speed-ups below.

    Arguments:
        result: what `equipax.launch.bench.attention_timing.run_attention_bench` returns (`results` rows
            with `seq_len`, `implementation`, `status`, `time_ms`, `speedup_vs_baseline`).
        path: the PNG to write (parent directories are created).

    Returns:
        The path written (None where matplotlib is missing: `NO_MATPLOTLIB`).
    """
    from matplotlib.ticker import NullFormatter

    plt = _pyplot()
    if plt is None:
        return None
    fig, (ax_t, ax_r) = plt.subplots(2, 1, figsize=(7, 7), dpi=100, sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    ok = [r for r in result["results"] if r["status"] == "ok"]
    for name in dict.fromkeys(r["implementation"] for r in result["results"]):
        rows = sorted((r for r in ok if r["implementation"] == name), key=lambda r: r["seq_len"])
        if not rows:
            continue
        xs = [r["seq_len"] for r in rows]
        bars = ax_t.errorbar(
            xs,
            [r["time_ms"]["mean"] for r in rows],
            yerr=[r["time_ms"]["std"] for r in rows],
            marker="o",
            capsize=3,
            label=name,
        )
        ratio = [
            (r["seq_len"], r["speedup_vs_baseline"])
            for r in rows
            if r["speedup_vs_baseline"] is not None and name != result.get("baseline")
        ]
        if ratio:
            ax_r.plot(*zip(*ratio), "o-", color=bars[0].get_color(), label=name)
    cfg = result["config"]
    if ok:  # log axes without data warn
        ax_t.set_xscale("log")
        ax_t.set_yscale("log")
    ax_t.set_ylabel("forward time (ms, mean ± std)")
    ax_t.set_title(
        f"attention, batch {cfg['batch_size']}, head_dim {cfg['head_dim']}, "
        f"{'causal' if cfg['causal'] else 'non-causal'} ({result['device']})"
    )
    ax_t.grid(alpha=0.3, which="both")
    ax_t.legend()
    ax_r.axhline(1.0, color="grey", lw=0.8)
    if ok:
        ax_r.set_yscale("log")
        ax_r.xaxis.set_minor_formatter(NullFormatter())  # crowded labels at 2x10^2, 3x10^2...
    ax_r.set_xlabel("sequence length")
    ax_r.set_ylabel(f"speed-up vs {result.get('baseline')}")
    ax_r.grid(alpha=0.3, which="both")
    if ax_r.get_legend_handles_labels()[0]:
        ax_r.legend()
    return _save(fig, path)


def plot_classifier_history(records: list[dict[str, Any]], path: AnyPath, *, title: str = "") -> AnyPath | None:
    """The CNN tutorial's figure (docs/tutorial_cnn.md): training loss (left), train and test accuracy (right) by epoch.

    Arguments:
        records: metrics.jsonl records of split `epoch` (`epoch`, `train_loss`,
            `train_accuracy`, `test_accuracy`).
        path: the PNG to write (parent directories are created).
        title: figure title.

    Returns:
        The path written (None where matplotlib is missing: `NO_MATPLOTLIB`).
    """
    rows = sorted((r for r in records if r.get("split") == "epoch"), key=lambda r: r["epoch"])
    epochs = [r["epoch"] for r in rows]
    plt = _pyplot()
    if plt is None:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4), dpi=100)
    ax1.plot(epochs, [r["train_loss"] for r in rows], "o-", label="Train Loss")
    ax1.set_xlabel("Epoch")
    ax1.set_ylabel("Loss")
    ax1.set_title("Training Loss")
    ax2.plot(epochs, [r["train_accuracy"] for r in rows], "o-", label="Train Accuracy")
    ax2.plot(epochs, [r["test_accuracy"] for r in rows], "o-", label="Test Accuracy")
    ax2.set_xlabel("Epoch")
    ax2.set_ylabel("Accuracy")
    ax2.set_title("Model Accuracy")
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
        if rows:  # a legend without artists warns
            ax.legend()
    if title:
        fig.suptitle(title)
    return _save(fig, path)
