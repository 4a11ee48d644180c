"""Segmentation outputs without ROS: masks from logits (unknown pixels, mono16), the
palette and overlay, label-free statistics, ground-truth masks in bags, and the replay's
mIoU per domain."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tta_core.errors import InputError
from tta_core.eval.seg_replay import SegMeter, score_run, write_seg_report
from tta_core.io.bag import bag_info, read_bag, write_bag
from tta_core.io.seg_masks import (
    CITYSCAPES_PALETTE,
    label_masks,
    mask_stats,
    overlay,
    palette,
    resize_masks,
    to_rgb8,
    unknown_id,
)


def test_label_masks_argmax_unknown_and_wide_ids() -> None:
    logits = torch.randn(2, 19, 4, 6)
    logits[1, 3, 2, 5] = math.nan
    masks = label_masks(logits)
    assert masks.dtype == np.uint8 and masks.shape == (2, 4, 6)
    want = logits.argmax(1).numpy()
    want[1, 2, 5] = 255
    assert (masks == want).all()
    wide = label_masks(torch.randn(1, 300, 2, 2))
    assert wide.dtype == np.uint16 and unknown_id(300) == 65535 and wide.max() < 300
    with pytest.raises(InputError, match="N x C x H x W"):
        label_masks(torch.randn(2, 19))


def test_palette_overlay_and_resize() -> None:
    assert [tuple(c) for c in palette(19)] == list(CITYSCAPES_PALETTE)
    big = palette(40)
    assert len({tuple(c) for c in big}) == 40  # the extra hues are distinct
    rgb = np.full((4, 4, 3), 100, np.uint8)
    mask = np.zeros((4, 4), np.uint8)
    mask[0, 0] = 255  # unknown: the frame shows through
    out = overlay(rgb, mask, palette(19), alpha=1.0)
    assert (out[0, 0] == 100).all() and (out[1, 1] == CITYSCAPES_PALETTE[0]).all()
    assert (overlay(rgb, mask, palette(19), alpha=0.0) == rgb).all()
    half = overlay(np.zeros((2, 2, 3), np.uint8), mask[:4:2, :4:2] * 0 + 13, palette(19))
    assert np.abs(half[0, 0].astype(int) - np.array(CITYSCAPES_PALETTE[13]) / 2).max() <= 1
    assert overlay(np.zeros((8, 8, 3), np.uint8), mask, palette(19)).shape == (4, 4, 3)
    masks = np.arange(6, dtype=np.uint8).reshape(1, 2, 3)
    up = resize_masks(masks, (4, 6))
    assert up.shape == (1, 4, 6) and set(np.unique(up)) == set(range(6))  # ids stay ids
    with pytest.raises(InputError, match="alpha"):
        overlay(rgb, mask, palette(19), alpha=1.5)


def test_to_rgb8_inverts_the_normalisation() -> None:
    img = np.random.default_rng(0).integers(0, 256, (2, 5, 7, 3), dtype=np.uint8)
    mean, std = (0.4, 0.5, 0.6), (0.2, 0.3, 0.25)
    x = (torch.from_numpy(img).float().div(255).permute(0, 3, 1, 2)
         - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    assert (to_rgb8(x, mean, std) == img).all()


def test_mask_stats_count_confidence_classes_and_unknown() -> None:
    logits = torch.full((1, 3, 2, 2), -10.0)
    logits[0, 0, 0, :] = 10.0  # two confident road pixels
    logits[0, 2, 1, 0] = 10.0  # one confident class 2
    logits[0, :, 1, 1] = math.nan
    s = mask_stats(logits, label_masks(logits))
    assert s.pixels == 4 and s.unknown_share == 0.25
    assert s.class_share == {0: 0.5, 2: 0.25} and s.mean_confidence == pytest.approx(1.0)
    assert s.top(["road", "sidewalk", "building"], 1) == "road 50.0 %"


def test_segmentation_bag_round_trip_and_bad_mask(tmp_path) -> None:
    rng = np.random.default_rng(1)
    frames = [(rng.integers(0, 256, (6, 10, 3), dtype=np.uint8),
               rng.choice(np.r_[np.arange(19), 255], (6, 10)).astype(np.uint8), d)
              for d in ("clean", "fog/4", "fog/4")]
    info = write_bag(tmp_path / "seg", frames, task="segmentation")
    assert info.task == "segmentation" and info.has_ground_truth and info.n_images == 3
    got = list(read_bag(tmp_path / "seg"))
    for (img, mask, dom), f in zip(frames, got, strict=True):
        assert (f.image == img).all() and (f.mask == mask).all() and f.domain == dom
        assert f.label == -1
    with pytest.raises(ValueError, match="mask must be"):
        write_bag(tmp_path / "bad", [(frames[0][0], frames[0][1][:3], "clean")],
                  task="segmentation")
    assert bag_info(tmp_path / "seg").task == "segmentation"


def test_seg_meter_scores_unknown_as_missed_and_resizes() -> None:
    label = np.array([[0, 0, 1, 1], [0, 0, 1, 255]], np.uint8)
    m = SegMeter(2)
    m.update(label.copy(), label)
    assert np.allclose(m.iou(), [1.0, 1.0])
    pred = label.copy()
    pred[0, 2] = 255  # unknown on a class-1 pixel: a miss for class 1, no false positive
    m = SegMeter(2)
    m.update(pred, label)
    assert np.allclose(m.iou(), [1.0, 2 / 3])  # class 1: TP 2, missed 1
    m = SegMeter(2)
    m.update(np.array([[0, 1]], np.uint8), label)  # 1 x 2 prediction resized to 2 x 4
    assert np.allclose(m.iou(), [1.0, 1.0])


def test_score_run_per_domain_dropped_and_report(tmp_path) -> None:
    lab = np.zeros((2, 2), np.uint8)
    lab[1] = 1
    truth = [(1, lab, "clean"), (2, lab, "fog/4"), (3, lab, "fog/4")]
    wrong = 1 - lab
    masks = {1: (lab, 10.0), 2: (wrong, 30.0)}  # 3 was published and never answered
    st = type("St", (), {"forward_ms": 2.0, "backward_ms": 1.0, "total_ms": 3.0,
                         "adapted": True, "method": "tent"})()
    run = score_run("tent", truth, masks, [st], {1: 0.0, 2: 0.0, 3: 0.0},
                    class_names=("road", "sidewalk"))
    assert run.miou == {"clean": 1.0, "fog/4": 0.0} and run.mean_miou == 0.5
    assert run.frames == 2 and run.frames_dropped == 1 and run.latency_ms_p50 == 20.0
    assert run.adapted_share == 1.0 and run.phases_ms["total"] == 3.0
    files = write_seg_report([run], tmp_path / "r", "t")
    assert "| tent | 100.0 | 0.0 | 50.0 | 100.0 | 20 | 2 | 1 |" in files.markdown.read_text()
    assert '"schema": "tta.seg_replay/1"' in files.json.read_text()
