"""ROS helpers for test/ros: camera frames, the bringup rig, a camera rig that times
predictions, status feeds (imports rclpy)."""

from __future__ import annotations

import time
from collections.abc import Callable

import cv2
import numpy as np
import rclpy
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from rcl_interfaces.msg import Log
from rclpy.executors import SingleThreadedExecutor
from rclpy.parameter import Parameter
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from sensor_msgs.msg import CompressedImage, Image
from tta_msgs.msg import (
    AdaptationStatus,
    ClassPrediction,
    LayerImportance,
    LayerPlan,
    ResourceTelemetry,
)
from visualization_msgs.msg import MarkerArray

from helpers import CARD, CONFIG, wait_for
from tta_core.io.image_msg import array_to_image_fields
from tta_ros.bringup import build_nodes
from tta_ros.lifecycle import activate
from tta_ros.nodes.perception import PerceptionNode
from tta_ros.spinning import SpinThread


def image_msg(sec: int, rgb: np.ndarray | None = None, encoding: str = "rgb8", *,
              nanosec: int = 0, pad: int = 0, size: int = 40,
              frame_id: str = "camera_front") -> Image:
    """A camera Image stamped sec.nanosec holding `rgb` as `encoding` (rows padded by `pad`
    bytes); without `rgb`, a random size x size float image seeded by `sec`."""
    if rgb is None:
        rgb = np.random.default_rng(sec).random((size, size, 3)).astype(np.float32)
    msg = Image(**array_to_image_fields(rgb, encoding, pad=pad))
    msg.header.stamp.sec, msg.header.stamp.nanosec = sec, nanosec
    msg.header.frame_id = frame_id
    return msg


class Rig:
    """bringup nodes + a probe node recording every output topic, spun in a thread."""

    def __init__(self, ctx, perception: dict | None = None, scheduler: dict | None = None):
        per = {"model_card": str(CARD), "batch_size": 4, "queue_size": 64,
               "reset_patience": 100000, "feed_timeout_s": 0.5, "num_threads": 1,
               **(perception or {})}
        self.ctx = ctx
        self.nodes = build_nodes(CONFIG, {"perception": per, "scheduler": {
            "model_card": str(CARD), **(scheduler or {})}, "resource_monitor": {
            "enable_perf": False}}, context=ctx)
        self.monitor, self.scheduler, self.perception = self.nodes
        self.probe = rclpy.create_node("probe", context=ctx)
        self.got: dict[str, list] = {k: [] for k in (
            "pred", "status", "imp", "plan", "markers", "tel", "diag")}
        rel = QoSProfile(depth=200, reliability=ReliabilityPolicy.RELIABLE)
        for key, typ, topic in (("pred", ClassPrediction, "predictions"),
                                ("status", AdaptationStatus, "adaptation_status"),
                                ("imp", LayerImportance, "layer_importance"),
                                ("plan", LayerPlan, "layer_plan"),
                                ("markers", MarkerArray, "layer_markers"),
                                ("tel", ResourceTelemetry, "telemetry"),
                                ("diag", DiagnosticArray, "/diagnostics")):
            self.probe.create_subscription(typ, topic, self._rec(key), rel)
        self.pub = self.probe.create_publisher(Image, "image", qos_profile_sensor_data)
        self.ex = SingleThreadedExecutor(context=ctx)  # as tta_ros.bringup.main
        for n in [*self.nodes, self.probe]:
            self.ex.add_node(n)
        self.spin = SpinThread(self.ex)
        wait_for(lambda: self.pub.get_subscription_count() > 0, 5.0)

    def _rec(self, key: str) -> Callable:
        def cb(msg) -> None:
            self.got[key].append((time.monotonic(), msg))
        return cb

    def msgs(self, key: str) -> list:
        return [m for _, m in list(self.got[key])]

    def statuses(self, subsystem: str) -> list[DiagnosticStatus]:
        return [s for a in self.msgs("diag") for s in a.status if subsystem in s.name]

    def send(self, images: list[Image], gap_s: float = 0.02) -> None:
        for img in images:
            self.pub.publish(img)
            time.sleep(gap_s)

    def close(self) -> None:
        self.spin.stop()  # after the running callback: no callback on a destroyed node
        for n in [*self.nodes, self.probe]:
            try:
                n.destroy_node()
            except Exception:  # already destroyed by the test
                pass


def send_until(ros_context, node, done: Callable[[], bool],
               statuses: list[AdaptationStatus]) -> None:
    """Publish `statuses` over DDS to `node` (spun here) until `done()`, then let repeats
    arrive."""
    perception = rclpy.create_node("fake_perception", context=ros_context)
    pub = perception.create_publisher(AdaptationStatus, "adaptation_status",
                                      QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE))
    ex = SingleThreadedExecutor(context=ros_context)
    for nd in (node, perception):
        ex.add_node(nd)
    try:
        deadline = time.monotonic() + 10.0
        while not done() and time.monotonic() < deadline:
            for st in statuses:
                pub.publish(st)
            ex.spin_once(timeout_sec=0.05)
        for _ in range(20):  # plans already answered: repeats must change nothing
            ex.spin_once(timeout_sec=0.01)
    finally:
        ex.shutdown()
        perception.destroy_node()


def large_image(height: int, width: int, encoding: str) -> Image:
    """A height x width 8-bit frame of random bytes (mono8: 1 channel, else 3)."""
    channels = 1 if encoding == "mono8" else 3
    data = np.random.default_rng(height).integers(0, 256, height * width * channels, np.uint8)
    return Image(height=height, width=width, encoding=encoding, step=width * channels,
                 data=data.tobytes())


class CameraRig:
    """A perception node (method source, batch size 1: a frame's latency is its
    transport, conversion, forward and publication; `kind`: its input, raw or compressed)
    and a probe: valid frames (40 px; PNG when compressed) on one publisher, large ones on
    another (each its own DDS writer, so a valid frame never waits for a large frame's
    fragments in transport), predictions recorded with their arrival time."""

    def __init__(self, ctx, kind: str = "raw") -> None:
        self.kind = kind
        self.node = activate(PerceptionNode(context=ctx, parameter_overrides=[
            Parameter(k, value=v) for k, v in {
                "model_card": str(CARD), "method": "source", "batch_size": 1,
                "queue_size": 64, "num_threads": 1, "input": kind}.items()]))
        self.probe = rclpy.create_node("probe", context=ctx)
        self.answered: dict[int, float] = {}  # stamp -> time.monotonic() of its prediction
        self.probe.create_subscription(
            ClassPrediction, "predictions",
            lambda m: self.answered.setdefault(m.header.stamp.sec, time.monotonic()),
            QoSProfile(depth=200, reliability=ReliabilityPolicy.RELIABLE))
        typ, topic = (Image, "image") if kind == "raw" else (CompressedImage,
                                                             "image/compressed")
        self.valid = self.probe.create_publisher(typ, topic, qos_profile_sensor_data)
        self.large = self.probe.create_publisher(typ, topic, qos_profile_sensor_data)
        self.ex = SingleThreadedExecutor(context=ctx)
        for n in (self.node, self.probe):
            self.ex.add_node(n)
        self.spin = SpinThread(self.ex)
        assert wait_for(lambda: self.valid.get_subscription_count() > 0
                        and self.large.get_subscription_count() > 0, 10.0)

    def send_valid(self, stamp: int) -> float:
        """Publish one valid frame; its latency (ms) once answered."""
        msg = image_msg(stamp)
        if self.kind == "compressed":
            rgb = np.frombuffer(msg.data, np.uint8).reshape(msg.height, msg.width, 3)
            msg = CompressedImage(header=msg.header, format="png",
                                  data=cv2.imencode(".png", rgb)[1].tobytes())
        sent = time.monotonic()
        self.valid.publish(msg)
        self.wait_answered(stamp)
        return (self.answered[stamp] - sent) * 1e3

    def send_large(self, msg: Image | CompressedImage, stamp: int) -> None:
        """Publish a large frame and return once the node has taken it (its conversion
        under way); sent again if best-effort transport lost it."""
        msg.header.stamp.sec = stamp
        for _ in range(3):
            taken = self.node.intake.taken
            self.large.publish(msg)
            if wait_for(lambda t=taken: self.node.intake.taken > t, 10.0):
                return
        raise AssertionError(f"large frame {stamp} never reached the node")

    def wait_answered(self, stamp: int, timeout_s: float = 20.0) -> None:
        assert wait_for(lambda: stamp in self.answered, timeout_s), f"frame {stamp} unanswered"

    def close(self) -> None:
        self.spin.stop()
        self.node.destroy_node()
        self.probe.destroy_node()


class RosoutLog:
    """Every log line of the nodes in a context, taken from /rosout (each node's rosout
    publisher keeps its lines for late subscribers), with a marker to know a node's lines
    up to now have all arrived: one publisher delivers in order."""

    def __init__(self, ctx) -> None:
        self.node = rclpy.create_node("rosout_log", context=ctx)
        self.lines: list[Log] = []
        qos = QoSProfile(depth=1000, reliability=ReliabilityPolicy.RELIABLE,
                         durability=DurabilityPolicy.TRANSIENT_LOCAL)
        self.node.create_subscription(Log, "/rosout", self.lines.append, qos)
        self.ex = SingleThreadedExecutor(context=ctx)
        self.ex.add_node(self.node)
        self.spin = SpinThread(self.ex)
        self._marks = 0

    def until_now(self, node, timeout_s: float = 10.0) -> list[Log]:
        """The lines `node` logged before this call (waits for a marker it logs now)."""
        self._marks += 1
        mark = f"rosout-log marker {self._marks}"
        node.get_logger().info(mark)
        name = node.get_logger().name
        assert wait_for(lambda: any(m.name == name and m.msg == mark for m in self.lines),
                        timeout_s), f"no marker from {name} on /rosout"
        mine = [m for m in self.lines if m.name == name]
        mine = mine[:next(i for i, m in enumerate(mine) if m.msg == mark)]
        return [m for m in mine if not m.msg.startswith("rosout-log marker")]

    def close(self) -> None:
        self.spin.stop()
        self.node.destroy_node()
