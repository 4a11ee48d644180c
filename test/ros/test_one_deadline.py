"""One deadline over real rclpy + DDS: the scheduler's deadline settings follow the
perception node's `method.*` options (tta_ros.nodes.scheduler_deadline): the values
perception had before the scheduler came up (its GetParameters service), then a change set
on perception at run time (its /parameter_events); both nodes' deadlines and the
scheduler's plans follow; a scheduler with `deadline_from: ''` keeps its own. Waits poll
the nodes' state, never a fixed sleep."""

from __future__ import annotations

import math

import pytest

rclpy = pytest.importorskip("rclpy")
from helpers import CARD, wait_for  # noqa: E402
from rclpy.executors import SingleThreadedExecutor  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402
from tta_msgs.msg import LayerImportance  # noqa: E402

from tta_ros.lifecycle import activate  # noqa: E402
from tta_ros.nodes.scheduler import SchedulerNode, deadline_values  # noqa: E402
from tta_ros.spinning import SpinThread  # noqa: E402


def _importance(node: SchedulerNode, batch_size: int) -> LayerImportance:
    lay = node.layout
    return LayerImportance(unit_names=lay.unit_names, model_name=lay.model_name,
                           importance=[1.0] * lay.n_units, batch_size=batch_size,
                           forward_ms=1.0, batch_id=1)


def _deadlines(perception, scheduler: SchedulerNode, batch_size: int) -> tuple[float, float]:
    """(perception's deadline of a batch, the budget of the scheduler's plan for one)."""
    plan = scheduler.plan_for(_importance(scheduler, batch_size)).plan
    return perception.deadline.batch_ms(perception.method, batch_size), plan.budget_ms


def test_a_deadline_set_on_perception_reaches_the_scheduler(ros_context) -> None:
    from tta_ros.nodes.perception import PerceptionNode

    perception = activate(PerceptionNode(context=ros_context, parameter_overrides=[
        Parameter("model_card", value=str(CARD)), Parameter("batch_size", value=2),
        Parameter("num_threads", value=1), Parameter("method.deadline_mode", value="fixed"),
        Parameter("method.deadline_ms", value=40.0),
        Parameter("odometry_type", value="geometry_msgs/TwistStamped")]))
    scheduler = activate(SchedulerNode(context=ros_context, parameter_overrides=[
        Parameter("model_card", value=str(CARD)), Parameter("fixed_cost_feedback", value=0.0),
        Parameter("odometry_type", value="geometry_msgs/TwistStamped")]))
    assert scheduler.planning.config.deadline_mode == "sigma"  # its own default, for now
    own = activate(SchedulerNode("own_scheduler", context=ros_context, parameter_overrides=[
        Parameter("model_card", value=str(CARD)), Parameter("deadline_from", value=""),
        Parameter("odometry_type", value="geometry_msgs/TwistStamped")]))
    ex = SingleThreadedExecutor(context=ros_context)
    for nd in (perception, scheduler, own):
        ex.add_node(nd)
    spin = SpinThread(ex)
    try:
        # what perception had before the scheduler came up: read from its service
        assert wait_for(lambda: scheduler.planning.config.deadline_mode == "fixed", 10.0)
        assert scheduler.get_parameter("deadline_ms").value == 40.0
        assert _deadlines(perception, scheduler, 2) == (40.0, 40.0)
        assert deadline_values(scheduler)["deadline_from"] == "/perception (followed)"

        # set once, on perception, at run time: per frame, 7.5 ms
        assert all(r.successful for r in perception.set_parameters([
            Parameter("method.deadline_per", value="frame"),
            Parameter("method.deadline_ms", value=7.5)]))
        assert wait_for(lambda: scheduler.get_parameter("deadline_ms").value == 7.5
                        and scheduler.planning.config.deadline_per == "frame", 10.0)
        # perception takes a change between batches (its worker): wait for it too
        assert wait_for(lambda: _deadlines(perception, scheduler, 2) == (15.0, 15.0), 10.0)
        assert _deadlines(perception, scheduler, 4) == (30.0, 30.0)

        # back to sigma*T with another sigma: perception reports no deadline, the
        # scheduler's budget is the new share of the full update again
        before = scheduler.plan_for(_importance(scheduler, 2)).budget_share
        assert all(r.successful for r in perception.set_parameters([
            Parameter("method.deadline_mode", value="sigma"),
            Parameter("method.sigma", value=0.8)]))
        assert wait_for(lambda: scheduler.planning.config.sigma == 0.8
                        and scheduler.planning.config.deadline_mode == "sigma", 10.0)
        assert wait_for(lambda: math.isnan(_deadlines(perception, scheduler, 2)[0]), 10.0)
        assert perception.method.config.sigma == 0.8
        after = scheduler.plan_for(_importance(scheduler, 2)).budget_share
        assert after == pytest.approx(0.8) and before != pytest.approx(0.8)
        assert scheduler.deadline_from.refused == ""
        # deadline_from '': a scheduler that keeps its own settings took none of it
        assert own.planning.config.deadline_mode == "sigma"
        assert own.planning.config.sigma == 0.33 and own.planning.config.deadline_per == "batch"
        assert deadline_values(own)["deadline_from"] == "own parameters"
    finally:
        spin.stop()
        for nd in (perception, scheduler, own):
            nd.destroy_node()
