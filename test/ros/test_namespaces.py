"""Two vehicles in one process: bringup nodes in /car1 and /car2 over real rclpy + DDS.

Frames published on /car1/image are answered only on /car1/predictions (and /car2 likewise);
plans, status and importance stay inside their namespace; each node has its own section of
config/vehicle.yaml plus its namespace's overrides.
"""

from __future__ import annotations

import time

import pytest

rclpy = pytest.importorskip("rclpy")
from diagnostic_msgs.msg import DiagnosticArray  # noqa: E402
from helpers import CARD, CONFIG, wait_for  # noqa: E402
from helpers.ros import image_msg  # noqa: E402
from rclpy.executors import SingleThreadedExecutor  # noqa: E402
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402
from tta_msgs.msg import (  # noqa: E402
    AdaptationStatus,
    ClassPrediction,
    LayerImportance,
    LayerPlan,
)

from tta_ros.bringup import build_nodes  # noqa: E402
from tta_ros.lifecycle import activate  # noqa: E402
from tta_ros.spinning import SpinThread  # noqa: E402

CARS = ("/car1", "/car2")
OUTPUTS = (("pred", ClassPrediction, "predictions"), ("status", AdaptationStatus,
                                                      "adaptation_status"),
           ("imp", LayerImportance, "layer_importance"), ("plan", LayerPlan, "layer_plan"))


@pytest.fixture
def fleet(ros_context):
    """Both vehicles' nodes (car1 with sigma 0.5), a probe recording every output topic
    in /car1, /car2 and the root namespace, one executor thread."""
    per = {"model_card": str(CARD), "batch_size": 2, "num_threads": 1,
           "reset_patience": 100000, "feed_timeout_s": 0.5}
    nodes = {}
    for ns in CARS:
        sigma = 0.5 if ns == "/car1" else None
        nodes[ns] = build_nodes(CONFIG, {"perception": {**per, **(
                                             {"method.sigma": sigma} if sigma else {})},
                                         "scheduler": {"model_card": str(CARD), **(
                                             {"sigma": sigma} if sigma else {})},
                                         "resource_monitor": {"enable_perf": False}},
                                context=ros_context, namespace=ns)
    probe = rclpy.create_node("probe", context=ros_context)
    got: dict[tuple[str, str], list] = {}
    rel = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
    for ns in ("", *CARS):
        for key, typ, topic in OUTPUTS:
            got[ns, key] = []
            probe.create_subscription(typ, f"{ns}/{topic}",
                                      lambda m, k=(ns, key): got[k].append(m), rel)
    got["", "diag"] = []
    probe.create_subscription(DiagnosticArray, "/diagnostics",
                              lambda m: got["", "diag"].extend(m.status), rel)
    pubs = {ns: probe.create_publisher(Image, f"{ns}/image", qos_profile_sensor_data)
            for ns in CARS}
    ex = SingleThreadedExecutor(context=ros_context)
    for n in [*nodes["/car1"], *nodes["/car2"], probe]:
        ex.add_node(n)
    spin = SpinThread(ex)
    try:
        assert wait_for(lambda: all(p.get_subscription_count() == 1 for p in pubs.values()), 5)
        yield nodes, pubs, got
    finally:
        spin.stop()  # after the running callback: no callback on a destroyed node
        for n in [*nodes["/car1"], *nodes["/car2"], probe]:
            n.destroy_node()


def test_two_vehicles_answer_only_in_their_own_namespace(fleet) -> None:
    nodes, pubs, got = fleet
    stamps = {"/car1": range(100, 106), "/car2": range(200, 206)}
    for i in range(6):
        for ns in CARS:
            pubs[ns].publish(image_msg(stamps[ns][i], size=32))
        time.sleep(0.03)
    assert wait_for(lambda: all(len(got[ns, "pred"]) >= 6 and got[ns, "plan"] for ns in CARS),
                 20.0)
    time.sleep(0.3)
    for ns in CARS:
        assert sorted(p.header.stamp.sec for p in got[ns, "pred"]) == list(stamps[ns])
        assert got[ns, "status"] and got[ns, "imp"]
    for key, _, _ in OUTPUTS:
        assert got["", key] == [], f"/{key} outside the namespaces"
    _assert_diagnostics_namespaced(got["", "diag"])
    for ns, (monitor, scheduler, perception) in nodes.items():
        assert {n.get_namespace() for n in (monitor, scheduler, perception)} == {ns}
        assert perception.intake.node.get_namespace() == ns
        want_sigma = 0.5 if ns == "/car1" else 0.33
        assert perception.get_parameter("method.sigma").value == want_sigma
        assert scheduler.get_parameter("sigma").value == want_sigma
        assert perception.get_parameter("method").value == "adashadow"
        assert monitor.get_parameter("frame_id").value == "base_link"  # its YAML section
        assert scheduler.get_parameter("trainable").value == "norm"
        topics = {t for n in (monitor, scheduler, perception)
                  for t in [p.topic_name for p in n.publishers]}
        assert {f"{ns}/predictions", f"{ns}/layer_plan", f"{ns}/telemetry",
                f"{ns}/adaptation_status", f"{ns}/layer_importance"} <= topics


def _assert_diagnostics_namespaced(statuses: list) -> None:
    """Both vehicles' nodes on the one /diagnostics: every status names its node under its
    namespace and carries a hardware_id, so the two never collide."""
    assert wait_for(lambda: {s.name.split(":")[0] for s in statuses} >= {
        f"{ns}/{node}" for ns in CARS for node in ("perception", "scheduler",
                                                   "resource_monitor")}, 15.0), \
        sorted({s.name for s in statuses})
    assert all(s.name.startswith(CARS) for s in statuses), sorted({s.name for s in statuses})
    assert all(s.hardware_id for s in statuses)


def test_node_names_unique_under_launch_global_arguments() -> None:
    """`ros2 launch` starts perception with the global `-r __node:=perception -r
    __ns:=/car1`; those must not rename its intake node too (two /car1/perception)."""
    import random

    from tta_ros.nodes.perception import PerceptionNode

    ctx = rclpy.context.Context()
    rclpy.init(args=["perception_node", "--ros-args", "-r", "__node:=perception",
                     "-r", "__ns:=/car1"], context=ctx, domain_id=random.randint(1, 200))
    try:
        node = activate(PerceptionNode(context=ctx, parameter_overrides=[
            rclpy.parameter.Parameter("model_card", value=str(CARD))]))
        probe = rclpy.create_node("probe", context=ctx, use_global_arguments=False)
        want = [("perception", "/car1"), ("perception_intake", "/car1"), ("probe", "/")]
        try:
            assert wait_for(lambda: sorted(probe.get_node_names_and_namespaces()) == want,
                            5.0), probe.get_node_names_and_namespaces()
            assert node.intake.node.resolve_topic_name("image") == "/car1/image"
            assert [s.topic_name for s in node.intake.node.subscriptions] == ["/car1/image"]
        finally:
            probe.destroy_node()
            node.destroy_node()
    finally:
        ctx.try_shutdown()
