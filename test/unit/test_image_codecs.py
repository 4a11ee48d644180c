"""Packed YUV 4:2:2, Bayer and compressed (JPEG/PNG) frames through tta_core.io.image_msg,
checked against references that do not use the decoder: the BT.601 formula in numpy, a
mosaic built from known colours, and the raw image a PNG/JPEG was made from."""

from __future__ import annotations

from types import SimpleNamespace

import cv2
import numpy as np
import pytest
from helpers import fake_image

import tta_core.io.image_msg as image_msg
from tta_core.data.signs import make_signs
from tta_core.io.image_msg import (
    FrameLimits,
    array_to_image_fields,
    compressed_codec,
    decode_compressed,
    decode_image,
)

RNG = np.random.default_rng(11)
#: where U, Y0, V, Y1 sit in each 4-byte group of two pixels
YUV_ORDER = {"yuv422": "uyvy", "uyvy": "uyvy", "yuyv": "yuyv", "yuv422_yuy2": "yuyv"}


def _bt601(y: np.ndarray, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Video-range BT.601 YUV -> RGB as OpenCV's YUV2RGB_* compute it (Y below 16 taken as
    16), in numpy."""
    c, d, e = 1.164 * np.maximum(y - 16.0, 0.0), u - 128.0, v - 128.0
    rgb = np.stack([c + 1.596 * e, c - 0.391 * d - 0.813 * e, c + 2.018 * d], axis=-1)
    return np.clip(np.round(rgb), 0, 255)


@pytest.mark.parametrize("encoding", sorted(YUV_ORDER))
def test_yuv422_matches_bt601_reference_honouring_step(encoding: str) -> None:
    h, w, pad = 6, 10, 4
    data = RNG.integers(0, 256, size=(h, 2 * w + pad), dtype=np.uint8)
    groups = data[:, :2 * w].reshape(h, w // 2, 4).astype(np.float64)
    order = YUV_ORDER[encoding]
    u, v = groups[..., order.index("u")], groups[..., order.index("v")]
    ys = [i for i, ch in enumerate(order) if ch == "y"]
    y = np.stack([groups[..., ys[0]], groups[..., ys[1]]], axis=-1).reshape(h, w)
    expect = _bt601(y, np.repeat(u, 2, axis=1), np.repeat(v, 2, axis=1))
    out = decode_image(fake_image(height=h, width=w, encoding=encoding, step=2 * w + pad,
                            data=data.tobytes()))
    assert out.shape == (h, w, 3) and out.dtype == np.uint8
    assert np.abs(out.astype(np.int64) - expect).max() <= 2
    data[:, 2 * w:] = 255 - data[:, 2 * w:]  # padding is ignored
    again = decode_image(fake_image(height=h, width=w, encoding=encoding.upper(), step=2 * w + pad,
                              data=data.tobytes()))
    np.testing.assert_array_equal(again, out)


def test_yuv422_odd_width_and_limits_refused_before_data_is_read() -> None:
    with pytest.raises(ValueError, match="width=5 is odd"):
        decode_image(fake_image(height=2, width=5, encoding="uyvy", step=10, data=bytes(20)))
    with pytest.raises(ValueError, match="max_pixels=16"):
        decode_image(fake_image(height=8, width=8, encoding="yuyv", step=16, data=None),
                     FrameLimits(max_pixels=16))
    with pytest.raises(ValueError, match="max_aspect"):
        decode_image(fake_image(height=2, width=100, encoding="yuv422", step=200, data=None))


PATCHES = np.array([[[230, 20, 40], [20, 200, 60]], [[30, 50, 220], [240, 210, 30]]],
                   dtype=np.uint8)  # red, green, blue, yellow: 2x2 patches of 12x12 px


def _mosaic(rgb: np.ndarray, pattern: str) -> np.ndarray:
    """A Bayer mosaic of `rgb` named the ROS way: `pattern` = the top-left 2x2, row-major."""
    out = np.empty(rgb.shape[:2], np.uint8)
    for k, colour in enumerate(pattern):
        r, c = divmod(k, 2)
        out[r::2, c::2] = rgb[r::2, c::2, "rgb".index(colour)]
    return out


@pytest.mark.parametrize("pattern", ["rggb", "bggr", "gbrg", "grbg"])
def test_bayer_flat_patches_decode_to_their_colours(pattern: str) -> None:
    rgb = np.repeat(np.repeat(PATCHES, 12, axis=0), 12, axis=1)  # 24 x 24
    pad = 3
    raw = np.full((24, 24 + pad), 0x5A, np.uint8)
    raw[:, :24] = _mosaic(rgb, pattern)
    out = decode_image(fake_image(height=24, width=24, encoding=f"bayer_{pattern}8",
                            step=24 + pad, data=raw.tobytes()))
    assert out.shape == (24, 24, 3) and out.dtype == np.uint8
    for i in range(2):
        for j in range(2):  # patch interiors: 2 px away from edges and other patches
            inner = out[12 * i + 2:12 * i + 10, 12 * j + 2:12 * j + 10].astype(np.int64)
            assert np.abs(inner - PATCHES[i, j]).max() <= 1, (pattern, i, j, inner[3, 3])


def test_bayer_code_named_like_the_ros_pattern_would_swap_red_and_blue() -> None:
    """Why rggb maps to COLOR_BayerBG2RGB: OpenCV names a pattern by its 2nd row, so the
    'same-named' code decodes a red patch as blue."""
    red = np.zeros((8, 8, 3), np.uint8)
    red[..., 0] = 200
    wrong = cv2.cvtColor(_mosaic(red, "rggb"), cv2.COLOR_BayerRG2RGB)[4, 4]
    right = decode_image(fake_image(height=8, width=8, encoding="bayer_rggb8", step=8,
                              data=_mosaic(red, "rggb").tobytes()))[4, 4]
    assert tuple(wrong) == (0, 0, 200) and tuple(right) == (200, 0, 0)


def test_array_to_image_fields_refuses_yuv_and_bayer() -> None:
    with pytest.raises(ValueError, match="does not encode"):
        array_to_image_fields(np.zeros((2, 2, 3), np.float32), "bayer_rggb8")


# ------------------------------------------------------------------ compressed


def _compressed(rgb: np.ndarray, ext: str = ".png", fmt: str = "png", *params: int):
    ok, enc = cv2.imencode(ext, np.ascontiguousarray(rgb[..., ::-1]), list(params))
    assert ok
    return SimpleNamespace(format=fmt, data=enc.tobytes())


@pytest.mark.parametrize("fmt", ["png", "PNG", "bgr8; png compressed bgr8",
                                 "rgb8; png compressed bgr8"])
def test_png_decodes_to_exactly_the_raw_image(fmt: str) -> None:
    rgb = make_signs(4, image_size=48, seed=3).images
    for img in rgb:
        raw = decode_image(fake_image(**array_to_image_fields(img / 255.0, "rgb8")))
        out = decode_compressed(_compressed(img, ".png", fmt))
        assert out.dtype == np.uint8 and out.shape == (48, 48, 3)
        np.testing.assert_array_equal(out, raw)


def test_jpeg_quality_95_is_close_to_the_raw_image() -> None:
    """Sign frames (noisy backgrounds, 4:2:0 chroma): mean abs difference 2.6-4.5 of 255
    per frame at quality 95 (OpenCV 5.0); the bound leaves room for other libjpeg builds."""
    imgs = make_signs(8, image_size=64, seed=4).images
    diffs = [np.abs(decode_compressed(_compressed(img, ".jpg", "rgb8; jpeg compressed bgr8",
                                                  cv2.IMWRITE_JPEG_QUALITY, 95))
                    .astype(np.int64) - img).mean() for img in imgs]
    assert max(diffs) < 6.0, diffs


def test_grey_and_16bit_png_come_out_as_8bit_rgb() -> None:
    grey = RNG.integers(0, 256, (5, 7), dtype=np.uint8)
    out = decode_compressed(SimpleNamespace(format="mono8; png compressed mono8",
                                            data=cv2.imencode(".png", grey)[1].tobytes()))
    np.testing.assert_array_equal(out, np.repeat(grey[..., None], 3, axis=2))
    deep = (grey.astype(np.uint16) << 8) | 0x7F
    out = decode_compressed(SimpleNamespace(format="png",
                                            data=cv2.imencode(".png", deep)[1].tobytes()))
    np.testing.assert_array_equal(out[..., 0], grey)


@pytest.mark.parametrize(("fmt", "codec"), [("jpeg", "jpeg"), ("jpg", "jpeg"),
                                            ("rgb8; jpeg compressed bgr8", "jpeg"),
                                            ("mono8; png compressed mono8", "png")])
def test_compressed_codec_reads_image_transport_formats(fmt: str, codec: str) -> None:
    assert compressed_codec(fmt) == codec


@pytest.mark.parametrize("fmt", ["", "tiff", "16UC1; compressedDepth png", "webp",
                                 "jpeg" + "x" * 70000])
def test_unknown_formats_refused_in_one_short_line(fmt: str) -> None:
    with pytest.raises(ValueError, match="unsupported compressed format") as info:
        decode_compressed(SimpleNamespace(format=fmt, data=b"\xff\xd8"))
    assert "\n" not in str(info.value) and len(str(info.value)) < 200


def _png_header(h: int, w: int) -> bytes:
    return (b"\x89PNG\r\n\x1a\n" + (13).to_bytes(4, "big") + b"IHDR"
            + w.to_bytes(4, "big") + h.to_bytes(4, "big") + bytes([8, 2, 0, 0, 0]))


def _huge_jpeg(h: int, w: int) -> bytes:
    """SOI, an APP0 segment, then a baseline frame header for h x w (nothing decodable)."""
    app0 = b"\xff\xe0" + (16).to_bytes(2, "big") + b"JFIF\x00" + bytes(9)
    sof = b"\xff\xc0" + (17).to_bytes(2, "big") + b"\x08" + h.to_bytes(2, "big") \
        + w.to_bytes(2, "big") + b"\x03" + bytes(9)
    return b"\xff\xd8" + app0 + sof


@pytest.mark.parametrize(("fmt", "data", "needle"), [
    ("png", _png_header(60000, 60000), "max_pixels"),
    ("jpeg", _huge_jpeg(65000, 65000), "max_pixels"),
    ("jpeg", _huge_jpeg(10, 5000), "max_aspect"),
    ("png", _png_header(0, 10), "zero size"),
])
def test_oversized_headers_refused_before_decoding(monkeypatch, fmt, data, needle) -> None:
    def no_decode(*_):
        raise AssertionError("imdecode called on a frame over the limits")

    monkeypatch.setattr(image_msg.cv2, "imdecode", no_decode)
    with pytest.raises(ValueError, match=needle):
        decode_compressed(SimpleNamespace(format=fmt, data=data))


def test_jpeg_size_comes_from_the_frame_header() -> None:
    img = make_signs(1, image_size=40, seed=5).images[0][:, :24]
    msg = _compressed(img, ".jpg", "jpeg")
    head = image_msg.jpeg_header(np.frombuffer(msg.data, np.uint8))
    assert (head.height, head.width, head.channels, head.bits) == (40, 24, 3, 8)
    with pytest.raises(ValueError, match="max_pixels=100"):
        decode_compressed(msg, FrameLimits(max_pixels=100))


@pytest.mark.parametrize(("fmt", "data", "needle"), [
    ("png", b"not an image at all", "not a readable png"),
    ("jpeg", b"\x89PNG\r\n\x1a\n" + bytes(40), "not a readable jpeg"),  # format lies
    ("jpeg", b"\xff\xd8\xff\xda" + bytes(40), "not a readable jpeg"),  # scan, no frame
    ("png", _png_header(8, 8) + bytes(30), "inflates to 0 of the 200 bytes"),  # no data
    ("jpeg", _huge_jpeg(8, 8), "without its end-of-image marker"),
    ("jpeg", _huge_jpeg(8, 8) + b"\xff\xd9", "could not be decoded"),
])
def test_undecodable_data_refused_in_one_line(fmt: str, data: bytes, needle: str) -> None:
    with pytest.raises(ValueError, match=needle) as info:
        decode_compressed(SimpleNamespace(format=fmt, data=data))
    assert "\n" not in str(info.value)


def test_truncated_png_refused_and_data_as_array_accepted() -> None:
    import array

    img = make_signs(1, image_size=32, seed=6).images[0]
    good = _compressed(img)
    with pytest.raises(ValueError, match=r"chunk b'IDAT' cut off"):
        decode_compressed(SimpleNamespace(format="png", data=good.data[:len(good.data) // 2]))
    as_array = SimpleNamespace(format="png", data=array.array("B", good.data))
    np.testing.assert_array_equal(decode_compressed(as_array), img)
