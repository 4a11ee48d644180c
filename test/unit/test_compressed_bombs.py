"""Decode budget of compressed frames (tta_core.io.image_msg): size, channels and bit depth
read from the JPEG/PNG header, and a frame whose decoding would write more than
FrameLimits.max_decode_bytes refused before OpenCV sees it (cv2.imdecode is spied on: a
refusal never calls it, so it costs the header parse only; the timings are printed by
benchmarks/field/bench_compressed_bombs.py)."""

from __future__ import annotations

from types import SimpleNamespace

import cv2
import numpy as np
import pytest
from helpers.bombs import bombs, jpeg_claiming, png_of_zeros

from tta_core.io import image_msg
from tta_core.io.image_msg import (
    UHD_PIXELS,
    CompressedHeader,
    FrameLimits,
    FrameTooLarge,
    decode_budget,
    decode_compressed,
    jpeg_header,
    png_header,
)

BOMBS = bombs()


class DecoderSpy:
    """Stands in for cv2.imdecode: records calls, decodes nothing (returns None)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *_: object) -> None:
        self.calls += 1


@pytest.fixture
def spy(monkeypatch) -> DecoderSpy:
    s = DecoderSpy()
    monkeypatch.setattr(image_msg.cv2, "imdecode", s)
    return s


def _msg(fmt: str, data: bytes) -> SimpleNamespace:
    return SimpleNamespace(format=fmt, data=data)


@pytest.mark.parametrize("bomb", BOMBS, ids=[b.name for b in BOMBS])
def test_bombs_refused_from_their_header_without_decoding(spy, bomb) -> None:
    with pytest.raises(FrameTooLarge) as info:
        decode_compressed(_msg(bomb.format, bomb.data))
    text = str(info.value)
    declared = bomb.height * bomb.width * max(bomb.channels * bomb.bits // 8, 3)
    assert text == (f"compressed {bomb.format} declares {bomb.width}x{bomb.height}, "
                    f"{bomb.channels} channel(s) of {bomb.bits} bits: {declared} bytes to "
                    f"decode, over max_decode_bytes={3 * UHD_PIXELS}")
    assert spy.calls == 0


def test_bomb_files_are_as_small_as_the_fuzz_cases() -> None:
    sizes = {b.name: len(b.data) for b in BOMBS}
    assert sizes["jpeg_4000x4000"] < 1536
    assert 40_000 < sizes["png_zeros_4000x4000_rgb8"] < 50_000
    assert 120_000 < sizes["png_zeros_4096x4096_rgba16"] < 140_000


def test_budget_boundary_just_inside_reaches_the_decoder(spy) -> None:
    """4K UHD RGB (exactly the default budget) goes to the decoder; one more row does not."""
    with pytest.raises(ValueError, match="could not be decoded"):  # the spy decodes nothing
        decode_compressed(_msg("jpeg", jpeg_claiming(2160, 3840)))
    assert spy.calls == 1
    with pytest.raises(FrameTooLarge, match=f"{3 * 3840 * 2161} bytes"):
        decode_compressed(_msg("jpeg", jpeg_claiming(2161, 3840)))
    assert spy.calls == 1


@pytest.mark.parametrize(("color_type", "bits", "per_pixel"), [
    (0, 8, 3), (0, 16, 3), (2, 8, 3), (2, 16, 6), (4, 8, 3), (4, 16, 4), (6, 8, 4),
    (6, 16, 8)])
def test_png_decode_cost_counts_channels_and_depth(spy, color_type, bits, per_pixel) -> None:
    """Declared bytes = pixels x max(channels x bytes per sample, 3): a budget of exactly
    that passes to the decoder, one byte less is refused."""
    data = png_of_zeros(30, 40, color_type, bits)
    head = png_header(np.frombuffer(data, np.uint8))
    assert head.decoded_bytes == 30 * 40 * per_pixel
    exact = FrameLimits(max_decode_bytes=30 * 40 * per_pixel)
    with pytest.raises(ValueError, match="could not be decoded"):
        decode_compressed(_msg("png", data), exact)
    with pytest.raises(FrameTooLarge, match="max_decode_bytes"):
        decode_compressed(_msg("png", data),
                          FrameLimits(max_decode_bytes=30 * 40 * per_pixel - 1))
    assert spy.calls == 1


def test_headers_of_real_encodings() -> None:
    rng = np.random.default_rng(0)
    rgba16 = rng.integers(0, 65536, (12, 20, 4), dtype=np.uint16)
    grey = rng.integers(0, 256, (9, 7), dtype=np.uint8)
    cases = [(png_header, cv2.imencode(".png", rgba16)[1], (12, 20, 4, 16)),
             (png_header, cv2.imencode(".png", grey)[1], (9, 7, 1, 8)),
             (jpeg_header, cv2.imencode(".jpg", grey)[1], (9, 7, 1, 8)),
             (jpeg_header, cv2.imencode(".jpg", rgba16[..., :3].astype(np.uint8))[1],
              (12, 20, 3, 8))]
    for parse, buf, want in cases:
        head = parse(buf)
        assert (head.height, head.width, head.channels, head.bits) == want


def test_twelve_bit_jpeg_counts_two_bytes_a_sample() -> None:
    assert CompressedHeader(100, 100, 3, 12).decoded_bytes == 100 * 100 * 6
    assert CompressedHeader(100, 100, 1, 8).decoded_bytes == 100 * 100 * 3


@pytest.mark.parametrize(("fmt", "data"), [
    ("png", png_of_zeros(8, 8)[:25]),  # IHDR cut before the colour type
    ("png", png_of_zeros(8, 8)[:25] + b"\x05"),  # colour type 5 does not exist
    ("jpeg", jpeg_claiming(8, 8)[:jpeg_claiming(8, 8).index(b"\xff\xc0") + 8]),  # SOF cut
])
def test_cut_or_invalid_headers_are_unreadable(spy, fmt, data) -> None:
    with pytest.raises(ValueError, match=f"not a readable {fmt}"):
        decode_compressed(_msg(fmt, data))
    assert spy.calls == 0


def test_small_png_of_zeros_decodes() -> None:
    out = decode_compressed(_msg("png", png_of_zeros(48, 64)))
    assert out.shape == (48, 64, 3) and out.dtype == np.uint8 and not out.any()


def test_default_budget_from_the_model_input_size() -> None:
    assert decode_budget(32) == decode_budget(224) == 3 * 3840 * 2160 == 24_883_200
    assert decode_budget(320) == 3 * 3840 * 3840 > decode_budget(224)
    assert decode_budget(512) == 3 * 6144 * 6144
    assert FrameLimits().max_decode_bytes == decode_budget(224)
    with pytest.raises(ValueError, match="max_decode_bytes must be >= 1, got 0"):
        FrameLimits(max_decode_bytes=0)


def test_small_png_with_a_stream_of_zeros_refused_past_its_declared_size(spy) -> None:
    """64 x 48 declared, 48 MB of zeros in 47 KB: libpng would inflate all of it."""
    data = png_of_zeros(48, 64, extra=48 * 2**20)
    assert len(data) < 60_000
    with pytest.raises(FrameTooLarge) as info:
        decode_compressed(_msg("png", data))
    assert str(info.value) == (f"compressed png ({len(data)} bytes): image data inflates "
                               f"beyond the {48 * (1 + 64 * 3)} bytes its header declares")
    assert spy.calls == 0


@pytest.mark.parametrize(("h", "w"), [(1, 1), (3, 5), (17, 9), (8, 8), (2, 30)])
@pytest.mark.parametrize(("color_type", "bits"), [(2, 8), (0, 1), (0, 4), (6, 16), (4, 8)])
def test_declared_scanlines_match_libpng(h, w, color_type, bits) -> None:
    """Interlaced (Adam7) and plain PNGs of every layout, sub-byte depths too: the stream
    the header asks for passes the check and libpng decodes it (zeros); one byte more or
    less is refused."""
    for interlaced in (False, True):
        out = decode_compressed(_msg("png", png_of_zeros(h, w, color_type, bits,
                                                         interlaced=interlaced)))
        assert out.shape == (h, w, 3) and not out.any(), (interlaced, out.shape)
        more = png_of_zeros(h, w, color_type, bits, interlaced=interlaced, extra=1)
        with pytest.raises(FrameTooLarge, match="inflates beyond"):
            decode_compressed(_msg("png", more))


def test_cut_or_corrupt_png_streams_refused_before_decoding(spy) -> None:
    rng = np.random.default_rng(1)
    good = cv2.imencode(".png", rng.integers(0, 256, (200, 300, 3), dtype=np.uint8))[1]
    good = good.tobytes()
    assert good.count(b"IDAT") > 1  # libpng splits the stream into several chunks
    bad = bytearray(good)
    bad[good.index(b"IDAT") + 40] ^= 0xFF
    for data, needle in ((bytes(bad), "not a valid zlib stream|inflates to"),
                         (good[:len(good) // 2], "cut off")):
        with pytest.raises(ValueError, match=needle):
            decode_compressed(_msg("png", data))
    assert spy.calls == 0


def test_multi_chunk_png_decodes_exactly() -> None:
    img = np.random.default_rng(2).integers(0, 256, (200, 300, 3), dtype=np.uint8)
    data = cv2.imencode(".png", img[..., ::-1])[1].tobytes()
    np.testing.assert_array_equal(decode_compressed(_msg("png", data)), img)


def test_cut_jpeg_refused_before_decoding(spy) -> None:
    img = np.random.default_rng(3).integers(0, 256, (40, 40, 3), dtype=np.uint8)
    data = cv2.imencode(".jpg", img)[1].tobytes()
    with pytest.raises(ValueError, match="without its end-of-image marker"):
        decode_compressed(_msg("jpeg", data[:len(data) * 2 // 3]))
    assert spy.calls == 0


def test_jpeg_padded_with_zeros_after_its_end_marker_decodes() -> None:
    img = np.full((16, 24, 3), 90, np.uint8)
    data = cv2.imencode(".jpg", img)[1].tobytes() + bytes(7)
    assert decode_compressed(_msg("jpeg", data)).shape == (16, 24, 3)
