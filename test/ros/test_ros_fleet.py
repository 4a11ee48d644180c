"""Fleet mode over real rclpy + DDS: one scheduler chooses the sizes of two namespaced
perception pipelines (/cam1 at 30 Hz, /cam2 at 10 Hz) from their /diagnostics reports and
sets them through SetParameters; each perception node applies its size (Resizable)."""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

rclpy = pytest.importorskip("rclpy")
from rclpy.executors import SingleThreadedExecutor  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402
from rclpy.qos import qos_profile_sensor_data  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402
from tta_msgs.msg import ClassPrediction  # noqa: E402

from tta_core.api import Resizable, StepResult  # noqa: E402
from tta_core.elasticdnn.fleet import equal_split, plan_fleet  # noqa: E402
from tta_core.io.image_msg import array_to_image_fields  # noqa: E402
from tta_core.methods import _REGISTRY, register  # noqa: E402
from tta_core.methods.source import Source  # noqa: E402
from tta_ros.diagnostics import OK, WARN, status  # noqa: E402
from tta_ros.nodes.fleet_wiring import app_from_status  # noqa: E402
from tta_ros.nodes.perception import PerceptionNode, perception_statuses  # noqa: E402
from tta_ros.nodes.scheduler import SchedulerNode  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CARD = ROOT / "checkpoints" / "small_resnet_signs32.json"
CAMS = {"/cam1": 30.0, "/cam2": 10.0}  # camera_hz
PRIOR = {1.0: 0.9, 0.5: 0.8, 0.25: 0.6}  # source accuracy per size


class SizedSource(Source):
    """The source model behind the Resizable protocol: larger sizes answer with sharper
    logits (more confident); fixed per-size forward times."""

    SIZES = (1.0, 0.5, 0.25)
    FORWARD_MS: ClassVar[dict[float, float]] = {1.0: 20.0, 0.5: 9.0, 0.25: 4.0}

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.keep: float | None = None
        self.calls: list[float | None] = []

    def sizes(self) -> tuple[float, ...]:
        return self.SIZES

    def set_size(self, keep: float | None) -> None:
        if keep is not None and keep not in self.SIZES:
            raise ValueError(f"no size {keep}")
        self.keep = keep
        self.calls.append(keep)

    def size_forward_ms(self) -> dict[float, float]:
        return dict(self.FORWARD_MS)

    def forward_and_adapt(self, x) -> StepResult:
        res = super().forward_and_adapt(x)
        served = self.keep or 1.0
        res.logits = res.logits * served
        res.stats["size"] = served
        return res


@pytest.fixture
def sized_method():
    register("fleet_test")(SizedSource)
    try:
        yield "fleet_test"
    finally:
        _REGISTRY.pop("fleet_test", None)


def _wait(cond: Callable[[], bool], timeout: float, tick: Callable[[], None]) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end and not cond():
        tick()
        time.sleep(0.05)
    return cond()


def _perception(ctx, ns: str, hz: float, method: str, calibration: Path) -> PerceptionNode:
    params = {"model_card": str(CARD), "method": method, "batch_size": 2, "num_threads": 1,
              "camera_hz": hz, "reset_patience": 100000, "fleet_calibration": str(calibration)}
    return PerceptionNode("perception", context=ctx, cli_args=["--ros-args", "-r",
                                                               f"__ns:={ns}"],
                          parameter_overrides=[Parameter(k, value=v) for k, v in params.items()])


def test_fleet_sizes_reach_each_namespaced_perception_node(ros_context, sized_method,
                                                           tmp_path) -> None:
    cal = tmp_path / "calibration.json"
    cal.write_text(json.dumps({"confidence": [0.0, 1.0], "accuracy": [0.0, 1.0],
                               "prior": {str(k): v for k, v in PRIOR.items()}}))
    perc = {ns: _perception(ros_context, ns, hz, sized_method, cal) for ns, hz in CAMS.items()}
    sched = SchedulerNode("fleet_scheduler", context=ros_context, parameter_overrides=[
        Parameter("model_card", value=str(CARD)),
        Parameter("fleet_namespaces", value=list(CAMS)),
        Parameter("fleet_capacity", value=0.25), Parameter("fleet_period_s", value=0.2)])
    probe = rclpy.create_node("probe", context=ros_context)
    pubs = {ns: probe.create_publisher(Image, f"{ns}/image", qos_profile_sensor_data)
            for ns in CAMS}
    ex = SingleThreadedExecutor(context=ros_context)
    nodes = [*perc.values(), sched, probe]
    for n in nodes:
        ex.add_node(n)
    thread = threading.Thread(target=ex.spin, daemon=True)
    thread.start()
    rng = np.random.default_rng(0)

    def frames() -> None:
        for pub in pubs.values():
            pub.publish(Image(**array_to_image_fields(
                rng.random((32, 32, 3)).astype(np.float32), "rgb8")))

    try:
        assert isinstance(perc["/cam1"].method, Resizable)

        def applied() -> bool:
            plan = sched.fleet.last
            return plan is not None and all(
                p.get_parameter("elastic_keep").value == plan[ns]
                and p.method.keep == plan[ns] for ns, p in perc.items())

        assert _wait(applied, 40.0, frames), (sched.fleet.waiting, sched.fleet.error,
                                              sched.fleet.last)
        apps = sched.fleet.apps()  # what the scheduler read from /diagnostics
        assert [a.name for a in apps] == list(CAMS)
        assert [a.hz for a in apps] == list(CAMS.values())
        assert apps[0].deadline_ms == pytest.approx(2000 / 30, rel=1e-5)
        assert [o.forward_ms for o in apps[0].options] == [20.0, 9.0, 4.0]
        # the 30 Hz camera cannot afford the full model; the fleet gives it the middle size,
        # where its 1/2 share would only allow the smallest
        assert dict(sched.fleet.last) == {"/cam1": 0.5, "/cam2": 1.0}
        assert dict(plan_fleet(apps, 0.25)) == dict(sched.fleet.last)
        assert dict(equal_split(apps, 0.25)) == {"/cam1": 0.25, "/cam2": 1.0}
        for ns, p in perc.items():
            assert p.method.calls[-1] == sched.fleet.last[ns]
            fleet = [s for s in perception_statuses(p) if s.name == "fleet"]
            assert fleet and dict((k.key, k.value) for k in fleet[0].values)["keep"] \
                == f"{sched.fleet.last[ns]:.6g}"
        st = sched.fleet.statuses()[0]
        assert st.level == OK and "2 pipelines" in st.message
    finally:
        ex.shutdown(timeout_sec=2.0)
        thread.join(timeout=2.0)
        for n in nodes:
            n.destroy_node()


def test_non_resizable_method_ignores_elastic_keep(ros_context) -> None:
    node = PerceptionNode("perception", context=ros_context, parameter_overrides=[
        Parameter("model_card", value=str(CARD)), Parameter("method", value="source"),
        Parameter("elastic_keep", value=0.5)])
    try:
        assert node.fleet.warned == "Source" and node.fleet.proxy is None
        assert not [s for s in perception_statuses(node) if s.name == "fleet"]
    finally:
        node.destroy_node()


def test_scheduler_waits_for_every_pipeline(ros_context) -> None:
    sched = SchedulerNode("fleet_scheduler", context=ros_context, parameter_overrides=[
        Parameter("model_card", value=str(CARD)),
        Parameter("fleet_namespaces", value=["/a", "/b"])])
    try:
        assert sched.fleet.step() is None and "/a: no fleet report" in sched.fleet.waiting
        assert sched.fleet.statuses()[0].level == WARN
        off = SchedulerNode("plain", context=ros_context,
                            parameter_overrides=[Parameter("model_card", value=str(CARD))])
        assert off.fleet.namespaces == [] and off.fleet.statuses() == []
        off.destroy_node()
    finally:
        sched.destroy_node()


def test_app_from_status_refuses_incomplete_reports() -> None:
    full = {"sizes": "1,0.5", "forward_ms": "10,5", "accuracy": "0.9,0.8", "hz": 30.0,
            "deadline_ms": 66.0, "batch_size": 2}
    app = app_from_status("/x", status("fleet", 0, "", full))
    assert app.batch_size == 2 and [o.keep for o in app.options] == [1.0, 0.5]
    with pytest.raises(ValueError, match="no forward time or accuracy estimate"):
        app_from_status("/x", status("fleet", 0, "", {**full, "accuracy": "nan,nan"}))
    with pytest.raises(ValueError, match="unreadable"):
        app_from_status("/x", status("fleet", 0, "", {"sizes": "1"}))


def test_perception_fleet_records_served_and_probed_sizes(sized_method) -> None:
    import logging
    from types import SimpleNamespace

    import torch

    from tta_core.methods import build_method
    from tta_core.model.source import load_source
    from tta_ros.nodes.fleet_wiring import PerceptionFleet

    method = build_method(sized_method, load_source(CARD)[0])
    node = SimpleNamespace(method=method, get_logger=lambda: logging.getLogger("t"))
    p = {"elastic_keep": 0.5, "fleet_calibration": "", "camera_hz": 20.0, "batch_size": 4}
    fleet = PerceptionFleet(node, p)
    assert method.keep == 0.5  # pinned at start
    logits = torch.log(torch.tensor([[0.8, 0.2], [0.6, 0.4]]))  # mean confidence 0.7
    fleet.on_batch({"size": 0.5, "confidence@0.25": 0.4}, logits)
    assert fleet.proxy.accuracy() == pytest.approx({0.25: 0.4, 0.5: 0.7, 1.0: 0.7})
    st = fleet.statuses()[0]
    kv = {k.key: k.value for k in st.values}
    assert kv["sizes"] == "1,0.5,0.25" and kv["accuracy"] == "0.7,0.7,0.4"
    assert kv["forward_ms"] == "20,9,4" and kv["deadline_ms"] == "200"
    assert kv["keep"] == "0.5" and kv["served"] == "0.5"  # what the batch was served at
    p["elastic_keep"] = 0.0
    fleet.apply({"elastic_keep": 0.0}, method)
    assert method.keep is None  # back to the method's own choice


def test_elastic_on_the_gated_card_serves_the_pinned_size(ros_context) -> None:
    """The shipped gated master in a perception node (method elastic): it answers frames
    (no unit decomposition of a GatedModel is needed) and serves the size pinned by
    elastic_keep, which its fleet status reports as `served`."""
    gated = ROOT / "checkpoints" / "small_resnet_signs32_elastic.json"
    node = PerceptionNode("perception", context=ros_context, parameter_overrides=[
        Parameter(k, value=v) for k, v in {
            "model_card": str(gated), "method": "elastic", "lr": 0.0, "batch_size": 2,
            "num_threads": 1, "camera_hz": 20.0, "deadline_mode": "camera",
            "reset_patience": 100000, "elastic_keep": 0.5}.items()])
    probe = rclpy.create_node("probe", context=ros_context)
    pub = probe.create_publisher(Image, "/image", qos_profile_sensor_data)
    got = []
    probe.create_subscription(ClassPrediction, "/predictions", got.append, 100)
    ex = SingleThreadedExecutor(context=ros_context)
    for n in (node, probe):
        ex.add_node(n)
    thread = threading.Thread(target=ex.spin, daemon=True)
    thread.start()
    rng = np.random.default_rng(0)

    def frame() -> None:
        pub.publish(Image(**array_to_image_fields(
            rng.random((32, 32, 3)).astype(np.float32), "rgb8")))

    try:
        assert node.unit_names == [] and isinstance(node.method, Resizable)
        assert _wait(lambda: len(got) >= 4 and node.fleet.served == 0.5, 30.0, frame)
        kv = {k.key: k.value for k in node.fleet.statuses()[0].values}
        assert kv["served"] == "0.5" and kv["keep"] == "0.5"
        assert kv["sizes"] == "1,0.7,0.5,0.3"
        assert all(math.isfinite(float(v)) for v in kv["forward_ms"].split(","))
    finally:
        ex.shutdown(timeout_sec=2.0)
        thread.join(timeout=2.0)
        for n in (node, probe):
            n.destroy_node()


def test_perception_passes_warmup_runs_to_methods_that_time_sizes() -> None:
    """`warmup_runs` reaches the elastic method (how many forwards per size its warm-up
    times) and no method without that option."""
    from tta_core.methods import build_method
    from tta_core.model.source import load_source
    from tta_ros.nodes.perception import method_options, param_specs

    p = {s.name: s.default for s in param_specs()}
    assert p["warmup_runs"] == 2
    p.update(method="elastic", warmup_runs=7)
    opts = method_options(p, 32, "gated_small_resnet")
    assert opts["warmup_runs"] == 7
    assert "warmup_runs" not in method_options({**p, "method": "tent"}, 32, "small_resnet")
    model = load_source(ROOT / "checkpoints" / "small_resnet_signs32_elastic.json")[0]
    assert build_method("elastic", model, **{**opts, "input_shape": ()}).config.warmup_runs == 7
