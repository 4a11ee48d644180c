"""sensor_msgs/Image -> model input tensor, in numpy (no cv_bridge: it breaks under NumPy 2).

Supported encodings: rgb8, bgr8, mono8, rgba8, bgra8 (8-bit: `is_bigendian` is irrelevant)
mono16, rgb16 (16-bit: byte order taken from `is_bigendian`, scaled by 1/65535) and
32FC1, 32FC3 (float32 RGB already in [0, 1], byte order from `is_bigendian`; these are the
encodings through which NaN pixels can arrive, and NaN/inf is refused).
Rows may be padded (`step` > width * bytes per pixel); padding bytes are ignored.
Output: float32 NCHW RGB in [0, 1], resized (bilinear) to the model card's image size and
normalised with its mean/std. Anything else is refused with a ValueError naming the value.
Works on any object with the Image fields (height, width, encoding, is_bigendian, step, data),
so tests and bag readers can use it without rclpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class EncodingSpec:
    """Layout of one encoding: channels, bytes per channel, channel order to reach RGB."""

    channels: int
    depth: int  # bytes per channel
    to_rgb: tuple[int, ...]  # channel indices giving R, G, B (mono: (0, 0, 0))
    kind: str = "u"  # "u": unsigned int scaled to [0, 1]; "f": float taken as is


ENCODINGS: dict[str, EncodingSpec] = {
    "rgb8": EncodingSpec(3, 1, (0, 1, 2)),
    "bgr8": EncodingSpec(3, 1, (2, 1, 0)),
    "mono8": EncodingSpec(1, 1, (0, 0, 0)),
    "rgba8": EncodingSpec(4, 1, (0, 1, 2)),
    "bgra8": EncodingSpec(4, 1, (2, 1, 0)),
    "mono16": EncodingSpec(1, 2, (0, 0, 0)),
    "rgb16": EncodingSpec(3, 2, (0, 1, 2)),
    "32fc1": EncodingSpec(1, 4, (0, 0, 0), "f"),
    "32fc3": EncodingSpec(3, 4, (0, 1, 2), "f"),
}


@dataclass(frozen=True)
class Preprocess:
    """Resize + normalisation taken from the model card."""

    image_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    def __post_init__(self) -> None:
        if self.image_size < 1:
            raise ValueError(f"image_size must be >= 1, got {self.image_size!r}")
        if len(self.mean) != 3 or len(self.std) != 3:
            raise ValueError(f"mean/std need 3 values, got {self.mean!r} / {self.std!r}")
        if any(not (s > 0) for s in self.std):
            raise ValueError(f"std values must be > 0, got {self.std!r}")

    @classmethod
    def from_card(cls, card: Any) -> Preprocess:
        """Build from a model card (dict or object with image_size, mean, std)."""
        get = card.get if isinstance(card, dict) else lambda k: getattr(card, k)
        return cls(int(get("image_size")), tuple(float(v) for v in get("mean")),
                   tuple(float(v) for v in get("std")))


def image_to_array(msg: Any) -> np.ndarray:
    """Decode an Image message to float32 HxWx3 RGB in [0, 1] (validates every field)."""
    enc = str(msg.encoding)
    spec = ENCODINGS.get(enc.lower())
    if spec is None:
        raise ValueError(f"unsupported image encoding {enc!r}; supported: "
                         f"{', '.join(ENCODINGS)}")
    h, w, step = int(msg.height), int(msg.width), int(msg.step)
    if h <= 0 or w <= 0:
        raise ValueError(f"image has zero size: height={h} width={w}")
    row_bytes = w * spec.channels * spec.depth
    if step < row_bytes:
        raise ValueError(f"image step={step} is smaller than width*bytes_per_pixel="
                         f"{row_bytes} ({enc}, width {w})")
    buf = _as_bytes(msg.data)
    if buf.size != h * step:
        raise ValueError(f"image data length={buf.size} does not match height*step="
                         f"{h * step} (height {h}, step {step})")
    rows = buf.reshape(h, step)[:, :row_bytes]
    if spec.depth == 1:
        pix = rows.reshape(h, w, spec.channels).astype(np.float32) / 255.0
    else:
        dtype = np.dtype(f"{'>' if bool(msg.is_bigendian) else '<'}{spec.kind}{spec.depth}")
        pix = np.ascontiguousarray(rows).view(dtype).reshape(h, w, spec.channels)
        pix = pix.astype(np.float32) / (65535.0 if spec.kind == "u" else 1.0)
    return pix[:, :, list(spec.to_rgb)]


def array_to_tensor(rgb: np.ndarray, pre: Preprocess) -> torch.Tensor:
    """HxWx3 RGB [0,1] -> 1x3xSxS normalised tensor; NaN/inf refused."""
    if rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"expected HxWx3 array, got shape {rgb.shape}")
    x = torch.from_numpy(np.ascontiguousarray(rgb)).permute(2, 0, 1).unsqueeze(0)
    if x.shape[-2:] != (pre.image_size, pre.image_size):
        x = F.interpolate(x, size=(pre.image_size, pre.image_size), mode="bilinear",
                          align_corners=False, antialias=True)
    mean = torch.tensor(pre.mean, dtype=x.dtype).view(1, 3, 1, 1)
    std = torch.tensor(pre.std, dtype=x.dtype).view(1, 3, 1, 1)
    x = (x - mean) / std
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        n = int(bad.sum())
        first = float(x[bad][0])
        raise ValueError(f"image converts to non-finite values ({n} of {x.numel()}, "
                         f"first {first}); check mean/std and the source data")
    return x


def image_to_tensor(msg: Any, pre: Preprocess) -> torch.Tensor:
    """sensor_msgs/Image -> 1x3xSxS float32 tensor, resized and normalised per the card."""
    return array_to_tensor(image_to_array(msg), pre)


def array_to_image_fields(rgb: np.ndarray, encoding: str = "rgb8", pad: int = 0,
                          bigendian: bool = False) -> dict[str, Any]:
    """Inverse for tests and bag writers: HxWx3 float [0,1] RGB -> Image field dict.

    `pad` extra bytes are appended to each row (step = row bytes + pad).
    """
    spec = ENCODINGS.get(encoding.lower())
    if spec is None:
        raise ValueError(f"unsupported image encoding {encoding!r}")
    h, w = rgb.shape[:2]
    chans = (rgb[:, :, _from_rgb_order(spec)] if spec.channels > 1
             else rgb.mean(axis=2, keepdims=True))
    if spec.channels == 4:
        alpha = np.ones((h, w, 1), dtype=chans.dtype)
        chans = np.concatenate([chans, alpha], axis=2)
    if spec.depth == 1:
        raw = np.round(np.clip(chans, 0, 1) * 255).astype(np.uint8).tobytes()
    elif spec.kind == "u":
        dt = np.dtype(">u2" if bigendian else "<u2")
        raw = np.round(np.clip(chans, 0, 1) * 65535).astype(dt).tobytes()
    else:
        raw = chans.astype(np.dtype(">f4" if bigendian else "<f4")).tobytes()
    row = w * spec.channels * spec.depth
    arr = np.frombuffer(raw, dtype=np.uint8).reshape(h, row)
    if pad:
        arr = np.concatenate([arr, np.full((h, pad), 0xAB, dtype=np.uint8)], axis=1)
    return {"height": h, "width": w, "encoding": encoding, "is_bigendian": int(bigendian),
            "step": row + pad, "data": arr.tobytes()}


def _from_rgb_order(spec: EncodingSpec) -> list[int]:
    """Channel order to write from RGB (inverse of to_rgb for 3/4-channel encodings)."""
    order = list(spec.to_rgb)
    return [order.index(i) for i in range(3)]


def stack_batch(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate 1x3xSxS tensors into an Nx3xSxS batch."""
    if not tensors:
        raise ValueError("cannot build a batch from 0 images")
    return torch.cat(list(tensors), dim=0)


def _as_bytes(data: Any) -> np.ndarray:
    """uint8 view of Image.data (bytes, array.array('B'), numpy or a list of ints)."""
    try:
        return np.frombuffer(data, dtype=np.uint8)
    except TypeError:
        return np.asarray(list(data), dtype=np.uint8)
