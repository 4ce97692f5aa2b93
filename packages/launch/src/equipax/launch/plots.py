"""Headless plots of a run's metrics (matplotlib, Agg backend)."""

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_loss(records: list[dict[str, Any]], path: Path, *, title: str = "") -> Path:
    """Train and eval loss against step, from metrics.jsonl records; writes a PNG.

    Arguments:
        records: metrics.jsonl records (`step`, `split`, `loss`).
        path: the PNG to write (parent directories are created).
        title: figure title.

    Returns:
        The path written.
    """
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    for split, style in (("train", "-"), ("eval", "o-")):
        pts = [(r["step"], r["loss"]) for r in records
               if r.get("split") == split and isinstance(r.get("loss"), (int, float))]
        if pts:
            xs, ys = zip(*sorted(pts))
            ax.plot(xs, ys, style, label=f"{split} loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
