"""Camera frame -> a few times the model's input side, reading only the pixels that count.

The model sees `side` x `side` pixels (32 for the shipped card); a 4096 x 4096 frame holds
16.8 million. Decoding all of them to float RGB and resizing (tta_core.io.image_msg:
decode_image, then to_tensor's antialiased bilinear resize) writes a full-size float copy
of the frame for a result 16,000 times smaller. Here a frame whose side is at least
2 * SIDE_MARGIN * side is reduced first, per axis: at most MAX_SAMPLES * SIDE_MARGIN * side
samples taken, `stride` pixels apart, then the mean of `area` consecutive samples
(cv2.INTER_AREA), leaving SIDE_MARGIN to about 2 * SIDE_MARGIN times the model's side
(the bound on the pixels read comes from the model's input size, not from the frame's);
only the samples are read, converted to float
(after the reduction of the bytes, never before) and checked (32FC1/32FC3 range: every
value that reaches the model is checked, none that does not is read). to_tensor's
antialiased resize then does the rest as before, on a frame of at most a few hundred
pixels a side. Smaller frames are decoded exactly as before (decode_image,
decode_compressed): their result is unchanged.

Compressed JPEG frames large enough are decoded by libjpeg at 1/2, 1/4 or 1/8 scale
(cv2.IMREAD_REDUCED_*: the scaling happens in the inverse DCT, most of the decode is
skipped); PNG has no reduced decode (OpenCV decodes it whole, then resizes), so a PNG is
decoded whole and reduced like a raw frame. Bayer mosaics are reduced by 2 x 2 cells (one
RGB pixel per cell: R, the mean of the two G, B), packed YUV 4:2:2 by sampled pixels
(each with its macropixel's U and V, converted by OpenCV as before).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cv2
import numpy as np

from tta_core.io.image_msg import (
    FrameLimits,
    as_bytes,
    check_budget,
    check_floats,
    check_layout,
    compressed_codec,
    decode_compressed,
    decode_image,
    encoding_spec,
    jpeg_header,
)

#: a frame is reduced to at least this many times the model's side (what the final
#: antialiased resize then averages over) once a side holds twice as many pixels
SIDE_MARGIN = 4
#: the most samples read along an axis, in model sides times SIDE_MARGIN (beyond it,
#: samples are taken at a stride): 640 for a 32 px model, so a VGA frame is averaged whole
MAX_SAMPLES = 5
#: JPEG decode scales libjpeg offers (cv2.IMREAD_REDUCED_COLOR_n / _GRAYSCALE_n)
JPEG_SCALES = {8: (cv2.IMREAD_REDUCED_COLOR_8, cv2.IMREAD_REDUCED_GRAYSCALE_8),
               4: (cv2.IMREAD_REDUCED_COLOR_4, cv2.IMREAD_REDUCED_GRAYSCALE_4),
               2: (cv2.IMREAD_REDUCED_COLOR_2, cv2.IMREAD_REDUCED_GRAYSCALE_2)}
#: Bayer encodings -> where R and B sit in a 2 x 2 cell (0 top left, 1 top right, 2 bottom
#: left, 3 bottom right; the G are the other two)
BAYER_RB = {"bayer_rggb8": (0, 3), "bayer_bggr8": (3, 0), "bayer_gbrg8": (2, 1),
            "bayer_grbg8": (1, 2)}
#: packed YUV 4:2:2 OpenCV code -> byte of Y0 and Y1 in a macropixel (UYVY: U Y0 V Y1,
#: YUY2: Y0 U Y1 V)
YUV_Y = {cv2.COLOR_YUV2RGB_UYVY: (1, 3), cv2.COLOR_YUV2RGB_YUY2: (0, 2)}


@dataclass(frozen=True)
class Axis:
    """How one axis is reduced: `count` outputs, each the mean of `area` samples taken
    `stride` apart; the first sample at `start` (the kept samples centred on the axis)."""

    start: int
    stride: int
    area: int
    count: int

    @property
    def samples(self) -> slice:
        """The indices read along this axis."""
        return slice(self.start, self.start + self.count * self.area * self.stride,
                     self.stride)

    @property
    def reduces(self) -> bool:
        return self.stride * self.area > 1


def axis_plan(length: int, side: int) -> Axis:
    """The reduction of an axis of `length` pixels for a model of input `side`: none below
    2 * SIDE_MARGIN * side pixels, else by f = length // (SIDE_MARGIN * side), at least
    SIDE_MARGIN * side outputs: at most MAX_SAMPLES * SIDE_MARGIN * side samples taken,
    `stride` apart, and averaged by the f // stride consecutive ones."""
    target = SIDE_MARGIN * side
    f = length // target
    if f < 2:
        return Axis(0, 1, 1, length)
    stride = -(-length // (MAX_SAMPLES * target))
    area = f // stride
    count = length // (stride * area)
    return Axis((length - count * stride * area) // 2 + stride // 2, stride, area, count)


def plan(height: int, width: int, side: int) -> tuple[Axis, Axis] | None:
    """(rows, columns) reductions of a frame, None when neither axis is reduced."""
    rows, cols = axis_plan(height, side), axis_plan(width, side)
    return (rows, cols) if rows.reduces or cols.reduces else None


def average(values: np.ndarray, rows: Axis, cols: Axis) -> np.ndarray:
    """HxWxC float32 samples -> the mean of each rows.area x cols.area block (cv2
    INTER_AREA on whole blocks: their exact mean), still HxWxC."""
    if rows.area == cols.area == 1:
        return values
    h, w, c = values.shape
    out = cv2.resize(values, (w // cols.area, h // rows.area), interpolation=cv2.INTER_AREA)
    return out.reshape(h // rows.area, w // cols.area, c)


def reduce_array(pix: np.ndarray, side: int) -> np.ndarray:
    """A decoded HxWx3 RGB frame (uint8, or float in [0, 1]) reduced for a model of input
    `side`: float32 in [0, 1], or `pix` itself when it is small enough."""
    axes = plan(pix.shape[0], pix.shape[1], side)
    if axes is None:
        return pix
    rows, cols = axes
    values = pix[rows.samples, cols.samples].astype(np.float32)
    out = average(values, rows, cols)
    return out / np.float32(255.0) if pix.dtype == np.uint8 else out


def reduced_image(msg: Any, limits: FrameLimits, side: int) -> np.ndarray:
    """Image message -> HxWx3 RGB for a model of input `side`: decode_image's result for a
    frame too small to reduce, else the reduced frame (float32 in [0, 1]), reading only
    its samples. The same checks and one-line errors as decode_image (the float range on
    every sample read)."""
    spec = encoding_spec(msg.encoding)
    h, w, step = check_layout(msg, spec, limits)
    axes = plan(h, w, side)
    if axes is None:
        return decode_image(msg, limits)
    rows = as_bytes(msg.data)[:h * step].reshape(h, step)
    if spec.kind == "cv" and spec.channels == 1:
        return _bayer(rows, h, w, BAYER_RB[str(msg.encoding).lower()], side)
    if spec.kind == "cv":
        return _yuv(rows, w, spec.cv_code, *axes)
    y, x = axes
    px = spec.channels * spec.depth
    raw = np.ascontiguousarray(rows[y.samples, :w * px].reshape(-1, w, px)[:, x.samples])
    if spec.depth == 1:
        values = raw.astype(np.float32)
    else:
        order = ">" if bool(msg.is_bigendian) else "<"
        values = raw.view(f"{order}{spec.kind}{spec.depth}").astype(np.float32)
    if spec.kind == "f":
        check_floats(values, limits)
    out = average(values, y, x)  # then the channels: fewer values to move
    if spec.to_rgb != tuple(range(spec.channels)):
        out = out[:, :, list(spec.to_rgb)]
    if spec.kind == "u":
        out /= np.float32(255.0 if spec.depth == 1 else 65535.0)
    return out


def _bayer(rows: np.ndarray, h: int, w: int, rb: tuple[int, int], side: int) -> np.ndarray:
    """A Bayer mosaic reduced by 2 x 2 cells: one RGB pixel a cell (R, mean of the G, B),
    the cells planned like pixels (axis_plan on the half sides)."""
    y, x = axis_plan(h // 2, side), axis_plan(w // 2, side)
    cells = rows[:h // 2 * 2, :w // 2 * 2].reshape(h // 2, 2, w // 2, 2)
    c = np.ascontiguousarray(cells[y.samples, :, x.samples].transpose(0, 2, 1, 3))
    c = c.reshape(c.shape[0], c.shape[1], 4).astype(np.float32)
    g = [i for i in range(4) if i not in rb]
    rgb = np.stack([c[..., rb[0]], (c[..., g[0]] + c[..., g[1]]) * 0.5, c[..., rb[1]]], -1)
    return average(rgb, y, x) / np.float32(255.0)


def _yuv(rows: np.ndarray, w: int, code: int, y: Axis, x: Axis) -> np.ndarray:
    """Packed YUV 4:2:2 reduced by sampled pixels: each sampled pixel's Y with its
    macropixel's U and V, converted by OpenCV (`code`) as decode_image converts them."""
    cols = np.arange(w)[x.samples]
    macro = rows[y.samples, :w * 2].reshape(-1, w // 2, 4)[:, cols // 2]  # a copy
    i0, i1 = YUV_Y[code]
    luma = np.where((cols % 2 == 1)[None, :], macro[..., i1], macro[..., i0])
    macro[..., i0] = macro[..., i1] = luma  # both pixels of each macropixel: the sample
    rgb = cv2.cvtColor(macro.reshape(macro.shape[0], -1, 2), code)[:, ::2]
    return average(rgb.astype(np.float32), y, x) / np.float32(255.0)


def jpeg_scale(height: int, width: int, side: int) -> int:
    """The libjpeg decode scale (1, 2, 4, 8) of a height x width JPEG for a model of input
    `side`: the largest that leaves the short side at least 2 * SIDE_MARGIN * side (then
    reduced like a raw frame), 1 (a full decode) for frames smaller than that."""
    need = 2 * SIDE_MARGIN * side
    return next((s for s in JPEG_SCALES if min(height, width) >= s * need), 1)


def reduced_compressed(msg: Any, limits: FrameLimits, side: int) -> np.ndarray:
    """CompressedImage message -> HxWx3 RGB for a model of input `side`: a large JPEG
    decoded at a reduced scale (jpeg_scale) after decode_compressed's checks, anything
    else by decode_compressed (the same checks and errors); then reduce_array."""
    if compressed_codec(msg.format) != "jpeg":
        return reduce_array(decode_compressed(msg, limits), side)
    buf = as_bytes(msg.data)
    head = jpeg_header(buf)
    scale = jpeg_scale(head.height, head.width, side) if head is not None else 1
    if scale == 1:  # unreadable headers and cut files: refused there, in one line
        return reduce_array(decode_compressed(msg, limits), side)
    check_budget(head, "jpeg", limits)
    if not buf[-256:].tobytes().rstrip(b"\0").endswith(b"\xff\xd9"):
        return decode_compressed(msg, limits)  # refuses it: cut off
    color, grey = JPEG_SCALES[scale]
    pix = cv2.imdecode(buf, (grey if head.channels == 1 else color)
                       | cv2.IMREAD_IGNORE_ORIENTATION)
    want = (-(-head.height // scale), -(-head.width // scale))
    if pix is None or pix.shape[:2] != want:
        got = "nothing" if pix is None else f"{pix.shape[0]}x{pix.shape[1]}"
        raise ValueError(f"compressed jpeg ({buf.size} bytes, height={head.height} "
                         f"width={head.width}) decoded at 1/{scale} to {got}, not "
                         f"{want[0]}x{want[1]}")
    rgb = np.repeat(pix[:, :, None], 3, axis=2) if pix.ndim == 2 else pix[:, :, ::-1]
    return reduce_array(rgb, side)
