"""The perception node over real rclpy + DDS: the largest frames the input limits admit
(4096 x 4096 mono8, 3840 x 2160 rgb8) sent between valid camera frames are answered, and
the valid frame sent right behind each of them is answered within 50 ms of the latency
valid frames have alone (medians: one busy moment on a shared machine is no regression).

Frames are converted to the model's input on the intake's converter threads before they
are queued (tta_ros.nodes.intake), reduced for the model's side (tta_ros.frame_reduce);
before that, the worker decoded each large frame whole to float and resized it, and the
frames behind it waited for that. Method `source`, batch size 1: one frame a batch, so a
frame's latency is its transport, conversion, forward and publication.
"""

from __future__ import annotations

import statistics

import pytest

rclpy = pytest.importorskip("rclpy")
from helpers import wait_for  # noqa: E402
from helpers.ros import CameraRig, image_msg, large_image  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402

pytestmark = pytest.mark.slow

DELAY_MS = 50.0
ROUNDS = 4


def test_large_frames_answered_and_valid_ones_behind_them_not_delayed(ros_context) -> None:
    cam = CameraRig(ros_context)
    try:
        for stamp in range(3):  # warm-up: first forwards, first publications
            cam.send_valid(stamp)
        baseline = [cam.send_valid(100 + i) for i in range(12)]
        larges = (large_image(4096, 4096, "mono8"), large_image(2160, 3840, "rgb8"))
        behind = []
        for r in range(ROUNDS):
            for k, msg in enumerate(larges):
                stamp = 500 + 2 * r + k
                cam.send_large(msg, stamp)
                behind.append(cam.send_valid(200 + 2 * r + k))
                cam.wait_answered(stamp)  # the next round starts with the converters idle
        too_many = Image(height=4100, width=4100, encoding="mono8", step=4100,
                         data=bytes(4100 * 4100))  # over max_pixels: refused, counted
        cam.send_large(too_many, 900)
        cam.send_valid(300)
        assert wait_for(lambda: cam.node.counters.rejected == 1, 10.0)
        assert cam.node.counters.too_large == 1 and 900 not in cam.answered
        assert "max_pixels" in cam.node.counters.last_rejection
        assert cam.node.queue.received == cam.node.intake.taken  # each answered or refused
        base, late = statistics.median(baseline), statistics.median(behind)
        assert late <= base + DELAY_MS, (f"valid frames behind a large one: median "
                                         f"{late:.1f} ms, alone {base:.1f} ms", behind)
    finally:
        cam.close()


def test_a_decoder_error_is_a_counted_one_line_refusal(ros_context, monkeypatch) -> None:
    """An error a decoder raises that is no ValueError (OpenCV's cv2.error) refuses the
    frame like any bad frame: counted, one line, and the next frame is answered."""
    import cv2

    from tta_ros.nodes import perception

    def broken(*_args, **_kwargs):
        raise cv2.error("OpenCV(5.0.0) resize.cpp:4155: error: (-215:Assertion failed)\n"
                        "!ssize.empty() in function 'resize'")

    cam = CameraRig(ros_context)
    try:
        cam.send_valid(1)
        monkeypatch.setattr(perception, "frame_input", broken)
        cam.send_large(image_msg(2), 2)
        assert wait_for(lambda: cam.node.counters.rejected == 1, 10.0)
        last = cam.node.counters.last_rejection
        assert last.startswith("frame not converted (error: ") and "\n" not in last, last
        monkeypatch.undo()
        cam.send_valid(3)
        assert 2 not in cam.answered and cam.node.queue.received == cam.node.intake.taken
    finally:
        cam.close()
