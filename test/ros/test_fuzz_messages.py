"""Fuzz: forged LayerPlan / LayerImportance messages (hypothesis) against the checks the
nodes run before using them (tta_ros.convert). A forged message is either refused with a
one-line ValueError naming a field, or yields a plan/importance that is safe to use: the
right length, only trainable units, finite non-negative numbers. Nothing else may escape.
Over real DDS: test_ros_nodes.py (forged plans and importance keep the nodes serving)."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("rclpy")
from helpers import CARD
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tta_msgs.msg import LayerImportance, LayerPlan

from tta_core.adashadow.planning import layout_from_card
from tta_ros.convert import MAX_FORWARD_MS, check_importance, check_plan

LAYOUT = layout_from_card(CARD)
N = LAYOUT.n_units
NAMES = list(LAYOUT.unit_names)
TRAINABLE = LAYOUT.trainable("norm")
FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])

floats = st.floats(width=32, allow_nan=True, allow_infinity=True)
nice = st.floats(min_value=0.0, max_value=1e4, width=32)
texts = st.one_of(st.just(LAYOUT.model_name), st.text(max_size=300))


def _names() -> st.SearchStrategy:
    return st.one_of(st.just(NAMES), st.lists(st.sampled_from([*NAMES, "x"]), max_size=N + 2))


@st.composite
def plans(draw) -> LayerPlan:
    """LayerPlans near valid ones: each field valid most of the time, forged otherwise."""
    n = draw(st.sampled_from([N, N, N, 0, N - 1, N + 1]))
    update = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    first = int(np.argmax(update)) if any(update) else len(update)
    msg = LayerPlan(
        plan_id=draw(st.integers(0, 2**32)), model_name=draw(texts), unit_names=draw(_names()),
        update=update, importance=draw(st.lists(st.one_of(nice, floats), max_size=N + 1)),
        predicted_unit_ms=draw(st.lists(st.one_of(nice, floats), max_size=N + 1)),
        first_updated_index=draw(st.one_of(st.just(first), st.integers(0, 2**31))),
        sigma=draw(st.one_of(nice, floats)), budget_ms=draw(st.one_of(nice, floats)),
        predicted_total_ms=draw(st.one_of(nice, floats)), solve_ms=draw(st.one_of(nice, floats)))
    return msg


@FUZZ
@given(plans())
def test_forged_plans_are_refused_or_safe(msg: LayerPlan) -> None:
    try:
        plan = check_plan(msg, LAYOUT.model_name, NAMES, TRAINABLE)
    except ValueError as exc:
        assert "\n" not in str(exc) and len(str(exc)) < 300
        return
    assert msg.model_name == LAYOUT.model_name and list(msg.unit_names) == NAMES
    assert plan.update.shape == (N,) and not (plan.update & ~TRAINABLE).any()
    assert plan.first_updated == (int(np.argmax(plan.update)) if plan.update.any() else N)
    for v in (msg.sigma, msg.budget_ms, msg.predicted_total_ms, msg.solve_ms,
              *msg.importance, *msg.predicted_unit_ms):
        assert math.isfinite(v) and v >= 0


@st.composite
def importances(draw) -> LayerImportance:
    n = draw(st.sampled_from([N, N, N, 0, N + 1]))
    return LayerImportance(
        batch_id=draw(st.integers(0, 2**32)), model_name=draw(texts), unit_names=draw(_names()),
        importance=draw(st.lists(st.one_of(nice, floats), min_size=n, max_size=n)),
        forward_ms=draw(st.one_of(nice, floats, st.just(3e38))),
        batch_size=draw(st.integers(0, 2**32 - 1)))


@FUZZ
@given(importances())
def test_forged_importance_is_refused_or_safe(msg: LayerImportance) -> None:
    try:
        a = check_importance(msg, LAYOUT.model_name, NAMES)
    except ValueError as exc:
        assert "\n" not in str(exc) and len(str(exc)) < 300
        return
    assert a.shape == (N,) and np.isfinite(a).all() and (a >= 0).all()
    assert 0 <= msg.forward_ms <= MAX_FORWARD_MS and msg.batch_size >= 1


def test_each_forged_field_is_named() -> None:
    """One forged field at a time: the error names that field."""
    good = LayerPlan(model_name=LAYOUT.model_name, unit_names=NAMES, update=[False] * N,
                     importance=[0.0] * N, predicted_unit_ms=[0.0] * N,
                     first_updated_index=N, sigma=0.3, budget_ms=1.0)
    check_plan(good, LAYOUT.model_name, NAMES, TRAINABLE)
    conv = int(np.flatnonzero(~TRAINABLE)[0])
    cases = {"model_name": {"model_name": "x" * 5000}, "unit_names": {"unit_names": NAMES[:-1]},
             "update has": {"update": [False] * (N - 1)},
             "budget_ms": {"budget_ms": math.nan}, "sigma": {"sigma": -1.0},
             "predicted_unit_ms[2]": {"predicted_unit_ms": [0.0, 0.0, math.inf] + [0.0] * (N - 3)},
             "first_updated_index": {"first_updated_index": 0},
             "not trainable": {"update": [i == conv for i in range(N)],
                               "first_updated_index": conv}}
    for needle, fields in cases.items():
        msg = LayerPlan(**{**{f: getattr(good, f) for f in (
            "model_name", "unit_names", "update", "importance", "predicted_unit_ms",
            "first_updated_index", "sigma", "budget_ms")}, **fields})
        with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            check_plan(msg, LAYOUT.model_name, NAMES, TRAINABLE)
    with pytest.raises(ValueError, match=r"\(5002 chars\)"):  # untrusted text is cut
        check_plan(LayerPlan(model_name="x" * 5000), LAYOUT.model_name, NAMES, TRAINABLE)


def test_raw_frame_size_is_read_from_its_bytes_before_deserializing(monkeypatch) -> None:
    """peek_image_size reads height/width from the CDR bytes (any frame_id length); a
    2,000,000 x 1 frame is refused before the bytes become a message."""
    from rclpy.serialization import serialize_message
    from sensor_msgs.msg import Image

    from tta_core.io.image_msg import FrameLimits
    from tta_ros import convert

    for frame_id in ("", "c", "cam", "camera_front_left_xyz"):
        msg = Image(height=7, width=5, encoding="rgb8", step=15, data=bytes(105))
        msg.header.frame_id = frame_id
        assert convert.peek_image_size(serialize_message(msg)) == (7, 5)
    tall = serialize_message(Image(height=2_000_000, width=1, encoding="rgb8", step=3,
                                   data=bytes(6_000_000)))
    assert convert.peek_image_size(b"\x00\x01") is None

    def never(*_a, **_k):
        raise AssertionError("deserialized a frame the size check refuses")

    monkeypatch.setattr(convert, "deserialize_message", never)
    with pytest.raises(ValueError, match=r"max_aspect|max_pixels"):
        convert.decode_frame(tall, "raw", FrameLimits())
