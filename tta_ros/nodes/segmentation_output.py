"""What the perception node publishes for a segmentation card (task carried by the card).

`SegmentationOutput` (made by PerceptionOutput when the card's task is segmentation) owns
two publishers, both reliable (depth SEG_DEPTH; RViz's best-effort image display takes
them too), one message per frame with the frame's own header:

- `segmentation`: sensor_msgs/Image, mono8 class ids (mono16 above 255 classes); a pixel
  without a finite prediction is 255 (65535). Its size is the model input's (H x W of the
  card) by default, or the frame's with `segmentation_size: frame` (nearest neighbour:
  the class ids stay ids);
- `segmentation_overlay`: rgb8, the Cityscapes colours of the classes blended on the frame
  (`overlay_alpha` of the colour) at the mask's size, for RViz; off with
  `publish_overlay: false`.

No labels exist online, so its `segmentation` status on /diagnostics says what can be
seen without them (tta_core.io.seg_masks.mask_stats): the last batch's mean max-softmax
confidence, its share of uncertain pixels (below 0.5) and of non-finite ones (WARN while
there are any), the classes present and the three largest, and the frames published.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from diagnostic_msgs.msg import DiagnosticStatus
from sensor_msgs.msg import Image

from tta_core.io.image_msg import Preprocess
from tta_core.io.seg_masks import (
    MaskStats,
    label_masks,
    mask_stats,
    overlay,
    palette,
    resize_masks,
    to_rgb8,
)
from tta_core.model.source import ModelCard
from tta_ros.diagnostics import OK, WARN, status
from tta_ros.lifecycle import ManagedNode

MASK_TOPIC = "segmentation"
OVERLAY_TOPIC = "segmentation_overlay"
#: frames of masks / overlays kept for a slow reliable reader (a few batches)
SEG_DEPTH = 30
SIZES = ("input", "frame")  # the mask's size: the model input's or the frame's


def mask_msg(header: Any, mask: np.ndarray) -> Image:
    """sensor_msgs/Image of a (H, W) uint8 (mono8) or uint16 (mono16, little-endian) mask."""
    h, w = mask.shape
    wide = mask.dtype == np.uint16
    data = np.ascontiguousarray(mask.astype("<u2") if wide else mask)
    msg = Image(height=h, width=w, encoding="mono16" if wide else "mono8", is_bigendian=0,
                step=w * data.itemsize, data=data.tobytes())
    msg.header = header
    return msg


def rgb8_msg(header: Any, rgb: np.ndarray) -> Image:
    """sensor_msgs/Image (rgb8) of a (H, W, 3) uint8 frame."""
    h, w = rgb.shape[:2]
    msg = Image(height=h, width=w, encoding="rgb8", is_bigendian=0, step=3 * w,
                data=np.ascontiguousarray(rgb).tobytes())
    msg.header = header
    return msg


class SegmentationOutput:
    """The segmentation publishers and their label-free statistics; see the module
    docstring."""

    def __init__(self, node: ManagedNode, card: ModelCard, pre: Preprocess, size: str,
                 alpha: float, with_overlay: bool) -> None:
        if size not in SIZES:
            raise ValueError(f"segmentation_size {size!r}: choose from {', '.join(SIZES)}")
        self.pub_mask = node.create_lifecycle_publisher(Image, MASK_TOPIC, SEG_DEPTH)
        self.pub_overlay = (node.create_lifecycle_publisher(Image, OVERLAY_TOPIC, SEG_DEPTH)
                            if with_overlay else None)
        self.pre, self.size, self.alpha = pre, size, float(alpha)
        self.class_names = list(card.class_names)
        self.colours = palette(card.num_classes)
        self.frames = 0
        self.last: MaskStats | None = None

    def publish(self, headers: Sequence[Any], logits: torch.Tensor, x: torch.Tensor,
                sizes: Sequence[tuple[int, int]], pixels: Sequence[np.ndarray | None]
                ) -> None:
        """A batch's masks (and overlays), one per frame with its header: `logits` N x C x
        H x W, `x` the batch's model input, `sizes` the frames' (height, width), `pixels`
        the frames' decoded RGB where kept (frame-size overlays)."""
        masks = label_masks(logits)
        self.last = mask_stats(logits, masks)
        views = to_rgb8(x, self.pre.mean, self.pre.std) if self.pub_overlay else None
        for i, header in enumerate(headers):
            mask = masks[i]
            if self.size == "frame":
                mask = resize_masks(mask[None], tuple(sizes[i]))[0]
            self.pub_mask.publish(mask_msg(header, mask))
            if self.pub_overlay is not None:
                pix = pixels[i] if i < len(pixels) and pixels[i] is not None else views[i]
                if pix.dtype != np.uint8:  # a 32FC frame, in [0, 1]
                    pix = np.round(np.clip(pix, 0, 1) * 255).astype(np.uint8)
                self.pub_overlay.publish(rgb8_msg(header, overlay(pix, mask, self.colours,
                                                                  self.alpha)))
        self.frames += len(headers)

    def status(self) -> DiagnosticStatus:
        """The `segmentation` status: what the last batch's masks show, no labels needed."""
        h, w = self.pre.hw
        values: dict[str, object] = {
            "frames": self.frames, "mask_size": f"{h}x{w}" if self.size == "input" else
            "frame", "overlay": self.pub_overlay is not None}
        s = self.last
        if s is None:
            return status("segmentation", OK, "no frame yet", values)
        values.update({"mean_confidence": s.mean_confidence,
                       "low_confidence_share": s.low_confidence_share,
                       "unknown_share": s.unknown_share,
                       "classes_present": len(s.class_share),
                       "top_classes": s.top(self.class_names)})
        level = WARN if s.unknown_share > 0 else OK
        message = (f"{100 * s.unknown_share:.1f} % of the last batch's pixels not finite"
                   if level == WARN else
                   f"mean confidence {s.mean_confidence:.3f}, {len(s.class_share)} classes")
        return status("segmentation", level, message, values)
