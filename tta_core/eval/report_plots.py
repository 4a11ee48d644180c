"""PNG plots of a report (matplotlib, Agg backend: no display needed).

- accuracy.png: accuracy of each contiguous domain segment over the stream, per method;
- latency.png: mean time per phase as stacked bars, one bar per method;
- tradeoff.png: mean accuracy vs latency per frame, one point per method.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from tta_core.eval.report import PHASES, RunSummary


def _accuracy_over_time(summaries: Sequence[RunSummary], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(9, 3.6))
    for s in summaries:
        xs, ys = [], []
        for seg in s.segments:
            xs += [seg.start, seg.stop]
            ys += [100 * seg.accuracy] * 2
        ax.plot(xs, ys, label=s.method)
    first = summaries[0]
    for seg in first.segments:
        ax.axvline(seg.start, color="0.85", lw=0.8, zorder=0)
        ax.text((seg.start + seg.stop) / 2, 103, seg.domain, rotation=90, fontsize=6,
                ha="center", va="bottom")
    ax.set(xlabel="frame", ylabel="accuracy per domain segment (%)", ylim=(-2, 102))
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _latency_bars(summaries: Sequence[RunSummary], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(summaries) + 2), 3.6))
    names = [s.method for s in summaries]
    bottom = [0.0] * len(summaries)
    for phase in PHASES:
        vals = [s.phases[phase].mean if phase in s.phases else 0.0 for s in summaries]
        if any(vals):
            ax.bar(names, vals, bottom=bottom, label=phase)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    for i, s in enumerate(summaries):  # measured total (may exceed the sum of phases)
        if "total" in s.phases:
            ax.plot([i - 0.4, i + 0.4], [s.phases["total"].mean] * 2, "k--", lw=1)
    ax.set(ylabel="mean time per batch (ms)", title="latency per phase (dashed: total)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _tradeoff(summaries: Sequence[RunSummary], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(5, 4))
    for s in summaries:
        total = s.phases.get("total")
        lat = s.e2e.mean if s.e2e else (total.mean if total else float("nan"))
        ax.scatter([lat], [100 * s.mean_accuracy])
        ax.annotate(s.method, (lat, 100 * s.mean_accuracy), fontsize=8,
                    xytext=(4, 4), textcoords="offset points")
    xlabel = "end-to-end latency (ms)" if all(s.e2e for s in summaries) else "ms per batch"
    ax.set(xlabel=xlabel, ylabel="mean accuracy (%)", title="accuracy vs latency")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(summaries: Sequence[RunSummary], out_dir: Path) -> list[Path]:
    """Write the three PNG plots of `summaries` into `out_dir`; returns their paths."""
    if not summaries:
        raise ValueError("no summaries to plot")
    return [
        _accuracy_over_time(summaries, out_dir / "accuracy.png"),
        _latency_bars(summaries, out_dir / "latency.png"),
        _tradeoff(summaries, out_dir / "tradeoff.png"),
    ]
