"""Per-frame input limits of the decoder (tta_core.io.image_msg.FrameLimits): size, aspect
and float range are refused with one short line, degenerate frames before `data` is read.

hypothesis is not installed in the venv, so the property test runs over generated cases
(seeded numpy RNG, pytest.mark.parametrize) instead.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import CARD, fake_image
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tta_core.io.image_msg import (
    ENCODINGS,
    FrameLimits,
    Preprocess,
    array_to_image_fields,
    decode_image,
    image_to_array,
    one_line,
    quoted,
    to_tensor,
)

RNG = np.random.default_rng(3)
DEFAULT = FrameLimits()


class Untouchable:
    """Image.data that fails on any access: the decoder must refuse the frame without it."""

    def _touched(self, *_: object) -> None:
        raise AssertionError("the decoder read Image.data")

    __len__ = __getitem__ = __iter__ = __buffer__ = _touched


def _float_msg(img: np.ndarray, encoding: str = "32FC3") -> SimpleNamespace:
    return fake_image(**array_to_image_fields(img, encoding))


def _refusal(msg: SimpleNamespace, limits: FrameLimits = DEFAULT) -> str:
    with pytest.raises(ValueError) as info:
        decode_image(msg, limits)
    text = str(info.value)
    assert "\n" not in text and len(text) < 200, text
    return text


def test_tall_one_pixel_frame_refused_before_data_is_read() -> None:
    text = _refusal(fake_image(height=2_000_000, width=1, encoding="rgb8", step=3,
                         data=Untouchable()))
    assert "aspect 2e+06" in text and "height=2000000 width=1" in text
    assert "max_aspect=20" in text


@pytest.mark.parametrize(("h", "w"), [(4097, 4096), (100_000, 5_000), (2**31, 2**31)])
def test_too_many_pixels_refused_before_data_is_read(h: int, w: int) -> None:
    text = _refusal(fake_image(height=h, width=w, encoding="32FC3", step=12 * w,
                         data=Untouchable()))
    assert f"{h * w} pixels" in text and f"max_pixels={4096 * 4096}" in text


def test_each_limit_names_its_value() -> None:
    rgb = RNG.random((11, 11, 3)).astype(np.float32)
    fields = array_to_image_fields(rgb, "rgb8")
    assert "max_pixels=100" in _refusal(fake_image(**fields), FrameLimits(max_pixels=100))
    wide = array_to_image_fields(RNG.random((2, 9, 3)).astype(np.float32), "mono8")
    assert "aspect 4.5" in _refusal(fake_image(**wide), FrameLimits(max_aspect=4.0))
    assert decode_image(fake_image(**wide), FrameLimits(max_aspect=4.5)).shape == (2, 9, 3)
    assert decode_image(fake_image(**fields), FrameLimits(max_pixels=121)).shape == (11, 11, 3)


@pytest.mark.parametrize("encoding", ["32FC1", "32FC3"])
@pytest.mark.parametrize(("value", "needle"), [(1e6, "max 1e+06"), (-0.5, "min -0.5"),
                                               (1.001, "max 1.001")])
def test_out_of_range_float_frame_refused(encoding: str, value: float, needle: str) -> None:
    img = RNG.random((6, 5, 3)).astype(np.float32)
    img[2, 3] = value
    text = _refusal(_float_msg(img, encoding))
    assert "float_range [0, 1]" in text and needle in text


def test_in_range_float_frame_accepted_and_range_is_an_option() -> None:
    img = RNG.random((6, 5, 3)).astype(np.float32)
    img[0, 0], img[1, 1] = 0.0, 1.0  # the bounds are inside
    np.testing.assert_array_equal(decode_image(_float_msg(img)), img)
    np.testing.assert_array_equal(image_to_array(_float_msg(img)), img)  # default call
    hdr = img * 1.5 - 0.25
    assert "min -0.25" in _refusal(_float_msg(hdr))
    out = decode_image(_float_msg(hdr), FrameLimits(float_range=(-0.25, 1.25)))
    np.testing.assert_array_equal(out, hdr)  # taken as is, not rescaled


def test_integer_encodings_have_no_range_check() -> None:
    full = np.ones((3, 4, 3), dtype=np.float32)  # 65535 / 255: the top of the range
    for enc in ("rgb16", "mono16", "rgb8"):
        out = image_to_array(fake_image(**array_to_image_fields(full, enc)),
                             FrameLimits(float_range=(0.0, 0.5)))
        np.testing.assert_array_equal(out, full)


def test_attacker_sized_strings_are_cut() -> None:
    enc = "rgb8" + "x" * (65536 - 4)
    text = _refusal(fake_image(height=1, width=1, encoding=enc, step=3, data=b"abc"))
    assert "'rgb8xxxxxxxxxxxx'\u2026 (65536 chars)" in text
    assert _refusal(fake_image(height=1, width=1, encoding="a\nb", step=3, data=b"abc")).count(
        "'a\\nb'") == 1
    assert quoted("rgb8") == "'rgb8'"
    assert one_line("x\n" * 1000, limit=50) == "x\\n" * 16 + "x\\\u2026 (3000 chars)"


@pytest.mark.parametrize("kwargs", [{"float_range": (1.0, 0.0)},
                                    {"float_range": (0.0, float("nan"))},
                                    {"float_range": (0.0, float("inf"))},
                                    {"max_pixels": 0}, {"max_aspect": 0.5},
                                    {"max_aspect": float("inf")}])
def test_bad_limits_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        FrameLimits(**kwargs)


def _random_case(rng: np.random.Generator) -> SimpleNamespace:
    """Random Image fields: sizes from degenerate to over the limits, steps and data
    lengths right or off, either byte order, data random or valid floats."""
    enc = str(rng.choice([*ENCODINGS, "RGB8", "32FC3", "yuv422", ""]))
    spec = ENCODINGS.get(enc.lower(), ENCODINGS["rgb8"])
    dims = [0, 1, 2, 3, 7, 33, 100, 5000, 2_000_000, -1]
    h, w = (int(rng.choice(dims)) if rng.random() < 0.3 else int(rng.integers(1, 40))
            for _ in range(2))
    row = max(w, 0) * spec.channels * spec.depth
    step = row + int(rng.choice([0, 0, 1, 3, 8, -1]))
    if h <= 0 or w <= 0 or h * w > 4096 * 4096 or max(h, w) > 20 * min(h, w):
        return fake_image(height=h, width=w, encoding=enc, step=step, data=Untouchable(),
                    is_bigendian=int(rng.integers(0, 2)))
    size = max(h * step + int(rng.choice([0, 0, 0, 1, -1, -step])), 0)
    if spec.kind == "f" and size % 4 == 0 and rng.random() < 0.5:
        data = rng.random(size // 4).astype(np.float32).tobytes()
    else:
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
    return fake_image(height=h, width=w, encoding=enc, step=step, data=data,
                is_bigendian=int(rng.integers(0, 2)))


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1))
def test_random_frames_decode_or_raise_value_error(seed: int) -> None:
    """Property (hypothesis over the case generator's seed): any frame either decodes to
    an (h, w, 3) array in [0, 1] or is refused with one short line, nothing else."""
    msg = _random_case(np.random.default_rng(seed))
    try:
        out = decode_image(msg)
    except ValueError as exc:
        assert "\n" not in str(exc) and len(str(exc)) < 200, exc
        return
    assert out.shape == (msg.height, msg.width, 3)
    assert out.dtype in (np.uint8, np.float32)
    if out.dtype == np.float32:
        assert np.isfinite(out).all() and 0.0 <= out.min() and out.max() <= 1.0


def test_random_frame_generator_covers_both_outcomes() -> None:
    """The generator above makes both decodable and refused frames (else it tests little)."""
    outcomes = set()
    for seed in range(200):
        try:
            decode_image(_random_case(np.random.default_rng(seed)))
            outcomes.add("ok")
        except ValueError:
            outcomes.add("refused")
    assert outcomes == {"ok", "refused"}


def test_far_out_float_frame_would_poison_a_bn_adapt_batch() -> None:
    """Why the float range matters: admitted (limits widened), one 1e6 frame changes the
    bn_adapt predictions of the seven clean frames batched with it."""

    from tta_core.model.source import load_source
    from tta_core.registry import build_method

    model, card = load_source(CARD)
    method, pre = build_method("bn_adapt", model), Preprocess.from_card(card)
    clean = [decode_image(_float_msg(RNG.random((40, 40, 3)).astype(np.float32)))
             for _ in range(7)]
    bad = decode_image(_float_msg(np.full((40, 40, 3), 1e6, np.float32)),
                       FrameLimits(float_range=(0.0, 1e7)))
    alone = torch.softmax(method.step(to_tensor(clean, pre)).logits, 1)
    mixed = torch.softmax(method.step(to_tensor([*clean, bad], pre)).logits, 1)[:7]
    assert (alone - mixed).abs().max() > 0.1
