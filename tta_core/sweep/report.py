"""The sweep's report: `sweep.json` (cells, rows), `sweep.md` (one table per condition:
mean ± 95 % CI over seeds per method and metric, the paired difference to the baseline)
and plots (mean accuracy with error bars; streaming accuracy vs frame rate)."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from tta_core.io.strict_json import write_json
from tta_core.sweep.aggregate import Row

PERCENT = ("mean_accuracy", "overall_accuracy", "within_budget", "adapted", "mean_miou",
           "online_error")


def _pct(metric: str) -> bool:
    return metric in PERCENT or metric.split("@")[0] in ("strict", "streaming", "deadline_met",
                                                         "miou")


def fmt(row: Row) -> str:
    """'41.2 ± 0.8' (percent for shares), '41.2' when one seed."""
    k = 100 if _pct(row.metric) else 1
    text = f"{k * row.ci.mean:.1f}"
    if not math.isnan(row.ci.half_width):
        text += f" ± {k * row.ci.half_width:.1f}"
    return text


def fmt_diff(row: Row) -> str:
    b = row.vs_baseline
    if b is None:
        return ""
    k = 100 if _pct(row.metric) else 1
    text = f"{k * b.diff.mean:+.1f}"
    if not math.isnan(b.diff.half_width):
        text += f" ± {k * b.diff.half_width:.1f}"
    return text + (f" {b.marker}" if b.marker else "")


def _condition_text(cond: dict[str, Any]) -> str:
    return ", ".join(f"{k.replace('_', '-')}={v}" for k, v in cond.items()) or "(base)"


def markdown(name: str, rows: list[Row], baseline: str, cells: list[dict[str, Any]]) -> str:
    """Per condition a table: method × metric, mean ± CI; the diff to the baseline."""
    failed = [c for c in cells if c.get("status") == "failed"]
    seeds = sorted({r.ci.n for r in rows}) or [0]
    lines = [f"# Sweep `{name}`", "",
             f"{len(cells)} cells, {len(failed)} failed; mean ± 95 % confidence interval over "
             f"{'/'.join(map(str, seeds))} seed(s) (Student t); percentages for shares."
             + (f" Δ: paired difference to `{baseline}` by seed, `*` p < 0.05 (paired t-test)."
                if baseline else ""), ""]
    by_cond: dict[str, list[Row]] = defaultdict(list)
    for r in rows:
        by_cond[_condition_text(r.condition)].append(r)
    for cond, rs in by_cond.items():
        metrics = list(dict.fromkeys(r.metric for r in rs))
        methods = list(dict.fromkeys(r.method for r in rs))
        cell = {(r.method, r.metric): r for r in rs}
        head = ["method"] + [x for m in metrics for x in ((m, f"Δ {m}") if baseline else (m,))]
        lines += [f"## {cond}", "", "| " + " | ".join(head) + " |",
                  "|---|" + "---:|" * (len(head) - 1)]
        for meth in methods:
            vals = []
            for m in metrics:
                r = cell.get((meth, m))
                vals.append(fmt(r) if r else "–")
                if baseline:
                    vals.append(fmt_diff(r) if r else "")
            lines.append(f"| {meth} | " + " | ".join(vals) + " |")
        lines.append("")
    lines += _nodes(cells)
    if failed:
        lines += ["## Failed cells", "", "| cell | error |", "|---|---|"]
        lines += [f"| `{' '.join(c.get('argv', []))}` | {c.get('error', '')} |" for c in failed]
    return "\n".join(lines) + "\n"


def _nodes(cells: list[dict[str, Any]]) -> list[str]:
    """A table of the Ray nodes that ran the cells and how many each, when more than one."""
    count: dict[tuple[str, str, str], int] = defaultdict(int)
    for c in cells:
        n = c.get("node") or {}
        if n.get("id"):
            count[(n["id"], n.get("ip", ""), n.get("host", ""))] += 1
    if len(count) < 2:
        return []
    return ["## Ray nodes", "", "| node | IP | host | cells |", "|---|---|---|---:|",
            *(f"| `{i[:12]}` | {ip} | {host} | {k} |" for (i, ip, host), k in count.items()), ""]


def _half_width(r: Row) -> float:
    """The CI half-width in % (0 where one seed gives no interval)."""
    return 0.0 if math.isnan(r.ci.half_width) else 100 * r.ci.half_width


def _accuracy_bars(ax: Any, acc: list[Row]) -> None:
    """Grouped bars: mean accuracy ± CI per condition, one bar per method."""
    conds = list(dict.fromkeys(_condition_text(r.condition) for r in acc))
    methods = list(dict.fromkeys(r.method for r in acc))
    width = 0.8 / max(1, len(methods))
    for j, meth in enumerate(methods):
        rs = {_condition_text(r.condition): r for r in acc if r.method == meth}
        shown = [c for c in conds if c in rs]
        ax.bar([conds.index(c) + j * width for c in shown], [100 * rs[c].ci.mean for c in shown],
               width, yerr=[_half_width(rs[c]) for c in shown], capsize=3, label=meth)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(conds))], conds, fontsize=7)
    ax.set_ylabel("mean accuracy %")


def _streaming_lines(ax: Any, stream: list[Row]) -> None:
    """Streaming accuracy ± CI against the camera rate, one line per (condition, method)."""
    keys = list(dict.fromkeys((_condition_text(r.condition), r.method) for r in stream))
    one_condition = len(keys) == len({m for _, m in keys})
    for cond, meth in keys:
        rs = sorted((float(r.metric.split("@")[1][:-2]), r) for r in stream
                    if r.method == meth and _condition_text(r.condition) == cond)
        ax.errorbar([h for h, _ in rs], [100 * r.ci.mean for _, r in rs],
                    yerr=[_half_width(r) for _, r in rs], capsize=3, marker="o",
                    label=meth if one_condition else f"{meth} ({cond})")
    ax.set_xscale("log")
    ax.set_xlabel("camera frame rate, Hz")
    ax.set_ylabel("streaming accuracy %")


def plots(rows: list[Row], out: Path) -> list[Path]:
    """accuracy.png (mean accuracy ± CI per method and condition) and, when streaming ran,
    streaming.png (streaming accuracy vs frame rate with error bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    acc = [r for r in rows if r.metric == "mean_accuracy"]
    stream = [r for r in rows if r.metric.startswith("streaming@")]
    n_bars = len({_condition_text(r.condition) for r in acc}) * len({r.method for r in acc})
    figures = [("accuracy.png", acc, _accuracy_bars, (max(5, 1.2 * n_bars), 3.5)),
               ("streaming.png", stream, _streaming_lines, (5.5, 3.5))]
    written = []
    for name, selected, draw, size in figures:
        if not selected:
            continue
        fig, ax = plt.subplots(figsize=size)
        draw(ax, selected)
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(out / name)
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written


def write_report(name: str, rows: list[Row], baseline: str, cells: list[dict[str, Any]],
                 out: Path) -> list[Path]:
    """sweep.json, sweep.md and the plots under `out`."""
    write_json(out / "sweep.json", {"name": name, "baseline": baseline, "cells": cells,
                                    "rows": [r.as_json() for r in rows]})
    (out / "sweep.md").write_text(markdown(name, rows, baseline, cells))
    return [out / "sweep.json", out / "sweep.md", *plots(rows, out)]
