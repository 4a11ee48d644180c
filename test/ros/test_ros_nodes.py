"""The three tta nodes over real rclpy + DDS (no ROS mocks), built by tta_ros.bringup.

Synthetic camera frames go in on `image`; the tests check what comes out on the real topics.
Model: the shipped small_resnet 32 px checkpoint.
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

rclpy = pytest.importorskip("rclpy")
from diagnostic_msgs.msg import DiagnosticStatus  # noqa: E402
from helpers import CARD, wait_for  # noqa: E402
from helpers.ros import Rig, image_msg, send_until  # noqa: E402
from rclpy.executors import SingleThreadedExecutor  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402
from tta_msgs.msg import (  # noqa: E402
    AdaptationStatus,
    LayerImportance,
    LayerPlan,
    ResourceTelemetry,
)
from visualization_msgs.msg import Marker  # noqa: E402

from tta_core.io.image_msg import array_to_image_fields  # noqa: E402
from tta_ros.lifecycle import activate  # noqa: E402
from tta_ros.nodes.perception_support import PlanGate  # noqa: E402
from tta_ros.nodes.scheduler import SchedulerNode  # noqa: E402
from tta_ros.spinning import SpinThread  # noqa: E402


@pytest.fixture
def rig_factory(ros_context):
    rigs: list[Rig] = []

    def make(**kw) -> Rig:
        rigs.append(Rig(ros_context, **kw))
        return rigs[-1]
    yield make
    for r in rigs:
        r.close()


def test_stream_predictions_status_plans_markers_telemetry(rig_factory) -> None:
    rig = rig_factory()
    imgs = [image_msg(1000 + i, None, "bgr8" if i % 2 else "rgb8", nanosec=7 * i, pad=3 * (i % 3))
            for i in range(24)]
    rig.send(imgs)
    assert wait_for(lambda: len(rig.msgs("pred")) >= 24, 20.0)
    time.sleep(0.3)
    preds = rig.msgs("pred")
    stamps = [(p.header.stamp.sec, p.header.stamp.nanosec) for p in preds]
    assert sorted(stamps) == [(1000 + i, 7 * i) for i in range(24)]  # one per image, same stamp
    assert all(p.header.frame_id == "camera_front" and 0 <= p.label < 64 for p in preds)
    statuses = rig.msgs("status")
    assert sorted(s.batch_id for s in statuses) == sorted({p.batch_id for p in preds})
    assert len(rig.msgs("imp")) == len(statuses)
    names = rig.perception.unit_names
    assert all(list(m.unit_names) == names and len(m.importance) == len(names)
               for m in rig.msgs("imp"))
    plans = {p.plan_id: p for p in rig.msgs("plan")}
    assert plans and all(list(p.unit_names) == names for p in plans.values())
    echoed = [s for s in statuses if s.plan_id != 0]
    assert echoed, "no batch ran on a plan from layer_plan"
    for s in echoed:  # the echoed plan exists and answers an earlier batch
        assert s.plan_id in plans and plans[s.plan_id].based_on_batch_id < s.batch_id
        assert s.units_updated == sum(plans[s.plan_id].update)
    arr = rig.msgs("markers")[-1]
    assert arr.markers[0].action == Marker.DELETEALL
    assert all(m.lifetime.sec == 2 for m in arr.markers)  # vehicle.yaml marker_lifetime_s
    cubes = [m for m in arr.markers if m.type == Marker.CUBE]
    assert len(cubes) == len(names)
    labels = [m for m in arr.markers if m.type == Marker.TEXT_VIEW_FACING]
    assert len(labels) == 1 and "budget" in labels[0].text
    assert wait_for(lambda: len(rig.statuses("resource_monitor")) >= 5, 3.0)
    subsystems = {s.name.split(": ")[1] for s in rig.statuses("resource_monitor")}
    assert {"cpu", "memory", "thermal", "gpu", "cache"} <= subsystems
    tel = rig.msgs("tel")
    assert len(tel) >= 5 and 0 <= tel[-1].cpu_percent <= 100 and tel[-1].mem_total_mb > 0
    assert np.isnan(tel[-1].cache_hit_rate)  # perf disabled: unknown is NaN, not 0


def test_bad_frames_rejected_next_good_frame_served(rig_factory) -> None:
    rig = rig_factory(perception={"batch_size": 1})
    nan_img = np.full((8, 8, 3), 0.5, dtype=np.float32)
    nan_img[1, 2, 0] = np.nan
    nan_msg = Image(**array_to_image_fields(nan_img, "32FC3"))
    bad = [
        (Image(height=4, width=4, encoding="nv21", step=8, data=bytes(32)), "nv21"),
        (Image(height=0, width=4, encoding="rgb8", step=12, data=b""), "height=0"),
        (Image(height=4, width=4, encoding="rgb8", step=5, data=bytes(20)), "step=5"),
        (nan_msg, "non-finite"),
    ]
    for i, (msg, _) in enumerate(bad):
        msg.header.stamp.sec = 1 + i
    rig.send([m for m, _ in bad] + [image_msg(1099)], gap_s=0.05)
    assert wait_for(lambda: len(rig.msgs("pred")) >= 1, 10.0)
    time.sleep(0.3)
    assert [p.header.stamp.sec for p in rig.msgs("pred")] == [1099]
    errors = [s for s in rig.statuses("perception: input") if s.level == DiagnosticStatus.ERROR]
    for _, needle in bad:
        assert any(needle in s.message for s in errors), needle
    assert rig.perception.counters.rejected == 4


def _stream(rig: Rig, stop: threading.Event) -> None:
    i = 0
    while not stop.is_set():
        rig.pub.publish(image_msg(1000 + i, size=32))
        i += 1
        time.sleep(0.03)


class _StoppedClockGate(PlanGate):
    """perception's PlanGate on a clock that stands still until the test moves it
    (`now`, s): when plans go stale is then decided by the test, not by the wall clock."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(timeout_s)
        self.now = 0.0

    def on_plan(self, plan, now=None) -> None:
        super().on_plan(plan, self.now)

    def on_importance_sent(self, now=None) -> None:
        super().on_importance_sent(self.now)

    def stale(self, now=None) -> bool:
        return super().stale(self.now)

    def current(self, now=None):
        return super().current(self.now)

    def silent_for(self, now=None) -> float:
        return super().silent_for(self.now)


def test_scheduler_killed_inline_after_plan_timeout_then_resumes(rig_factory, ros_context):
    """Plans stop: perception keeps the last plan until an importance has waited
    feed_timeout_s for an answer (not at 0.9x of it), then plans inline from the next batch
    on (at 1.2x) and says so on /diagnostics; a new scheduler's plans are used again. The
    gate's clock is the test's (_StoppedClockGate): the wall clock only bounds the waits."""
    rig = rig_factory(perception={"batch_size": 2, "feed_timeout_s": 0.5})
    timeout = rig.perception.planning.gate.timeout_s
    assert timeout == 0.5
    gate = rig.perception.planning.gate = _StoppedClockGate(timeout)  # before any frame is sent
    stop = threading.Event()
    th = threading.Thread(target=_stream, args=(rig, stop), daemon=True)
    th.start()

    def statuses() -> list:
        return rig.msgs("status")

    def since(n: int, k: int) -> bool:  # k more statuses after the first n
        return len(statuses()) >= n + k

    try:
        assert wait_for(lambda: any(s.plan_id for s in statuses()), 15.0)
        first = next(i for i, s in enumerate(statuses()) if s.plan_id)
        killed: list[int] = []

        def kill() -> None:  # on the executor thread, so no scheduler callback is running
            rig.ex.remove_node(rig.scheduler)
            rig.scheduler.destroy_node()
            killed.append(len(statuses()))

        rig.ex.create_task(kill)
        assert wait_for(lambda: bool(killed), 5.0)
        # the clock stands: the last plan stays in use, however long the wall clock runs
        assert wait_for(lambda: since(killed[0], 3), 10.0)
        assert gate.waiting_since == 0.0  # an importance is waiting for its plan
        gate.now = 0.9 * timeout  # not stale yet
        n = len(statuses())
        assert wait_for(lambda: since(n, 3), 10.0)
        assert all(s.plan_id for s in statuses()[first:]), "inline before feed_timeout_s"
        inline_before = rig.perception.planning.inline_batches  # those before the 1st plan
        assert not [s for s in rig.statuses("perception: planning")
                    if s.level == DiagnosticStatus.WARN and "inline" in s.message]
        before = rig.perception.counters.batches  # a batch running now may keep its plan
        gate.now = 1.2 * timeout
        assert wait_for(lambda: any(s.plan_id == 0 and s.batch_id > before
                                    for s in statuses()), 10.0)
        inline = [s.batch_id for s in statuses() if s.plan_id == 0 and s.batch_id > before]
        assert min(inline) <= before + 2  # the next batch that chooses its plan
        assert all(s.plan_id for s in statuses()[first:] if s.batch_id <= before)
        assert rig.perception.planning.inline_batches > inline_before
        warn = [s for s in rig.statuses("perception: planning")
                if s.level == DiagnosticStatus.WARN and "inline" in s.message]
        assert warn and f"timeout {timeout:g} s" in warn[0].message
        n_plans = len(rig.msgs("plan"))
        new = activate(SchedulerNode(context=ros_context, parameter_overrides=[
            Parameter("model_card", value=str(CARD))]))
        rig.nodes.append(new)
        rig.ex.add_node(new)
        n = len(statuses())
        assert wait_for(lambda: any(s.plan_id != 0 for s in statuses()[n:]), 10.0)
        assert len(rig.msgs("plan")) > n_plans
        assert wait_for(lambda: any(
            s.level == DiagnosticStatus.OK and "plans resumed" in s.message
            for s in rig.statuses("perception: planning")), 5.0)
    finally:
        stop.set()
        th.join()


def test_burst_drops_frames_with_bounded_queue(rig_factory) -> None:
    """A burst far beyond the processing rate while the worker is held (as a slow step
    would hold it): the intake stops taking frames at its backlog (2 batches), so memory
    stays bounded; the frames in between are lost upstream (DDS keeps the newest) and every
    one of them is counted as dropped, from the publisher's sequence numbers; when the
    worker resumes, the newest frame is among those served. No rate is assumed."""
    rig = rig_factory(perception={"batch_size": 1, "queue_size": 4, "batch_timeout_s": 0.0,
                                  "plan_source": "inline"})
    rig.send([image_msg(1000 + i, size=32) for i in range(3)], gap_s=0.05)
    assert wait_for(lambda: len(rig.msgs("status")) >= 3, 10.0)
    q, node = rig.perception.queue, rig.perception
    served0, dropped0 = len(rig.msgs("pred")), q.dropped
    sizes: list[int] = []
    with node.params.pending_lock:  # the worker stops at its next _apply_pending
        time.sleep(0.2)
        for k in range(40):
            rig.pub.publish(image_msg(1010 + k, size=32))
            time.sleep(0.01)
            sizes.append(len(q))
        time.sleep(0.3)
        assert len(q) == 2 and max(sizes) <= 2  # the backlog: 2 batches of 1 frame
    assert wait_for(lambda: len(rig.msgs("pred")) - served0 + q.dropped - dropped0 >= 40, 10.0)
    time.sleep(0.3)
    preds = rig.msgs("pred")[served0:]
    assert len(preds) + q.dropped - dropped0 == 40  # every burst frame: served or counted
    assert 2 < len(preds) < 40  # the held backlog, then the newest ones DDS kept
    assert max(p.header.stamp.sec for p in preds) == 1049  # the newest frame was served
    assert rig.msgs("status")[-1].frames_dropped == q.dropped


def test_parameters_validated_and_applied_at_run_time(rig_factory) -> None:
    rig = rig_factory(perception={"plan_source": "inline"})
    node = rig.perception
    for name, value, needle in (("method.sigma", 10.5, "10.5"),
                                ("method.sigma", -0.1, "-0.1"), ("method.lr", -1.0, "-1.0"),
                                ("method.momentum", 1.0, "momentum=1.0"),
                                ("method.mode", "fast", "'fast'"),
                                ("batch_size", 0, "batch_size"),
                                ("batch_size", 1000, "batch_size"),
                                ("method", "nope", "nope"), ("plan_source", "bus", "bus"),
                                ("model_card", "/x.json", "model_card")):
        res = node.set_parameters([Parameter(name, value=value)])[0]
        assert not res.successful and needle in res.reason, (name, value, res.reason)
    assert node.get_parameter("method.sigma").value == pytest.approx(0.33)
    ok = node.set_parameters([Parameter("method.sigma", value=0.2),
                              Parameter("method.lr", value=0.01)])
    assert all(r.successful for r in ok)
    assert wait_for(lambda: node.method.config.sigma == pytest.approx(0.2), 2.0)
    assert wait_for(lambda: node.method.config.lr == pytest.approx(0.01), 2.0)
    rig.send([image_msg(1000 + i) for i in range(4)])
    assert wait_for(lambda: len(rig.msgs("status")) >= 1, 10.0)
    # the new lr is applied at the next batch, scaled linearly for its size (1..4 frames)
    allowed = [0.01 * b / 64 for b in range(1, 5)]
    assert all(any(g["lr"] == pytest.approx(a) for a in allowed)
               for g in node.method.optimizer.param_groups)
    st = rig.msgs("status")[-1]
    assert st.predicted_total_ms <= st.budget_ms + 1e-3 or st.units_updated == 0
    assert node.set_parameters([Parameter("method", value="tent")])[0].successful
    assert wait_for(lambda: type(node.method).__name__.lower() == "tent", 5.0)
    rig.send([image_msg(1010 + i) for i in range(4)])
    assert wait_for(lambda: any(s.method == "tent" for s in rig.msgs("status")), 10.0)


def test_divergence_guard_resets_method(rig_factory) -> None:
    rig = rig_factory(perception={"reset_entropy_ratio": 0.0, "reset_patience": 2,
                                  "plan_source": "inline"})
    rig.send([image_msg(1000 + i) for i in range(16)])
    assert wait_for(lambda: len(rig.msgs("status")) >= 4, 15.0)
    flags = [s.reset for s in sorted(rig.msgs("status"), key=lambda s: s.batch_id)]
    assert flags[:4] == [False, True, False, True]  # every 2nd batch over a 0-nats limit


def test_resource_monitor_calibration_fills_expansion(ros_context, tmp_path) -> None:
    from tta_core.adashadow.predictor import Calibration, compute_expansion
    from tta_ros.nodes.resource_monitor import ResourceMonitorNode, expansion_status

    cal = {"f_slope": 0.5, "f_intercept": 0.0, "b_ratio": 4.0, "freq_offline_mhz": None,
           "cache_hit_offline": None}  # an old file: no n_off / probe / threads keys
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"schema": "tta.calibration/1", "calibration": cal}))
    off = [Parameter("enable_perf", value=False), Parameter("enable_nvml", value=False),
           Parameter("enable_jtop", value=False)]
    plain = activate(ResourceMonitorNode(context=ros_context, parameter_overrides=off))
    node = activate(ResourceMonitorNode("rm_cal", context=ros_context, parameter_overrides=[
        *off, Parameter("calibration", value=str(path)), Parameter("torch_threads", value=2),
        Parameter("bandwidth_probe", value=True)]))
    paper = activate(ResourceMonitorNode("rm_paper", context=ros_context, parameter_overrides=[
        *off, Parameter("calibration", value=str(path)),
        Parameter("expansion_model", value="paper")]))
    try:
        for n in (plain, node, paper):
            n._on_sample()
        assert np.isnan(plain.last_sample.compute_expansion)
        assert expansion_status(plain.sampler).level == DiagnosticStatus.OK  # none: absent
        # default "share" model, T = 2 torch threads, C = the cores, n_off = 0 (old file)
        s = node.last_sample
        n = s.competing_processes if np.isfinite(s.competing_processes) else 0.0
        cores = node.expansion.cores
        assert (node.expansion.model, node.expansion.threads) == ("share", 2)
        share = max(1.0, (n + 2) / cores) / max(1.0, 2 / cores)
        assert s.compute_expansion == pytest.approx(share) and s.compute_expansion >= 1.0
        assert s.memory_expansion == pytest.approx(share)  # no counters, no probe: 1 * s(n)
        # the probe was asked for, but the old file has no probe reference: WARN, not run
        assert node.sampler.probe is None and "probe_bw_offline_gbs" in node.probe_note
        st = expansion_status(node.sampler, node.probe_note)
        vals = {kv.key: kv.value for kv in st.values}
        assert st.level == DiagnosticStatus.WARN and vals["model"] == "share"
        assert vals["pi2_source"] == "none" and "share" in st.message
        s = paper.last_sample
        n = s.competing_processes if np.isfinite(s.competing_processes) else 0.0
        want = compute_expansion(s.cpu_freq_mhz, n, Calibration(f_slope=0.5, b_ratio=4.0))
        assert s.compute_expansion == pytest.approx(want) and s.memory_expansion == 1.0
        assert expansion_status(paper.sampler).level == DiagnosticStatus.OK
    finally:
        for n in (plain, node, paper):
            n.destroy_node()
    with pytest.raises(ValueError, match="calibration="):
        activate(ResourceMonitorNode("rm_bad", context=ros_context, parameter_overrides=[
            *off, Parameter("calibration", value=str(tmp_path / "missing.json"))]))
    from rclpy.exceptions import InvalidParameterValueException

    # choices are checked by the node, ranges by rclpy already at declaration
    for name, value in (("expansion_model", "linear"), ("torch_threads", -1)):
        with pytest.raises((ValueError, InvalidParameterValueException), match=name):
            activate(ResourceMonitorNode("rm_bad", context=ros_context, parameter_overrides=[
                *off, Parameter(name, value=value)]))


def _exchange(ros_context, node: SchedulerNode, tel: ResourceTelemetry | None,
              imp: LayerImportance) -> LayerPlan:
    """Publish telemetry (if any), then `imp`, over DDS; return the plan answering it."""
    probe = rclpy.create_node("fake_perception", context=ros_context)
    rel = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
    got: list[LayerPlan] = []
    probe.create_subscription(LayerPlan, "layer_plan", got.append, rel)
    pub_imp = probe.create_publisher(LayerImportance, "layer_importance", rel)
    pub_tel = probe.create_publisher(ResourceTelemetry, "telemetry", 10)
    ex = SingleThreadedExecutor(context=ros_context)
    for nd in (node, probe):
        ex.add_node(nd)
    try:
        deadline = time.monotonic() + 10.0
        while tel is not None and node.telemetry is None and time.monotonic() < deadline:
            pub_tel.publish(tel)
            ex.spin_once(timeout_sec=0.05)
        while not got and time.monotonic() < deadline:
            if pub_imp.get_subscription_count() > 0 and probe.count_subscribers(
                    "layer_plan") >= 1:
                pub_imp.publish(imp)
            ex.spin_once(timeout_sec=0.05)
            ex.spin_once(timeout_sec=0.05)
        assert got, "no plan received"
        return got[0]
    finally:
        ex.shutdown()
        probe.destroy_node()


@pytest.mark.parametrize("feedback", ["memory", "uniform", "off"])
def test_scheduler_publishes_the_planning_services_plan(ros_context, tmp_path,
                                                         feedback: str) -> None:
    """Importance and telemetry (pi1 = 2) in over DDS: the published LayerPlan is exactly
    the plan of a standalone PlanningService (tta_core, no ROS) given the same input."""
    from tta_core.adashadow.planning import PlanningConfig, PlanningService, layout_from_card
    from tta_core.adashadow.predictor import UnitProfile

    layout = layout_from_card(CARD)
    n = layout.n_units
    eta = np.where(np.arange(n) % 2 == 0, 4.0, 0.25)
    prof = UnitProfile(model="small_resnet", device="cpu", batch_size=4,
                       input_shape=(3, 32, 32), unit_names=layout.unit_names,
                       w_ms=np.linspace(0.1, 0.3, n), x_ms=np.full(n, 0.1),
                       r_ms=np.full(n, 0.3), eta=eta, forward_ms=0.3 * n)
    prof.save(tmp_path / "p.json")
    node = activate(SchedulerNode(context=ros_context, parameter_overrides=[
        Parameter("model_card", value=str(CARD)),
        Parameter("profile", value=str(tmp_path / "p.json")),
        Parameter("forward_feedback", value=feedback), Parameter("sigma", value=0.6),
        Parameter("fixed_cost_feedback", value=0.0)]))
    imp = LayerImportance(unit_names=layout.unit_names, model_name=layout.model_name,
                          importance=np.random.default_rng(1).random(n).tolist(),
                          batch_size=4, forward_ms=2.5 * 0.3 * n, batch_id=7)
    try:
        msg = _exchange(ros_context, node, ResourceTelemetry(
            compute_expansion=2.0, memory_expansion=1.0), imp)
    finally:
        node.destroy_node()
    svc = PlanningService(layout, PlanningConfig(sigma=0.6, forward_feedback=feedback,
                                                 fixed_cost_feedback=0.0), prof)
    svc.set_expansion(2.0, 1.0)
    want = svc.plan(np.asarray(imp.importance), imp.forward_ms,
                    candidates=layout.trainable("norm"))  # the scheduler's default
    assert list(msg.update) == want.plan.update.tolist() and any(msg.update)
    assert msg.based_on_batch_id == 7 and msg.first_updated_index == want.plan.first_updated
    np.testing.assert_allclose(msg.predicted_unit_ms, want.unit_ms, rtol=1e-6)
    assert msg.budget_ms == pytest.approx(want.plan.budget_ms, rel=1e-6)
    assert msg.predicted_total_ms == pytest.approx(want.plan.predicted_total_ms, rel=1e-6)
    offline = PlanningService(layout, svc.config, prof).plan(np.asarray(imp.importance),
                                                             imp.forward_ms)
    if feedback == "off":  # telemetry reached the plan: Eq. 4 at pi1 = 2
        np.testing.assert_allclose(msg.predicted_unit_ms,
                                   offline.unit_ms * (2 * eta + 1) / (eta + 1), rtol=1e-6)


def _profiled_scheduler(ros_context, tmp_path, *params: Parameter) -> SchedulerNode:
    """A scheduler on the shipped card with a flat profile (w 0.2, x 0.1, r 0.3 ms)."""
    from tta_core.adashadow.predictor import UnitProfile

    probe = activate(SchedulerNode(context=ros_context, parameter_overrides=[
        Parameter("model_card", value=str(CARD))]))
    names = probe.layout.unit_names
    probe.destroy_node()
    n = len(names)
    UnitProfile(model="small_resnet", device="cpu", batch_size=4, input_shape=(3, 32, 32),
                unit_names=names, w_ms=np.full(n, 0.2), x_ms=np.full(n, 0.1),
                r_ms=np.full(n, 0.3), eta=np.ones(n), forward_ms=0.3 * n,
                ).save(tmp_path / "p.json")
    return activate(SchedulerNode(context=ros_context, parameter_overrides=[
        Parameter("model_card", value=str(CARD)),
        Parameter("profile", value=str(tmp_path / "p.json")),
        Parameter("forward_feedback", value="uniform"), Parameter("sigma", value=0.8),
        *params]))


def test_scheduler_corrects_backward_times_by_the_status_perception_reports(
        ros_context, tmp_path) -> None:
    """An AdaptationStatus received over DDS for one of our plans (plan_id echoed) feeds its
    measured backward_ms back: the next plan's unit times grow by the EMA of measured /
    predicted; a repeated status, or one for a plan we never made, changes nothing."""
    node = _profiled_scheduler(ros_context, tmp_path, Parameter("backward_feedback", value=0.5))
    n = len(node.layout.unit_names)
    try:
        imp = LayerImportance(unit_names=node.layout.unit_names, importance=[1.0] * n,
                              model_name=node.layout.model_name,
                              batch_size=4, forward_ms=0.3 * n)
        predicted = node.plan_for(imp).predicted_backward_ms
        node._on_importance(imp)  # plan 1
        assert predicted > 0
        fb = node.planning.backward_fb
        send_until(ros_context, node, lambda: fb.updates > 0, [
            AdaptationStatus(plan_id=1, adapted=True, backward_ms=4.0 * predicted),
            AdaptationStatus(plan_id=77, adapted=True, backward_ms=1e6)])
        assert fb.updates == 1
        assert fb.factor == pytest.approx(2.0)  # exp(0.5 * ln 4)
        np.testing.assert_allclose(node.plan_for(imp).unit_ms, np.full(n, 0.3 * 2.0),
                                   rtol=1e-6)
    finally:
        node.destroy_node()


def test_scheduler_leaves_room_for_the_fixed_costs_perception_reports(
        ros_context, tmp_path) -> None:
    """Statuses of our plans teach the plan phase (plan_ms) and the update's fixed cost
    (backward + reforward beyond the per-unit prediction); the next plan's T_f and its
    fixed cost include them, so T grows by exactly their sum."""
    node = _profiled_scheduler(ros_context, tmp_path, Parameter("backward_feedback", value=0.0),
                               Parameter("fixed_cost_feedback", value=1.0))
    n = len(node.layout.unit_names)
    try:
        imp = LayerImportance(unit_names=node.layout.unit_names, importance=[1.0] * n,
                              model_name=node.layout.model_name,
                              batch_size=4, forward_ms=0.3 * n)
        out = node.plan_for(imp)
        before = out.plan
        for _ in range(2):  # plans 1 (the warm-up sample) and 2
            node._on_importance(imp)
        assert before.update.any()
        per_unit = out.predicted_backward_ms + out.predicted_reforward_ms
        assert per_unit == pytest.approx(before.predicted_total_ms - 0.3 * n)
        fixed = node.planning.fixed
        send_until(ros_context, node, lambda: fixed.adapt_updates >= 2, [
            AdaptationStatus(plan_id=pid, adapted=True, forward_ms=0.3 * n, plan_ms=2.0,
                             backward_ms=per_unit, reforward_ms=1.5) for pid in (1, 2)])
        assert fixed.adapt_updates == 2 and fixed.plan_updates == 2
        assert fixed.plan_phase_ms == pytest.approx(2.0)
        assert fixed.overhead_ms == pytest.approx(1.5)
        after = node.plan_for(imp).plan
        assert after.full_ms == pytest.approx(before.full_ms + 2.0 + 1.5)
        assert after.predicted_total_ms <= after.budget_ms
    finally:
        node.destroy_node()


def test_scheduler_warns_when_no_unit_fits_the_budget(ros_context, tmp_path) -> None:
    """A budget below forward + the cheapest update: empty plans and a WARN saying to raise
    sigma; a budget with room: OK again."""
    node = _profiled_scheduler(ros_context, tmp_path)
    n = len(node.layout.unit_names)
    try:
        imp = LayerImportance(unit_names=node.layout.unit_names, importance=[1.0] * n,
                              model_name=node.layout.model_name,
                              batch_size=4, forward_ms=0.3 * n)
        node.set_parameters([Parameter("sigma", value=0.05)])
        node._on_importance(imp)
        st = node._planning_status()
        assert st.level == DiagnosticStatus.WARN and "raise sigma" in st.message
        node.set_parameters([Parameter("sigma", value=0.8)])
        node._on_importance(imp)
        st = node._planning_status()
        assert st.level == DiagnosticStatus.OK and node.no_room == ""
    finally:
        node.destroy_node()


def test_perception_warns_when_inline_plans_have_no_room(rig_factory) -> None:
    """sigma so small that no unit fits after the forward: batches still served, planning
    status WARNs with the fix; a sigma with room clears it."""
    rig = rig_factory(perception={"plan_source": "inline", "method.sigma": 0.01})
    rig.send([image_msg(1000 + i) for i in range(8)])
    assert wait_for(lambda: len(rig.msgs("status")) >= 2, 10.0)
    assert all(s.units_updated == 0 for s in rig.msgs("status"))
    plan = next(s for s in rig.perception.statuses() if s.name.endswith("planning"))
    assert plan.level == DiagnosticStatus.WARN and "raise sigma" in plan.message
    assert rig.perception.set_parameters([Parameter("method.sigma", value=1.0)])[0].successful
    n = len(rig.msgs("status"))
    rig.send([image_msg(1020 + i) for i in range(8)])
    assert wait_for(lambda: any(s.units_updated > 0 for s in rig.msgs("status")[n:]), 10.0)
    plan = next(s for s in rig.perception.statuses() if s.name.endswith("planning"))
    assert plan.level == DiagnosticStatus.OK


def test_parallel_status_carries_the_backward_of_its_update(rig_factory) -> None:
    """Parallel mode: predictions go out after the forward; the batch's status waits for
    the background update and carries its backward time (the scheduler learns from it)."""
    rig = rig_factory(perception={"plan_source": "inline", "method.sigma": 1.0,
                                  "method.mode": "parallel"})
    rig.send([image_msg(1000 + i) for i in range(12)])
    assert wait_for(lambda: len(rig.msgs("status")) >= 3, 20.0)
    adapted = [s for s in rig.msgs("status") if s.adapted]
    assert adapted and all(s.mode == "parallel" for s in adapted)
    assert all(s.backward_ms > 0 and s.reforward_ms == 0 for s in adapted)


def test_telemetry_topic_reaches_inline_planning(ros_context) -> None:
    """Perception planning inline takes pi1/pi2 from the `telemetry` topic (NaN -> 1) for
    its next batches, and goes back to offline factors when telemetry is older than
    feed_timeout_s."""
    from tta_ros.nodes.perception import PerceptionNode

    node = activate(PerceptionNode(context=ros_context, parameter_overrides=[
        Parameter("model_card", value=str(CARD)), Parameter("plan_source", value="inline"),
        Parameter("batch_size", value=2), Parameter("feed_timeout_s", value=0.5),
        Parameter("num_threads", value=1)]))
    probe = rclpy.create_node("fake_monitor", context=ros_context)
    pub_tel = probe.create_publisher(ResourceTelemetry, "telemetry", 10)
    pub_img = probe.create_publisher(Image, "image", qos_profile_sensor_data)
    ex = SingleThreadedExecutor(context=ros_context)
    for nd in (node, probe):
        ex.add_node(nd)
    spin = SpinThread(ex)
    try:
        assert wait_for(lambda: pub_img.get_subscription_count() > 0, 5.0)
        tel = ResourceTelemetry(compute_expansion=2.0, memory_expansion=float("nan"))
        i = 0

        def fed(want: tuple) -> bool:
            nonlocal i
            if want[2]:  # live wanted: keep telemetry coming; offline: let it go stale
                pub_tel.publish(tel)
            pub_img.publish(image_msg(1000 + i))
            i += 1
            return node.method.expansion == want

        assert wait_for(lambda: fed((2.0, 1.0, True)), 10.0)
        assert wait_for(lambda: fed((1.0, 1.0, False)), 10.0)  # no telemetry for > 0.5 s
    finally:
        spin.stop()  # after the running callback: no callback on a destroyed node
        node.destroy_node()
        probe.destroy_node()


def _forged_plans(rig: Rig) -> list[tuple[str, LayerPlan]]:
    """(the field its diagnostic must name, a forged LayerPlan) for perception's model."""
    names = rig.perception.unit_names
    n = len(names)
    conv = int(np.flatnonzero(~rig.perception.method.trainable)[0])
    base = {"model_name": rig.perception.model_name, "unit_names": names,
            "update": [False] * n, "first_updated_index": n, "sigma": 0.3, "budget_ms": 5.0}
    cases = [("not trainable", {"update": [i == conv for i in range(n)],
                                "first_updated_index": conv}),
             ("model_name", {"model_name": "other_net"}),
             ("budget_ms", {"budget_ms": float("nan")}),
             ("sigma", {"sigma": float("-inf")}),
             ("update has", {"update": [True] * (n + 3)}),
             ("unit_names", {"unit_names": names[:3]})]
    return [(needle, LayerPlan(plan_id=900 + i, **{**base, **kw}))
            for i, (needle, kw) in enumerate(cases)]


def test_forged_plans_and_importance_never_stop_service(rig_factory) -> None:
    """Each forged LayerPlan is ignored with a diagnostic naming the bad field and each
    forged LayerImportance is refused by the scheduler (WARN); the next valid frame is
    answered within 2 s every time."""
    rig = rig_factory()
    rel = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
    pub_plan = rig.probe.create_publisher(LayerPlan, "layer_plan", rel)
    pub_imp = rig.probe.create_publisher(LayerImportance, "layer_importance", rel)
    assert wait_for(lambda: pub_plan.get_subscription_count() > 0, 5.0)
    rig.send([image_msg(1000 + i) for i in range(8)])
    assert wait_for(lambda: len(rig.msgs("pred")) >= 8, 20.0)
    names, model = rig.perception.unit_names, rig.perception.model_name
    forged_imp = [("forward_ms", LayerImportance(model_name=model, unit_names=names,
                                                 importance=[1.0] * len(names),
                                                 forward_ms=3e38, batch_size=4)),
                  ("batch_size", LayerImportance(model_name=model, unit_names=names,
                                                 importance=[1.0] * len(names),
                                                 forward_ms=5.0, batch_size=0)),
                  ("importance[0]", LayerImportance(model_name=model, unit_names=names,
                                                    importance=[float("nan")] * len(names),
                                                    forward_ms=5.0, batch_size=4))]
    for k, (needle, msg) in enumerate(_forged_plans(rig) + forged_imp):
        (pub_plan if isinstance(msg, LayerPlan) else pub_imp).publish(msg)
        node = "perception" if isinstance(msg, LayerPlan) else "scheduler"
        assert wait_for(lambda n=node, s=needle: any(
            s in st.message and st.level == DiagnosticStatus.WARN
            for st in rig.statuses(f"{n}: planning")), 5.0), needle
        seen = len(rig.msgs("pred"))
        t0 = time.monotonic()
        rig.send([image_msg(1100 + k)])
        assert wait_for(lambda s=seen: len(rig.msgs("pred")) > s, 2.0), needle
        assert time.monotonic() - t0 < 2.0
    assert rig.perception.counters.step_errors == 0


def test_a_plan_that_fails_is_served_inline(rig_factory) -> None:
    """A topic plan that passes the checks but makes the step fail: the batch is served
    inline at once, the plan is dropped with a WARN, and the next plans apply again."""
    rig = rig_factory()
    rig.send([image_msg(1000 + i) for i in range(8)])
    assert wait_for(lambda: any(s.plan_id for s in rig.msgs("status")), 20.0)
    method, broken = rig.perception.method, {"left": 1}
    step = method.step

    def failing_step(x, plan=None):
        if plan is not None and broken["left"] > 0:
            broken["left"] -= 1
            raise RuntimeError("simulated plan failure")
        return step(x, plan=plan)

    method.step = failing_step
    seen = len(rig.msgs("pred"))
    rig.send([image_msg(1050 + i) for i in range(4)])
    assert wait_for(lambda: len(rig.msgs("pred")) >= seen + 4, 20.0)
    assert broken["left"] == 0 and rig.perception.counters.step_errors == 0
    assert any("simulated plan failure" in s.message and "inline" in s.message
               for s in rig.statuses("perception: planning"))
    rig.send([image_msg(1060 + i) for i in range(8)])
    n = len(rig.msgs("status"))
    assert wait_for(lambda: any(s.plan_id for s in rig.msgs("status")[n:]), 10.0)
