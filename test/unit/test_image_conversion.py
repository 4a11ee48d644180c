"""sensor_msgs/Image decoding in numpy: every encoding, padded rows, byte order, bad input."""

from __future__ import annotations

import array
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import CARD, fake_image

from tta_core.io.image_msg import (
    ENCODINGS,
    Preprocess,
    array_to_image_fields,
    image_to_array,
    image_to_rgb8,
    image_to_tensor,
    to_tensor,
)

RNG = np.random.default_rng(0)
RGB = RNG.random((5, 7, 3)).astype(np.float32)


def _hand_built(encoding: str, pad: int) -> tuple[SimpleNamespace, np.ndarray]:
    """An Image built byte by byte (independently of array_to_image_fields) + expected RGB."""
    h, w = 3, 4
    vals = RNG.integers(0, 256, size=(h, w, 4), dtype=np.uint8)
    rows = []
    for y in range(h):
        row = bytearray()
        for x in range(w):
            r, g, b, a = (int(v) for v in vals[y, x])
            row += {"rgb8": bytes([r, g, b]), "bgr8": bytes([b, g, r]), "mono8": bytes([r]),
                    "rgba8": bytes([r, g, b, a]), "bgra8": bytes([b, g, r, a])}[encoding]
        row += bytes([0xEE] * pad)
        rows.append(bytes(row))
    step = len(rows[0])
    expect = vals[:, :, :3].astype(np.float32) / 255.0
    if encoding == "mono8":
        expect = np.repeat(expect[:, :, :1], 3, axis=2)
    msg = fake_image(height=h, width=w, encoding=encoding, is_bigendian=0, step=step,
               data=array.array("B", b"".join(rows)))
    return msg, expect


@pytest.mark.parametrize("encoding", ["rgb8", "bgr8", "mono8", "rgba8", "bgra8"])
@pytest.mark.parametrize("pad", [0, 5])
def test_8bit_encodings_decode_exactly(encoding: str, pad: int) -> None:
    msg, expect = _hand_built(encoding, pad)
    np.testing.assert_array_equal(image_to_array(msg), expect)


@pytest.mark.parametrize("bigendian", [False, True])
@pytest.mark.parametrize("encoding", ["mono16", "rgb16"])
def test_16bit_honours_byte_order(encoding: str, bigendian: bool) -> None:
    h, w = 2, 3
    ch = ENCODINGS[encoding].channels
    vals = RNG.integers(0, 65536, size=(h, w, ch), dtype=np.uint16)
    dt = ">u2" if bigendian else "<u2"
    data = vals.astype(dt).tobytes()
    msg = fake_image(height=h, width=w, encoding=encoding, is_bigendian=int(bigendian),
               step=w * ch * 2, data=data)
    out = image_to_array(msg)
    expect = vals.astype(np.float32) / 65535.0
    if ch == 1:
        expect = np.repeat(expect, 3, axis=2)
    np.testing.assert_allclose(out, expect, rtol=0, atol=1e-7)
    # the wrong byte order gives a different image (the flag really is read)
    msg.is_bigendian = int(not bigendian)
    assert not np.allclose(image_to_array(msg), expect)


@pytest.mark.parametrize("encoding", sorted(e for e, s in ENCODINGS.items() if s.kind != "cv"))
def test_round_trip_with_padding(encoding: str) -> None:
    fields = array_to_image_fields(RGB, encoding, pad=3, bigendian=True)
    out = image_to_array(fake_image(**fields))
    ref = RGB if ENCODINGS[encoding].channels > 1 else np.repeat(
        RGB.mean(axis=2, keepdims=True), 3, axis=2)
    tol = 1 / 255 if ENCODINGS[encoding].depth == 1 else 1 / 65535
    np.testing.assert_allclose(out, ref, atol=tol * 0.51 + 1e-7)


def test_tensor_resized_and_normalised() -> None:
    pre = Preprocess(4, (0.5, 0.25, 0.0), (0.5, 0.25, 2.0))
    img = np.zeros((8, 8, 3), dtype=np.float32)
    img[:, :, 0] = 1.0
    img[:, :, 1] = 0.25
    img[:, :, 2] = 0.5
    x = image_to_tensor(fake_image(**array_to_image_fields(img, "rgb8")), pre)
    assert x.shape == (1, 3, 4, 4) and x.dtype == torch.float32
    exp = torch.tensor([1.0, 0.25, 0.5])
    exp = ((torch.round(exp * 255) / 255) - torch.tensor(pre.mean)) / torch.tensor(pre.std)
    torch.testing.assert_close(x[0].mean(dim=(1, 2)), exp, atol=1e-6, rtol=0)


def test_preprocess_from_the_shipped_card() -> None:
    from tta_core.model.source import load_card

    card = load_card(CARD)
    pre = Preprocess.from_card(card)
    assert pre.image_size == card.image_size == 32 and pre.mean == tuple(card.mean)


def test_uint8_fast_path_equals_float_path() -> None:
    """Same-size uint8 frames take the vectorised path; it must match the float path."""
    pre = Preprocess(6, (0.4, 0.5, 0.6), (0.2, 0.3, 0.25))
    imgs = [RNG.integers(0, 256, (6, 6, 3), dtype=np.uint8) for _ in range(3)]
    fast = to_tensor(imgs, pre)
    slow = to_tensor([a.astype(np.float32) / 255 for a in imgs], pre)
    assert fast.shape == (3, 3, 6, 6)
    torch.testing.assert_close(fast, slow, atol=1e-6, rtol=0)
    mixed = to_tensor([imgs[0], RNG.random((9, 9, 3)).astype(np.float32)], pre)
    torch.testing.assert_close(mixed[0], fast[0], atol=1e-6, rtol=0)  # resized: other path
    with pytest.raises(ValueError, match="0 images"):
        to_tensor([], pre)


def test_rgb8_of_16bit_and_8bit() -> None:
    fields = array_to_image_fields(RGB, "rgb16")
    np.testing.assert_array_equal(image_to_rgb8(fake_image(**fields)), np.round(RGB * 255))
    msg, expect = _hand_built("bgra8", 2)
    out = image_to_rgb8(msg)
    assert out.dtype == np.uint8
    np.testing.assert_array_equal(out, np.round(expect * 255))


def _good() -> dict:
    return array_to_image_fields(RGB, "rgb8")


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"encoding": "nv21"}, "nv21"),
        ({"encoding": "8UC3"}, "8UC3"),
        ({"height": 0, "data": b""}, "height=0"),
        ({"width": 0}, "width=0"),
        ({"step": 20}, "step=20"),
        ({"data": b"\x00" * 10}, "length=10"),
    ],
)
def test_bad_images_name_the_value(change: dict, needle: str) -> None:
    fields = {**_good(), **change}
    with pytest.raises(ValueError, match=needle):
        image_to_array(fake_image(**fields))


@pytest.mark.parametrize("bigendian", [False, True])
def test_float_encoding_byte_order_and_nan_pixels(bigendian: bool) -> None:
    img = RGB.copy()
    fields = array_to_image_fields(img, "32FC3", pad=4, bigendian=bigendian)
    np.testing.assert_array_equal(image_to_array(fake_image(**fields)), img)
    img[2, 3, 1] = np.nan
    bad = fake_image(**array_to_image_fields(img, "32FC3", bigendian=bigendian))
    with pytest.raises(ValueError, match="non-finite values"):
        image_to_tensor(bad, Preprocess(5, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)))


def test_non_finite_normalisation_is_refused() -> None:
    with pytest.raises(ValueError, match="mean"):
        Preprocess(4, (float("inf"), 0.0, 0.0), (1.0, 1.0, 1.0))
    with pytest.raises(ValueError, match="std"):
        Preprocess(4, (0.0, 0.0, 0.0), (1.0, 0.0, 1.0))
