"""Sweep plots: one figure per metric family, drawn from the aggregated rows."""

from __future__ import annotations

from pathlib import Path

import pytest

from tta_core.sweep.aggregate import Sample, aggregate
from tta_core.sweep.report import plots

pytest.importorskip("matplotlib")


def _samples(metrics: list[str]) -> list[Sample]:
    return [Sample((("batch_size", b),), m, seed, metric, 0.4 + 0.01 * seed + 0.1 * (m == "tent"))
            for b in (4, 16) for m in ("bn_adapt", "tent") for seed in (0, 1, 2)
            for metric in metrics]


def test_accuracy_and_streaming_plots_are_written(tmp_path: Path) -> None:
    rows = aggregate(_samples(["mean_accuracy", "streaming@10Hz", "streaming@30Hz"]),
                     baseline="bn_adapt")
    written = plots(rows, tmp_path)
    assert [p.name for p in written] == ["accuracy.png", "streaming.png"]
    assert all(p.stat().st_size > 1000 and p.read_bytes()[:4] == b"\x89PNG" for p in written)


def test_no_streaming_plot_without_streaming_rows(tmp_path: Path) -> None:
    written = plots(aggregate(_samples(["mean_accuracy"])), tmp_path)
    assert [p.name for p in written] == ["accuracy.png"]
    assert not (tmp_path / "streaming.png").exists()
