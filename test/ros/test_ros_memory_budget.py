"""The memory budget (adashadow.memory_budget) in the ROS nodes: perception passes
method.memory_budget_mb to the method; the scheduler plans within a fixed budget or a share of the
free memory its telemetry reports, over real rclpy + DDS."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("rclpy")
from helpers import CARD

from tta_core.adashadow.memory_budget import MIB

pytestmark = pytest.mark.usefixtures("one_thread")  # as in the unit tier's file


def test_perception_passes_memory_budget_mb_to_the_method() -> None:
    from tta_ros.nodes.method_params import MethodOptions

    opts = MethodOptions("adashadow")
    assert opts.values["method.memory_budget_mb"] == 0.0  # 0: none
    assert opts.config()["memory_budget_mb"] is None
    assert opts.config({"method.memory_budget_mb": 2.5})["memory_budget_mb"] == 2.5
    assert "method.memory_budget_mb" not in MethodOptions("tent").params


def test_scheduler_plans_within_its_memory_budget_mb(ros_context) -> None:
    """The scheduler's memory_budget_mb: plans on both budgets (keep 1: a LayerPlan has no
    keeps), within it; a tiny one says why plans stay empty; 0 turns it off at run time."""
    from rclpy.parameter import Parameter
    from tta_msgs.msg import LayerImportance

    from tta_ros.lifecycle import activate
    from tta_ros.nodes.scheduler import SchedulerNode

    node = activate(SchedulerNode(context=ros_context, parameter_overrides=[
        Parameter("model_card", value=str(CARD)), Parameter("sigma", value=1.0),
        Parameter("memory_budget_mb", value=0.5)]))
    try:
        lay = node.layout
        imp = LayerImportance(unit_names=lay.unit_names, model_name=lay.model_name,
                              importance=[1.0] * lay.n_units, batch_size=8, forward_ms=5.0)
        out = node.plan_for(imp)
        assert out.memory is not None and out.updates
        assert out.memory.predicted_bytes <= 0.5 * MIB
        assert set(out.memory.keep[out.plan.update]) == {1.0}
        node.set_parameters([Parameter("memory_budget_mb", value=0.0)])
        unbounded = node.plan_for(imp)
        assert unbounded.memory is None
        assert unbounded.plan.update.sum() > out.plan.update.sum()
        node.set_parameters([Parameter("memory_budget_mb", value=1e-5)])
        tiny = node.plan_for(imp)
        assert not tiny.updates and "memory budget" in tiny.no_room
    finally:
        node.destroy_node()


def test_scheduler_plans_within_a_share_of_the_free_memory_telemetry_reports(
        ros_context) -> None:
    """memory_budget_free_share 0.5: telemetry saying 1.2 MiB free gives a 0.6 MiB budget
    (the RViz label shows the plan's predicted saved MiB against it),
    99.99 % used none that fits; stale telemetry leaves no budget (none fixed)."""
    import rclpy
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.parameter import Parameter
    from tta_msgs.msg import LayerImportance, LayerPlan, ResourceTelemetry

    from tta_ros.lifecycle import activate
    from tta_ros.nodes.scheduler import SchedulerNode, memory_text, plan_markers

    node = activate(SchedulerNode(context=ros_context, parameter_overrides=[
        Parameter("model_card", value=str(CARD)), Parameter("sigma", value=1.0),
        Parameter("memory_budget_free_share", value=0.5)]))
    probe = rclpy.create_node("monitor_probe", context=ros_context)
    pub = probe.create_publisher(ResourceTelemetry, "telemetry", 10)
    ex = SingleThreadedExecutor(context=ros_context)
    ex.add_node(node)
    lay = node.layout
    imp = LayerImportance(unit_names=lay.unit_names, model_name=lay.model_name,
                          importance=[1.0] * lay.n_units, batch_size=8, forward_ms=5.0)

    def telemetry(total: float, used: float) -> None:
        msg = ResourceTelemetry(mem_total_mb=total, mem_used_mb=used)
        node.telemetry = None
        end = time.monotonic() + 5.0
        while node.telemetry is None and time.monotonic() < end:
            pub.publish(msg)
            ex.spin_once(timeout_sec=0.05)
        assert node.telemetry is not None, "telemetry never received"

    try:
        assert node.plan_for(imp).memory is None  # no telemetry yet: no budget
        telemetry(1000.0, 998.8)
        out = node.plan_for(imp)
        assert node.planning.config.memory_budget_mb == pytest.approx(0.6, rel=1e-3)
        assert out.updates and out.memory.predicted_bytes <= 0.6 * MIB
        text = memory_text(out, node.planning.config.memory_budget_mb)
        assert text == f"saved {out.memory.predicted_bytes / MIB:.2f} / 0.60 MiB"
        plan = LayerPlan(importance=[1.0] * lay.n_units, update=list(out.plan.update))
        label = plan_markers(plan, "tta", 0.3, 2.0, memory=text).markers[-1].text
        assert label.endswith(", " + text) and memory_text(out, None) == ""
        telemetry(1000.0, 999.9999)
        assert not node.plan_for(imp).updates
        node.set_parameters([Parameter("telemetry_timeout_s", value=0.1)])
        time.sleep(0.2)  # stale
        assert node.plan_for(imp).memory is None
    finally:
        ex.shutdown()
        node.destroy_node()
        probe.destroy_node()

