"""``sweep.png``: the objective against each searched value, and the spread over seeds or folds."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from finetune.plot import DPI, _matplotlib

PANEL_INCHES = 4.0


def save_sweep_figure(path: Path, header, rows: list[dict[str, Any]], best: Optional[dict[str, Any]], repeats,
                      repeat_values: list[tuple[int, float]]) -> None:
    """One panel per searched key (finished trials as dots, the best ringed), one for the seeds or folds when run
    (``repeats``: which)."""
    Figure = _matplotlib()
    dimensions = list(header.space.dimensions) if rows else []
    panels = len(dimensions) + (1 if repeat_values else 0)
    fig = Figure(figsize=(PANEL_INCHES * panels, PANEL_INCHES * 0.8), dpi=DPI, layout="constrained")
    axes = fig.subplots(1, panels, squeeze=False)[0]
    scored = [r for r in rows if r["state"] in ("complete", "same") and r["value"] is not None]
    for ax, dim in zip(axes, dimensions):
        if dim.kind == "choice":
            labels = [str(c) for c in dim.choices]
            position = {c: i for i, c in enumerate(labels)}
            x_of = lambda row, key=dim.key: position[str(row[key])]  # noqa: E731
            ax.set_xticks(range(len(labels)), labels)
        else:
            x_of = lambda row, key=dim.key: row[key]  # noqa: E731
            if dim.log:
                ax.set_xscale("log")
        ax.scatter([x_of(r) for r in scored], [r["value"] for r in scored], color="tab:blue", label="finished")
        if best is not None:
            ax.scatter([x_of(best)], [best["value"]], s=160, facecolors="none", edgecolors="tab:red", label="best")
        pruned = [r for r in rows if r["state"] == "pruned"]
        if pruned:
            ax.scatter([x_of(r) for r in pruned], [header_floor(scored)] * len(pruned), marker="x",
                       color="tab:gray", label="pruned (at the bottom)")
        ax.set_xlabel(dim.key)
        ax.set_ylabel(header.metric)
        ax.grid(alpha=0.3)
    if dimensions:
        axes[0].legend(fontsize="small")
    if repeat_values:
        ax = axes[-1]
        values = [v for _, v in repeat_values]
        mean = sum(values) / len(values)
        ax.scatter(range(len(values)), values, color="tab:green")
        ax.axhline(mean, color="tab:green", linestyle="--", label=f"mean {mean:.4f}")
        ax.set_xticks(range(len(values)), [str(s) for s, _ in repeat_values])
        ax.set_xlabel(repeats.key)
        ax.set_ylabel(header.metric)
        over = f"over {len(values)} {repeats.name}"
        ax.set_title(f"best config {over}" if dimensions else over)
        ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # several workers draw it: each its own, then a rename
    fig.savefig(tmp, format="png")
    os.replace(tmp, path)


def header_floor(scored: list[dict[str, Any]]) -> float:
    """Where pruned trials are drawn: at the lowest finished value (they have none of their own)."""
    return min((r["value"] for r in scored), default=0.0)
