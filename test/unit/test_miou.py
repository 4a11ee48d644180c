"""mIoU and per-class IoU from the confusion matrix, against brute-force counting."""

from __future__ import annotations

import math

import pytest
import torch

from tta_core.eval.miou import ConfusionMeter, confusion_matrix, scores


def _brute(pred, target, k):
    ious = []
    for c in range(k):
        valid = target != 255
        tp = int(((pred == c) & (target == c) & valid).sum())
        fp = int(((pred == c) & (target != c) & valid).sum())
        fn = int(((pred != c) & (target == c)).sum())
        ious.append(tp / (tp + fp + fn) if tp + fp + fn else math.nan)
    return ious


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_iou_equals_brute_force_counts(seed):
    g = torch.Generator().manual_seed(seed)
    k = 7
    target = torch.randint(0, k - 1, (3, 17, 23), generator=g)  # class 6 never labelled
    target[torch.rand(target.shape, generator=g) < 0.2] = 255
    pred = torch.randint(0, k - 2, (3, 17, 23), generator=g)  # 5, 6 never predicted
    got = scores(confusion_matrix(pred, target, k))
    want = _brute(pred, target, k)
    assert math.isnan(got.iou[6]) and math.isnan(want[6])
    assert got.iou[5] == 0.0 == want[5]
    assert got.iou[:6] == pytest.approx(want[:6], abs=1e-12)
    assert got.miou == pytest.approx(sum(want[:6]) / 6)
    valid = target != 255
    assert got.pixels == int(valid.sum())
    assert got.pixel_accuracy == pytest.approx(float((pred == target)[valid].float().mean()))


def test_meter_accumulates_logits_batches():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 5, 8, 9, generator=g)
    target = torch.randint(0, 5, (4, 8, 9), generator=g)
    meter = ConfusionMeter(5)
    for i in range(4):
        meter.update(logits[i:i + 1], target[i:i + 1])
    assert torch.equal(meter.matrix, confusion_matrix(logits.argmax(1), target, 5))
    assert meter.scores().miou == pytest.approx(scores(meter.matrix).miou)
    assert set(meter.scores(list("abcde")).named_iou()) == set("abcde")


def test_bad_labels_are_named():
    with pytest.raises(ValueError, match=r"0\.\.4 or 255"):
        confusion_matrix(torch.zeros(2, 2), torch.full((2, 2), 9), 5)
    with pytest.raises(ValueError, match="differ in shape"):
        confusion_matrix(torch.zeros(2, 2), torch.zeros(2, 3), 5)
