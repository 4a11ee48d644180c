"""Segmentation outputs as images: label masks, a colour overlay and label-free statistics.

What a segmentation model's N x C x H x W logits become when they leave the process (the
perception node's `segmentation` and `segmentation_overlay` topics, tta_ros): one class id
per pixel (`label_masks`: uint8, or uint16 above 255 classes; a pixel whose logits are not
finite gets `unknown_id`), optionally resized to the frame by nearest neighbour
(`resize_masks`), a Cityscapes-like colour per class blended on the frame (`overlay`), and
what can be said online without labels (`mask_stats`: confidence, uncertain pixels, the
classes present and their shares). No rclpy: the node wraps these in messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import cv2
import numpy as np
import torch

from tta_core.errors import InputError

#: the Cityscapes colours of the 19 train ids (cityscapesScripts' labels.py), RGB
CITYSCAPES_PALETTE: tuple[tuple[int, int, int], ...] = (
    (128, 64, 128), (244, 35, 232), (70, 70, 70), (102, 102, 156), (190, 153, 153),
    (153, 153, 153), (250, 170, 30), (220, 220, 0), (107, 142, 35), (152, 251, 152),
    (70, 130, 180), (220, 20, 60), (255, 0, 0), (0, 0, 142), (0, 0, 70), (0, 60, 100),
    (0, 80, 100), (0, 0, 230), (119, 11, 32))
#: a pixel below this max-softmax probability counts as uncertain (`mask_stats`)
LOW_CONFIDENCE = 0.5


def mask_dtype(num_classes: int) -> np.dtype:
    """uint8 for up to 255 classes (ids 0-254, 255 left for unknown), else uint16."""
    if num_classes < 1 or num_classes > 65535:
        raise InputError(f"num_classes {num_classes} cannot be a mono8/mono16 mask")
    return np.dtype(np.uint8 if num_classes <= 255 else np.uint16)


def unknown_id(num_classes: int) -> int:
    """The id of a pixel without a finite prediction: 255 (Cityscapes' ignore) in mono8,
    65535 in mono16."""
    return int(np.iinfo(mask_dtype(num_classes)).max)


def palette(num_classes: int) -> np.ndarray:
    """(num_classes, 3) uint8 RGB colours: Cityscapes' for the first 19 ids, then hues
    spread by the golden angle (distinct, the same for every call)."""
    out = np.zeros((num_classes, 3), np.uint8)
    n = min(num_classes, len(CITYSCAPES_PALETTE))
    out[:n] = CITYSCAPES_PALETTE[:n]
    if num_classes > n:
        hues = ((np.arange(num_classes - n) * 137.508) % 360 / 2).astype(np.uint8)
        hsv = np.stack([hues, np.full_like(hues, 200), np.full_like(hues, 230)], -1)
        out[n:] = cv2.cvtColor(hsv[None], cv2.COLOR_HSV2RGB)[0]
    return out


def label_masks(logits: torch.Tensor) -> np.ndarray:
    """N x C x H x W logits -> (N, H, W) class ids (mask_dtype(C)); pixels whose logits are
    not all finite get unknown_id(C)."""
    if logits.dim() != 4:
        raise InputError(f"segmentation logits must be N x C x H x W, got shape "
                         f"{tuple(logits.shape)}")
    c = int(logits.shape[1])
    lab = logits.argmax(1)
    bad = ~torch.isfinite(logits).all(1)
    if bool(bad.any()):
        lab = lab.masked_fill(bad, unknown_id(c))
    return lab.cpu().numpy().astype(mask_dtype(c))


def resize_masks(masks: np.ndarray, hw: tuple[int, int]) -> np.ndarray:
    """(N, H, W) masks resized to `hw` by nearest neighbour (themselves when already)."""
    h, w = hw
    if masks.shape[1:] == (h, w):
        return masks
    return np.stack([cv2.resize(m, (w, h), interpolation=cv2.INTER_NEAREST) for m in masks])


def to_rgb8(x: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """A normalised N x 3 x H x W model input back to (N, H, W, 3) uint8 RGB (the frame as
    the model saw it)."""
    m = torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1)
    rgb = (x.detach().float().cpu() * s + m).clamp(0, 1).mul(255).round().to(torch.uint8)
    return rgb.permute(0, 2, 3, 1).contiguous().numpy()


def overlay(rgb: np.ndarray, mask: np.ndarray, colours: np.ndarray, alpha: float = 0.5
            ) -> np.ndarray:
    """(H, W, 3) uint8 frame with each pixel's class colour blended in (`alpha` of the
    colour; unknown ids leave the frame as it is); the frame is resized to the mask's
    size when it differs."""
    if not 0.0 <= alpha <= 1.0:
        raise InputError(f"overlay alpha {alpha!r} is not in [0, 1]")
    h, w = mask.shape
    if rgb.shape[:2] != (h, w):
        rgb = cv2.resize(rgb, (w, h), interpolation=cv2.INTER_AREA)
    known = mask < len(colours)
    col = colours[np.where(known, mask, 0)]
    out = cv2.addWeighted(rgb, 1.0 - alpha, col, alpha, 0.0)
    out[~known] = rgb[~known]
    return out


@dataclass
class MaskStats:
    """What a batch of masks says without labels: mean max-softmax probability, the share
    of uncertain pixels (below LOW_CONFIDENCE), the share of unknown pixels (not finite),
    and each predicted class's share of the pixels."""

    pixels: int
    mean_confidence: float
    low_confidence_share: float
    unknown_share: float
    class_share: dict[int, float] = field(default_factory=dict)

    def top(self, names: Sequence[str], k: int = 3) -> str:
        """The `k` most frequent classes as 'road 41.0 %, sky 22.3 %, ...'."""
        best = sorted(self.class_share.items(), key=lambda kv: -kv[1])[:k]
        return ", ".join(f"{names[c] if c < len(names) else c} {100 * v:.1f} %"
                         for c, v in best)


def mask_stats(logits: torch.Tensor, masks: np.ndarray) -> MaskStats:
    """MaskStats of N x C x H x W `logits` and their label_masks `masks`."""
    c = int(logits.shape[1])
    conf = torch.softmax(logits.detach().float(), 1).amax(1)
    finite = torch.isfinite(conf)
    n = int(conf.numel())
    good = conf[finite]
    counts = np.bincount(masks.reshape(-1).astype(np.int64), minlength=c)[:c]
    return MaskStats(n, float(good.mean()) if good.numel() else float("nan"),
                     float((good < LOW_CONFIDENCE).sum()) / max(n, 1),
                     1.0 - float(finite.sum()) / max(n, 1),
                     {int(k): float(counts[k]) / max(n, 1) for k in np.flatnonzero(counts)})
