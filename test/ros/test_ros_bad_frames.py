"""The perception node over real rclpy + DDS: a frame outside the input limits is rejected
before batching, so it changes nothing for the frames batched with it.

Method bn_adapt: it normalises by the batch's statistics (the effect a far-out frame would
have) but keeps no state between batches and takes no gradient step, so the same clean
frames give the same predictions in any later batch; `source` (running statistics, each
frame on its own) could not show the poisoning, and tent-like methods would make the
second batch depend on the first's update.
"""

from __future__ import annotations

import copy
import time

import numpy as np
import pytest

rclpy = pytest.importorskip("rclpy")
from diagnostic_msgs.msg import DiagnosticStatus  # noqa: E402
from helpers import wait_for  # noqa: E402
from helpers.ros import Rig, image_msg  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402

RNG = np.random.default_rng(5)


def _restamped(msg: Image, stamp: int) -> Image:
    out = copy.deepcopy(msg)
    out.header.stamp.sec = stamp
    return out


def _by_stamp(rig: Rig, first: int, n: int) -> dict[int, object]:
    return {p.header.stamp.sec - first: p for p in rig.msgs("pred")
            if first <= p.header.stamp.sec < first + n}


def test_far_out_float_frame_rejected_and_changes_no_other_prediction(ros_context) -> None:
    rig = Rig(ros_context, perception={"method": "bn_adapt", "batch_size": 8,
                                       "batch_timeout_s": 1.0})
    try:
        clean = [image_msg(100 + i, RNG.random((40, 40, 3)).astype(np.float32),
                        "32FC3" if i % 2 else "rgb8") for i in range(7)]
        bad = image_msg(150, (1e6 * (1 + RNG.random((40, 40, 3)))).astype(np.float32), "32FC3")
        rig.send([*clean[:4], bad, *clean[4:]], gap_s=0.01)  # one batch of 8
        assert wait_for(lambda: len(_by_stamp(rig, 100, 7)) == 7, 10.0)
        rig.send([_restamped(m, 200 + i) for i, m in enumerate(clean)], gap_s=0.01)  # of 7
        assert wait_for(lambda: len(_by_stamp(rig, 200, 7)) == 7, 10.0)
        mixed, alone = _by_stamp(rig, 100, 7), _by_stamp(rig, 200, 7)
        assert len({p.batch_id for p in mixed.values()}) == 1  # batched together
        assert len({p.batch_id for p in alone.values()}) == 1
        assert not any(p.header.stamp.sec == 150 for p in rig.msgs("pred"))
        for i in range(7):
            assert mixed[i].label == alone[i].label, i
            assert mixed[i].confidence == pytest.approx(alone[i].confidence, abs=1e-5), i
        node = rig.perception
        assert node.counters.rejected == 1 and node.guard.resets == 0
        errors = [s for s in rig.statuses("perception: input")
                  if s.level == DiagnosticStatus.ERROR]
        assert any("float_range [0, 1]" in s.message for s in errors), errors
    finally:
        rig.close()


def test_rejection_of_a_64k_encoding_is_reported_in_one_short_line(ros_context) -> None:
    rig = Rig(ros_context, perception={"batch_size": 1})
    try:
        msg = Image(height=2, width=2, encoding="rgb8" + "x" * (65536 - 4), step=6,
                    data=bytes(12))
        msg.header.stamp.sec = 7
        rig.send([msg, image_msg(8, RNG.random((40, 40, 3)).astype(np.float32), "rgb8")])
        assert wait_for(lambda: len(rig.msgs("pred")) == 1, 10.0)
        time.sleep(0.2)
        errors = [s for s in rig.statuses("perception: input")
                  if s.level == DiagnosticStatus.ERROR]
        assert errors and all(len(s.message) < 200 and "\n" not in s.message for s in errors)
        assert "(65536 chars)" in errors[0].message
        last = rig.perception.counters.last_rejection
        assert len(last) < 200 and "(65536 chars)" in last
    finally:
        rig.close()
