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
import time

import numpy as np
import pytest

rclpy = pytest.importorskip("rclpy")
from helpers import CARD, wait_for  # noqa: E402
from helpers.ros import image_msg  # noqa: E402
from rclpy.executors import SingleThreadedExecutor  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402
from tta_msgs.msg import ClassPrediction  # noqa: E402

from tta_ros.nodes.perception import PerceptionNode  # noqa: E402
from tta_ros.spinning import SpinThread  # noqa: E402

pytestmark = pytest.mark.slow

DELAY_MS = 50.0
ROUNDS = 4


def _large(height: int, width: int, encoding: str, channels: int) -> Image:
    data = np.random.default_rng(height).integers(0, 256, height * width * channels, np.uint8)
    return Image(height=height, width=width, encoding=encoding, step=width * channels,
                 data=data.tobytes())


class Camera:
    """A perception node and a probe: valid frames on one publisher, large ones on
    another (each its own DDS writer, so a valid frame never waits for a large frame's
    fragments in transport), predictions recorded with their arrival time."""

    def __init__(self, ctx) -> None:
        self.node = PerceptionNode(context=ctx, parameter_overrides=[
            Parameter(k, value=v) for k, v in {
                "model_card": str(CARD), "method": "source", "batch_size": 1,
                "queue_size": 64, "num_threads": 1}.items()])
        self.probe = rclpy.create_node("probe", context=ctx)
        self.answered: dict[int, float] = {}  # stamp -> time.monotonic() of its prediction
        self.probe.create_subscription(
            ClassPrediction, "predictions",
            lambda m: self.answered.setdefault(m.header.stamp.sec, time.monotonic()),
            QoSProfile(depth=200, reliability=ReliabilityPolicy.RELIABLE))
        self.valid = self.probe.create_publisher(Image, "image", qos_profile_sensor_data)
        self.large = self.probe.create_publisher(Image, "image", qos_profile_sensor_data)
        self.ex = SingleThreadedExecutor(context=ctx)
        for n in (self.node, self.probe):
            self.ex.add_node(n)
        self.spin = SpinThread(self.ex)
        assert wait_for(lambda: self.valid.get_subscription_count() > 0
                        and self.large.get_subscription_count() > 0, 10.0)

    def send_valid(self, stamp: int) -> float:
        """Publish one valid frame; its latency (ms) once answered."""
        msg = image_msg(stamp)
        sent = time.monotonic()
        self.valid.publish(msg)
        assert wait_for(lambda: stamp in self.answered, 20.0), f"valid frame {stamp} unanswered"
        return (self.answered[stamp] - sent) * 1e3

    def send_large(self, msg: Image, stamp: int) -> None:
        """Publish a large frame and return once the node has taken it (its conversion
        under way); sent again if best-effort transport lost it."""
        msg.header.stamp.sec = stamp
        for _ in range(3):
            taken = self.node.intake.taken
            self.large.publish(msg)
            if wait_for(lambda t=taken: self.node.intake.taken > t, 10.0):
                return
        raise AssertionError(f"large frame {stamp} never reached the node")

    def close(self) -> None:
        self.spin.stop()
        self.node.destroy_node()
        self.probe.destroy_node()


def test_large_frames_answered_and_valid_ones_behind_them_not_delayed(ros_context) -> None:
    cam = Camera(ros_context)
    try:
        for stamp in range(3):  # warm-up: first forwards, first publications
            cam.send_valid(stamp)
        baseline = [cam.send_valid(100 + i) for i in range(12)]
        larges = (_large(4096, 4096, "mono8", 1), _large(2160, 3840, "rgb8", 3))
        behind, large_stamps = [], []
        for r in range(ROUNDS):
            for k, msg in enumerate(larges):
                stamp = 500 + 2 * r + k
                cam.send_large(msg, stamp)
                large_stamps.append(stamp)
                behind.append(cam.send_valid(200 + 2 * r + k))
        too_many = Image(height=4100, width=4100, encoding="mono8", step=4100,
                         data=bytes(4100 * 4100))  # over max_pixels: refused, counted
        cam.send_large(too_many, 900)
        cam.send_valid(300)
        assert wait_for(lambda: all(s in cam.answered for s in large_stamps), 20.0), \
            sorted(set(large_stamps) - set(cam.answered))
        assert wait_for(lambda: cam.node.counters.rejected == 1, 10.0)
        assert cam.node.counters.too_large == 1 and 900 not in cam.answered
        assert "max_pixels" in cam.node.counters.last_rejection
        assert cam.node.queue.received == cam.node.intake.taken  # each answered or refused
        base, late = statistics.median(baseline), statistics.median(behind)
        assert late <= base + DELAY_MS, (f"valid frames behind a large one: median "
                                         f"{late:.1f} ms, alone {base:.1f} ms", behind)
    finally:
        cam.close()
