"""Camera frames reduced for the model's input (tta_ros.frame_reduce, convert.frame_tensor):
small frames convert to the very same tensor as before, larger ones to block means of a
bounded sample that stay close to the old full-size resize, reading and allocating only
that sample; the checks and one-line errors are decode_image's.

Tolerance of the comparisons with the old path (`old`: decode_image, then to_tensor's
antialiased bilinear resize of the whole frame): the new path averages blocks of samples
and then applies the same resize, so its filter is the old triangle widened by one block
(at most a quarter of its half-width: SIDE_MARGIN), taken at a stride beyond
MAX_SAMPLES samples a side; on content that varies over the model's pixels rather than
over single camera pixels (camera-like frames: signs upscaled, sensor noise of 2/255) the
two outputs then differ by a fraction of the content's variation within one output
pixel. TOL = 10/255 of the pixel range bounds that with room for the noise, and sits far
below what changes a prediction (the shipped model gives the same labels, checked
below).
"""

from __future__ import annotations

import tracemalloc
from types import SimpleNamespace

import cv2
import numpy as np
import pytest
import torch

pytest.importorskip("rclpy")
from helpers import CARD
from rclpy.serialization import deserialize_message, serialize_message
from sensor_msgs.msg import CompressedImage, Image

from tta_core.data.signs import make_signs
from tta_core.io.image_msg import (
    ENCODINGS,
    FrameLimits,
    Preprocess,
    array_to_image_fields,
    decode_compressed,
    decode_image,
    to_tensor,
)
from tta_core.model.source import load_source
from tta_ros.convert import decode_frame, frame_tensor, read_frame
from tta_ros.frame_reduce import (
    MAX_SAMPLES,
    SIDE_MARGIN,
    axis_plan,
    jpeg_scale,
    plan,
    reduced_compressed,
    reduced_image,
)

SIDE = 32  # the shipped card's input side
PRE = Preprocess(SIDE, (0.48, 0.45, 0.40), (0.25, 0.24, 0.26))
PIXELS = Preprocess(SIDE, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))  # tensors in pixel units
LIMITS = FrameLimits()
TOL = 10 / 255
DIRECT = ("rgb8", "bgr8", "mono8", "rgba8", "bgra8", "mono16", "rgb16", "32FC1", "32FC3")
PACKED = ("yuv422", "yuyv", "bayer_rggb8", "bayer_bggr8", "bayer_gbrg8", "bayer_grbg8")
SIGNS = make_signs(6, image_size=64, seed=4).images


def noise_frame(h: int, w: int, encoding: str, seed: int = 0) -> SimpleNamespace:
    """An Image-like frame of random bytes (floats in [0, 1] for the float encodings)."""
    spec, rng = ENCODINGS[encoding.lower()], np.random.default_rng(seed)
    if spec.kind == "f":
        data = rng.random(h * w * spec.channels, dtype=np.float32).tobytes()
    else:
        data = rng.integers(0, 256, h * w * spec.channels * spec.depth, np.uint8).tobytes()
    return SimpleNamespace(height=h, width=w, encoding=encoding, is_bigendian=0,
                           step=w * spec.channels * spec.depth, data=data)


def camera_frame(h: int, w: int, i: int = 0) -> np.ndarray:
    """A sign upscaled to h x w with sensor noise: float RGB in [0, 1]."""
    big = cv2.resize(SIGNS[i % len(SIGNS)], (w, h), interpolation=cv2.INTER_LINEAR)
    noise = np.random.default_rng(i).normal(0.0, 2.0, big.shape)
    return (np.clip(big + noise, 0, 255) / 255.0).astype(np.float32)


def old(msg: SimpleNamespace, pre: Preprocess = PIXELS) -> torch.Tensor:
    return to_tensor([decode_image(msg, LIMITS)], pre)


def new(msg: SimpleNamespace, pre: Preprocess = PIXELS) -> torch.Tensor:
    return to_tensor([reduced_image(msg, LIMITS, SIDE)], pre)


@pytest.mark.parametrize("side", [32, 224])
def test_axis_plan_reads_a_bounded_centred_sample_and_leaves_enough(side: int) -> None:
    target = SIDE_MARGIN * side
    for length in [*range(1, 2 * target + 3), *range(2 * target, 30000, 89), 2160, 4096]:
        a = axis_plan(length, side)
        idx = np.arange(length)[a.samples]
        if length < 2 * target:
            assert not a.reduces and idx.tolist() == list(range(length)), length
            continue
        assert a.reduces and len(idx) == a.count * a.area, length
        assert len(idx) <= MAX_SAMPLES * target, length  # the bound on the pixels read
        assert a.count >= target, length  # what the antialiased resize then averages
        assert (np.diff(idx) == a.stride).all() and 0 <= idx[0] and idx[-1] < length
        before = idx[0] - a.stride // 2  # pixels left out before the first block
        after = length - (before + a.count * a.area * a.stride)
        assert 0 <= before and 0 <= after and abs(before - after) <= 1, length


@pytest.mark.parametrize("encoding", DIRECT + PACKED)
def test_frames_too_small_to_reduce_convert_to_the_same_tensor(encoding: str) -> None:
    for h, w in ((40, 40), (64, 64), (255, 200)):
        msg = noise_frame(h, w, encoding)
        assert plan(h, w, SIDE) is None
        assert torch.equal(new(msg, PRE), old(msg, PRE)), (h, w)
    img = Image(**{**vars(noise_frame(64, 64, encoding)), "is_bigendian": False})
    img.header.stamp.sec, img.header.frame_id = 5, "cam"
    header, x = frame_tensor(serialize_message(img), "raw", LIMITS, PRE)
    assert torch.equal(x, old(img, PRE)) and header == img.header


def _blocks(h: int, w: int, small: np.ndarray) -> np.ndarray:
    """An h x w frame whose reduction blocks (axis_plan) hold the pixels of `small`, one
    pixel a block (the margins copy the edge blocks)."""
    index = []
    for length in (h, w):
        a = axis_plan(length, SIDE)
        first = a.start - a.stride // 2
        block = a.stride * a.area
        index.append(np.clip((np.arange(length) - first) // block, 0, a.count - 1))
    return small[index[0]][:, index[1]]


@pytest.mark.parametrize(("encoding", "bigendian", "pad"), [
    ("rgb8", False, 0), ("bgr8", False, 3), ("mono8", False, 1), ("rgba8", False, 0),
    ("bgra8", False, 2), ("mono16", True, 0), ("rgb16", False, 6), ("32FC1", False, 0),
    ("32FC3", True, 4), ("32FC3", False, 0)])
def test_reduction_is_the_mean_of_each_block(encoding: str, bigendian: bool,
                                             pad: int) -> None:
    """A frame constant on each reduction block reduces to exactly those values, in RGB
    order, in [0, 1], whatever the byte order and row padding: the reduction reads the
    right samples, averages within blocks only and maps the channels."""
    h, w = 1200, 1500  # a stride (2 and 3) and an area (4 and 3) on each axis
    rows, cols = plan(h, w, SIDE)
    assert rows.stride > 1 and cols.stride > 1 and rows.area > 1 and cols.area > 1
    small = np.random.default_rng(1).random((rows.count, cols.count, 3)).astype(np.float32)
    frame = SimpleNamespace(**array_to_image_fields(_blocks(h, w, small), encoding, pad,
                                                    bigendian))
    tiny = SimpleNamespace(**array_to_image_fields(small, encoding, 0, bigendian))
    want = decode_image(tiny, LIMITS)
    want = want / np.float32(255.0) if want.dtype == np.uint8 else want
    got = reduced_image(frame, LIMITS, SIDE)
    assert got.shape == (rows.count, cols.count, 3) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)


@pytest.mark.parametrize("encoding", ["yuv422", "yuyv", "bayer_rggb8", "bayer_gbrg8"])
def test_packed_encodings_reduce_to_their_colours(encoding: str) -> None:
    """A uniform colour as a Bayer mosaic or packed YUV 4:2:2 reduces to that colour as
    decode_image converts it (within OpenCV's rounding, 2/255)."""
    h, w = 1200, 1500
    tile = {"yuv422": [90, 120, 200, 120], "yuyv": [120, 90, 120, 200],  # Y=120 U=90 V=200
            "bayer_rggb8": [200, 80, 80, 30], "bayer_gbrg8": [80, 30, 200, 80]}[encoding]
    if encoding.startswith("bayer"):
        data = np.tile(np.array(tile, np.uint8).reshape(2, 2), (h // 2, w // 2))
    else:
        data = np.tile(np.array(tile, np.uint8), (h, w // 2))
    step = data.nbytes // h
    frame = SimpleNamespace(height=h, width=w, encoding=encoding, is_bigendian=0,
                            step=step, data=data.tobytes())
    want = decode_image(frame, LIMITS)[h // 2, w // 2] / 255.0  # the middle: no border
    got = reduced_image(frame, LIMITS, SIDE)
    assert got.shape[2] == 3 and min(got.shape[:2]) >= SIDE_MARGIN * SIDE
    np.testing.assert_allclose(got.reshape(-1, 3), np.broadcast_to(want, (got[..., 0].size, 3)),
                               rtol=0, atol=2 / 255)


@pytest.mark.parametrize(("h", "w"), [(480, 640), (720, 1280), (2160, 3840)])
@pytest.mark.parametrize("encoding", ["rgb8", "bgr8", "mono8", "32FC3", "mono16"])
def test_camera_frames_stay_close_to_the_old_conversion(h: int, w: int,
                                                        encoding: str) -> None:
    for i in range(3):
        msg = SimpleNamespace(**array_to_image_fields(camera_frame(h, w, i), encoding))
        diff = float((new(msg) - old(msg)).abs().max())
        assert diff <= TOL, (i, diff)


def test_the_shipped_model_gives_the_same_labels_either_way() -> None:
    model, card = load_source(CARD)
    pre = Preprocess.from_card(card)
    msgs = [SimpleNamespace(**array_to_image_fields(camera_frame(h, w, i), enc))
            for i, (h, w, enc) in enumerate([(480, 640, "rgb8"), (720, 1280, "bgr8"),
                                             (2160, 3840, "rgb8"), (1080, 1920, "mono8"),
                                             (480, 640, "32FC3"), (1200, 1600, "rgb8")])]
    with torch.no_grad():
        before = model.eval()(torch.cat([old(m, pre) for m in msgs])).argmax(1)
        after = model(torch.cat([to_tensor([reduced_image(m, LIMITS, card.image_size)], pre)
                                 for m in msgs])).argmax(1)
    assert before.tolist() == after.tolist()


def test_only_the_sample_is_read_and_allocated() -> None:
    """A 2048 x 2048 32FC3 frame (50 MB): the old conversion allocates more than the
    frame, the reduction a few MB; a far-out value where a sample is read refuses the
    frame, one where none is read never reaches the model."""
    h = w = 2048
    rows, cols = plan(h, w, SIDE)
    pix = np.full((h, w, 3), 0.5, np.float32)
    msg = SimpleNamespace(height=h, width=w, encoding="32FC3", is_bigendian=0, step=w * 12,
                          data=pix.tobytes())
    peaks = []
    for fn in (lambda: old(msg), lambda: reduced_image(msg, LIMITS, SIDE)):
        tracemalloc.start()
        fn()
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    assert peaks[0] > h * w * 12 and peaks[1] < 8 * 2**20, peaks
    read = rows.start + rows.stride, cols.start + 2 * cols.stride
    skipped = read[0] + 1, read[1]
    for (y, x), value, admitted in ((read, 7.0, False), (read, np.nan, False),
                                    (skipped, np.nan, True)):
        bad = pix.copy()
        bad[y, x, 1] = value
        frame = SimpleNamespace(**{**vars(msg), "data": bad.tobytes()})
        if admitted:
            assert np.isfinite(reduced_image(frame, LIMITS, SIDE)).all()
            continue
        with pytest.raises(ValueError, match=r"float_range|non-finite") as err:
            reduced_image(frame, LIMITS, SIDE)
        assert "\n" not in str(err.value) and len(str(err.value)) < 200


@pytest.mark.parametrize("fields", [
    {"encoding": "rgb8", "step": 3000}, {"encoding": "rgb8", "data": bytes(10)},
    {"encoding": "yuv422", "width": 1501, "step": 3002},
    {"encoding": "16UC1", "step": 3000}, {"height": 100_000, "width": 1}])
def test_large_bad_frames_are_refused_as_decode_image_refuses_them(fields: dict) -> None:
    base = {"height": 1200, "width": 1500, "encoding": "rgb8", "is_bigendian": 0,
            "step": 4500, "data": bytes(1200 * 4500)}
    msg = SimpleNamespace(**{**base, **fields})
    with pytest.raises(ValueError) as want:
        decode_image(msg, LIMITS)
    with pytest.raises(ValueError) as got:
        reduced_image(msg, LIMITS, SIDE)
    assert str(got.value) == str(want.value) and type(got.value) is type(want.value)


def test_per_frame_tensors_batch_to_the_batch_tensor() -> None:
    """What the converter threads make, one frame at a time, is what to_tensor of the
    whole batch gave (same-size uint8 frames and mixed batches alike)."""
    rng = np.random.default_rng(2)
    same = [rng.integers(0, 256, (SIDE, SIDE, 3), np.uint8) for _ in range(4)]
    mixed = [*same[:2], rng.random((50, 70, 3), dtype=np.float32),
             rng.integers(0, 256, (64, 64, 3), np.uint8)]
    for batch in (same, mixed):
        one_by_one = torch.cat([to_tensor([a], PRE) for a in batch])
        assert torch.equal(one_by_one, to_tensor(batch, PRE))


def test_frames_are_read_from_their_bytes_as_rclpy_reads_them() -> None:
    for frame_id in ("", "cam", "caméra_前", "a\x00b"):
        img = Image(height=3, width=2, encoding="bgr8", is_bigendian=True, step=7,
                    data=bytes(range(21)))
        img.header.stamp.sec, img.header.stamp.nanosec = -7, 999_999_999
        img.header.frame_id = frame_id
        cmp = CompressedImage(format="rgb8; jpeg compressed bgr8", data=b"\xff\xd8xyz")
        cmp.header = img.header
        for kind, msg in (("raw", img), ("compressed", cmp)):
            data = serialize_message(msg)
            got, want = read_frame(data, kind), deserialize_message(data, type(msg))
            assert got.header == want.header, frame_id
            for name in ("height", "width", "encoding", "is_bigendian", "step", "format"):
                assert getattr(got, name, None) == getattr(want, name, None), name
            assert bytes(got.data) == bytes(want.data)
    data = bytearray(serialize_message(img))
    data[data.index(b"bgr8") + 1] = 0xFF  # not UTF-8: replaced, as rclpy does
    assert read_frame(bytes(data), "raw").encoding == deserialize_message(
        bytes(data), Image).encoding


def _jpeg(rgb: np.ndarray, quality: int = 92) -> SimpleNamespace:
    data = cv2.imencode(".jpg", np.ascontiguousarray(rgb[..., ::-1]),
                        [cv2.IMWRITE_JPEG_QUALITY, quality])[1].tobytes()
    return SimpleNamespace(format="jpeg", data=data)


def test_jpeg_scale_follows_the_header_and_the_model_side() -> None:
    assert jpeg_scale(2160, 3840, 32) == 8 and jpeg_scale(4096, 4096, 32) == 8
    assert jpeg_scale(1080, 1920, 32) == 4 and jpeg_scale(600, 800, 32) == 2
    assert jpeg_scale(480, 640, 32) == 1 and jpeg_scale(2160, 3840, 224) == 1
    assert jpeg_scale(2160, 3840, 128) == 2


def test_large_jpegs_decode_reduced_and_stay_close(monkeypatch) -> None:
    flags = []
    imdecode = cv2.imdecode
    monkeypatch.setattr(cv2, "imdecode", lambda buf, f: flags.append(f) or imdecode(buf, f))
    for rgb, scale in ((camera_frame(2160, 3840), 8), (camera_frame(1080, 1920, 1), 4)):
        msg = _jpeg((rgb * 255).astype(np.uint8))
        got = to_tensor([reduced_compressed(msg, LIMITS, SIDE)], PIXELS)
        assert flags[-1] & ~cv2.IMREAD_IGNORE_ORIENTATION == {
            8: cv2.IMREAD_REDUCED_COLOR_8, 4: cv2.IMREAD_REDUCED_COLOR_4}[scale]
        want = to_tensor([decode_compressed(msg, LIMITS)], PIXELS)
        assert float((got - want).abs().max()) <= TOL
    grey = (camera_frame(2160, 3840, 2).mean(axis=2) * 255).astype(np.uint8)
    data = cv2.imencode(".jpg", grey)[1].tobytes()
    msg = SimpleNamespace(format="jpeg", data=data)
    got = reduced_compressed(msg, LIMITS, SIDE)
    assert flags[-1] & ~cv2.IMREAD_IGNORE_ORIENTATION == cv2.IMREAD_REDUCED_GRAYSCALE_8
    assert (got[..., 0] == got[..., 1]).all() and (got[..., 1] == got[..., 2]).all()
    want = to_tensor([decode_compressed(msg, LIMITS)], PIXELS)
    assert float((to_tensor([got], PIXELS) - want).abs().max()) <= TOL
    small = _jpeg((camera_frame(64, 64) * 255).astype(np.uint8))
    assert np.array_equal(reduced_compressed(small, LIMITS, SIDE),
                          decode_compressed(small, LIMITS))  # small: decoded as before


def test_large_compressed_frames_keep_their_checks() -> None:
    big = _jpeg((camera_frame(2160, 3840) * 255).astype(np.uint8))
    cut = SimpleNamespace(format="jpeg", data=big.data[:len(big.data) // 2])
    with pytest.raises(ValueError, match="end-of-image marker"):
        reduced_compressed(cut, LIMITS, SIDE)
    tight = FrameLimits(max_decode_bytes=3 * 1920 * 1080)
    for msg in (big, SimpleNamespace(format="png", data=cv2.imencode(
            ".png", np.zeros((2160, 3840, 3), np.uint8))[1].tobytes())):
        with pytest.raises(ValueError, match="max_decode_bytes"):
            reduced_compressed(msg, tight, SIDE)
    rgb = (camera_frame(2160, 3840, 3) * 255).astype(np.uint8)
    png = SimpleNamespace(format="png", data=cv2.imencode(".png", rgb[..., ::-1])[1].tobytes())
    got = to_tensor([reduced_compressed(png, LIMITS, SIDE)], PIXELS)
    assert float((got - to_tensor([decode_compressed(png, LIMITS)], PIXELS)).abs().max()) \
        <= TOL


def test_node_path_decodes_a_serialized_frame_whole_or_reduced() -> None:
    img = Image(**array_to_image_fields(camera_frame(2160, 3840), "bgr8"))
    data = serialize_message(img)
    _, whole = decode_frame(data, "raw", LIMITS)
    _, reduced = decode_frame(data, "raw", LIMITS, SIDE)
    assert whole.shape == (2160, 3840, 3) and reduced.shape == (
        axis_plan(2160, SIDE).count, axis_plan(3840, SIDE).count, 3)
    header, x = frame_tensor(data, "raw", LIMITS, PRE)
    assert x.shape == (1, 3, SIDE, SIDE) and header == img.header
