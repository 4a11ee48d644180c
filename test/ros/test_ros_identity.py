"""Who said it: every /diagnostics status of the three nodes names its node (fully
qualified, namespace included) and carries a hardware_id, so two vehicles on one
/diagnostics never collide; the scheduler's RViz markers expire. Real rclpy + DDS."""

from __future__ import annotations

import socket
import time

import pytest

rclpy = pytest.importorskip("rclpy")
from builtin_interfaces.msg import Duration  # noqa: E402
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus  # noqa: E402
from helpers import CARD, CONFIG, wait_for  # noqa: E402
from helpers.ros import Rig, image_msg  # noqa: E402
from rclpy.executors import SingleThreadedExecutor  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402
from tta_msgs.msg import LayerPlan  # noqa: E402

from tta_ros.bringup import load_params, resolve_paths  # noqa: E402
from tta_ros.diagnostics import DiagnosticsPublisher, node_hardware_id, status  # noqa: E402
from tta_ros.lifecycle import activate  # noqa: E402
from tta_ros.nodes.perception import PerceptionNode  # noqa: E402
from tta_ros.nodes.resource_monitor import ResourceMonitorNode  # noqa: E402
from tta_ros.nodes.scheduler import SchedulerNode, plan_markers  # noqa: E402
from tta_ros.spinning import SpinThread  # noqa: E402

NODES = (("resource_monitor", ResourceMonitorNode), ("scheduler", SchedulerNode),
         ("perception", PerceptionNode))
EXTRA = {"perception": {"num_threads": 1}, "resource_monitor": {"enable_perf": False}}


def _statuses_of_three(ctx, namespace: str, common: dict) -> dict[str, list[DiagnosticStatus]]:
    """Start the three nodes (params from vehicle.yaml + `common`) in `namespace`, collect
    /diagnostics until each has published; {node fully qualified name: its statuses}."""
    params = load_params(CONFIG)
    cli = ["--ros-args", "-r", f"__ns:={namespace}"] if namespace else None
    nodes = [activate(cls(name, context=ctx, cli_args=cli, parameter_overrides=[
        Parameter(k, value=v) for k, v in resolve_paths(
            {**params[name], "model_card": str(CARD), **EXTRA.get(name, {}), **common}).items()]))
        for name, cls in NODES]
    probe = rclpy.create_node("diag_probe", context=ctx)
    got: list[DiagnosticStatus] = []
    probe.create_subscription(DiagnosticArray, "/diagnostics",
                              lambda a: got.extend(a.status), 50)
    ex = SingleThreadedExecutor(context=ctx)
    for n in [*nodes, probe]:
        ex.add_node(n)
    spin = SpinThread(ex)
    fqns = [n.get_fully_qualified_name() for n in nodes]
    try:
        wait_for(lambda: all(any(s.name.startswith(f"{f}: ") for s in list(got))
                             for f in fqns), 10.0)
    finally:
        spin.stop()  # after the running callback: no callback on a destroyed node
        for n in [*nodes, probe]:
            n.destroy_node()
    return {f: [s for s in got if s.name.startswith(f"{f}: ")] for f in fqns}


def test_statuses_name_their_node_and_default_to_the_hostname(ros_context) -> None:
    by_node = _statuses_of_three(ros_context, "", {})
    assert list(by_node) == ["/resource_monitor", "/scheduler", "/perception"]
    for fqn, sts in by_node.items():
        assert sts, f"no status from {fqn}"
        assert {s.hardware_id for s in sts} == {socket.gethostname()}, fqn
    subsystems = {f: {s.name.split(": ", 1)[1] for s in sts} for f, sts in by_node.items()}
    assert {"input", "planning", "adaptation"} <= subsystems["/perception"]
    assert subsystems["/scheduler"] == {"planning"}
    assert {"cpu", "memory", "sources", "expansion"} <= subsystems["/resource_monitor"]


def test_namespace_and_hardware_id_parameter(ros_context) -> None:
    by_node = _statuses_of_three(ros_context, "/car1", {"hardware_id": "car1-ecu"})
    assert list(by_node) == ["/car1/resource_monitor", "/car1/scheduler", "/car1/perception"]
    for fqn, sts in by_node.items():
        assert sts and {s.hardware_id for s in sts} == {"car1-ecu"}, fqn
        assert all(s.name.startswith(f"{fqn}: ") and s.name.count(": ") == 1 for s in sts)


def test_publisher_qualifies_once_and_empty_id_means_hostname(ros_context) -> None:
    node = rclpy.create_node("bare", namespace="veh", context=ros_context,
                             parameter_overrides=[Parameter("hardware_id", value="")],
                             automatically_declare_parameters_from_overrides=True)
    try:
        pub = DiagnosticsPublisher(node)
        assert node_hardware_id(node) == pub.hardware_id == socket.gethostname()
        st = pub.qualified(status("input", 0, "ok", {"x": 1.5}))
        assert (st.name, st.hardware_id) == ("/veh/bare: input", socket.gethostname())
        assert pub.qualified(st).name == st.name  # already qualified: unchanged
        assert [(kv.key, kv.value) for kv in st.values] == [("x", "1.5")]
    finally:
        node.destroy_node()


def test_plan_markers_carry_the_lifetime() -> None:
    plan = LayerPlan(plan_id=3, unit_names=["a", "b"], importance=[0.2, 1.0],
                     update=[True, False])
    for lifetime, want in ((2.0, Duration(sec=2)), (0.25, Duration(nanosec=250_000_000)),
                           (0.0, Duration())):
        arr = plan_markers(plan, "tta", 0.3, 2.0, lifetime)
        assert len(arr.markers) == 4 and all(m.lifetime == want for m in arr.markers)


def test_scheduler_markers_expire_after_marker_lifetime_s(ros_context) -> None:
    rig = Rig(ros_context, scheduler={"marker_lifetime_s": 1.5})
    try:
        rig.send([image_msg(1000 + i) for i in range(8)])
        assert wait_for(lambda: rig.msgs("markers"), 20.0)
        time.sleep(0.1)
        for arr in rig.msgs("markers"):
            assert all(m.lifetime == Duration(sec=1, nanosec=500_000_000)
                       for m in arr.markers)
    finally:
        rig.close()
