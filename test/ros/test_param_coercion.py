"""An int where a float parameter is expected is that float, at start (`--set
perception.batch_timeout_s=0`, a params file's `rate_hz: 5`, `-p sigma:=1`) and at run
time (`ros2 param set /scheduler sigma 1` sends an INTEGER); any other type is refused in
one line naming the value (tta_ros.ros_params: ParamSpec.coerce, accept_ints_for_floats)."""

from __future__ import annotations

import pytest

rclpy = pytest.importorskip("rclpy")
from helpers import CARD, CONFIG  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402

from tta_ros.bringup import build_nodes, parse_set  # noqa: E402
from tta_ros.lifecycle import activate  # noqa: E402
from tta_ros.nodes.scheduler import SchedulerNode  # noqa: E402
from tta_ros.ros_params import ParamSpec  # noqa: E402


def test_ints_for_floats_at_start_through_set(ros_context) -> None:
    over = parse_set(["perception.batch_timeout_s=0", "perception.float_range=[0, 1]",
                      "perception.max_aspect=3", "scheduler.sigma=1",
                      "resource_monitor.rate_hz=5", "perception.num_threads=1"])
    nodes = build_nodes(CONFIG, over, context=ros_context)
    try:
        got = {(n.get_name(), k): n.get_parameter(k).value for n in nodes
               for k in over.get(n.get_name(), {})}
        assert got == {("perception", "batch_timeout_s"): 0.0,
                       ("perception", "float_range"): [0.0, 1.0],
                       ("perception", "max_aspect"): 3.0, ("perception", "num_threads"): 1,
                       ("scheduler", "sigma"): 1.0, ("resource_monitor", "rate_hz"): 5.0}
        assert all(type(v) is float for (_, k), v in got.items()
                   if k not in ("float_range", "num_threads"))
        assert nodes[2].limits.max_aspect == 3.0
    finally:
        for n in nodes:
            n.destroy_node()


@pytest.mark.parametrize(("spec", "value", "error"), [
    (ParamSpec("max_aspect", 20.0, ""), "x", "max_aspect='x' is of type str, expected float"),
    (ParamSpec("batch_size", 8, ""), 2.5, "batch_size=2.5 is of type float, expected int"),
    (ParamSpec("publish_scores", False, ""), 1,
     "publish_scores=1 is of type int, expected bool"),
])
def test_other_types_refused_in_one_line(spec, value, error) -> None:
    with pytest.raises(ValueError) as info:
        spec.coerce(value)
    assert str(info.value) == error


def test_ints_for_floats_at_run_time(ros_context) -> None:
    node = activate(SchedulerNode(context=ros_context, parameter_overrides=[
        Parameter("model_card", value=str(CARD)), Parameter("max_budget_ms", value=500)]))
    try:
        assert node.bounds.max_budget_ms == 500.0
        res = node.set_parameters([Parameter("sigma", value=1)])[0]
        assert res.successful and node.get_parameter("sigma").value == 1.0
        assert node.planning.config.sigma == 1.0
        assert not node.set_parameters([Parameter("sigma", value=2)])[0].successful
        assert not node.set_parameters([Parameter("sigma", value="1")])[0].successful
        assert node.get_parameter("sigma").value == 1.0
    finally:
        node.destroy_node()
