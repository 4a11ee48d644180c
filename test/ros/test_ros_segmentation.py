"""The perception node serving the shipped segmentation card over real rclpy + DDS.

Frames go in on `image`; `segmentation` (mono8 class ids) and `segmentation_overlay`
(rgb8) come out, one each per frame with the frame's header, at the model input's size or
the frame's; the `segmentation` status on /diagnostics reports label-free statistics; a
method that cannot segment is refused at configure, naming why.
"""

from __future__ import annotations

import numpy as np
import pytest

rclpy = pytest.importorskip("rclpy")
import torch  # noqa: E402
from diagnostic_msgs.msg import DiagnosticArray  # noqa: E402
from helpers import ROOT, wait_for  # noqa: E402
from helpers.ros import image_msg  # noqa: E402
from rclpy.executors import SingleThreadedExecutor  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402
from tta_msgs.msg import AdaptationStatus  # noqa: E402

from tta_core.data.scenes import render_scene  # noqa: E402
from tta_core.io.image_msg import Preprocess, to_tensor  # noqa: E402
from tta_core.io.seg_masks import CITYSCAPES_PALETTE, label_masks  # noqa: E402
from tta_core.model.source import load_source  # noqa: E402
from tta_ros.lifecycle import activate  # noqa: E402
from tta_ros.nodes.perception import PerceptionNode  # noqa: E402
from tta_ros.spinning import SpinThread  # noqa: E402

SEG_CARD = ROOT / "checkpoints" / "lraspp_mobilenet_v3_large_scenes.json"


class SegRig:
    """A perception node on the segmentation card and a probe recording its outputs."""

    def __init__(self, ctx, **params) -> None:
        values = {"model_card": str(SEG_CARD), "method": "source", "batch_size": 2,
                  "batch_timeout_s": 0.05, "queue_size": 16, "num_threads": 1, **params}
        self.node = activate(PerceptionNode(context=ctx, parameter_overrides=[
            Parameter(k, value=v) for k, v in values.items()]))
        self.probe = rclpy.create_node("probe", context=ctx)
        self.got: dict[str, list] = {"mask": [], "overlay": [], "status": [], "diag": []}
        rel = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
        for key, typ, topic in (("mask", Image, "segmentation"),
                                ("overlay", Image, "segmentation_overlay"),
                                ("status", AdaptationStatus, "adaptation_status"),
                                ("diag", DiagnosticArray, "/diagnostics")):
            self.probe.create_subscription(typ, topic, self.got[key].append, rel)
        self.pub = self.probe.create_publisher(Image, "image", qos_profile_sensor_data)
        self.ex = SingleThreadedExecutor(context=ctx)
        for n in (self.node, self.probe):
            self.ex.add_node(n)
        self.spin = SpinThread(self.ex)
        assert wait_for(lambda: self.pub.get_subscription_count() > 0
                        and self.probe.count_publishers("segmentation") > 0, 10.0)

    def send(self, frames: list[Image], key: str = "mask") -> None:
        """Publish `frames` one at a time, each until its output arrived (best effort)."""
        for msg in frames:
            stamp = (msg.header.stamp.sec, msg.header.stamp.nanosec)
            for _ in range(5):
                self.pub.publish(msg)
                if wait_for(lambda s=stamp: s in self.stamps(key), 10.0):
                    break
            assert stamp in self.stamps(key), f"no {key} for frame {stamp}"

    def stamps(self, key: str) -> set[tuple[int, int]]:
        return {(m.header.stamp.sec, m.header.stamp.nanosec) for m in list(self.got[key])}

    def first(self, key: str, sec: int) -> Image:
        return next(m for m in list(self.got[key]) if m.header.stamp.sec == sec)

    def close(self) -> None:
        self.spin.stop()
        self.node.destroy_node()
        self.probe.destroy_node()


def _scene_msg(sec: int, encoding: str = "rgb8", size: tuple[int, int] | None = None
               ) -> tuple[Image, np.ndarray]:
    """A driving scene as a frame (resized to `size` (h, w) when given) and its RGB."""
    import cv2

    rgb = render_scene((7, 7, sec)).image
    if size is not None:
        rgb = cv2.resize(rgb, size[::-1], interpolation=cv2.INTER_AREA)
    return image_msg(sec, rgb.astype(np.float32) / 255.0, encoding, nanosec=11 * sec,
                     frame_id="camera_front"), rgb


@pytest.fixture
def seg_rig(ros_context):
    rigs: list[SegRig] = []

    def make(**params) -> SegRig:
        rigs.append(SegRig(ros_context, **params))
        return rigs[-1]
    yield make
    for r in rigs:
        r.close()


def test_masks_at_input_size_match_the_model_and_overlay_follows(seg_rig) -> None:
    rig = seg_rig()
    frames = [_scene_msg(100, "rgb8"), _scene_msg(101, "bgr8", (96, 160)),
              _scene_msg(102, "rgb8", (240, 320))]
    rig.send([m for m, _ in frames])
    assert wait_for(lambda: len(rig.stamps("overlay")) >= 3, 10.0)
    model, card = load_source(SEG_CARD)
    pre = Preprocess.from_card(card)
    for msg, rgb in frames:
        sec = msg.header.stamp.sec
        mask, over = rig.first("mask", sec), rig.first("overlay", sec)
        for out in (mask, over):  # the frame's header, the model input's size
            assert out.header.frame_id == "camera_front"
            assert out.header.stamp.nanosec == 11 * sec
            assert (out.height, out.width) == card.input_hw
        assert mask.encoding == "mono8" and mask.step == mask.width
        assert over.encoding == "rgb8" and over.step == 3 * over.width
        got = np.frombuffer(bytes(mask.data), np.uint8).reshape(card.input_hw)
        with torch.no_grad():  # source: the node's masks are the card's own predictions
            want = label_masks(model(to_tensor([rgb], pre)))[0]
        assert (got == want).mean() > 0.999  # bgr8 / resize rounding may flip an edge pixel
        assert got.max() < card.num_classes and len(np.unique(got)) >= 3
        road = got == 0  # the overlay blends road's colour over road pixels
        ov = np.frombuffer(bytes(over.data), np.uint8).reshape(*card.input_hw, 3)
        tint = ov[road].astype(float).mean(0) - ov[~road].astype(float).mean(0)
        want_tint = np.subtract(CITYSCAPES_PALETTE[0], np.mean(CITYSCAPES_PALETTE, 0))
        assert float(np.dot(tint, want_tint)) > 0
    def seg_values() -> list[dict[str, str]]:
        return [{kv.key: kv.value for kv in s.values} for a in list(rig.got["diag"])
                for s in a.status if s.name.endswith(": segmentation")]

    assert wait_for(lambda: any(int(v["frames"]) >= 3 for v in seg_values()), 5.0)
    values = [v for v in seg_values() if int(v["frames"]) >= 3][-1]
    assert values["mask_size"] == "128x256"
    assert 0 < float(values["mean_confidence"]) <= 1 and "road" in values["top_classes"]
    assert rig.got["status"] and rig.probe.count_publishers("predictions") == 0


def test_frame_size_masks_and_no_overlay(seg_rig) -> None:
    rig = seg_rig(segmentation_size="frame", publish_overlay=False, batch_size=1)
    msg, _ = _scene_msg(200, "rgb8", (90, 150))
    rig.send([msg])
    mask = rig.first("mask", 200)
    assert (mask.height, mask.width) == (90, 150) and mask.step == 150
    assert rig.probe.count_publishers("segmentation_overlay") == 0


def test_frame_size_overlay_on_the_frame(seg_rig) -> None:
    rig = seg_rig(segmentation_size="frame", overlay_alpha=0.0, batch_size=1)
    msg, rgb = _scene_msg(300, "rgb8", (60, 100))
    rig.send([msg], key="overlay")
    over = rig.first("overlay", 300)
    assert (over.height, over.width) == (60, 100)
    got = np.frombuffer(bytes(over.data), np.uint8).reshape(60, 100, 3)
    assert np.abs(got.astype(int) - rgb).max() <= 1  # alpha 0: the frame itself


def test_a_method_that_cannot_segment_is_refused(ros_context) -> None:
    node = PerceptionNode(context=ros_context, parameter_overrides=[
        Parameter("model_card", value=str(SEG_CARD)), Parameter("method", value="lame"),
        Parameter("num_threads", value=1)])
    try:
        with pytest.raises(Exception, match="does not support segmentation"):
            activate(node)
    finally:
        node.destroy_node()


def test_replay_scores_a_segmentation_bag_per_domain(ros_context, tmp_path) -> None:
    """`tta replay`'s engine on a scene bag: every frame answered by a mask, and the mIoU
    per domain is what the card's own predictions score (computed here independently)."""
    from helpers import CONFIG

    from tta_core.cli.commands.make_bag import make_bag
    from tta_core.eval.miou import ConfusionMeter
    from tta_core.io.bag import read_bag
    from tta_ros.replay import ReplayOptions, replay

    bag = tmp_path / "scenes"
    make_bag(bag, 6, 0, "clean,night/4", seed=3, progress=False, task="segmentation")
    opts = ReplayOptions(bag, CONFIG, "max", "source", out=tmp_path / "report",
                         own_options_only=True, overrides={
                             "perception": {"model_card": str(SEG_CARD), "batch_size": 2,
                                            "num_threads": 1},
                             "scheduler": {"model_card": str(SEG_CARD)},
                             "resource_monitor": {"enable_perf": False}})
    res = replay(opts, context=ros_context)
    run = res.run
    assert run.frames == 6 and run.frames_dropped == 0 and res.n_published == 6
    model, card = load_source(SEG_CARD)
    pre = Preprocess.from_card(card)
    meters: dict[str, ConfusionMeter] = {}
    with torch.no_grad():
        for f in read_bag(bag):
            pred = model(to_tensor([f.image], pre)).argmax(1)
            meters.setdefault(f.domain, ConfusionMeter(19)).update(
                pred, torch.from_numpy(f.mask).long()[None])
    assert list(run.miou) == ["clean", "night/4"]
    for domain, meter in meters.items():
        assert run.miou[domain] == pytest.approx(meter.scores().miou, abs=1e-3), domain
    md = (tmp_path / "report" / "seg_report.md").read_text()
    assert "| source |" in md and "night/4" in md
