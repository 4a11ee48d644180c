"""Segmentation scores from a confusion matrix: per-class IoU, mIoU, pixel accuracy.

The matrix counts pixels by (true class, predicted class); pixels whose label is the
ignore index (255) are left out. IoU of class c = TP / (TP + FP + FN); a class that is in
neither the labels nor the predictions has no IoU (NaN) and mIoU averages the others (the
Cityscapes convention for classes absent from an evaluation set).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

IGNORE_INDEX = 255


def confusion_matrix(pred: torch.Tensor, target: torch.Tensor, num_classes: int,
                     ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """(num_classes, num_classes) int64 counts, rows true class, columns predicted;
    ValueError when shapes differ or a label is neither a class nor `ignore_index`."""
    if pred.shape != target.shape:
        raise ValueError(f"predictions {tuple(pred.shape)} and labels {tuple(target.shape)} "
                         "differ in shape")
    t = target.reshape(-1).long()
    p = pred.reshape(-1).long()
    keep = t != ignore_index
    t, p = t[keep], p[keep]
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= num_classes):
        raise ValueError(f"labels reach {int(t.min())}..{int(t.max())}; expected 0.."
                         f"{num_classes - 1} or {ignore_index}")
    if p.numel() and (int(p.min()) < 0 or int(p.max()) >= num_classes):
        raise ValueError(f"predictions reach {int(p.max())}; expected 0..{num_classes - 1}")
    return torch.bincount(t * num_classes + p, minlength=num_classes ** 2).view(
        num_classes, num_classes)


@dataclass
class SegScores:
    """Scores of one confusion matrix (fractions in [0, 1]; NaN for absent classes)."""

    iou: list[float]
    miou: float
    pixel_accuracy: float
    pixels: int
    class_names: list[str] = field(default_factory=list)

    def named_iou(self) -> dict[str, float]:
        """{class name: IoU} of the classes that have one."""
        names = self.class_names or [str(i) for i in range(len(self.iou))]
        return {n: v for n, v in zip(names, self.iou, strict=True) if not math.isnan(v)}


def scores(conf: torch.Tensor, class_names: list[str] | tuple[str, ...] = ()) -> SegScores:
    """Per-class IoU, mIoU and pixel accuracy of a confusion matrix."""
    conf = conf.double()
    tp = conf.diag()
    union = conf.sum(0) + conf.sum(1) - tp
    iou = torch.where(union > 0, tp / union.clamp(min=1), torch.full_like(tp, float("nan")))
    present = ~torch.isnan(iou)
    total = float(conf.sum())
    return SegScores(iou=iou.tolist(),
                     miou=float(iou[present].mean()) if bool(present.any()) else float("nan"),
                     pixel_accuracy=float(tp.sum()) / total if total else float("nan"),
                     pixels=int(total), class_names=list(class_names))


class ConfusionMeter:
    """Accumulates the confusion matrix over batches of logits or predictions."""

    def __init__(self, num_classes: int, ignore_index: int = IGNORE_INDEX) -> None:
        self.num_classes = num_classes
        self.ignore_index = ignore_index
        self.matrix = torch.zeros(num_classes, num_classes, dtype=torch.int64)

    def update(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Add a batch: N x C x H x W logits (argmax over C) or N x H x W predictions;
        returns the batch's own matrix."""
        pred = output.argmax(1) if output.dim() == target.dim() + 1 else output
        conf = confusion_matrix(pred.detach().cpu(), target.cpu(), self.num_classes,
                                self.ignore_index)
        self.matrix += conf
        return conf

    def scores(self, class_names: list[str] | tuple[str, ...] = ()) -> SegScores:
        """Scores of everything added so far."""
        return scores(self.matrix, class_names)
