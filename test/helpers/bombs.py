"""Compressed-image bombs: small JPEG/PNG files whose headers declare huge images (the
fuzz cases of issue #33), for the decode-budget tests and benchmarks/field/bench_compressed_bombs.

Each is a real file OpenCV would decode (slowly) if it were let through: the JPEG is a
small valid image whose frame header was rewritten to a large size (libjpeg fills the
missing scan data), the PNGs hold complete zlib streams of zero rows.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import cv2
import numpy as np


@dataclass(frozen=True)
class Bomb:
    """One crafted file: its CompressedImage format, bytes and what its header declares."""

    name: str
    format: str
    data: bytes
    height: int
    width: int
    channels: int
    bits: int


def _chunk(kind: bytes, body: bytes) -> bytes:
    return (len(body).to_bytes(4, "big") + kind + body
            + zlib.crc32(kind + body).to_bytes(4, "big"))


#: Adam7 passes (first column, first row, column step, row step), from the PNG spec
ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2),
         (0, 1, 1, 2))


def png_of_zeros(h: int, w: int, color_type: int = 2, bits: int = 8, *,
                 interlaced: bool = False, extra: int = 0) -> bytes:
    """A complete PNG of h x w zero pixels (filter byte 0 per row), zlib level 9, Adam7
    interlaced or not, with `extra` zero bytes more in its stream than the image needs;
    streamed a block at a time so a 134 MB image never sits in memory."""
    channels = {0: 1, 2: 3, 4: 2, 6: 4}[color_type]

    def row(width: int) -> int:
        return 1 + (width * channels * bits + 7) // 8

    if interlaced:  # each pass: its rows x its columns, counted pixel by pixel
        raw = sum(len(range(y0, h, dy)) * row(len(range(x0, w, dx)))
                  for x0, y0, dx, dy in ADAM7 if len(range(x0, w, dx)))
    else:
        raw = h * row(w)
    raw += extra
    comp, parts, block = zlib.compressobj(9), [], bytes(2**20)
    for start in range(0, raw, len(block)):
        parts.append(comp.compress(block[:min(len(block), raw - start)]))
    parts.append(comp.flush())
    ihdr = w.to_bytes(4, "big") + h.to_bytes(4, "big") + bytes([bits, color_type, 0, 0,
                                                                 int(interlaced)])
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", b"".join(parts))
            + _chunk(b"IEND", b""))


def jpeg_claiming(h: int, w: int) -> bytes:
    """A 16 x 16 baseline JPEG whose frame header is rewritten to h x w: about 700 bytes
    that libjpeg decodes (warning of missing data) into an h x w image."""
    img = np.full((16, 16, 3), 128, np.uint8)
    data = bytearray(cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, 50])[1].tobytes())
    i = data.index(b"\xff\xc0")
    data[i + 5:i + 7] = h.to_bytes(2, "big")
    data[i + 7:i + 9] = w.to_bytes(2, "big")
    return bytes(data)


def bombs() -> list[Bomb]:
    """The three fuzz cases: a JPEG claiming 4000 x 4000, a PNG of zeros 4000 x 4000 RGB,
    a 16-bit RGBA PNG of zeros 4096 x 4096."""
    return [Bomb("jpeg_4000x4000", "jpeg", jpeg_claiming(4000, 4000), 4000, 4000, 3, 8),
            Bomb("png_zeros_4000x4000_rgb8", "png", png_of_zeros(4000, 4000), 4000, 4000,
                 3, 8),
            Bomb("png_zeros_4096x4096_rgba16", "png", png_of_zeros(4096, 4096, 6, 16), 4096,
                 4096, 4, 16)]


def zero_stream_bomb() -> Bomb:
    """A PNG declaring a small 64 x 48 RGB image whose zlib stream holds 48 MB of zeros
    (47 KB): within any decode budget, but libpng inflates the whole stream."""
    return Bomb("png_64x48_stream_of_48MB", "png", png_of_zeros(48, 64, extra=48 * 2**20),
                48, 64, 3, 8)
