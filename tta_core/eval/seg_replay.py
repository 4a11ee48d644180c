"""The report of a segmentation bag replayed through the perception node (`tta replay`,
`tta demo --task segmentation`): masks received, scored against the bag's masks.

Each frame's published mask (the node's `segmentation` topic) is joined to the bag's
ground-truth mask by stamp and counted into one confusion matrix per domain (ignore 255);
a predicted mask of another size than its label is resized by nearest neighbour. A pixel
the node could not predict (its unknown id) counts as missed for its true class. The run
keeps the mIoU and per-class IoU per domain, their mean, the frames scored and dropped, the
latency publish -> mask received, and from the AdaptationStatus messages the share of
batches adapted and the mean phase times. `write_seg_report` writes seg_report.json
(strict JSON) and seg_report.md (one row per method: mIoU per domain).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tta_core.data.scenes import CITYSCAPES_CLASSES
from tta_core.eval.miou import IGNORE_INDEX
from tta_core.io.seg_masks import resize_masks
from tta_core.io.strict_json import dumps as json_dumps

SCHEMA = "tta.seg_replay/1"


@dataclass
class SegReplayRun:
    """One method's replay of a segmentation bag (fractions in [0, 1], times in ms)."""

    method: str
    miou: dict[str, float]  # per domain, in stream order
    mean_miou: float
    class_iou: dict[str, dict[str, float]]
    frames: int  # frames scored
    frames_dropped: int  # published, never answered
    latency_ms_p50: float
    latency_ms_p95: float
    adapted_share: float
    phases_ms: dict[str, float] = field(default_factory=dict)  # mean per batch
    wall_s: float = math.nan
    meta: dict[str, Any] = field(default_factory=dict)


class SegMeter:
    """Confusion counts of one domain with an extra column for unknown predictions."""

    def __init__(self, num_classes: int) -> None:
        self.c = num_classes
        self.matrix = np.zeros((num_classes, num_classes + 1), np.int64)

    def update(self, pred: np.ndarray, target: np.ndarray) -> None:
        """Add one (H, W) predicted mask against its (H, W) train-id label."""
        if pred.shape != target.shape:
            pred = resize_masks(pred[None], target.shape)[0]
        keep = target != IGNORE_INDEX
        t = target[keep].astype(np.int64)
        p = pred[keep].astype(np.int64)
        if t.size and t.max() >= self.c:
            raise ValueError(f"label ids reach {int(t.max())}; expected 0..{self.c - 1} or "
                             f"{IGNORE_INDEX}")
        p = np.where(p < self.c, p, self.c)  # unknown id -> its own column
        self.matrix += np.bincount(t * (self.c + 1) + p, minlength=self.c * (self.c + 1)
                                   ).reshape(self.c, self.c + 1)

    def iou(self) -> np.ndarray:
        """Per-class IoU (NaN for a class in neither labels nor predictions)."""
        m = torch.from_numpy(self.matrix).double()
        tp = m[:, : self.c].diag()
        union = m.sum(1) + m[:, : self.c].sum(0) - tp
        return torch.where(union > 0, tp / union.clamp(min=1),
                           torch.full_like(tp, math.nan)).numpy()


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan


def score_run(method: str, truth: Sequence[tuple[int, np.ndarray, str]],
              masks: Mapping[int, tuple[np.ndarray, float]], statuses: Sequence[Any],
              published: Mapping[int, float], class_names: Sequence[str] = CITYSCAPES_CLASSES,
              wall_s: float = math.nan, meta: Mapping[str, Any] | None = None
              ) -> SegReplayRun:
    """The run of `truth` frames (stamp, label mask, domain) given the `masks` received
    (stamp -> (mask, latency ms)), the AdaptationStatus messages and the stamps published."""
    meters: dict[str, SegMeter] = {}
    latencies, dropped = [], 0
    for stamp, label, domain in truth:
        if stamp not in masks:
            dropped += stamp in published
            continue
        pred, latency = masks[stamp]
        meters.setdefault(domain, SegMeter(len(class_names))).update(pred, label)
        latencies.append(latency)
    miou, class_iou = {}, {}
    for domain, meter in meters.items():
        iou = meter.iou()
        miou[domain] = float(np.nanmean(iou)) if np.isfinite(iou).any() else math.nan
        class_iou[domain] = {class_names[c]: float(v) for c, v in enumerate(iou)
                             if not math.isnan(v)}
    phases = {k: float(np.mean([getattr(s, f"{k}_ms") for s in statuses]))
              for k in ("forward", "backward", "total")} if statuses else {}
    return SegReplayRun(method, miou, float(np.mean(list(miou.values()))) if miou else
                        math.nan, class_iou, len(latencies), dropped, _pct(latencies, 50),
                        _pct(latencies, 95), float(np.mean([bool(s.adapted) for s in statuses]))
                        if statuses else math.nan, phases, wall_s, dict(meta or {}))


def _cell(v: float) -> str:
    return "–" if math.isnan(v) else f"{100 * v:.1f}"


def seg_markdown(runs: Sequence[SegReplayRun], title: str) -> str:
    """One row per method: mIoU per domain (%), the mean, adapted share, latency."""
    domains = list(dict.fromkeys(d for r in runs for d in r.miou))
    lines = [f"# {title}", "", "mIoU (%) of the masks on `segmentation` against the bag's "
             "masks, per domain in stream order; latency: image published -> mask received.",
             "", "| method | " + " | ".join(domains) + " | mean mIoU % | adapted % | "
             "p50 ms | frames | dropped |", "|---" * (len(domains) + 6) + "|"]
    for r in runs:
        cells = " | ".join(_cell(r.miou.get(d, math.nan)) for d in domains)
        lines.append(f"| {r.method} | {cells} | {_cell(r.mean_miou)} | "
                     f"{_cell(r.adapted_share)} | {r.latency_ms_p50:.0f} | {r.frames} | "
                     f"{r.frames_dropped} |")
    return "\n".join(lines) + "\n"


@dataclass
class SegReportFiles:
    """The files write_seg_report wrote (plots: none)."""

    json: Path
    markdown: Path
    plots: list[Path] = field(default_factory=list)


def write_seg_report(runs: Sequence[SegReplayRun], out: str | Path, title: str
                     ) -> SegReportFiles:
    """seg_report.json and seg_report.md of `runs` in `out` (created)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = SegReportFiles(out / "seg_report.json", out / "seg_report.md")
    record = {"schema": SCHEMA, "title": title, "runs": [asdict(r) for r in runs]}
    files.json.write_text(json_dumps(record, indent=1) + "\n")
    files.markdown.write_text(seg_markdown(runs, title))
    return files
