"""The perception node over real rclpy + DDS with `input: compressed`: the same camera
frames sent as sensor_msgs/Image on `image` and as sensor_msgs/CompressedImage on
`image/compressed` (the image_transport convention) give the same predictions.

Method `source`: no adaptation; the model stays in eval mode with its running BatchNorm
statistics, so a frame's prediction depends only on that frame's pixels, not on the
frames batched with it nor on any earlier update. Differences between the two nodes can
then only come from the transport: none for PNG (lossless: the decoded pixels are the raw
ones), a few labels for JPEG quality 95 (lossy).
"""

from __future__ import annotations

import cv2
import numpy as np
import pytest

rclpy = pytest.importorskip("rclpy")
from helpers import CARD, wait_for  # noqa: E402
from rclpy.executors import SingleThreadedExecutor  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data  # noqa: E402
from sensor_msgs.msg import CompressedImage, Image  # noqa: E402
from tta_msgs.msg import ClassPrediction  # noqa: E402

from tta_core.data.signs import make_signs  # noqa: E402
from tta_core.io.image_msg import array_to_image_fields  # noqa: E402
from tta_ros.lifecycle import activate  # noqa: E402
from tta_ros.nodes.perception import PerceptionNode  # noqa: E402
from tta_ros.spinning import SpinThread  # noqa: E402

N = 64
FRAMES = make_signs(N, image_size=64, seed=21).images  # camera-like 64 px sign frames


class TwoInputs:
    """A perception node per input (namespaces /raw and /cmp) and a probe publishing
    frames to both and recording their predictions."""

    def __init__(self, ctx) -> None:
        self.nodes = {kind: activate(PerceptionNode(
            context=ctx, cli_args=["--ros-args", "-r", f"__ns:=/{ns}"],
            parameter_overrides=[Parameter(k, value=v) for k, v in {
                "model_card": str(CARD), "method": "source", "input": kind,
                "batch_size": 8, "queue_size": 64, "num_threads": 1}.items()]))
            for kind, ns in (("raw", "raw"), ("compressed", "cmp"))}
        self.probe = rclpy.create_node("probe", context=ctx)
        self.preds: dict[str, dict[int, ClassPrediction]] = {"raw": {}, "compressed": {}}
        rel = QoSProfile(depth=200, reliability=ReliabilityPolicy.RELIABLE)
        for kind, ns in (("raw", "raw"), ("compressed", "cmp")):
            self.probe.create_subscription(
                ClassPrediction, f"/{ns}/predictions",
                lambda m, k=kind: self.preds[k].__setitem__(m.header.stamp.sec, m), rel)
        self.pub_raw = self.probe.create_publisher(Image, "/raw/image",
                                                   qos_profile_sensor_data)
        self.pub_cmp = self.probe.create_publisher(CompressedImage, "/cmp/image/compressed",
                                                   qos_profile_sensor_data)
        self.ex = SingleThreadedExecutor(context=ctx)
        for n in [*self.nodes.values(), self.probe]:
            self.ex.add_node(n)
        self.spin = SpinThread(self.ex)
        assert wait_for(lambda: self.pub_raw.get_subscription_count() > 0
                        and self.pub_cmp.get_subscription_count() > 0, 5.0)

    def send(self, first: int, fmt: str | None) -> None:
        """All FRAMES, stamped first + i: raw (fmt None) or compressed (".png"/".jpg")."""
        for i, img in enumerate(FRAMES):
            if fmt is None:
                msg = Image(**array_to_image_fields(img / 255.0, "rgb8"))
            else:
                params = [cv2.IMWRITE_JPEG_QUALITY, 95] if fmt == ".jpg" else []
                data = cv2.imencode(fmt, np.ascontiguousarray(img[..., ::-1]), params)[1]
                msg = CompressedImage(format=f"rgb8; {'jpeg' if fmt == '.jpg' else 'png'} "
                                      "compressed bgr8", data=data.tobytes())
            msg.header.stamp.sec = first + i
            (self.pub_raw if fmt is None else self.pub_cmp).publish(msg)
            wait_for(lambda: False, 0.015)

    def received(self, kind: str, first: int) -> dict[int, ClassPrediction]:
        return {s - first: p for s, p in list(self.preds[kind].items())
                if first <= s < first + N}

    def close(self) -> None:
        self.spin.stop()  # after the running callback: no callback on a destroyed node
        for n in [*self.nodes.values(), self.probe]:
            n.destroy_node()


def test_same_frames_raw_and_compressed_give_the_same_predictions(ros_context) -> None:
    rig = TwoInputs(ros_context)
    try:
        for first, kind, fmt in ((1000, "raw", None), (2000, "compressed", ".png"),
                                 (3000, "compressed", ".jpg")):
            rig.send(first, fmt)
            assert wait_for(lambda f=first, k=kind: len(rig.received(k, f)) >= N * 0.9, 20.0)
        raw, png = rig.received("raw", 1000), rig.received("compressed", 2000)
        jpg = rig.received("compressed", 3000)
        assert rig.nodes["compressed"].counters.rejected == 0
        both = sorted(set(raw) & set(png))
        assert len(both) >= N * 0.8
        for i in both:  # lossless: the very same pixels, so the same prediction
            assert png[i].label == raw[i].label, i
            assert png[i].confidence == pytest.approx(raw[i].confidence, abs=1e-5), i
        common = sorted(set(raw) & set(jpg))
        agree = np.mean([jpg[i].label == raw[i].label for i in common])
        print(f"jpeg q95 label agreement: {agree:.4f} over {len(common)} frames")
        assert len(common) >= N * 0.8 and agree >= 0.95, agree
    finally:
        rig.close()


def test_compressed_input_follows_a_remapped_image_topic(ros_context) -> None:
    """image_transport naming: `image` remapped to /camera/image_raw puts the compressed
    frames on /camera/image_raw/compressed; a frame that is not a PNG is refused there."""
    node = activate(PerceptionNode(context=ros_context, cli_args=[
        "--ros-args", "-r", "image:=/camera/image_raw"], parameter_overrides=[
        Parameter("model_card", value=str(CARD)), Parameter("input", value="compressed"),
        Parameter("method", value="source"), Parameter("batch_size", value=1)]))
    try:
        topics = dict(node.intake.node.get_topic_names_and_types())
        names = [t for t, _ in node.intake.node.get_subscriber_names_and_types_by_node(
            node.intake.node.get_name(), node.intake.node.get_namespace())]
        assert names == ["/camera/image_raw/compressed"], (names, topics)
        bad = CompressedImage(format="png", data=b"\x89PNG\r\n\x1a\n not really")
        from rclpy.serialization import serialize_message

        assert node._prepare(serialize_message(bad)) is None  # what a converter thread runs
        assert node._prepare(b"\x00\x01") is None
        assert node.counters.rejected == 2
        assert "deserialize as CompressedImage" in node.counters.last_rejection
    finally:
        node.destroy_node()


def test_bombs_between_valid_frames_are_refused_and_every_valid_frame_answered(
        ros_context) -> None:
    """The three fuzz-case bombs (tiny files declaring 4000 x 4000 or 4096 x 4096 images)
    and a small PNG whose stream inflates to 48 MB, sent between valid PNG frames: each
    bomb refused undecoded and reported on /diagnostics (with the size it declared);
    every valid frame answered."""
    from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
    from helpers.bombs import bombs, zero_stream_bomb

    node = activate(PerceptionNode(context=ros_context, parameter_overrides=[
        Parameter(k, value=v) for k, v in {
            "model_card": str(CARD), "method": "source", "input": "compressed",
            "batch_size": 4, "queue_size": 64, "num_threads": 1}.items()]))
    probe = rclpy.create_node("probe", context=ros_context)
    preds: dict[int, ClassPrediction] = {}
    diags: list[DiagnosticStatus] = []
    rel = QoSProfile(depth=200, reliability=ReliabilityPolicy.RELIABLE)
    probe.create_subscription(ClassPrediction, "predictions",
                              lambda m: preds.__setitem__(m.header.stamp.sec, m), rel)
    probe.create_subscription(DiagnosticArray, "/diagnostics",
                              lambda m: diags.extend(m.status), rel)
    pub = probe.create_publisher(CompressedImage, "image/compressed", qos_profile_sensor_data)
    ex = SingleThreadedExecutor(context=ros_context)
    for n in (node, probe):
        ex.add_node(n)
    spin = SpinThread(ex)
    try:
        assert wait_for(lambda: pub.get_subscription_count() > 0, 5.0)
        valid = [cv2.imencode(".png", np.ascontiguousarray(img[..., ::-1]))[1].tobytes()
                 for img in FRAMES[:12]]
        bomb_list = [*bombs(), zero_stream_bomb()] * 3
        for i, (data, b) in enumerate(zip(valid, bomb_list, strict=True)):
            for stamp, fmt, payload in ((100 + i, "png", data), (500 + i, b.format, b.data)):
                msg = CompressedImage(format=fmt, data=payload)
                msg.header.stamp.sec = stamp
                pub.publish(msg)
            # each valid frame is answered although a bomb follows it at once
            assert wait_for(lambda i=i: 100 + i in preds, 10.0), (i, b.name, sorted(preds))
        assert wait_for(lambda: node.counters.rejected == len(bomb_list), 5.0)
        assert node.counters.too_large == len(bomb_list)
        assert not [s for s in preds if s >= 500]
        assert wait_for(lambda: any("max_decode_bytes" in s.message for s in diags
                                    if s.level == DiagnosticStatus.ERROR), 5.0)
        refused = [s.message for s in diags if "max_decode_bytes" in s.message]
        assert any("declares 4000x4000" in m or "declares 4096x4096" in m for m in refused)
        assert wait_for(lambda: any(
            {kv.key: kv.value for kv in s.values}.get("too_large") == str(len(bomb_list))
            for s in diags if s.name.endswith("input")), 5.0)
    finally:
        spin.stop()  # after the running callback: no callback on a destroyed node
        node.destroy_node()
        probe.destroy_node()
