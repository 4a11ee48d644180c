"""Several cameras, one computer (ElasticDNN §III-C): the ROS side of tta_core.elasticdnn.fleet.

Perception side (`PerceptionFleet`): with a method that serves several sizes
(tta_core.api.Resizable, e.g. elastic) the option `method.keep` (None / 0: the method's own
choice) pins the served size through Resizable.set_size, also after a method rebuild. The
label-free accuracy proxy (`SizeProxy`): every batch's mean max-softmax confidence,
recorded for the size it was served at (StepResult.stats['size']; a method that probes
other sizes on the batch may add stats['confidence@<keep>']), mapped to accuracy by
`fleet_calibration` (a JSON file with the confidence -> accuracy knots and, optional, the
source accuracy per size, `prior`, which moves the estimate to sizes not seen yet). Once
per second the node publishes a tta_msgs/FleetReport on `fleet_report` (in its namespace):
the sizes, the predicted forward per size (Resizable.size_forward_ms, per batch), the
proxy accuracy per size, the camera rate (method.camera_hz), one batch's deadline, the
batch size, the pinned size and the size the last batch was served at (what a fleet
scheduler's choice became), and what the paper objective needs: per size the retraining
time T (tta_core.api.Retrains.size_retrain_ms) and the accuracy before / after
retraining A, Ã (tta_core.elasticdnn.accuracy_estimate.AccuracyHistory.label_free, Eq. 5-7,
on the method's domain representation and the past domains of the calibration file's
`past`; NaN without them); /diagnostics keeps a one-line summary (`<ns>/perception:
fleet`). A Resizable method without the deadline options (no camera_hz) sends no report
and says so there.

Scheduler side (`FleetScheduler`, the scheduler node's fleet mode): with `fleet_namespaces`
set (e.g. ['/car1/front', '/car1/rear']) it subscribes to `<ns>/fleet_report` of each,
plans every `fleet_period_s` (tta_core.elasticdnn.fleet.plan_fleet within
`fleet_capacity`, maximising `fleet_objective`: confidence = the sum of the accuracy
proxies, paper = Eq. 8-11 over the retraining window `fleet_t_max_s`, which falls back to
confidence, saying so once in the log, while a report lacks T, A or Ã; or the equal split
with `fleet_policy: equal_split`) and sets each chosen
size on `<ns>/<fleet_node>` through the standard rcl_interfaces SetParameters service
(parameter `method.keep`). A pipeline whose report is missing or older than
`fleet_timeout_s` holds the plan back (its diagnostics say which).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

from diagnostic_msgs.msg import DiagnosticStatus
from rcl_interfaces.msg import ParameterDescriptor
from rcl_interfaces.srv import SetParameters
from rclpy.node import Node
from rclpy.parameter import Parameter
from rclpy.qos import QoSProfile, ReliabilityPolicy
from tta_msgs.msg import FleetReport

from tta_core.api import Resizable, Retrains
from tta_core.elasticdnn.accuracy_estimate import AccuracyHistory
from tta_core.elasticdnn.fleet import (
    App,
    AppOption,
    ConfidenceCalibration,
    FleetPlan,
    Objective,
    SizeProxy,
    equal_split,
    mean_confidence,
    plan_fleet,
)
from tta_ros import ros_params
from tta_ros.diagnostics import OK, WARN, status
from tta_ros.nodes.plausibility import check_fleet_report
from tta_ros.ros_params import ParamSpec

FLEET_STATUS = "fleet"
REPORT_TOPIC = "fleet_report"
KEEP_PARAM = "method.keep"  # the perception parameter a fleet scheduler sets
NAMESPACES_PARAM = "fleet_namespaces"  # the scheduler's, declared by FleetScheduler
PROBE_PREFIX = "confidence@"  # StepResult.stats key of a probed size's mean confidence
REPORT_QOS = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE)
PERCEPTION_FLEET_PARAMS: tuple[ParamSpec, ...] = (
    ParamSpec("fleet_calibration", "", "JSON of the confidence -> accuracy calibration of "
              "the fleet report's accuracy proxy ({'confidence': [...], 'accuracy': [...], "
              "'prior': {keep: source accuracy}, 'past': [{'representation': [...], "
              "'before': {keep: accuracy}, 'after': {keep: accuracy}}]}, past: labelled "
              "domains for the Eq. 5-7 estimates); '': the confidence itself",
              read_only=True),
)
SCHEDULER_FLEET_PARAMS: tuple[ParamSpec, ...] = (
    ParamSpec("fleet_capacity", 1.0, "fleet mode: processor-seconds per second the "
              "pipelines share (sum of hz / batch_size * forward_ms / 1000)", 0.001, 1024.0),
    ParamSpec("fleet_period_s", 1.0, "fleet mode: plan every this many seconds", 0.05, 3600.0,
              read_only=True),
    ParamSpec("fleet_timeout_s", 5.0, "fleet mode: a pipeline's report older than this "
              "holds the plan back", 0.1, 3600.0),
    ParamSpec("fleet_policy", "plan", "fleet mode: plan = the exhaustive best under "
              "fleet_objective, equal_split = each pipeline 1/N of the capacity (baseline)",
              choices=("plan", "equal_split")),
    ParamSpec("fleet_objective", "confidence", "fleet mode, policy plan: confidence = the "
              "sum of the accuracy proxies, paper = ElasticDNN Eq. 8-11 (accuracy over the "
              "retraining window with the reports' T, A, Ã; confidence while one lacks them)",
              choices=("confidence", "paper")),
    ParamSpec("fleet_t_max_s", 20.0, "fleet mode, paper objective: the retraining window "
              "t_max, seconds", 0.01, 86400.0),
    ParamSpec("fleet_node", "perception", "fleet mode: name of the perception node in each "
              "namespace (whose method.keep is set)", read_only=True),
)


def batch_deadline_ms(p: Mapping[str, Any]) -> float:
    """One batch's deadline from the batch size and the deadline options: fixed -> deadline_ms
    (times the batch for per-frame deadlines); otherwise the camera's: batch / camera_hz."""
    b = int(p["batch_size"])
    if p.get("deadline_mode") == "fixed":
        return float(p["deadline_ms"]) * (b if p.get("deadline_per") == "frame" else 1)
    return b * 1000.0 / float(p["camera_hz"])


def load_calibration(path: str) -> tuple[ConfidenceCalibration, dict[float, float], list]:
    """(calibration, prior, past domain records) from a fleet_calibration file ('' ->
    identity, no prior, no past); ValueError naming the file when it cannot be used."""
    if not path:
        return ConfidenceCalibration.identity(), {}, []
    try:
        d = json.loads(open(ros_params.resolve_data_path(path)).read())
        prior = {float(k): float(v) for k, v in d.get("prior", {}).items()}
        past = d.get("past", [])
        if not isinstance(past, list):
            raise ValueError(f"'past' must be a list, got {type(past).__name__}")
        return ConfidenceCalibration.from_dict(d), prior, past
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(f"fleet_calibration {path!r}: {exc}") from None


class PerceptionFleet:
    """The perception node's size pin and fleet report (module docstring)."""

    def __init__(self, node: Node, calibration: str,
                 settings: Callable[[], Mapping[str, Any]]) -> None:
        """`settings()`: the node's batch_size and the method's options (keep, camera_hz,
        deadline_*), read at each report and rebuild."""
        self.node, self.settings = node, settings
        self.calibration, self.prior, self.past = load_calibration(calibration)
        self.method: Any = None
        self.proxy: SizeProxy | None = None
        self.history: AccuracyHistory | None = None  # past domains (Eq. 5-7)
        self.served = math.nan  # the size the last batch was served at
        self.pub = node.create_publisher(FleetReport, REPORT_TOPIC, REPORT_QOS)

    @property
    def keep(self) -> float | None:
        """The pinned size (method.keep); None: the method's own choice."""
        return self.settings().get("keep") or None

    def attach(self, method: Any) -> None:
        """A (re)built method: a proxy for its sizes, and the pinned size set on it."""
        self.method, self.served = method, math.nan
        self.proxy = (SizeProxy(method.sizes(), self.calibration, prior=self.prior)
                      if isinstance(method, Resizable) else None)
        self.history = None
        if self.proxy is not None and self.past:
            try:
                self.history = AccuracyHistory.from_records(self.past, method.sizes())
            except ValueError as exc:
                self.node.get_logger().warning(f"fleet_calibration: no Eq. 5-7 estimates: "
                                               f"{exc}")
        if self.proxy is not None and self.keep is not None:
            try:
                method.set_size(self.keep)
            except ValueError as exc:
                self.node.get_logger().warning(f"{KEEP_PARAM} not applied: {exc}")

    def on_batch(self, stats: Mapping[str, Any], logits: Any) -> None:
        """Record the batch's mean confidence for the size it was served at (the method's
        stats['size'] when it reports one, else the pinned size, else the full model),
        and any per-size confidences the method probed (stats['confidence@<keep>'])."""
        if self.proxy is None:
            return
        served = stats.get("size", stats.get("keep", self.keep or max(self.proxy.sizes)))
        self.served = float(served)
        self.proxy.observe(self.served, mean_confidence(logits))
        for key, value in stats.items():
            if key.startswith(PROBE_PREFIX):
                self.proxy.observe(float(key[len(PROBE_PREFIX):]), float(value))

    def missing(self) -> str:
        """Why no report can be made ('' when one can, or when the method is no fleet
        member)."""
        if self.proxy is None or "camera_hz" in self.settings():
            return ""
        return (f"method {getattr(self.method, 'name', '?')} has no camera_hz option: "
                f"no fleet report (its frame rate and deadline are unknown)")

    def report(self) -> FleetReport | None:
        """The current FleetReport (header unset); None when the method is not Resizable
        or lacks the deadline options."""
        method, proxy, s = self.method, self.proxy, self.settings()
        if proxy is None or not isinstance(method, Resizable) or self.missing():
            return None
        fwd, acc = method.size_forward_ms(), proxy.accuracy()
        sizes = sorted(proxy.sizes, reverse=True)
        retrain = method.size_retrain_ms() if isinstance(method, Retrains) else {}
        before, after = self.estimates(method, [acc[k] for k in sizes])
        return FleetReport(
            sizes=[float(k) for k in sizes],
            forward_ms=[float(fwd.get(k, math.nan)) for k in sizes],
            accuracy=[float(acc[k]) for k in sizes], hz=float(s["camera_hz"]),
            deadline_ms=batch_deadline_ms(s), batch_size=int(s["batch_size"]),
            keep=float(self.keep or 0.0), served=self.served,
            retrain_ms=[float(retrain.get(k, math.nan)) for k in sizes],
            accuracy_before=[float(v) for v in before],
            accuracy_after=[float(v) for v in after])

    def estimates(self, method: Any, proxy: list[float]) -> tuple[list[float], list[float]]:
        """(A, Ã) per size, largest first (AccuracyHistory.label_free); NaN without past
        domains or without the method's domain representation."""
        rep = method.domain_representation() if isinstance(method, Retrains) else None
        if self.history is None or rep is None:
            return [math.nan] * len(proxy), [math.nan] * len(proxy)
        try:
            a, b = self.history.label_free(rep, proxy)
        except ValueError:  # a representation of another shape than the past domains'
            return [math.nan] * len(proxy), [math.nan] * len(proxy)
        return a.tolist(), b.tolist()

    def publish(self) -> None:
        """Publish the report, stamped now (nothing when there is none)."""
        msg = self.report()
        if msg is not None:
            msg.header.stamp = self.node.get_clock().now().to_msg()
            self.pub.publish(msg)

    def statuses(self) -> list[DiagnosticStatus]:
        """The fleet summary ([] when the method is not Resizable)."""
        if self.proxy is None:
            return []
        if why := self.missing():
            return [status(FLEET_STATUS, WARN, why)]
        pinned = f"size {self.keep:g} pinned" if self.keep else "own size choice"
        return [status(FLEET_STATUS, OK, f"{pinned}, last batch served at {self.served:g}, "
                       f"reports on {self.pub.topic_name}",
                       {"keep": float(self.keep or 0.0), "served": self.served})]


def app_from_report(name: str, msg: FleetReport, paper: bool = False) -> App:
    """The App a fleet report describes, for the confidence objective (accuracy: the
    proxy) or, `paper`, for Eq. 8-11 (A, Ã and T per size); ValueError naming what is
    missing or not ready (`NoPaperEstimates` when only the paper's fields are)."""
    sizes, fwd, acc = list(msg.sizes), list(msg.forward_ms), list(msg.accuracy)
    if not sizes or not len(sizes) == len(fwd) == len(acc):
        raise ValueError(f"{name}: fleet report unreadable ({len(sizes)} sizes, {len(fwd)} "
                         f"forward times, {len(acc)} accuracies)")
    if not all(map(math.isfinite, fwd + acc)):
        raise ValueError(f"{name}: no forward time or accuracy estimate for every size yet")
    if not paper:
        options = [AppOption(float(k), float(f), float(a))
                   for k, f, a in zip(sizes, fwd, acc, strict=True)]
    else:
        t, a0, a1 = (list(v) for v in (msg.retrain_ms, msg.accuracy_before,
                                       msg.accuracy_after))
        if not (len(t) == len(a0) == len(a1) == len(sizes)
                and all(map(math.isfinite, t + a0 + a1))):
            raise NoPaperEstimates(f"{name}: no retraining time T or accuracy before / after "
                                   f"retraining (A, Ã) for every size")
        options = [AppOption(float(k), float(f), float(b), float(c), float(r) / 1000.0)
                   for k, f, b, c, r in zip(sizes, fwd, a0, a1, t, strict=True)]
    return App(name, float(msg.hz), float(msg.deadline_ms), options, int(msg.batch_size))


class NoPaperEstimates(ValueError):
    """A fleet report lacks what the paper objective needs (T, A, Ã)."""


def declare_namespaces(node: Node) -> None:
    """Declare the scheduler's `fleet_namespaces` (string array, read-only) unless it is
    declared: the node declares it when built, the FleetScheduler of each configure reads
    it."""
    if not node.has_parameter(NAMESPACES_PARAM):
        node.declare_parameter(NAMESPACES_PARAM, Parameter.Type.STRING_ARRAY,
                               ParameterDescriptor(description=(
                                   "fleet mode: namespaces of the perception pipelines that "
                                   "share this computer (empty: off)"), read_only=True))


class FleetScheduler:
    """The scheduler node's fleet mode (module docstring); inactive without namespaces."""

    def __init__(self, node: Node) -> None:
        self.node = node
        declare_namespaces(node)
        ns = node.get_parameter_or(NAMESPACES_PARAM,
                                   Parameter(NAMESPACES_PARAM, value=[""])).value or []
        self.namespaces = [n.rstrip("/") for n in ns if n]
        self.reports: dict[str, tuple[float, FleetReport]] = {}  # ns -> (time, report)
        self.sent: dict[str, float] = {}  # ns -> keep the node accepted
        self.last: FleetPlan | None = None
        self.waiting = self.error = ""
        self.fallback = ""  # why the paper objective fell back to confidence ('' if not)
        self.objective = ""  # the objective the last plan maximised
        self.plans = 0
        if not self.namespaces:
            return
        node_name = node.get_parameter("fleet_node").value
        self.clients = {n: node.create_client(SetParameters, f"{n}/{node_name}/set_parameters")
                        for n in self.namespaces}
        for n in self.namespaces:
            node.create_subscription(FleetReport, f"{n}/{REPORT_TOPIC}",
                                     lambda msg, n=n: self.on_report(n, msg), REPORT_QOS)
        node.create_timer(float(node.get_parameter("fleet_period_s").value), self.step)

    def _now(self) -> float:
        return self.node.get_clock().now().nanoseconds * 1e-9

    def on_report(self, ns: str, msg: FleetReport) -> None:
        """A pipeline's report (kept with its arrival time) when plausible (the node's
        `refusals` and `bounds`: plausibility.check_fleet_report)."""
        if self.node.refusals.admit("FleetReport", check_fleet_report, msg, self.node.bounds):
            self.reports[ns] = (self._now(), msg)

    def apps(self, paper: bool = False) -> list[App]:
        """One App per namespace from fresh reports (`paper`: with T, A, Ã); ValueError
        naming a missing one."""
        timeout = float(self.node.get_parameter("fleet_timeout_s").value)
        now, apps = self._now(), []
        for ns in self.namespaces:
            t, msg = self.reports.get(ns, (-math.inf, None))
            if msg is None or now - t > timeout:
                raise ValueError(f"{ns}: no fleet report within {timeout:g} s")
            apps.append(app_from_report(ns, msg, paper))
        return apps

    def step(self) -> FleetPlan | None:
        """Plan with the latest reports and send each changed size; None when waiting."""
        try:
            apps = self.apps()
        except ValueError as exc:
            self.waiting = str(exc)
            return None
        capacity = float(self.node.get_parameter("fleet_capacity").value)
        policy = self.node.get_parameter("fleet_policy").value
        if policy == "equal_split":
            plan, self.objective = equal_split(apps, capacity), "equal_split"
        else:
            apps, objective = self._objective(apps)
            plan = plan_fleet(apps, capacity, objective)
        self.waiting, self.last, self.plans = "", plan, self.plans + 1
        for ns, keep in plan.items():
            if self.sent.get(ns) != keep:
                self._send(ns, keep)
        return plan

    def _objective(self, apps: list[App]) -> tuple[list[App], Objective]:
        """The apps and objective to plan with: `fleet_objective`, or confidence (logged
        once until the paper's estimates arrive) while a report lacks T, A or Ã."""
        if self.node.get_parameter("fleet_objective").value == "paper":
            t_max = float(self.node.get_parameter("fleet_t_max_s").value)
            try:
                paper_apps = self.apps(paper=True)
            except NoPaperEstimates as exc:
                if not self.fallback:
                    self.node.get_logger().warning(f"fleet_objective paper: {exc}; planning "
                                                   f"with the confidence proxy meanwhile")
                self.fallback = str(exc)
            else:
                self.fallback, self.objective = "", "paper"
                return paper_apps, Objective("paper", t_max)
        else:
            self.fallback = ""
        self.objective = "confidence"
        return apps, Objective("confidence")

    def _send(self, ns: str, keep: float) -> None:
        client = self.clients[ns]
        if not client.service_is_ready():
            self.error = f"{client.srv_name} not available"
            return
        req = SetParameters.Request(parameters=[
            Parameter(KEEP_PARAM, value=float(keep)).to_parameter_msg()])
        fut = client.call_async(req)
        fut.add_done_callback(lambda f, ns=ns, keep=keep: self._sent(ns, keep, f))

    def _sent(self, ns: str, keep: float, fut: Any) -> None:
        res = fut.result()
        ok = res is not None and res.results and res.results[0].successful
        if ok:
            self.sent[ns], self.error = keep, ""
        else:
            why = res.results[0].reason if res is not None and res.results else "no answer"
            self.error = f"{ns}: {KEEP_PARAM}={keep:g} refused: {why}"
            self.node.get_logger().warning(self.error, throttle_duration_sec=5.0)

    def statuses(self) -> list[DiagnosticStatus]:
        """The fleet status ([] when fleet mode is off)."""
        if not self.namespaces:
            return []
        plan, warn = self.last, self.waiting or self.error
        if plan is not None and not plan.feasible:
            warn = warn or f"infeasible: {plan.reason}"
        values: dict[str, object] = {"plans": self.plans,
                                     "policy": self.node.get_parameter("fleet_policy").value,
                                     "objective": self.objective}
        if self.fallback:
            values["fallback"] = self.fallback
        if plan is not None:
            values.update({"load": plan.load, "accuracy": plan.accuracy,
                           **{f"keep {ns}": k for ns, k in plan.items()}})
        message = warn or (f"{len(self.namespaces)} pipelines, load {plan.load:.3g}"
                           if plan is not None else "no plan yet")
        return [status(FLEET_STATUS, WARN if warn else OK, message, values)]
