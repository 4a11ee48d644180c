"""Report summary numbers on hand-made records; files written; plots non-empty."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tta_core.eval.report import (
    FrameRecord,
    RunRecord,
    domain_segments,
    load_runs,
    markdown_table,
    summarize,
)
from tta_core.eval.report_files import write_report


def _run(method: str = "tent") -> RunRecord:
    """8 frames: clean (4, 3 right), fog (2, 0 right), clean again (2, 2 right);
    batches of 2 with known phase times; e2e on all but one frame."""
    doms = ["clean"] * 4 + ["fog/5"] * 2 + ["clean"] * 2
    labels = [0, 1, 2, 3, 4, 5, 6, 7]
    preds = [0, 1, 2, 9, 9, 9, 6, 7]
    frames = []
    for i in range(8):
        b = i // 2
        phases = {"forward": 1.0 + b, "backward": 2.0 * b, "total": 1.0 + 3.0 * b}
        e2e = math.nan if i == 7 else 10.0 + i
        frames.append(FrameRecord(doms[i], labels[i], preds[i], b, phases, e2e, stamp_ns=i))
    return RunRecord(method, frames, wall_s=2.0, peak_memory_mb=123.0, frames_dropped=1)


def test_summary_numbers() -> None:
    s = summarize(_run())
    assert list(s.accuracy) == ["clean", "fog/5"]  # stream order of first appearance
    assert s.accuracy["clean"] == pytest.approx(5 / 6)
    assert s.accuracy["fog/5"] == 0.0
    assert s.mean_accuracy == pytest.approx((5 / 6 + 0) / 2)
    assert s.overall_accuracy == pytest.approx(5 / 8)
    assert s.throughput_fps == pytest.approx(4.0)
    assert s.n_batches == 4
    # per-batch totals 1, 4, 7, 10: each batch counted once, not once per frame
    tot = s.phases["total"]
    assert (tot.n, tot.mean, tot.max) == (4, pytest.approx(5.5), 10.0)
    assert tot.p50 == pytest.approx(np.percentile([1, 4, 7, 10], 50))
    assert tot.p90 == pytest.approx(np.percentile([1, 4, 7, 10], 90))
    assert "plan" not in s.phases  # never measured -> not reported
    e2e = np.array([10.0 + i for i in range(7)])
    assert s.e2e is not None and s.e2e.n == 7  # NaN (missing) excluded
    assert s.e2e.p90 == pytest.approx(np.percentile(e2e, 90))
    assert (s.peak_memory_mb, s.frames_dropped) == (123.0, 1)


def test_segments_split_recurring_domains() -> None:
    segs = domain_segments(_run().frames)
    assert [(g.domain, g.start, g.stop) for g in segs] == [
        ("clean", 0, 4), ("fog/5", 4, 6), ("clean", 6, 8)]
    assert [g.accuracy for g in segs] == [0.75, 0.0, 1.0]


def test_unknown_batch_counts_each_frame_and_no_e2e() -> None:
    frames = [FrameRecord("a", 0, 0, -1, {"total": float(t)}) for t in (1, 1, 4)]
    s = summarize(RunRecord("source", frames))
    assert s.phases["total"].n == 3 and s.phases["total"].mean == pytest.approx(2.0)
    assert s.e2e is None and math.isnan(s.throughput_fps)


def test_empty_run_is_rejected() -> None:
    with pytest.raises(ValueError, match="no frames"):
        summarize(RunRecord("empty"))


def test_markdown_table_rows() -> None:
    other = RunRecord("source", [FrameRecord("fog/5", 1, 1, 0, {"total": 2.0})], wall_s=1.0)
    md = markdown_table([summarize(_run()), summarize(other)])
    lines = md.strip().splitlines()
    assert lines[0].split("|")[2:4] == [" clean ", " fog/5 "]
    tent = lines[2].split("|")
    assert tent[1].strip() == "tent" and tent[2].strip() == "83.3" and tent[3].strip() == "0.0"
    src = lines[3].split("|")
    assert src[2].strip() == "–" and src[3].strip() == "100.0"  # domain it never saw


def test_write_report_files_roundtrip(tmp_path) -> None:
    runs = [_run("tent"), _run("adashadow")]
    files = write_report(runs, tmp_path / "out")
    data = json.loads(files.json.read_text())  # strict JSON (NaN written as null)
    assert data["summaries"][0]["accuracy"]["clean"] == pytest.approx(5 / 6)
    assert "| adashadow |" in files.markdown.read_text()
    assert len(files.plots) == 3
    for p in files.plots:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    back = load_runs(files.json)
    assert [f.prediction for f in back[1].frames] == [f.prediction for f in runs[1].frames]
    assert math.isnan(back[0].frames[7].e2e_ms)
    assert summarize(back[0]) == summarize(runs[0])


def test_write_report_without_frames_fails(tmp_path) -> None:
    with pytest.raises(ValueError, match="no run has frames"):
        write_report([RunRecord("tent")], tmp_path)


def test_budget_adherence_counts_batches_with_a_budget(tmp_path) -> None:
    """Per batch (not per frame): totals 1, 4, 7, 10 against a 5 ms budget -> 2 of 4 held;
    frames without a budget do not count; methods without any budget show '–'."""
    run = _run("adashadow")
    for f in run.frames:
        f.budget_ms = 5.0 if f.batch_id < 3 else 12.0  # the last batch (10 ms) holds 12
    run.frames[6].budget_ms = run.frames[7].budget_ms = math.nan  # ...but reports none
    s = summarize(run)
    assert s.within_budget == pytest.approx(2 / 3)  # batches 0, 1 hold 5 ms; 2 does not
    assert math.isnan(summarize(_run()).within_budget)
    md = markdown_table([s, summarize(_run("tent"))]).strip().splitlines()
    col = [c.strip() for c in md[0].split("|")].index("in budget %")
    assert [c.strip() for c in md[2].split("|")][col] == "67"
    assert [c.strip() for c in md[3].split("|")][col] == "–"
    back = load_runs(write_report([run], tmp_path).json)[0]
    assert back.frames[0].budget_ms == 5.0 and math.isnan(back.frames[7].budget_ms)
    assert summarize(back).within_budget == pytest.approx(2 / 3)


def test_adapted_share_counts_batches_that_reported_it() -> None:
    run = _run("adashadow")
    for f in run.frames:  # batches 0..3: updated, not, not reported, updated
        f.adapted = {0: True, 1: False, 2: None, 3: True}[f.batch_id]
    s = summarize(run)
    assert s.adapted == pytest.approx(2 / 3)
    assert math.isnan(summarize(_run()).adapted)
    md = markdown_table([s]).strip().splitlines()
    col = [c.strip() for c in md[0].split("|")].index("adapted %")
    assert [c.strip() for c in md[2].split("|")][col] == "67"
