"""sensor_msgs/Image <-> numpy/torch, in numpy only (no rclpy, no cv_bridge: it breaks
under NumPy 2, and rosbags-image ignores `step`). The one decoder of the project: the
perception node (live frames) and tta_core.io.bag (recorded frames) both use it.

Supported encodings: rgb8, bgr8, mono8, rgba8, bgra8 (8-bit: `is_bigendian` irrelevant),
mono16, rgb16 (byte order from `is_bigendian`, scaled by 1/65535), 32FC1, 32FC3
(float32 RGB in [0, 1], byte order from `is_bigendian`; the encodings through which NaN
or far out-of-range pixels can arrive: such frames are refused), the packed YUV 4:2:2
encodings yuv422 = uyvy (U Y0 V Y1) and yuyv = yuv422_yuy2 (Y0 U Y1 V) (even widths only)
and the Bayer mosaics bayer_rggb8, bayer_bggr8, bayer_gbrg8, bayer_grbg8 (the last two
families converted to RGB by OpenCV: BT.601 video range for YUV, bilinear demosaicing for
Bayer). Rows may be padded (`step` > width * bytes per pixel); padding is ignored. Works
on any object with the Image fields (height, width, encoding, is_bigendian, step, data).
Frames beyond FrameLimits (pixels, aspect, float range) are refused, the size checks
before `data` is read. Bad input -> ValueError, one line naming the value (long strings
cut to a prefix and their length).

sensor_msgs/CompressedImage (`format`, `data`; JPEG or PNG, as image_transport's
`compressed` transport publishes them): decode_compressed, the size checks on the
width and height read from the JPEG/PNG header, before OpenCV decodes anything.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import cv2
import numpy as np
import torch
import torch.nn.functional as F

from tta_core.data.preprocess import images_to_tensor


@dataclass(frozen=True)
class EncodingSpec:
    """Layout of one encoding: channels, bytes per channel, channel order to reach RGB."""

    channels: int
    depth: int  # bytes per channel
    to_rgb: tuple[int, ...]  # channel indices giving R, G, B (mono: (0, 0, 0))
    kind: str = "u"  # "u": unsigned int scaled to [0, 1]; "f": float taken as is;
    # "cv": 8-bit data converted to RGB by cv2.cvtColor(pixels, cv_code)
    cv_code: int = -1


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
    # packed YUV 4:2:2, 2 bytes a pixel; ROS "yuv422" is UYVY (sensor_msgs image_encodings)
    "yuv422": EncodingSpec(2, 1, (0, 1, 2), "cv", cv2.COLOR_YUV2RGB_UYVY),
    "uyvy": EncodingSpec(2, 1, (0, 1, 2), "cv", cv2.COLOR_YUV2RGB_UYVY),
    "yuv422_yuy2": EncodingSpec(2, 1, (0, 1, 2), "cv", cv2.COLOR_YUV2RGB_YUY2),
    "yuyv": EncodingSpec(2, 1, (0, 1, 2), "cv", cv2.COLOR_YUV2RGB_YUY2),
    # Bayer mosaics: ROS names the first 2x2 block from the top left (rggb: R G / G B);
    # OpenCV names the pattern by the 2nd and 3rd pixels of its 2nd row, so ROS rggb is
    # OpenCV's BayerBG (as cv_bridge maps them; test_image_codecs checks it on a mosaic)
    "bayer_rggb8": EncodingSpec(1, 1, (0, 1, 2), "cv", cv2.COLOR_BayerBG2RGB),
    "bayer_bggr8": EncodingSpec(1, 1, (0, 1, 2), "cv", cv2.COLOR_BayerRG2RGB),
    "bayer_gbrg8": EncodingSpec(1, 1, (0, 1, 2), "cv", cv2.COLOR_BayerGR2RGB),
    "bayer_grbg8": EncodingSpec(1, 1, (0, 1, 2), "cv", cv2.COLOR_BayerGB2RGB),
}

_SUPPORTED = ("rgb8 bgr8 mono8 rgba8 bgra8 mono16 rgb16 32FC1 32FC3 yuv422 uyvy yuyv "
              "bayer_{rggb,bggr,gbrg,grbg}8")  # short: errors stay one line < 200 chars

#: compressed formats decode_compressed takes (first word of CompressedImage.format, or of
#: its part after ";": "jpeg", "png", "rgb8; jpeg compressed bgr8")
COMPRESSED_FORMATS = {"jpeg": "jpeg", "jpg": "jpeg", "png": "png"}


@dataclass(frozen=True)
class Preprocess:
    """Resize + normalisation of the model card (mean/std in [0, 1] pixel units); the
    input is image_size x image_size, or image_height x image_size when the card gives a
    height (a segmentation card's H x W)."""

    image_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    image_height: int = 0  # 0: square

    def __post_init__(self) -> None:
        if self.image_size < 1 or self.image_height < 0:
            raise ValueError(f"image_size must be >= 1 and image_height >= 0, got "
                             f"{self.image_size!r} / {self.image_height!r}")
        if len(self.mean) != 3 or len(self.std) != 3:
            raise ValueError(f"mean/std need 3 values, got {self.mean!r} / {self.std!r}")
        if any(not (0 < s < float("inf")) for s in self.std):
            raise ValueError(f"std values must be finite and > 0, got {self.std!r}")
        if not np.isfinite(self.mean).all():
            raise ValueError(f"mean values must be finite, got {self.mean!r}")

    @classmethod
    def from_card(cls, card: Any) -> Preprocess:
        """From a tta_core.model.source.ModelCard (image_size, mean, std, image_height)."""
        return cls(int(card.image_size), tuple(float(v) for v in card.mean),
                   tuple(float(v) for v in card.std), int(getattr(card, "image_height", 0)))

    @property
    def hw(self) -> tuple[int, int]:
        """The model input's (height, width)."""
        return (self.image_height or self.image_size, self.image_size)

    @property
    def side(self) -> int:
        """The input's longer side (what a frame is reduced for: tta_ros.frame_reduce)."""
        return max(self.hw)


#: pixels of a 4K UHD frame (3840 x 2160)
UHD_PIXELS = 3840 * 2160


class FrameTooLarge(ValueError):
    """A frame refused for what decoding it would cost (size, aspect, decode budget),
    before any of it is decoded."""


@dataclass(frozen=True)
class FrameLimits:
    """What a frame may be before the decoder spends time or memory on it.

    A frame is refused (ValueError) when it has more than `max_pixels` pixels (default
    4096 x 4096 = 16.8 MP: above 4K UHD, 8.3 MP, and the 8-12 MP of automotive cameras, so
    no real camera is refused; it bounds the work per frame, it does not make it small: the
    resize of a 16.8 MP frame to the card's size takes ~0.1 s on 2 shared CPU cores (up to
    1 s cold), of an 8.3 MP one ~50 ms; set it to the camera's resolution on a vehicle), or
    when its long side exceeds `max_aspect` times its short side (default 20: stitched
    panoramas stay under ~6:1; a 2,000,000 x 1 frame of a few MB, whose antialiased resize
    costs ~1 s, is refused; benchmarks/field/bench_bad_frames.py measures these). Both come from
    height and width alone, before `data` is read. Float encodings (32FC1, 32FC3; taken as
    is, not rescaled) must lie in `float_range` (default [0, 1], what the model was trained
    on): one frame with values far outside it would take over the batch statistics that
    BatchNorm shares across frames. Integer encodings are scaled into [0, 1] and need no
    range check.

    Compressed frames (JPEG, PNG) also have a decode budget, `max_decode_bytes`: what
    decoding the frame would write, read from its header before anything is decoded
    (decoded_bytes: pixels x the larger of the decoded samples and the 8-bit RGB result).
    A small file can declare a huge image (a 1.5 KB JPEG of 4000 x 4000, a 47 KB PNG of
    zeros, a 16-bit RGBA PNG of 4096 x 4096: 0.5-3 s of decoding each); the default,
    decode_budget(), is one 4K UHD RGB frame, what a camera feeding a classifier of up to
    240 px needs.
    """

    float_range: tuple[float, float] = (0.0, 1.0)
    max_pixels: int = 4096 * 4096
    max_aspect: float = 20.0
    max_decode_bytes: int = 3 * UHD_PIXELS

    def __post_init__(self) -> None:
        lo, hi = self.float_range
        if not (np.isfinite([lo, hi]).all() and lo < hi):
            raise ValueError(f"float_range must be finite with low < high, got {lo!r}, {hi!r}")
        if self.max_pixels < 1:
            raise ValueError(f"max_pixels must be >= 1, got {self.max_pixels!r}")
        if not 1.0 <= self.max_aspect < float("inf"):
            raise ValueError(f"max_aspect must be finite and >= 1, got {self.max_aspect!r}")
        if self.max_decode_bytes < 1:
            raise ValueError(f"max_decode_bytes must be >= 1, got {self.max_decode_bytes!r}")


def decode_budget(image_size: int) -> int:
    """Default decode budget (bytes) of a compressed frame for a model of input side
    `image_size`: one 4K UHD RGB frame (8-bit), or a frame 12 times the model's side in
    each direction when that is larger (models over 240 px); far below the 4096 x 4096
    16-bit RGBA (134 MB) a 130 KB PNG can declare."""
    side = 12 * int(image_size)
    return 3 * max(UHD_PIXELS, side * side)


def quoted(value: object, limit: int = 16) -> str:
    """repr of str(value) cut to `limit` characters, with its length when cut: echoes a
    field of a message (attacker-sized) in one short line."""
    text = str(value)
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}\u2026 ({len(text)} chars)"


def one_line(text: object, limit: int = 300) -> str:
    """`text` on one line (control characters escaped), at most about `limit` characters:
    for logs and /diagnostics."""
    flat = repr(str(text))[1:-1]
    return flat if len(flat) <= limit else f"{flat[:limit]}\u2026 ({len(flat)} chars)"


def encoding_spec(encoding: str) -> EncodingSpec:
    """The layout of a supported raw encoding; ValueError naming an unsupported one."""
    spec = ENCODINGS.get(str(encoding).lower())
    if spec is None:
        raise ValueError(f"unsupported image encoding {quoted(encoding)}; supported: "
                         f"{_SUPPORTED}")
    return spec


def check_layout(msg: Any, spec: EncodingSpec, limits: FrameLimits) -> tuple[int, int, int]:
    """(height, width, step) once size, aspect, step and data length are acceptable; only
    len(msg.data) is read, so nothing is copied for a refused frame."""
    h, w, step = int(msg.height), int(msg.width), int(msg.step)
    check_size(h, w, limits)
    if spec.channels == 2 and w % 2:
        raise ValueError(f"image width={w} is odd: packed YUV 4:2:2 needs an even width")
    row_bytes = w * spec.channels * spec.depth
    if step < row_bytes:
        raise ValueError(f"image step={step} is smaller than width*bytes_per_pixel="
                         f"{row_bytes} (width {w})")
    size = _data_size(msg.data)
    if size != h * step:
        raise ValueError(f"image data length={size} does not match height*step="
                         f"{h * step} (height {h}, step {step})")
    return h, w, step


def check_size(h: int, w: int, limits: FrameLimits) -> None:
    """Non-zero size (else ValueError) within limits.max_pixels and limits.max_aspect
    (else FrameTooLarge)."""
    if h <= 0 or w <= 0:
        raise ValueError(f"image has zero size: height={h} width={w}")
    if h * w > limits.max_pixels:
        raise FrameTooLarge(f"image has {h * w} pixels (height={h} width={w}), more "
                            f"than max_pixels={limits.max_pixels}")
    if max(h, w) > limits.max_aspect * min(h, w):
        raise FrameTooLarge(f"image aspect {max(h, w) / min(h, w):.4g} (height={h} "
                            f"width={w}) exceeds max_aspect={limits.max_aspect:g}")


def check_floats(pix: np.ndarray, limits: FrameLimits) -> None:
    """Float pixels must be finite and inside limits.float_range."""
    bad = ~np.isfinite(pix)
    if bad.any():
        raise ValueError(f"image has non-finite values ({int(bad.sum())} of {pix.size}, "
                         f"first {pix[bad][0]})")
    lo, hi = limits.float_range
    vmin, vmax = float(pix.min()), float(pix.max())
    if vmin < lo or vmax > hi:
        out = int(np.count_nonzero((pix < lo) | (pix > hi)))
        raise ValueError(f"image values outside float_range [{lo:g}, {hi:g}]: {out} of "
                         f"{pix.size}, min {vmin:.6g} max {vmax:.6g}")


def decode_image(msg: Any, limits: FrameLimits = FrameLimits()) -> np.ndarray:
    """Image message -> HxWx3 RGB: uint8 for 8-bit encodings (possibly a read-only view of
    `msg.data`), else float32 in [0, 1] (floats: in limits.float_range). Frames outside
    `limits` are refused before any copy (see FrameLimits)."""
    spec = encoding_spec(msg.encoding)
    h, w, step = check_layout(msg, spec, limits)
    row_bytes = w * spec.channels * spec.depth
    rows = as_bytes(msg.data).reshape(h, step)[:, :row_bytes]
    if spec.kind == "cv":  # YUV 4:2:2 (h, w, 2) or Bayer (h, w) -> RGB, by OpenCV
        shape = (h, w, spec.channels) if spec.channels > 1 else (h, w)
        return cv2.cvtColor(rows.reshape(shape), spec.cv_code)
    if spec.depth == 1:
        pix = rows.reshape(h, w, spec.channels)
    else:
        dtype = np.dtype(f"{'>' if bool(msg.is_bigendian) else '<'}{spec.kind}{spec.depth}")
        pix = np.ascontiguousarray(rows).view(dtype).reshape(h, w, spec.channels)
        pix = pix.astype(np.float32)
        if spec.kind == "u":
            pix /= 65535.0
        else:
            check_floats(pix, limits)
    if spec.to_rgb == (0, 1, 2) and spec.channels == 3:
        return np.ascontiguousarray(pix)
    return pix[:, :, list(spec.to_rgb)]


def compressed_codec(fmt: object) -> str:
    """"jpeg" or "png" from a CompressedImage.format ("jpeg", "png", "rgb8; jpeg compressed
    bgr8", ...: the first word after the last ";"); ValueError for anything else (the
    depth transport's "16UC1; compressedDepth png" included: its data is not a plain PNG)."""
    words = str(fmt).lower().split(";")[-1].split()
    codec = COMPRESSED_FORMATS.get(words[0]) if words else None
    if codec is None:
        raise ValueError(f"unsupported compressed format {quoted(fmt, 40)}; supported: "
                         f"{', '.join(COMPRESSED_FORMATS)} (image_transport compressed)")
    return codec


@dataclass(frozen=True)
class CompressedHeader:
    """What a JPEG/PNG header declares: size, channels and bits per sample."""

    height: int
    width: int
    channels: int  # samples per pixel the decoder produces (a PNG palette: RGB, 3)
    bits: int  # bits per sample (PNG 1-16, JPEG 8, 12 or 16)

    @property
    def decoded_bytes(self) -> int:
        """Bytes decoding writes: pixels x the larger of the decoded samples (channels x
        bytes per sample) and the 8-bit RGB result."""
        sample = self.channels * (2 if self.bits > 8 else 1)
        return self.height * self.width * max(sample, 3)

    def describe(self) -> str:
        return f"{self.width}x{self.height}, {self.channels} channel(s) of {self.bits} bits"


#: PNG colour type -> samples per decoded pixel (grey, RGB, palette -> RGB, grey+alpha, RGBA)
_PNG_CHANNELS = {0: 1, 2: 3, 3: 3, 4: 2, 6: 4}


def png_header(buf: np.ndarray) -> CompressedHeader | None:
    """The IHDR chunk of a PNG (size, colour type, bit depth), None when `buf` is not one."""
    if buf.size < 26 or buf[:8].tobytes() != b"\x89PNG\r\n\x1a\n" \
            or buf[12:16].tobytes() != b"IHDR":
        return None
    channels = _PNG_CHANNELS.get(int(buf[25]))
    if channels is None:
        return None
    return CompressedHeader(int.from_bytes(buf[20:24].tobytes(), "big"),
                            int.from_bytes(buf[16:20].tobytes(), "big"), channels,
                            int(buf[24]))


#: PNG colour type -> samples per pixel as stored (a palette index is one sample)
_PNG_SAMPLES = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}
#: Adam7 passes: first column, first row, column step, row step
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2),
          (0, 1, 1, 2))


def png_raw_bytes(buf: np.ndarray) -> int:
    """Bytes of filtered scanlines the IHDR of PNG `buf` declares (a filter byte a row, rows
    packed to whole bytes; each Adam7 pass on its own when interlaced): exactly what its
    zlib stream must inflate to."""
    w, h = (int.from_bytes(buf[i:i + 4].tobytes(), "big") for i in (16, 20))
    pixel_bits = int(buf[24]) * _PNG_SAMPLES.get(int(buf[25]), 4)

    def rows(n: int, width: int) -> int:
        return n * (1 + (width * pixel_bits + 7) // 8) if n > 0 and width > 0 else 0

    if buf.size < 29 or int(buf[28]) == 0:
        return rows(h, w)
    return sum(rows((h - y0 + dy - 1) // dy, (w - x0 + dx - 1) // dx)
               for x0, y0, dx, dy in _ADAM7)


def check_png_data(buf: np.ndarray) -> None:
    """The image data (IDAT chunks, one zlib stream) of PNG `buf` must inflate to exactly
    the scanlines its header declares. Inflates at most one byte more than declared: a
    small image whose stream holds megabytes of zeros (libpng inflates all of it, ~0.1 s
    for 47 KB) is refused (FrameTooLarge) once past its declared size; a cut or corrupt
    stream is refused (ValueError) before libpng prints its error line."""
    problem, too_long = _png_data_problem(buf)
    if problem:
        what = f"compressed png ({buf.size} bytes): {problem}"
        raise FrameTooLarge(what) if too_long else ValueError(what)


def _png_data_problem(buf: np.ndarray) -> tuple[str, bool]:
    """What is wrong with the IDAT stream of `buf` ('' when nothing), and whether it is
    that the stream inflates to more than declared."""
    data, pos, idat = memoryview(buf), 8, []
    while pos + 8 <= len(data):
        length = int.from_bytes(data[pos:pos + 4], "big")
        kind = bytes(data[pos + 4:pos + 8])
        if pos + 12 + length > len(data):
            return f"chunk {kind!r} cut off ({length} bytes declared)", False
        if kind == b"IDAT":
            idat.append(data[pos + 8:pos + 8 + length])
        elif kind == b"IEND":
            break
        pos += 12 + length
    want, inflater = png_raw_bytes(buf), zlib.decompressobj()
    try:
        out = len(inflater.decompress(b"".join(idat), want + 1))
    except zlib.error as exc:
        return f"image data is not a valid zlib stream ({exc})", False
    if out > want or inflater.unconsumed_tail:
        return f"image data inflates beyond the {want} bytes its header declares", True
    if out < want or not inflater.eof:
        return f"image data inflates to {out} of the {want} bytes its header declares", False
    return "", False


#: JPEG start-of-frame markers (baseline, progressive, lossless, arithmetic): not DHT (C4),
#: JPG (C8), DAC (CC)
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def jpeg_header(buf: np.ndarray, max_segments: int = 256) -> CompressedHeader | None:
    """The first start-of-frame segment of a JPEG (precision, size, components), None when
    `buf` is not one or has no frame header in its first `max_segments` segments (real
    files have a few: APPn, DQT, DHT, COM)."""
    data, i = memoryview(buf), 2  # no copy
    if data[:2].tobytes() != b"\xff\xd8":
        return None
    for _ in range(max_segments):
        while i < len(data) and data[i] == 0xFF:
            i += 1  # marker prefix and fill bytes
        if i + 2 >= len(data):
            return None
        marker, length = data[i], int.from_bytes(data[i + 1:i + 3], "big")
        if marker in _SOF:
            if i + 9 > len(data):
                return None
            return CompressedHeader(int.from_bytes(data[i + 4:i + 6], "big"),
                                    int.from_bytes(data[i + 6:i + 8], "big"),
                                    max(int(data[i + 8]), 1), int(data[i + 3]))
        if marker == 0xDA or length < 2:  # scan data before any frame header: broken
            return None
        i += 1 + length
    return None


def check_budget(head: CompressedHeader, codec: str, limits: FrameLimits) -> None:
    """Size and aspect (check_size), then the decode budget; FrameTooLarge naming the
    declared size."""
    check_size(head.height, head.width, limits)
    if head.decoded_bytes > limits.max_decode_bytes:
        raise FrameTooLarge(f"compressed {codec} declares {head.describe()}: "
                            f"{head.decoded_bytes} bytes to decode, over "
                            f"max_decode_bytes={limits.max_decode_bytes}")


def decode_compressed(msg: Any, limits: FrameLimits = FrameLimits()) -> np.ndarray:
    """CompressedImage message (`format`, `data`) -> HxWx3 RGB uint8, like decode_image.

    The format must be JPEG or PNG (compressed_codec). Size, channels and bit depth are
    read from the file's header (PNG IHDR, JPEG start of frame) and checked against
    `limits` (check_budget) before OpenCV decodes anything, so a small file declaring a
    huge image costs microseconds; a PNG's stream must inflate to exactly the declared
    scanlines (check_png_data) and a JPEG must end with its end-of-image marker (a cut
    frame is refused, not decoded half grey); the decoded image must then have the
    declared size. Grey,
    16-bit and alpha images come out as 8-bit RGB (cv2.IMREAD_COLOR); EXIF orientation is
    ignored (cameras write none).
    """
    codec = compressed_codec(msg.format)
    buf = as_bytes(msg.data)
    head = (png_header if codec == "png" else jpeg_header)(buf)
    if head is None:
        raise ValueError(f"compressed image is not a readable {codec} ({buf.size} bytes, "
                         f"format {quoted(msg.format, 40)})")
    h, w = head.height, head.width
    check_budget(head, codec, limits)
    if codec == "png":
        check_png_data(buf)
    elif not buf[-256:].tobytes().rstrip(b"\0").endswith(b"\xff\xd9"):  # zero padding ok
        # cut off: libjpeg would fill the rest grey, print a warning and return the frame
        raise ValueError(f"compressed jpeg ({buf.size} bytes, height={h} width={w}) ends "
                         "without its end-of-image marker (cut off)")
    bgr = cv2.imdecode(buf, cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION)
    if bgr is None:
        raise ValueError(f"compressed {codec} image ({buf.size} bytes, height={h} "
                         f"width={w}) could not be decoded")
    if bgr.shape[:2] != (h, w):
        raise ValueError(f"decoded {codec} image is {bgr.shape[0]}x{bgr.shape[1]}, its "
                         f"header said height={h} width={w}")
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)


def image_to_array(msg: Any, limits: FrameLimits = FrameLimits()) -> np.ndarray:
    """Image message -> float32 HxWx3 RGB in [0, 1]."""
    pix = decode_image(msg, limits)
    return pix.astype(np.float32) / 255.0 if pix.dtype == np.uint8 else pix


def image_to_rgb8(msg: Any, limits: FrameLimits = FrameLimits()) -> np.ndarray:
    """Image message -> uint8 HxWx3 RGB (16-bit/float encodings rounded to 8 bits)."""
    pix = decode_image(msg, limits)
    if pix.dtype == np.uint8:
        return pix
    return np.round(np.clip(pix, 0.0, 1.0) * 255.0).astype(np.uint8)


def to_tensor(images: Sequence[np.ndarray], pre: Preprocess) -> torch.Tensor:
    """Decoded HxWx3 images (uint8, or float in [0, 1]) -> Nx3xHxW normalised batch at the
    card's input size (`pre.hw`).

    Same-size uint8 frames at the card's size go through one vectorised normalisation
    (tta_core.data.preprocess.images_to_tensor, as in training); others are resized
    (bilinear, antialiased) frame by frame first.
    """
    if not images:
        raise ValueError("cannot build a batch from 0 images")
    hw = pre.hw
    if all(a.dtype == np.uint8 and a.shape == (*hw, 3) for a in images):
        return images_to_tensor(np.stack(images), pre.mean, pre.std)
    xs = []
    for a in images:
        if a.ndim != 3 or a.shape[2] != 3:
            raise ValueError(f"expected an HxWx3 image, got shape {a.shape}")
        f = a.astype(np.float32) / 255.0 if a.dtype == np.uint8 else a.astype(np.float32)
        x = torch.from_numpy(f).permute(2, 0, 1).unsqueeze(0)
        if tuple(x.shape[-2:]) != hw:
            x = F.interpolate(x, size=hw, mode="bilinear", align_corners=False,
                              antialias=True)
        xs.append(x)
    mean = torch.tensor(pre.mean, dtype=torch.float32).view(1, 3, 1, 1)
    std = torch.tensor(pre.std, dtype=torch.float32).view(1, 3, 1, 1)
    return (torch.cat(xs) - mean) / std


def image_to_tensor(msg: Any, pre: Preprocess) -> torch.Tensor:
    """One Image message -> 1x3xSxS tensor, resized and normalised per the card."""
    return to_tensor([decode_image(msg)], pre)


def array_to_image_fields(rgb: np.ndarray, encoding: str = "rgb8", pad: int = 0,
                          bigendian: bool = False) -> dict[str, Any]:
    """Inverse, for tests and benchmarks: HxWx3 float [0, 1] RGB -> Image field dict.

    `pad` extra bytes are appended to each row (step = row bytes + pad).
    """
    spec = encoding_spec(encoding)
    if spec.kind == "cv":
        raise ValueError(f"array_to_image_fields does not encode {encoding} (YUV/Bayer)")
    h, w = rgb.shape[:2]
    chans = (rgb[:, :, [list(spec.to_rgb).index(i) for i in range(3)]]
             if spec.channels > 1 else rgb.mean(axis=2, keepdims=True))
    if spec.channels == 4:
        chans = np.concatenate([chans, np.ones((h, w, 1), dtype=chans.dtype)], axis=2)
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


def _data_size(data: Any) -> int:
    """Bytes in Image.data without copying it (a buffer's nbytes, else its length)."""
    try:
        with memoryview(data) as view:
            return view.nbytes
    except TypeError:
        return len(data)


def as_bytes(data: Any) -> np.ndarray:
    """uint8 view of Image.data (bytes, array.array('B'), numpy or a list of ints)."""
    try:
        return np.frombuffer(data, dtype=np.uint8)
    except TypeError:
        return np.asarray(list(data), dtype=np.uint8)
