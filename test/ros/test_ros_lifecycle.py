"""The nodes are managed (lifecycle) nodes, driven over real rclpy + DDS through their
standard services (`<node>/change_state`, `<node>/get_state`), as `ros2 lifecycle set` and
the lifecycle manager drive them.

Perception walks every transition (configure, activate, deactivate, activate, deactivate,
cleanup, shutdown): frames are answered only while it is active (no image subscription
otherwise: a frame sent while inactive is never answered), and after cleanup it holds no
model (its attributes None, the models collected, the process's resident memory down by at
least the two models' weights: measured; on CUDA the allocator back to where it started).
The scheduler plans and the monitor samples only while active; shutdown works from every
state. The lifecycle manager brings the three nodes up (autostart), resets them (models
freed) and starts them again; a failing configure is named on its diagnostics. Everything
waits on readiness (service answers, subscriptions matched, messages received).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable

import psutil
import pytest

rclpy = pytest.importorskip("rclpy")
import torch  # noqa: E402
from diagnostic_msgs.msg import DiagnosticStatus  # noqa: E402
from helpers import CARD, CONFIG, ROOT, wait_for  # noqa: E402
from helpers.ros import image_msg  # noqa: E402
from lifecycle_msgs.srv import ChangeState, GetState  # noqa: E402
from rclpy.executors import SingleThreadedExecutor  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402
from std_srvs.srv import Trigger  # noqa: E402
from tta_msgs.msg import ClassPrediction, LayerImportance, ResourceTelemetry  # noqa: E402

from tta_ros.bringup import build_nodes  # noqa: E402
from tta_ros.lifecycle import activate  # noqa: E402
from tta_ros.nodes.lifecycle_manager import LifecycleManagerNode  # noqa: E402
from tta_ros.nodes.perception import PerceptionNode  # noqa: E402
from tta_ros.nodes.resource_monitor import ResourceMonitorNode  # noqa: E402
from tta_ros.nodes.scheduler import SchedulerNode  # noqa: E402
from tta_ros.spinning import SpinThread  # noqa: E402

WIDE_CARD = ROOT / "checkpoints" / "resnet18_cifar_w32_signs64.json"  # weights of MiBs
RELIABLE = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
TIMEOUT_S = 60.0


def _call(client, request, timeout_s: float = TIMEOUT_S):
    """`request` on `client` (spun elsewhere); its response."""
    assert client.wait_for_service(timeout_sec=timeout_s), f"no {client.srv_name}"
    future = client.call_async(request)
    assert wait_for(future.done, timeout_s), f"{client.srv_name} not answered"
    return future.result()


class Lifecycle:
    """A node's lifecycle services, called from a probe node."""

    def __init__(self, probe, name: str) -> None:
        self.name = name
        self.change = probe.create_client(ChangeState, f"{name}/change_state")
        self.get = probe.create_client(GetState, f"{name}/get_state")

    def state(self) -> str:
        return _call(self.get, GetState.Request()).current_state.label

    def go(self, transition: str) -> str:
        """Take `transition` (its label); the state it led to."""
        req = ChangeState.Request()
        req.transition.label = transition
        assert _call(self.change, req).success, f"{self.name}: {transition} failed"
        return self.state()


class Stage:
    """Nodes spun in a thread and a probe node (clients, camera, recorders) spun with them."""

    def __init__(self, ctx, *nodes) -> None:
        self.nodes = list(nodes)
        self.probe = rclpy.create_node("lifecycle_probe", context=ctx)
        self.answered: set[int] = set()
        self.probe.create_subscription(ClassPrediction, "predictions",
                                       lambda m: self.answered.add(m.header.stamp.sec),
                                       RELIABLE)
        self.camera = self.probe.create_publisher(Image, "image", qos_profile_sensor_data)
        self.ex = SingleThreadedExecutor(context=ctx)
        for n in [*self.nodes, self.probe]:
            self.ex.add_node(n)
        self.spin = SpinThread(self.ex)

    def lifecycle(self, name: str) -> Lifecycle:
        return Lifecycle(self.probe, name)

    def serve_frame(self, stamp: int) -> None:
        """Send frame `stamp` until it is answered (the camera matched the node first)."""
        assert wait_for(lambda: self.camera.get_subscription_count() > 0, TIMEOUT_S)

        def sent() -> bool:
            self.camera.publish(image_msg(stamp))
            return stamp in self.answered
        assert wait_for(sent, TIMEOUT_S, poll=0.05), f"frame {stamp} unanswered"

    def close(self) -> None:
        self.spin.stop()
        for n in [*self.nodes, self.probe]:
            n.destroy_node()


def _rss_mib() -> float:
    return psutil.Process().memory_info().rss / 2**20


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_perception_walks_every_transition_serving_only_while_active(ros_context, device):
    node = PerceptionNode(context=ros_context, parameter_overrides=[
        Parameter(k, value=v) for k, v in {
            "model_card": str(WIDE_CARD), "device": device, "num_threads": 1,
            "batch_size": 1, "plan_source": "inline"}.items()])
    stage = Stage(ros_context, node)
    life = stage.lifecycle("perception")
    cuda = device == "cuda"
    try:
        assert life.state() == "unconfigured" and node.method is None
        assert node.has_parameter("method.lr")  # declared: settable before configure
        assert node.count_publishers("predictions") == 0  # serving nothing
        gc.collect()
        rss_before = _rss_mib()
        cuda_before = torch.cuda.memory_allocated() if cuda else 0

        assert life.go("configure") == "inactive"
        assert node.method is not None and node.source_model is not None
        assert node.count_publishers("predictions") == 1
        assert stage.camera.get_subscription_count() == 0  # no image subscription yet
        stage.camera.publish(image_msg(1))  # inactive: never answered

        assert life.go("activate") == "active"
        stage.serve_frame(2)
        assert life.go("deactivate") == "inactive"
        assert wait_for(lambda: stage.camera.get_subscription_count() == 0, TIMEOUT_S)
        stage.camera.publish(image_msg(3))  # inactive again: never answered
        assert node.method is not None  # deactivation keeps the (adapted) model
        assert life.go("activate") == "active"
        stage.serve_frame(4)
        assert 1 not in stage.answered and 3 not in stage.answered, stage.answered

        assert life.go("deactivate") == "inactive"
        weights = sum(p.numel() * p.element_size() for p in node.source_model.parameters())
        models = [weakref.ref(node.source_model), weakref.ref(node.method)]
        rss_loaded = _rss_mib()
        cuda_loaded = torch.cuda.memory_allocated() if cuda else 0

        assert life.go("cleanup") == "unconfigured"
        assert node.method is None and node.source_model is None
        assert [ref() for ref in models] == [None, None]  # collected: nothing holds them
        freed_mib = rss_loaded - _rss_mib()
        # the source model and the method's adapted copy, at least
        assert freed_mib >= 2 * weights / 2**20, (rss_before, rss_loaded, freed_mib)
        if cuda:
            assert cuda_loaded > cuda_before + weights
            assert torch.cuda.memory_allocated() <= cuda_before
        assert node.count_publishers("predictions") == 0

        assert life.go("shutdown") == "finalized"
    finally:
        stage.close()


def test_scheduler_plans_and_monitor_samples_only_while_active(ros_context) -> None:
    sched = SchedulerNode(context=ros_context, parameter_overrides=[
        Parameter("model_card", value=str(CARD))])
    mon = ResourceMonitorNode(context=ros_context, parameter_overrides=[
        Parameter("enable_perf", value=False), Parameter("rate_hz", value=20.0)])
    stage = Stage(ros_context, sched, mon)
    telemetry: list[ResourceTelemetry] = []
    stage.probe.create_subscription(ResourceTelemetry, "telemetry", telemetry.append, 10)
    s_life, m_life = stage.lifecycle("scheduler"), stage.lifecycle("resource_monitor")
    try:
        assert s_life.go("configure") == "inactive" and m_life.go("configure") == "inactive"
        lay = sched.layout
        imp = LayerImportance(model_name=lay.model_name, unit_names=lay.unit_names,
                              importance=[1.0] * lay.n_units, forward_ms=5.0, batch_size=4)
        sched._on_importance(imp)  # inactive: no plan
        assert sched.plans_published == 0
        assert mon.timers and all(t.is_canceled() for t in mon.timers)  # inactive
        assert m_life.go("activate") == "active" and s_life.go("activate") == "active"
        assert wait_for(lambda: len(telemetry) >= 2, TIMEOUT_S)
        sched._on_importance(imp)
        assert sched.plans_published == 1
        assert m_life.go("deactivate") == "inactive"
        assert all(t.is_canceled() for t in mon.timers)  # no sampling while inactive
        assert not mon.pub_telemetry.is_activated
        assert m_life.go("cleanup") == "unconfigured" and mon.sampler is None
        assert s_life.go("deactivate") == "inactive" and s_life.go("cleanup") == "unconfigured"
        assert sched.planning is None
        assert s_life.go("configure") == "inactive"  # configured again from the parameters
        assert sched.layout.n_units == lay.n_units
    finally:
        stage.close()


@pytest.mark.parametrize("start", ["unconfigured", "inactive", "active"])
def test_shutdown_from_every_state_frees_what_configure_loaded(ros_context, start) -> None:
    node = PerceptionNode(context=ros_context, parameter_overrides=[
        Parameter("model_card", value=str(CARD)), Parameter("num_threads", value=1)])
    stage = Stage(ros_context, node)
    life = stage.lifecycle("perception")
    try:
        for transition, state in (("configure", "inactive"), ("activate", "active")):
            if life.state() == start:
                break
            assert life.go(transition) == state
        assert life.state() == start
        assert life.go("shutdown") == "finalized"
        assert node.method is None and not node.serving and not node.configured
        assert node._worker is None and node.intake is None
    finally:
        stage.close()


def _trigger(probe, service: str) -> Trigger.Response:
    return _call(probe.create_client(Trigger, service), Trigger.Request(), timeout_s=120.0)


def test_the_lifecycle_manager_brings_the_nodes_up_resets_and_restarts_them(ros_context):
    """bringup's three nodes left unconfigured (autostart false), as launch starts them;
    the manager (on an executor of its own, as in its own process) configures and
    activates them; ~/reset frees perception's model; ~/startup serves again."""
    nodes = build_nodes(CONFIG, {"perception": {"model_card": str(CARD), "num_threads": 1,
                                                "batch_size": 1},
                                 "resource_monitor": {"enable_perf": False}},
                        context=ros_context, autostart=False)
    per = nodes[2]
    stage = Stage(ros_context, *nodes)
    assert all(n.lifecycle_state == "unconfigured" for n in nodes)
    manager = LifecycleManagerNode(context=ros_context)
    ex = SingleThreadedExecutor(context=ros_context)
    ex.add_node(manager)
    spin = SpinThread(ex)
    states: Callable[[], list[str]] = lambda: [n.lifecycle_state for n in nodes]  # noqa: E731
    try:
        assert wait_for(lambda: states() == ["active"] * 3, TIMEOUT_S), states()
        stage.serve_frame(10)
        assert manager.lifecycle_status().level == DiagnosticStatus.OK and not manager.error
        reset = _trigger(stage.probe, "lifecycle_manager/reset")
        assert reset.success, reset.message
        assert states() == ["unconfigured"] * 3 and per.method is None
        start = _trigger(stage.probe, "lifecycle_manager/startup")
        assert start.success and states() == ["active"] * 3, start.message
        stage.serve_frame(11)
        down = _trigger(stage.probe, "lifecycle_manager/shutdown")
        assert down.success and states() == ["finalized"] * 3, down.message
    finally:
        spin.stop()
        manager.destroy_node()
        stage.close()


def test_the_lifecycle_manager_names_a_configure_that_fails(ros_context, tmp_path) -> None:
    """perception with a model card that does not exist: configure fails (the node stays
    unconfigured), the manager stops there and says so; autostart false does nothing."""
    per = PerceptionNode(context=ros_context, parameter_overrides=[
        Parameter("model_card", value=str(tmp_path / "missing.json"))])
    idle = LifecycleManagerNode("idle_manager", context=ros_context, parameter_overrides=[
        Parameter("node_names", value=["perception"]), Parameter("autostart", value=False)])
    stage = Stage(ros_context, per)
    manager = LifecycleManagerNode(context=ros_context, parameter_overrides=[
        Parameter("node_names", value=["perception"])])
    ex = SingleThreadedExecutor(context=ros_context)
    for n in (manager, idle):
        ex.add_node(n)
    spin = SpinThread(ex)
    try:
        assert wait_for(lambda: bool(manager.error), TIMEOUT_S)
        assert manager.error == ("startup: perception: configure failed (the node's log "
                                 "says why)"), manager.error
        st = manager.lifecycle_status()
        assert st.level == DiagnosticStatus.ERROR and "perception: configure failed" in st.message
        assert per.lifecycle_state == "unconfigured"
        assert "missing.json" in str(per.transition_error)
        assert idle.last_command == "" and idle.states == {"perception": "unknown"}
    finally:
        spin.stop()
        for n in (manager, idle):
            n.destroy_node()
        stage.close()


def test_activate_in_process_raises_the_configure_error(ros_context, tmp_path) -> None:
    """In process (bringup, tests) a failed configure is the error itself, not a log line."""
    node = PerceptionNode(context=ros_context, parameter_overrides=[
        Parameter("model_card", value=str(tmp_path / "missing.json"))])
    try:
        with pytest.raises(FileNotFoundError, match=r"missing\.json"):
            activate(node)
        assert node.lifecycle_state == "unconfigured"
    finally:
        node.destroy_node()


@pytest.mark.parametrize(("argv", "state"), [([], "active"), (["--managed"], "unconfigured")])
def test_a_node_started_alone_is_active_unless_managed(ros_context, monkeypatch, argv,
                                                       state) -> None:
    """`ros2 run tta_ros scheduler_node` serves at once; `--managed` (how the launch file
    starts it) leaves it to the lifecycle manager."""
    import functools

    from tta_ros import bringup

    built: list = []
    monkeypatch.setattr(bringup, "run_nodes", lambda prog, build, args: built.extend(build()))
    cls = functools.partial(SchedulerNode, context=ros_context, parameter_overrides=[
        Parameter("model_card", value=str(CARD))])
    bringup.node_main(cls, ["scheduler_node", *argv, "--ros-args", "--log-level", "warn"],
                      prog="scheduler_node")
    try:
        assert [n.lifecycle_state for n in built] == [state]
    finally:
        for n in built:
            n.destroy_node()
