"""Fleet mode over real rclpy + DDS: one scheduler chooses the sizes of two namespaced
perception pipelines (/cam1 at 30 Hz, /cam2 at 10 Hz) from the tta_msgs/FleetReport each
publishes on its `fleet_report` topic and sets them (method.keep) through SetParameters;
each perception node applies its size (Resizable)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

rclpy = pytest.importorskip("rclpy")
from helpers import CARD, ROOT, wait_for  # noqa: E402
from rclpy.executors import SingleThreadedExecutor  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402
from rclpy.qos import qos_profile_sensor_data  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402
from tta_msgs.msg import ClassPrediction, FleetReport  # noqa: E402

from tta_core.api import Resizable, StepResult  # noqa: E402
from tta_core.elasticdnn.fleet import equal_split, plan_fleet  # noqa: E402
from tta_core.io.image_msg import array_to_image_fields  # noqa: E402
from tta_core.methods.source import Source  # noqa: E402
from tta_core.registry import _REGISTRY, register  # noqa: E402
from tta_core.runtime.deadline import DeadlineConfig  # noqa: E402
from tta_core.runtime.method import MethodConfig  # noqa: E402
from tta_core.runtime.options import option  # noqa: E402
from tta_ros.diagnostics import OK, WARN  # noqa: E402
from tta_ros.lifecycle import activate  # noqa: E402
from tta_ros.nodes.fleet_wiring import REPORT_TOPIC, app_from_report  # noqa: E402
from tta_ros.nodes.perception import PerceptionNode  # noqa: E402
from tta_ros.nodes.scheduler import SchedulerNode  # noqa: E402
from tta_ros.spinning import SpinThread  # noqa: E402

CAMS = {"/cam1": 30.0, "/cam2": 10.0}  # camera_hz
PRIOR = {1.0: 0.9, 0.5: 0.8, 0.25: 0.6}  # source accuracy per size


@dataclass
class SizedConfig(MethodConfig, DeadlineConfig):
    """The sized test method's options: the deadline ones (camera_hz: the report's rate)
    and the size to pin."""

    keep: float | None = option(None, "size to serve (None: the method's own)", low=0.0,
                                high=1.0)


class SizedSource(Source):
    """The source model behind the Resizable protocol: larger sizes answer with sharper
    logits (more confident); fixed per-size forward times."""

    config_cls = SizedConfig
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


def _perception(ctx, ns: str, hz: float, method: str, calibration: Path) -> PerceptionNode:
    params = {"model_card": str(CARD), "method": method, "batch_size": 2, "num_threads": 1,
              "method.camera_hz": hz, "reset_patience": 100000,
              "fleet_calibration": str(calibration)}
    return activate(PerceptionNode("perception", context=ctx, cli_args=["--ros-args", "-r",
                                                               f"__ns:={ns}"],
                          parameter_overrides=[Parameter(k, value=v) for k, v in params.items()]))


def test_fleet_sizes_reach_each_namespaced_perception_node(ros_context, sized_method,
                                                           tmp_path) -> None:
    cal = tmp_path / "calibration.json"
    cal.write_text(json.dumps({"confidence": [0.0, 1.0], "accuracy": [0.0, 1.0],
                               "prior": {str(k): v for k, v in PRIOR.items()}}))
    perc = {ns: _perception(ros_context, ns, hz, sized_method, cal) for ns, hz in CAMS.items()}
    sched = activate(SchedulerNode("fleet_scheduler", context=ros_context, parameter_overrides=[
        Parameter("model_card", value=str(CARD)),
        Parameter("fleet_namespaces", value=list(CAMS)),
        Parameter("fleet_capacity", value=0.25), Parameter("fleet_period_s", value=0.2)]))
    probe = rclpy.create_node("probe", context=ros_context)
    pubs = {ns: probe.create_publisher(Image, f"{ns}/image", qos_profile_sensor_data)
            for ns in CAMS}
    ex = SingleThreadedExecutor(context=ros_context)
    nodes = [*perc.values(), sched, probe]
    for n in nodes:
        ex.add_node(n)
    spin = SpinThread(ex)
    rng = np.random.default_rng(0)

    def frames() -> None:
        for pub in pubs.values():
            pub.publish(Image(**array_to_image_fields(
                rng.random((32, 32, 3)).astype(np.float32), "rgb8")))

    try:
        assert isinstance(perc["/cam1"].method, Resizable)
        assert perc["/cam1"].fleet.pub.topic_name == f"/cam1/{REPORT_TOPIC}"

        def applied() -> bool:
            plan = sched.fleet.last
            return plan is not None and all(
                p.get_parameter("method.keep").value == plan[ns]
                and p.method.keep == plan[ns] for ns, p in perc.items())

        assert wait_for(applied, 40.0, frames), (sched.fleet.waiting, sched.fleet.error,
                                                 sched.fleet.last)
        # what the scheduler received over DDS: one FleetReport per namespace
        assert set(sched.fleet.reports) == set(CAMS)
        assert all(isinstance(msg, FleetReport) for _, msg in sched.fleet.reports.values())
        report = sched.fleet.reports["/cam2"][1]
        assert list(report.sizes) == [1.0, 0.5, 0.25] and report.batch_size == 2
        assert report.hz == 10.0 and report.header.stamp.sec > 0
        apps = sched.fleet.apps()
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
            fleet = [s for s in p.statuses() if s.name == "fleet"]
            assert fleet and dict((k.key, k.value) for k in fleet[0].values)["keep"] \
                == f"{sched.fleet.last[ns]:.6g}"
        st = sched.fleet.statuses()[0]
        assert st.level == OK and "2 pipelines" in st.message
        res = perc["/cam1"].set_parameters([Parameter("method.keep", value=0.6)])[0]
        assert not res.successful and "method.keep=0.6 is no size" in res.reason
    finally:
        spin.stop()  # after the running callback: no callback on a destroyed node
        for n in nodes:
            n.destroy_node()


def test_non_resizable_method_has_no_size_to_set(ros_context) -> None:
    """A method that is not Resizable has no method.keep: a fleet scheduler's size is
    refused, and the node sends no fleet report."""
    node = activate(PerceptionNode("perception", context=ros_context, parameter_overrides=[
        Parameter("model_card", value=str(CARD)), Parameter("method", value="source")]))
    try:
        assert not node.has_parameter("method.keep")
        with pytest.raises(rclpy.exceptions.ParameterNotDeclaredException):
            node.set_parameters([Parameter("method.keep", value=0.5)])
        assert node.fleet.proxy is None and node.fleet.report() is None
        assert not [s for s in node.statuses() if s.name == "fleet"]
    finally:
        node.destroy_node()


def test_scheduler_waits_for_every_pipeline(ros_context) -> None:
    sched = activate(SchedulerNode("fleet_scheduler", context=ros_context, parameter_overrides=[
        Parameter("model_card", value=str(CARD)),
        Parameter("fleet_namespaces", value=["/a", "/b"])]))
    try:
        assert sched.fleet.step() is None and "/a: no fleet report" in sched.fleet.waiting
        assert sched.fleet.statuses()[0].level == WARN
        off = activate(SchedulerNode("plain", context=ros_context,
                            parameter_overrides=[Parameter("model_card", value=str(CARD))]))
        assert off.fleet.namespaces == [] and off.fleet.statuses() == []
        off.destroy_node()
    finally:
        sched.destroy_node()


def test_app_from_report_refuses_incomplete_reports() -> None:
    full = FleetReport(sizes=[1.0, 0.7], forward_ms=[10.0, 5.0], accuracy=[0.9, 0.8],
                       hz=30.0, deadline_ms=66.0, batch_size=2)
    app = app_from_report("/x", full)
    assert app.batch_size == 2 and [o.keep for o in app.options] == [1.0, 0.7]
    full.accuracy = [math.nan, math.nan]
    with pytest.raises(ValueError, match="no forward time or accuracy estimate"):
        app_from_report("/x", full)
    with pytest.raises(ValueError, match="unreadable"):
        app_from_report("/x", FleetReport(sizes=[1.0]))


def test_perception_fleet_records_served_and_probed_sizes(ros_context, sized_method) -> None:
    import torch

    from tta_core.model.source import load_source
    from tta_core.registry import build_method
    from tta_ros.nodes.fleet_wiring import PerceptionFleet

    node = rclpy.create_node("fleet_probe", context=ros_context)
    settings = {"keep": 0.5, "camera_hz": 20.0, "batch_size": 4}
    try:
        method = build_method(sized_method, load_source(CARD)[0])
        fleet = PerceptionFleet(node, "", lambda: settings)
        fleet.attach(method)
        assert method.keep == 0.5  # pinned when attached
        logits = torch.log(torch.tensor([[0.8, 0.2], [0.6, 0.4]]))  # mean confidence 0.7
        fleet.on_batch({"size": 0.5, "confidence@0.25": 0.4}, logits)
        assert fleet.proxy.accuracy() == pytest.approx({0.25: 0.4, 0.5: 0.7, 1.0: 0.7})
        msg = fleet.report()
        assert list(msg.sizes) == [1.0, 0.5, 0.25]
        assert list(msg.accuracy) == pytest.approx([0.7, 0.7, 0.4])
        assert list(msg.forward_ms) == [20.0, 9.0, 4.0] and msg.deadline_ms == 200.0
        assert msg.keep == 0.5 and msg.served == 0.5  # what the batch was served at
        kv = {k.key: k.value for k in fleet.statuses()[0].values}
        assert kv == {"keep": "0.5", "served": "0.5"}
        del settings["camera_hz"]  # a Resizable method without the deadline options
        assert fleet.report() is None and "no camera_hz" in fleet.statuses()[0].message
    finally:
        node.destroy_node()


def test_elastic_on_the_gated_card_serves_the_pinned_size(ros_context) -> None:
    """The shipped gated master in a perception node (method elastic): it answers frames
    (no unit decomposition of a GatedModel is needed) and serves the size pinned by
    method.keep, which its fleet report gives as `served`."""
    gated = ROOT / "checkpoints" / "small_resnet_signs32_elastic.json"
    node = activate(PerceptionNode("perception", context=ros_context, parameter_overrides=[
        Parameter(k, value=v) for k, v in {
            "model_card": str(gated), "method": "elastic", "method.lr": 0.0,
            "batch_size": 2, "num_threads": 1, "method.camera_hz": 20.0,
            "method.deadline_mode": "camera", "reset_patience": 100000,
            "method.keep": 0.5}.items()]))
    probe = rclpy.create_node("probe", context=ros_context)
    pub = probe.create_publisher(Image, "/image", qos_profile_sensor_data)
    got, reports = [], []
    probe.create_subscription(ClassPrediction, "/predictions", got.append, 100)
    probe.create_subscription(FleetReport, f"/{REPORT_TOPIC}", reports.append, 10)
    ex = SingleThreadedExecutor(context=ros_context)
    for n in (node, probe):
        ex.add_node(n)
    spin = SpinThread(ex)
    rng = np.random.default_rng(0)

    def frame() -> None:
        pub.publish(Image(**array_to_image_fields(
            rng.random((32, 32, 3)).astype(np.float32), "rgb8")))

    try:
        assert node.unit_names == [] and isinstance(node.method, Resizable)
        assert wait_for(lambda: len(got) >= 4 and node.fleet.served == 0.5, 30.0, frame)
        assert wait_for(lambda: any(r.served == 0.5 for r in reports), 5.0)
        msg = reports[-1]
        assert msg.keep == 0.5 and list(msg.sizes) == [1.0, 0.7, 0.5, 0.3]
        assert all(math.isfinite(v) for v in msg.forward_ms)
    finally:
        spin.stop()  # after the running callback: no callback on a destroyed node
        for n in (node, probe):
            n.destroy_node()


def test_elastic_options_are_parameters_of_the_node() -> None:
    """`method.warmup_runs` is an option of elastic (how many forwards per size its warm-up
    times), reaches its config, and is no option of tent."""
    from tta_core.model.source import load_source
    from tta_core.registry import build_method
    from tta_ros.nodes.method_params import MethodOptions

    opts = MethodOptions("elastic", {"method.warmup_runs": 7})
    assert opts.values["method.warmup_runs"] == 7 and opts.check(opts.values) == ""
    assert "method.warmup_runs" not in MethodOptions("tent").params
    model = load_source(ROOT / "checkpoints" / "small_resnet_signs32_elastic.json")[0]
    assert build_method("elastic", model, **opts.config()).config.warmup_runs == 7


# ---------------------------------------------------------------- the paper objective
# two pipelines, sizes 1.0 / 0.5, 10 Hz, batch 1: loads 0.5 / 0.2 each, capacity 0.75 (one
# may run full). The proxy favours /a at full size; retraining gains only /b at full
# size (Ã), so over a t_max window the paper objective gives /b the full size instead.
PLANTED = {
    "/a": {"forward_ms": [50.0, 20.0], "accuracy": [0.9, 0.6], "retrain_ms": [100.0, 40.0],
           "accuracy_before": [0.9, 0.6], "accuracy_after": [0.9, 0.6]},
    "/b": {"forward_ms": [50.0, 20.0], "accuracy": [0.8, 0.6], "retrain_ms": [100.0, 40.0],
           "accuracy_before": [0.8, 0.6], "accuracy_after": [0.95, 0.6]},
}
T_MAX, CAPACITY, SIZES2 = 20.0, 0.75, [1.0, 0.5]


def _brute_force(paper: bool) -> dict[str, float]:
    """Every size pair: forward load within the capacity; confidence = sum of proxies;
    paper = sum over apps of (A tau + Ã (t_max - tau)) / t_max, tau = T / lambda,
    lambda = keep / sum of keeps, tau <= t_max."""
    import itertools

    best, best_val = None, -math.inf
    for ja, jb in itertools.product(range(2), repeat=2):
        pick = {"/a": ja, "/b": jb}
        if sum(10.0 * PLANTED[ns]["forward_ms"][j] / 1000 for ns, j in pick.items()) > CAPACITY:
            continue
        total = sum(SIZES2[j] for j in pick.values())
        val = 0.0
        for ns, j in pick.items():
            p = PLANTED[ns]
            if not paper:
                val += p["accuracy"][j]
                continue
            tau = p["retrain_ms"][j] / 1000 / (SIZES2[j] / total)
            assert tau <= T_MAX
            val += (p["accuracy_before"][j] * tau
                    + p["accuracy_after"][j] * (T_MAX - tau)) / T_MAX
        if val > best_val:
            best, best_val = {ns: SIZES2[j] for ns, j in pick.items()}, val
    return best


def _report(ns: str, paper_fields: bool) -> FleetReport:
    p = PLANTED[ns]
    msg = FleetReport(sizes=SIZES2, forward_ms=p["forward_ms"], accuracy=p["accuracy"],
                      hz=10.0, deadline_ms=100.0, batch_size=1, keep=0.0, served=math.nan)
    if paper_fields:
        msg.retrain_ms, msg.accuracy_before = p["retrain_ms"], p["accuracy_before"]
        msg.accuracy_after = p["accuracy_after"]
    return msg


class _Warnings:
    """The node's logger, counting its warnings."""

    def __init__(self, logger) -> None:
        self.logger, self.lines = logger, []

    def warning(self, msg: str, **kw) -> None:
        self.lines.append(msg)
        self.logger.warning(msg, **kw)

    def __getattr__(self, name: str):
        return getattr(self.logger, name)


def test_paper_objective_plans_with_the_received_retraining_estimates(ros_context) -> None:
    """Planted FleetReports over DDS: under fleet_objective paper the scheduler falls back
    to the confidence plan (one log line) while the reports lack T, A, Ã, and plans the
    brute-force paper optimum once they carry them; confidence again when switched back."""
    conf, paper = _brute_force(False), _brute_force(True)
    assert conf == {"/a": 1.0, "/b": 0.5} and paper == {"/a": 0.5, "/b": 1.0}  # they differ
    sched = activate(SchedulerNode("fleet_scheduler", context=ros_context, parameter_overrides=[
        Parameter("model_card", value=str(CARD)),
        Parameter("fleet_namespaces", value=list(PLANTED)),
        Parameter("fleet_capacity", value=CAPACITY), Parameter("fleet_period_s", value=0.05),
        Parameter("fleet_objective", value="paper"), Parameter("fleet_t_max_s", value=T_MAX)]))
    log = _Warnings(sched.get_logger())
    sched.get_logger = lambda: log
    probe = rclpy.create_node("probe", context=ros_context)
    pubs = {ns: probe.create_publisher(FleetReport, f"{ns}/{REPORT_TOPIC}", 10)
            for ns in PLANTED}
    ex = SingleThreadedExecutor(context=ros_context)
    for n in (sched, probe):
        ex.add_node(n)
    spin = SpinThread(ex)
    fields = {"on": False}

    def publish() -> None:
        for ns, pub in pubs.items():
            pub.publish(_report(ns, fields["on"]))

    def planned(sizes: dict[str, float], objective: str) -> Callable[[], bool]:
        plans = sched.fleet.plans

        def done() -> bool:  # a plan made after the call, with these sizes
            last = sched.fleet.last
            return (sched.fleet.plans > plans + 1 and last is not None
                    and dict(last) == sizes and sched.fleet.objective == objective)
        return done

    try:
        assert wait_for(planned(conf, "confidence"), 20.0, publish), sched.fleet.waiting
        assert "no retraining time T" in sched.fleet.fallback
        fleet_warnings = [ln for ln in log.lines if "fleet_objective paper" in ln]
        assert len(fleet_warnings) == 1, log.lines  # said once, though planned many times
        received = sched.fleet.reports["/b"][1]
        assert list(received.retrain_ms) == [] and list(received.accuracy_after) == []
        fields["on"] = True
        assert wait_for(planned(paper, "paper"), 20.0, publish), (sched.fleet.last,
                                                                  sched.fleet.fallback)
        received = sched.fleet.reports["/b"][1]  # the new fields arrived over DDS
        assert list(received.retrain_ms) == [100.0, 40.0]
        assert list(received.accuracy_after) == pytest.approx([0.95, 0.6])
        assert sched.fleet.fallback == "" and sched.fleet.last.retrain_shares == \
            pytest.approx({"/a": 1 / 3, "/b": 2 / 3})
        kv = {k.key: k.value for k in sched.fleet.statuses()[0].values}
        assert kv["objective"] == "paper" and "fallback" not in kv
        sched.set_parameters([Parameter("fleet_objective", value="confidence")])
        assert wait_for(planned(conf, "confidence"), 20.0, publish)
        bad = sched.set_parameters([Parameter("fleet_objective", value="oracle")])[0]
        assert not bad.successful and "oracle" in bad.reason
    finally:
        spin.stop()  # after the running callback: no callback on a destroyed node
        for n in (sched, probe):
            n.destroy_node()


class RetrainingSource(SizedSource):
    """SizedSource that also retrains (api.Retrains): planted T and representation."""

    RETRAIN_MS: ClassVar[dict[float, float]] = {1.0: 300.0, 0.5: 120.0, 0.25: math.nan}

    def size_retrain_ms(self) -> dict[float, float]:
        return dict(self.RETRAIN_MS)

    def domain_representation(self) -> np.ndarray | None:
        return np.array([1.0, 2.0])


def test_perception_fleet_reports_retraining_time_and_eq5_7_estimates(ros_context,
                                                                      tmp_path) -> None:
    """The report's T per size is the method's (tta_core.api.Retrains), A and Ã the Eq. 5-7
    estimates from the calibration file's past domains: one past domain at distance 0
    (all the weight) gives A = (proxy + its before) / 2, Ã = (min(proxy + its gain, 1) +
    its after) / 2; without past domains they are NaN."""
    import torch

    from tta_core.model.source import load_source
    from tta_core.registry import build_method
    from tta_ros.nodes.fleet_wiring import PerceptionFleet

    register("fleet_retrain_test")(RetrainingSource)
    cal = tmp_path / "calibration.json"
    past = {"representation": [1.0, 2.0], "before": {"1.0": 0.8, "0.5": 0.6, "0.25": 0.4},
            "after": {"1.0": 0.9, "0.5": 0.8, "0.25": 0.4}}
    cal.write_text(json.dumps({"confidence": [0.0, 1.0], "accuracy": [0.0, 1.0],
                               "past": [past]}))
    node = rclpy.create_node("fleet_probe", context=ros_context)
    settings = {"keep": 0.5, "camera_hz": 20.0, "batch_size": 4}
    try:
        method = build_method("fleet_retrain_test", load_source(CARD)[0])
        fleet = PerceptionFleet(node, str(cal), lambda: settings)
        fleet.attach(method)
        logits = torch.log(torch.tensor([[0.8, 0.2], [0.6, 0.4]]))  # mean confidence 0.7
        fleet.on_batch({"size": 0.5, "confidence@0.25": 0.4, "confidence@1.0": 0.95}, logits)
        msg = fleet.report()
        assert list(msg.accuracy) == pytest.approx([0.95, 0.7, 0.4])
        assert list(msg.retrain_ms[:2]) == [300.0, 120.0] and math.isnan(msg.retrain_ms[2])
        assert list(msg.accuracy_before) == pytest.approx([(0.95 + 0.8) / 2, (0.7 + 0.6) / 2,
                                                           (0.4 + 0.4) / 2])
        assert list(msg.accuracy_after) == pytest.approx([(1.0 + 0.9) / 2, (0.9 + 0.8) / 2,
                                                          (0.4 + 0.4) / 2])
        bare = PerceptionFleet(node, "", lambda: settings)  # no past domains: unknown
        bare.attach(method)
        bare.on_batch({"size": 0.5}, logits)
        msg = bare.report()
        assert all(math.isnan(v) for v in [*msg.accuracy_before, *msg.accuracy_after])
        with pytest.raises(ValueError, match="no retraining time T"):
            app_from_report("/x", msg, paper=True)
    finally:
        _REGISTRY.pop("fleet_retrain_test", None)
        node.destroy_node()


def test_fleet_report_plausibility_of_the_paper_fields() -> None:
    """Empty (an older sender) or one value per size, NaN allowed (unknown); a wrong
    length or an out-of-range value is refused, naming the field."""
    from tta_ros.nodes.plausibility import Bounds, Implausible, check_fleet_report

    b = Bounds()
    msg = _report("/b", False)
    check_fleet_report(msg, b)  # no paper fields
    msg = _report("/b", True)
    msg.retrain_ms = [math.nan, 40.0]
    check_fleet_report(msg, b)
    msg.accuracy_after = [0.9]
    with pytest.raises(Implausible, match="accuracy_after has 1 values for 2 sizes"):
        check_fleet_report(msg, b)
    msg.accuracy_after, msg.retrain_ms = [0.9, 0.6], [100.0, -1.0]
    with pytest.raises(Implausible, match=r"retrain_ms\[1\]"):
        check_fleet_report(msg, b)
