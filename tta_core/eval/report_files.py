"""Writing a report's files: report.json, report.md (tta_core.eval.report) and the PNG plots
(tta_core.eval.report_plots).

Its own module so that the plots can depend on the report's records while the report does
not depend on the plots: no import cycle, and matplotlib loads only when plots are written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tta_core.eval.report import (
    RunRecord,
    gain_markdown,
    layer_updates_markdown,
    markdown_table,
    report_dict,
    summarize,
    write_json_atomic,
)


@dataclass
class ReportFiles:
    """Paths written by `write_report`."""

    json: Path
    markdown: Path
    plots: list[Path]


def write_report(runs: Sequence[RunRecord], out_dir: str | Path,
                 title: str = "tta report") -> ReportFiles:
    """Write report.json, report.md and the PNG plots of `runs` into `out_dir`."""
    from tta_core.eval.report_plots import write_plots  # lazy: matplotlib only when writing

    if not any(r.frames for r in runs):
        raise ValueError("no run has frames: nothing to report")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summaries = [summarize(r) for r in runs if r.frames]
    json_path = out / "report.json"
    write_json_atomic(json_path, report_dict(runs))
    md_path = out / "report.md"
    md_path.write_text(f"# {title}\n\nAccuracy in %, latency in ms.\n\n"
                       + markdown_table(summaries) + gain_markdown(summaries)
                       + layer_updates_markdown(runs))
    return ReportFiles(json_path, md_path, write_plots(summaries, out))
