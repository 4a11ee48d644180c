"""Deadline budgets over real rclpy + DDS (issue #18): the scheduler's "speed" deadline
follows the odometry published on its (namespaced) `odom` topic, its plans and RViz label
follow the deadline, /diagnostics says when the forward alone misses it; deadline
parameters change at run time and bad ones are refused; perception plans inline against
its own deadline.

nav_msgs may not be installed: the Odometry case is skipped then and the same scheduler
runs on geometry_msgs/TwistStamped (odometry_type), the other message it can take.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable

import numpy as np
import pytest

rclpy = pytest.importorskip("rclpy")
from diagnostic_msgs.msg import DiagnosticStatus  # noqa: E402
from geometry_msgs.msg import TwistStamped  # noqa: E402
from helpers import CARD, wait_for  # noqa: E402
from helpers.ros import image_msg  # noqa: E402
from rclpy.executors import SingleThreadedExecutor  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402
from tta_msgs.msg import AdaptationStatus, LayerImportance, LayerPlan  # noqa: E402
from visualization_msgs.msg import MarkerArray  # noqa: E402

from tta_core.adashadow.predictor import UnitProfile  # noqa: E402
from tta_ros.lifecycle import activate  # noqa: E402
from tta_ros.nodes.scheduler import SchedulerNode  # noqa: E402
from tta_ros.spinning import SpinThread  # noqa: E402

HAVE_NAV_MSGS = importlib.util.find_spec("nav_msgs") is not None
N_UNITS = 19  # the card's units; BN units are the odd ones, 1..17
FORWARD_MS = 0.3 * N_UNITS  # = the flat profile's forward: its times are used as they are
# 0.166 m per decision: 33.2 ms at 5 m/s, 8.3 ms at 20 m/s. After the 5.7 ms forward the
# flat profile (w 0.2, x 0.1, r 0.3) fits every BN unit into 27.5 ms, and only units 15
# and 17 into 2.6 ms: the card's blocks replay their units' outputs, so a reforward from
# unit d runs d on (1.9 ms; {13, 15, 17} would take 2.9)
DISTANCE_M = 0.166


def _odometry(type_name: str, speed: float):
    if type_name == "nav_msgs/Odometry":
        from nav_msgs.msg import Odometry

        msg = Odometry()
        msg.twist.twist.linear.x = speed
        return Odometry, msg
    msg = TwistStamped()
    msg.twist.linear.x = speed * 0.6  # planar speed: |(0.6, 0.8) * speed| = speed
    msg.twist.linear.y = speed * 0.8
    return TwistStamped, msg


def _scheduler(ros_context, tmp_path, namespace: str = "", *params: Parameter
               ) -> SchedulerNode:
    """A scheduler on the shipped card with a flat profile and no fixed-cost learning."""
    names = activate(SchedulerNode(context=ros_context, parameter_overrides=[
        Parameter("model_card", value=str(CARD))]))
    unit_names = names.layout.unit_names
    names.destroy_node()
    n = len(unit_names)
    assert n == N_UNITS
    UnitProfile(model="small_resnet", device="cpu", batch_size=4, input_shape=(3, 32, 32),
                unit_names=unit_names, w_ms=np.full(n, 0.2), x_ms=np.full(n, 0.1),
                r_ms=np.full(n, 0.3), eta=np.ones(n), forward_ms=FORWARD_MS,
                ).save(tmp_path / "p.json")
    return activate(SchedulerNode(context=ros_context, cli_args=(
        ["--ros-args", "-r", f"__ns:=/{namespace}"] if namespace else None),
        parameter_overrides=[
        Parameter("model_card", value=str(CARD)),
        Parameter("profile", value=str(tmp_path / "p.json")),
        Parameter("fixed_cost_feedback", value=0.0), Parameter("backward_feedback", value=0.0),
        Parameter("deadline_mode", value="speed"),
        Parameter("distance_per_decision_m", value=DISTANCE_M),
        Parameter("min_deadline_ms", value=1.0), Parameter("max_deadline_ms", value=1000.0),
        *params]))


def _importance(node: SchedulerNode, batch_id: int, forward_ms: float = FORWARD_MS
                ) -> LayerImportance:
    lay = node.layout
    return LayerImportance(unit_names=lay.unit_names, model_name=lay.model_name,
                           importance=[1.0] * lay.n_units, batch_size=4,
                           forward_ms=forward_ms, batch_id=batch_id)


class _Car:
    """A probe node in the scheduler's namespace: odometry and importance out, plans and
    markers in, all over DDS; spun with the scheduler on one executor."""

    def __init__(self, ros_context, node: SchedulerNode, type_name: str, namespace: str):
        self.node, self.type_name = node, type_name
        self.probe = rclpy.create_node("fake_car", namespace=f"/{namespace}" if namespace else None,
                                       context=ros_context)
        rel = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
        self.plans: list[LayerPlan] = []
        self.markers: list[MarkerArray] = []
        self.probe.create_subscription(LayerPlan, "layer_plan", self.plans.append, rel)
        self.probe.create_subscription(MarkerArray, "layer_markers", self.markers.append, 10)
        self.pub_imp = self.probe.create_publisher(LayerImportance, "layer_importance", rel)
        self.pub_odom = self.probe.create_publisher(_odometry(type_name, 0.0)[0], "odom", 10)
        self.ex = SingleThreadedExecutor(context=ros_context)
        for nd in (node, self.probe):
            self.ex.add_node(nd)

    def spin_until(self, done: Callable[[], bool], act: Callable[[], None],
                   timeout: float = 10.0) -> bool:
        end = time.monotonic() + timeout
        while not done() and time.monotonic() < end:
            act()
            self.ex.spin_once(timeout_sec=0.05)
        return done()

    def drive(self, speed: float) -> None:
        """Publish odometry at `speed` until the scheduler has it."""
        msg = _odometry(self.type_name, speed)[1]
        assert self.spin_until(lambda: self.node.speed.speed() == pytest.approx(speed),
                               lambda: self.pub_odom.publish(msg)), \
            f"odometry at {speed} m/s never reached the scheduler"

    def plan(self, imp: LayerImportance) -> tuple[LayerPlan, MarkerArray]:
        """Publish `imp` until its plan (and markers) come back."""
        def answered() -> bool:
            return any(p.based_on_batch_id == imp.batch_id for p in self.plans) and bool(
                self.markers) and self.markers[-1].markers[-1].text.startswith(
                    f"plan {self.plans[-1].plan_id}:")

        def send() -> None:
            if self.pub_imp.get_subscription_count() > 0:
                self.pub_imp.publish(imp)
        assert self.spin_until(answered, send), f"no plan for batch {imp.batch_id}"
        plan = next(p for p in self.plans if p.based_on_batch_id == imp.batch_id)
        return plan, self.markers[-1]

    def close(self) -> None:
        self.ex.shutdown()
        self.probe.destroy_node()


ODOMETRY_TYPES = [pytest.param("nav_msgs/Odometry", marks=pytest.mark.skipif(
    not HAVE_NAV_MSGS, reason="nav_msgs is not installed (ros-nav-msgs)")),
    "geometry_msgs/TwistStamped"]


@pytest.mark.parametrize("type_name", ODOMETRY_TYPES)
def test_odometry_speed_sets_the_deadline_and_the_plans_follow(ros_context, tmp_path,
                                                               type_name: str) -> None:
    """/car1/odom at 5 m/s, then 20 m/s: the budget of the published plans shrinks 4x
    (33.2 -> 8.3 ms) and the plan from all 9 BN units to units 15 and 17; the RViz label
    shows the deadline."""
    node = _scheduler(ros_context, tmp_path, "car1",
                      Parameter("odometry_type", value=type_name))
    car = _Car(ros_context, node, type_name, "car1")
    try:
        assert node.speed.topic == "/car1/odom"
        car.drive(5.0)
        slow, slow_markers = car.plan(_importance(node, 1))
        car.drive(20.0)
        fast, fast_markers = car.plan(_importance(node, 2))
    finally:
        car.close()
        node.destroy_node()
    assert slow.budget_ms == pytest.approx(33.2) and fast.budget_ms == pytest.approx(8.3)
    assert slow.budget_ms == pytest.approx(4 * fast.budget_ms)
    assert [i for i, u in enumerate(slow.update) if u] == list(range(1, 18, 2))
    assert [i for i, u in enumerate(fast.update) if u] == [15, 17]
    assert fast.predicted_total_ms == pytest.approx(FORWARD_MS + 1.9)
    assert fast.predicted_total_ms <= fast.budget_ms
    # LayerPlan.sigma: the deadline as a share of the full update, so budget / sigma = T
    full = FORWARD_MS + 0.2 * N_UNITS + 0.1 * (N_UNITS - 1) + 0.3 * N_UNITS
    assert fast.budget_ms / fast.sigma == pytest.approx(full)
    assert "deadline 33.2 ms (speed: 0.166 m per batch at 5 m/s" in \
        slow_markers.markers[-1].text
    assert "deadline 8.3 ms" in fast_markers.markers[-1].text


def test_diagnostics_say_when_the_forward_alone_misses_the_deadline(ros_context,
                                                                    tmp_path) -> None:
    """A 40 ms forward against 8.3 ms: an empty plan, WARN naming the deadline, counted;
    no odometry at all: WARN that the speed is unknown and the shortest deadline applies."""
    node = _scheduler(ros_context, tmp_path, "", Parameter(
        "odometry_type", value="geometry_msgs/TwistStamped"))
    try:
        st = node._planning_status()
        assert st.level == DiagnosticStatus.WARN and "no odometry on '/odom'" in st.message
        assert node.plan_for(_importance(node, 1)).plan.budget_ms == 1.0  # min_deadline_ms
        node.speed.on_speed(20.0)
        node._on_importance(_importance(node, 1, forward_ms=40.0))
        st = node._planning_status()
        values = {kv.key: kv.value for kv in st.values}
        assert st.level == DiagnosticStatus.WARN
        assert st.message.startswith("the forward alone (40 ms) misses the deadline 8.3 ms")
        assert values["forward_misses"] == "1" and values["deadline_ms"] == "8.3"
        assert values["speed_mps"] == "20" and values["deadline"].startswith("speed: 0.166 m")
        node._on_importance(_importance(node, 2))
        st = node._planning_status()
        assert st.level == DiagnosticStatus.OK and node.forward_misses == 1
    finally:
        node.destroy_node()


def test_deadline_parameters_change_at_run_time_and_bad_ones_are_refused(
        ros_context, tmp_path) -> None:
    node = _scheduler(ros_context, tmp_path, "", Parameter(
        "odometry_type", value="geometry_msgs/TwistStamped"))
    try:
        imp = _importance(node, 1)
        ok = node.set_parameters([Parameter("deadline_mode", value="camera"),
                                  Parameter("camera_hz", value=400.0)])
        assert all(r.successful for r in ok)
        assert node.plan_for(imp).plan.budget_ms == pytest.approx(10.0)  # 4 frames at 400 Hz
        node.set_parameters([Parameter("deadline_mode", value="fixed"),
                             Parameter("deadline_ms", value=2.0),
                             Parameter("deadline_per", value="frame")])
        assert node.plan_for(imp).plan.budget_ms == pytest.approx(8.0)
        bad = node.set_parameters([Parameter("min_deadline_ms", value=5000.0)])[0]
        assert not bad.successful and "min_deadline_ms=5000.0" in bad.reason
        bad = node.set_parameters([Parameter("odometry_topic", value="1 odom")])[0]
        assert not bad.successful and "odometry_topic '1 odom'" in bad.reason
        bad = node.set_parameters([Parameter("deadline_mode", value="soon")])[0]
        assert not bad.successful and "'soon'" in bad.reason
        assert node.planning.config.deadline_mode == "fixed"
        assert node.planning.config.min_deadline_ms == 1.0
        assert node.set_parameters([Parameter("odometry_topic", value="/car9/odom")])[0] \
            .successful and node.speed.topic == "/car9/odom"
        node.set_parameters([Parameter("deadline_mode", value="sigma")])
        out = node.plan_for(imp)
        assert out.plan.budget_ms == pytest.approx(0.33 * out.plan.full_ms)
    finally:
        node.destroy_node()


def test_perception_plans_inline_against_its_deadline(ros_context) -> None:
    """Inline planning with a deadline the forward cannot meet: batches served without
    update, the planning status WARNs naming the deadline; a camera deadline set at run
    time with room adapts again."""
    from tta_ros.nodes.perception import PerceptionNode

    node = activate(PerceptionNode(context=ros_context, parameter_overrides=[
        Parameter("model_card", value=str(CARD)), Parameter("plan_source", value="inline"),
        Parameter("batch_size", value=2), Parameter("num_threads", value=1),
        Parameter("method.deadline_mode", value="fixed"),
        Parameter("method.deadline_ms", value=0.01),
        Parameter("odometry_type", value="geometry_msgs/TwistStamped")]))
    probe = rclpy.create_node("fake_camera", context=ros_context)
    statuses: list[AdaptationStatus] = []
    probe.create_subscription(AdaptationStatus, "adaptation_status", statuses.append,
                              QoSProfile(depth=50, reliability=ReliabilityPolicy.RELIABLE))
    pub = probe.create_publisher(Image, "image", qos_profile_sensor_data)
    ex = SingleThreadedExecutor(context=ros_context)
    for nd in (node, probe):
        ex.add_node(nd)
    spin = SpinThread(ex)
    i = 0

    def fed(done: Callable[[], bool]) -> bool:
        nonlocal i
        pub.publish(image_msg(1000 + i, size=32))
        i += 1
        return done()
    try:
        end = time.monotonic() + 5.0
        while pub.get_subscription_count() == 0 and time.monotonic() < end:
            time.sleep(0.02)
        assert wait_for(lambda: fed(lambda: len(statuses) >= 3), 15.0)
        assert not any(s.adapted for s in statuses)
        # per batch (per frame would be 0.02), less the time the frames waited (lateness)
        assert all(0.0 <= s.budget_ms <= 0.01 for s in statuses)
        plan = next(s for s in node.statuses() if s.name.endswith("planning"))
        assert plan.level == DiagnosticStatus.WARN
        assert "deadline_mode=fixed: the forward alone (" in plan.message
        values = {kv.key: kv.value for kv in plan.values}
        assert values["deadline_mode"] == "fixed"
        assert "speed" not in values  # not a speed deadline: the odometry does not count
        assert all(r.successful for r in node.set_parameters([
            Parameter("method.deadline_mode", value="speed")]))
        speed = next(s for s in node.statuses() if s.name.endswith("planning"))
        assert {kv.key: kv.value for kv in speed.values}["speed"].startswith(
            "no odometry on '/odom'")
        node.speed.on_speed(7.5)
        speed = next(s for s in node.statuses() if s.name.endswith("planning"))
        assert {kv.key: kv.value for kv in speed.values}["speed"] == "7.5 m/s"
        assert all(r.successful for r in node.set_parameters([
            Parameter("method.deadline_mode", value="camera"),
            Parameter("method.camera_hz", value=0.5)]))
        n = len(statuses)
        assert wait_for(lambda: fed(lambda: any(s.adapted for s in statuses[n:])), 15.0)
        # 1 or 2 frames at 0.5 Hz, less the few ms the batch waited
        assert any(abs(statuses[-1].budget_ms - b) < 100.0 for b in (2000.0, 4000.0))
    finally:
        spin.stop()  # after the running callback: no callback on a destroyed node
        node.destroy_node()
        probe.destroy_node()


def test_inconsistent_deadline_settings_are_refused_at_start(ros_context) -> None:
    from tta_ros.nodes.perception import PerceptionNode

    for cls, prefix in ((PerceptionNode, "method."), (SchedulerNode, "")):
        bad = [Parameter("model_card", value=str(CARD)),
               Parameter(prefix + "min_deadline_ms", value=500.0),
               Parameter(prefix + "max_deadline_ms", value=100.0)]
        with pytest.raises(ValueError) as err:
            cls(context=ros_context, parameter_overrides=bad)
        assert "min_deadline_ms=500.0 is above max_deadline_ms=100.0" in str(err.value)
        assert "\n" not in str(err.value)
