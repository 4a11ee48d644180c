"""scheduler node: layer importance + telemetry -> `layer_plan` and RViz `layer_markers`.

ROS wiring around tta_core's PlanningService (the same planning loop the perception
engine runs inline): every LayerImportance is planned with the latest fresh telemetry's
pi1/pi2 (NaN or stale -> offline factors), the offline profile (or the MAC-proportional
default scaled to the batch's measured forward), and what perception reported for earlier
plans. The unit structure comes from decomposing the model the card describes, so plans
and perception agree on units by construction; a LayerImportance whose unit_names differ
is refused with a diagnostic. The AdaptationStatus perception publishes for each plan it
followed (plan_id echoed) closes the loop (PlanningService.observe: backward correction,
plan phase, the update's fixed cost).

Deadline modes (`deadline_mode`, tta_core.runtime.deadline): the budget of a batch is its
deadline (fixed, from `camera_hz`, or from the speed on `odometry_topic`) instead of
sigma*T; the LayerPlan's `sigma` is then the deadline's share of the full update
(budget_ms / T), /diagnostics says when the forward alone misses the deadline and the RViz
label shows it. Those settings and `sigma` follow perception's `method.*` options
(`deadline_from`, tta_ros.nodes.scheduler_deadline): one place for the deadline.

A managed (lifecycle) node (tta_ros.lifecycle): configure loads the card's unit layout
and the profile and creates the planning service; it plans only while active (inactive:
importance, statuses and telemetry are ignored); cleanup drops the service.

Fleet mode (tta_ros.nodes.fleet_wiring): with `fleet_namespaces` set, the node
also reads every perception pipeline's tta_msgs/FleetReport (`<ns>/fleet_report`), chooses
the surrogate size of each (the pipelines share this computer: tta_core.elasticdnn.fleet)
and sets it on each through the standard SetParameters service (`method.keep`).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import numpy as np
from diagnostic_msgs.msg import DiagnosticStatus
from geometry_msgs.msg import Point, Vector3
from rcl_interfaces.msg import SetParametersResult
from rclpy.context import Context
from rclpy.parameter import Parameter
from rclpy.qos import QoSProfile, ReliabilityPolicy
from std_msgs.msg import ColorRGBA
from tta_msgs.msg import AdaptationStatus, LayerImportance, LayerPlan, ResourceTelemetry
from visualization_msgs.msg import Marker, MarkerArray

from tta_core.adashadow.planning import (
    FEEDBACK_MODES,
    TRAINABLE,
    CardSaveCosts,
    Measured,
    MemoryCosts,
    PlanningConfig,
    PlanningService,
    PlanOutcome,
    UnitProfile,
    budget_from_free,
    layout_from_card,
    telemetry_pis,
)
from tta_ros import ros_params
from tta_ros.convert import check_importance, plan_to_msg
from tta_ros.diagnostics import HARDWARE_ID, OK, WARN, DiagnosticsPublisher, status
from tta_ros.lifecycle import ManagedNode
from tta_ros.nodes import plausibility
from tta_ros.nodes.deadline_wiring import (
    DEADLINE_KEYS,
    DEADLINE_PARAMS,
    SpeedFeed,
    check_deadline_change,
    deadline_settings,
    resolve_topic,
)
from tta_ros.nodes.fleet_wiring import (
    SCHEDULER_FLEET_PARAMS,
    FleetScheduler,
    declare_namespaces,
)
from tta_ros.nodes.node_params import taken_elsewhere
from tta_ros.nodes.plausibility import (
    PLAUSIBILITY_PARAMS,
    Bounds,
    Refusals,
    check_speed,
    check_status,
    check_telemetry,
)
from tta_ros.nodes.scheduler_deadline import DEADLINE_FROM, DeadlineFollower
from tta_ros.ros_params import ParamSpec, check_initial, declare_all, validate, values

PARAMS: tuple[ParamSpec, ...] = (
    ParamSpec("model_card", "", "model card JSON (arch, num_classes, image_size) of the "
              "perception model", read_only=True),
    ParamSpec("profile", "", "offline UnitProfile JSON; empty: MAC-proportional default "
              "scaled to the measured forward time", read_only=True),
    ParamSpec("sigma", 0.33, "latency budget as a fraction of a full update, in (0, 1] "
              "(deadline_mode sigma)", 0.0, 1.0),
    ParamSpec("trainable", "norm", "units perception may update (its method's trainable "
              "setting): norm = BN/LayerNorm affine parameters, all = every unit",
              choices=TRAINABLE, read_only=True),
    ParamSpec("n_t", 500, "planner budget discretisation steps", 10, 100000),
    ParamSpec("memory_budget_mb", 0.0, "saved-activation budget of perception's update, MiB "
              "(0: none); plans assume perception's adashadow with this budget", 0.0, 1e6),
    ParamSpec("memory_budget_free_share", 0.0, "with fresh telemetry, plan within this share "
              "of the free memory it reports (total - used), MiB, and within "
              "memory_budget_mb if set too (0: off)", 0.0, 1.0),
    ParamSpec("forward_feedback", "uniform", "correct the telemetry-scaled times by the "
              "forward measured on the batch (predictor.feedback_pis): memory = keep the "
              "telemetry's pi1 and solve pi2 from the forward (uniform while telemetry is "
              "stale), uniform = scale every time alike, off = telemetry only",
              choices=FEEDBACK_MODES),
    ParamSpec("backward_feedback", 0.2, "EMA weight of the correction of predicted backward "
              "times by the backward_ms perception reports for our plans (0: off)", 0.0, 1.0,
              read_only=True),
    ParamSpec("fixed_cost_feedback", 0.2, "EMA weight of perception's plan phase and the "
              "update's fixed cost that plans leave room for (0: off)", 0.0, 1.0,
              read_only=True),
    ParamSpec("telemetry_timeout_s", 2.0, "older telemetry is ignored (pi = 1)", 0.1, 3600.0),
    ParamSpec("marker_frame_id", "tta", "frame of the RViz markers"),
    ParamSpec("bar_spacing", 0.3, "distance between unit bars [m]", 0.01, 10.0),
    ParamSpec("bar_max_height", 2.0, "height of the most important unit's bar [m]",
              0.01, 100.0),
    ParamSpec("marker_lifetime_s", 2.0, "lifetime of the RViz markers: they vanish this long "
              "after the last plan [s] (0: forever)", 0.0, 3600.0),
    *DEADLINE_PARAMS,
    DEADLINE_FROM,
    *SCHEDULER_FLEET_PARAMS,
    *PLAUSIBILITY_PARAMS,
    HARDWARE_ID,
)

UPDATED = ColorRGBA(r=0.1, g=0.8, b=0.2, a=0.9)
FROZEN = ColorRGBA(r=0.55, g=0.55, b=0.55, a=0.6)
WHITE = ColorRGBA(r=1.0, g=1.0, b=1.0, a=1.0)


def plan_markers(plan: LayerPlan, frame_id: str, spacing: float, max_height: float,
                 lifetime_s: float = 0.0, deadline: str = "", domain: str = "",
                 memory: str = "") -> MarkerArray:
    """DELETEALL, then one CUBE bar per unit (height ∝ importance, green = updated), a label;
    every marker lives `lifetime_s` (0: forever). `deadline`: the deadline and what set it,
    when the budget is one (the label then shows it instead of the budget). `domain`: the
    domain perception last recognised (AdaptationStatus.domain), when any.
    `memory`: the plan's predicted saved activations against the memory budget, when one
    is set."""
    arr = MarkerArray()
    clear = Marker(action=Marker.DELETEALL)
    clear.header.frame_id = frame_id
    arr.markers.append(clear)
    imp = np.nan_to_num(np.asarray(plan.importance, dtype=np.float64), nan=0.0)
    top = float(imp.max()) if imp.size and imp.max() > 0 else 1.0
    for i, (a, upd) in enumerate(zip(imp, plan.update, strict=True)):
        h = max(max_height * float(a) / top, 0.01)
        m = Marker(ns="units", id=i, type=Marker.CUBE, action=Marker.ADD,
                   color=UPDATED if upd else FROZEN,
                   scale=Vector3(x=0.8 * spacing, y=0.8 * spacing, z=h))
        m.pose.position = Point(x=i * spacing, y=0.0, z=h / 2)
        m.pose.orientation.w = 1.0
        m.header.frame_id, m.header.stamp = frame_id, plan.header.stamp
        arr.markers.append(m)
    label = Marker(ns="label", id=0, type=Marker.TEXT_VIEW_FACING, action=Marker.ADD,
                   color=WHITE, scale=Vector3(z=0.25),
                   text=f"plan {plan.plan_id}: {sum(plan.update)}/{len(plan.update)} units, "
                        + (f"deadline {deadline}" if deadline else
                           f"budget {plan.budget_ms:.1f} ms")
                        + f", predicted {plan.predicted_total_ms:.1f} ms"
                        + (f", domain {domain}" if domain else "")
                        + (f", {memory}" if memory else ""))
    label.pose.position = Point(x=0.0, y=0.0, z=max_height + 0.5)
    label.pose.orientation.w = 1.0
    label.header.frame_id, label.header.stamp = frame_id, plan.header.stamp
    arr.markers.append(label)
    sec, nanosec = divmod(round(lifetime_s * 1e9), 10**9)
    for m in arr.markers:
        m.lifetime.sec, m.lifetime.nanosec = sec, nanosec
    return arr


def sigma_reason(sigma: float) -> str:
    """'' for a sigma the planner takes, in (0, 1] (sigma*T: a share of the full update;
    0 would plan nothing ever), else why not."""
    return "" if 0.0 < sigma <= 1.0 else (f"sigma={sigma!r} outside (0, 1]: the budget is a "
                                          "share of the full update's time T")


def deadline_values(node: SchedulerNode) -> dict[str, str | int]:
    """The deadline part of the planning diagnostics."""
    svc, last = node.planning, node.last_outcome
    speed = node.speed.speed()
    speed_value = {"speed_mps": f"{speed:.4g}" if speed is not None else "unknown"} \
        if svc.config.deadline_mode == "speed" else {}  # only where the speed counts
    return {"deadline": svc.describe_deadline(),
            "deadline_from": node.deadline_from.describe(),
            "deadline_ms": f"{last.deadline_ms:.4g}" if last is not None else "nan",
            **speed_value, "forward_misses": node.forward_misses}


def memory_text(outcome: PlanOutcome, budget_mib: float | None) -> str:
    """'saved 0.41 / 0.60 MiB' (the plan's predicted saved activations / the budget) when
    a memory budget is set, else ''."""
    if budget_mib is None or outcome.memory is None:
        return ""
    return f"saved {outcome.memory.predicted_bytes / 2**20:.2f} / {budget_mib:.2f} MiB"


class SchedulerNode(ManagedNode):
    """Plans layer updates for every importance message and draws them for RViz."""

    def __init__(self, node_name: str = "scheduler", *, context: Context | None = None,
                 parameter_overrides: Sequence[Parameter] | None = None,
                 cli_args: Sequence[str] | None = None) -> None:
        self.planning: PlanningService | None = None
        super().__init__(node_name, context=context, parameter_overrides=parameter_overrides,
                         cli_args=list(cli_args) if cli_args else None,
                         automatically_declare_parameters_from_overrides=True)  # start_values
        declare_all(self, PARAMS)
        check_initial(PARAMS, values(self, PARAMS))
        if reason := sigma_reason(self.get_parameter("sigma").value) or \
                check_deadline_change(values(self, DEADLINE_PARAMS), ()):
            raise ValueError(reason)  # the start values, as the callbacks check changes
        declare_namespaces(self)  # fleet mode
        ros_params.report_unknown(self, others=taken_elsewhere("scheduler"))  # all declared
        self.add_on_set_parameters_callback(self._on_set_parameters)
        self.add_post_set_parameters_callback(self._after_set_parameters)

    def _configure(self) -> None:
        """Read the parameters, load the model's unit layout and the profile, create the
        planning service, publishers, subscriptions and the diagnostics timer."""
        p = values(self, PARAMS)
        if not p["model_card"]:
            raise ValueError("parameter model_card is empty: the scheduler needs the model")
        layout = layout_from_card(ros_params.resolve_data_path(p["model_card"]))
        profile = (UnitProfile.load(ros_params.resolve_data_path(p["profile"]))
                   if p["profile"] else None)
        self.planning = PlanningService(layout, PlanningConfig(
            sigma=p["sigma"], n_t=p["n_t"], forward_feedback=p["forward_feedback"],
            backward_feedback=p["backward_feedback"],
            fixed_cost_feedback=p["fixed_cost_feedback"], **deadline_settings(p),
            memory_budget_mb=p["memory_budget_mb"] or None), profile)
        self._card, self._save_costs = p["model_card"], None  # memory costs: on first use
        self.bounds = Bounds.from_params(p)  # plausibility of every message taken in
        self.refusals = Refusals(self.get_logger().warning)
        self.speed = SpeedFeed(self, p["odometry_topic"], p["odometry_type"],
                               p["odometry_timeout_s"], self._now)
        self.speed.admit = lambda v: self.refusals.admit("odometry", check_speed, v,
                                                         self.bounds)
        self.forward_misses = 0  # batches whose forward alone missed the deadline
        self._trainable = layout.trainable(p["trainable"])
        self.telemetry: ResourceTelemetry | None = None
        self._tel_time = -math.inf
        self.plans_published = 0
        # perception records the autograd graph from the stage of the plan it follows: the
        # forward it reports is compared with that kind of forward (predictor.forward_reference)
        self._grad_from = 0
        self._outcomes: dict[int, PlanOutcome] = {}  # plan_id -> outcome, last 64 plans
        self.last_error = ""
        self.no_room = ""  # why no update fits the budget (empty: some unit does)
        self.last_outcome: PlanOutcome | None = None
        self.domain = ""  # perception's recognised domain (AdaptationStatus.domain)
        reliable = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
        self.pub_plan = self.create_lifecycle_publisher(LayerPlan, "layer_plan", reliable)
        self.pub_markers = self.create_lifecycle_publisher(MarkerArray, "layer_markers", 10)
        self.diag = DiagnosticsPublisher(self)
        self.create_subscription(LayerImportance, "layer_importance", self._on_importance,
                                 reliable)
        self.create_subscription(ResourceTelemetry, "telemetry", self._on_telemetry, 10)
        self.create_subscription(AdaptationStatus, "adaptation_status", self._on_status,
                                 reliable)
        self.fleet = FleetScheduler(self)  # fleet mode: sizes of several pipelines (#22)
        self.deadline_from = DeadlineFollower(self, p["deadline_from"])  # one deadline
        self.create_timer(1.0, self._publish_diagnostics)

    def _cleanup(self) -> None:
        self.planning = self.fleet = self.telemetry = self.last_outcome = None
        self._outcomes = {}

    @property
    def layout(self):
        """The model's unit layout (tta_core.adashadow.planning.UnitLayout)."""
        return self.planning.layout

    def _on_set_parameters(self, params: Sequence[Parameter]) -> SetParametersResult:
        """Validate a change (ranges, choices, consistent deadline settings, a valid
        odometry topic); _after_set_parameters applies it."""
        res = validate(PARAMS, params)
        if res.successful:
            new = {p.name: p.value for p in params}
            res.reason = check_deadline_change(values(self, DEADLINE_PARAMS), params) or (
                sigma_reason(new["sigma"]) if "sigma" in new else "")
            try:
                if "odometry_topic" in new:
                    resolve_topic(self, new["odometry_topic"])
            except ValueError as exc:
                res.reason = str(exc)
            res.successful = not res.reason
        return res

    def _after_set_parameters(self, params: Sequence[Parameter]) -> None:
        """Accepted changes into the planning service and the speed feed (unconfigured:
        configure reads them)."""
        if self.planning is None:
            return
        for prm in params:
            if prm.name in ("sigma", "n_t", "forward_feedback", *DEADLINE_KEYS):
                setattr(self.planning.config, prm.name, prm.value)
            if prm.name == "memory_budget_mb":
                self.planning.config.memory_budget_mb = prm.value or None
        self.speed.on_params({p.name: p.value for p in params})

    def _on_telemetry(self, msg: ResourceTelemetry) -> None:
        if self.serving and self.refusals.admit("ResourceTelemetry", check_telemetry, msg,
                                                self.bounds):
            self.telemetry, self._tel_time = msg, self._now()

    def _on_status(self, msg: AdaptationStatus) -> None:
        """Perception followed one of our plans: the service learns from what it measured.
        In parallel mode no reforward runs (its time is not part of the check). Every
        status also carries the recognised domain, for the marker label. An implausible
        status is refused (plausibility.check_status): nothing learnt from it."""
        if not self.serving or not self.refusals.admit("AdaptationStatus", check_status, msg,
                                                       self.bounds):
            return
        self.domain = msg.domain  # the marker label shows it
        outcome = self._outcomes.pop(int(msg.plan_id), None)
        if outcome is None:
            return
        self.planning.observe(outcome, Measured(
            float(msg.forward_ms), float(msg.plan_ms), bool(msg.adapted),
            float(msg.backward_ms),
            None if msg.mode == "parallel" else float(msg.reforward_ms),
            total_ms=float(msg.total_ms)))

    def _now(self) -> float:
        return self.get_clock().now().nanoseconds * 1e-9

    def _apply_telemetry(self) -> None:
        """Fresh telemetry -> live pi1/pi2 in the service; stale -> offline factors."""
        fresh = self._now() - self._tel_time <= self.get_parameter("telemetry_timeout_s").value
        tel = self.telemetry if fresh else None
        if tel is not None:
            self.planning.set_expansion(*telemetry_pis(tel.compute_expansion,
                                                       tel.memory_expansion))
        else:
            self.planning.clear_expansion()
        free = tel.mem_total_mb - tel.mem_used_mb if tel is not None else math.nan
        self.planning.config.memory_budget_mb = budget_from_free(
            self.get_parameter("memory_budget_mb").value or None,
            self.get_parameter("memory_budget_free_share").value, free)

    def plan_for(self, imp: LayerImportance) -> PlanOutcome:
        """The service's plan for `imp` with the current telemetry (nothing published);
        ValueError naming the field when `imp` is not a valid message for this model."""
        lay = self.layout
        plausibility.check_importance(imp, self.bounds)
        importance = check_importance(imp, lay.model_name, lay.unit_names)
        self._apply_telemetry()
        self.planning.set_speed(self.speed.speed())
        return self.planning.plan(importance, float(imp.forward_ms), grad_from=self._grad_from,
                                  candidates=self._trainable, batch_size=int(imp.batch_size),
                                  memory=self._memory_costs(int(imp.batch_size)))

    def _memory_costs(self, batch_size: int) -> MemoryCosts | None:
        """Memory costs of a batch when a memory budget is set (the card's model, profiled
        once per batch size: memory_budget.CardSaveCosts), else None."""
        if self.planning.config.memory_budget_mb is None:
            return None
        if self._save_costs is None:
            self._save_costs = CardSaveCosts(ros_params.resolve_data_path(self._card),
                                             self.get_parameter("trainable").value)
        return self._save_costs(batch_size)

    def _on_importance(self, imp: LayerImportance) -> None:
        if not self.serving:
            return
        try:
            outcome = self.plan_for(imp)
        except ValueError as exc:
            self.last_error = str(exc)
            self.refusals.refuse("LayerImportance", f"no plan for batch {imp.batch_id}: {exc}")
            self._publish_diagnostics()
            return
        self.last_error, self.no_room = "", outcome.no_room
        self.last_outcome = outcome
        self.forward_misses += bool(outcome.forward_misses)
        self.plans_published += 1
        n = self.layout.n_units
        first = outcome.plan.first_updated
        self._grad_from = int(self.layout.stage_start[first]) if first < n else n
        cfg = self.planning.config
        deadline = (f"{outcome.deadline_ms:.1f} ms ({self.planning.describe_deadline()})"
                    if cfg.has_deadline else "")
        msg = plan_to_msg(outcome, imp, self.plans_published,  # sigma: a share, in [0, 1]
                          min(outcome.budget_share, 1.0) if deadline else cfg.sigma)
        self._outcomes[self.plans_published] = outcome
        while len(self._outcomes) > 64:  # plans perception never followed
            del self._outcomes[next(iter(self._outcomes))]
        self.pub_plan.publish(msg)
        self.pub_markers.publish(plan_markers(
            msg, self.get_parameter("marker_frame_id").value,
            self.get_parameter("bar_spacing").value, self.get_parameter("bar_max_height").value,
            self.get_parameter("marker_lifetime_s").value, deadline, self.domain,
            memory_text(outcome, cfg.memory_budget_mb)))

    def _planning_status(self) -> DiagnosticStatus:
        svc = self.planning
        speed = self.speed.describe() if svc.config.deadline_mode == "speed" else ""
        warn = self.last_error or self.no_room or speed
        pi1, pi2, live = svc.expansion
        return status("planning", WARN if warn else OK,
                      warn or f"{self.plans_published} plans", {
                          "plans": self.plans_published,
                          "profile": svc.profile.device if svc.profile else "mac-estimate",
                          "pi1": f"{pi1:.4g}", "pi2": f"{pi2:.4g}",
                          "telemetry": "live" if live else "offline",
                          "backward_factor": f"{svc.backward_factor:.4g}",
                          "plan_phase_ms": f"{svc.plan_phase_ms:.4g}",
                          "update_overhead_ms": f"{svc.overhead_ms:.4g}",
                          **deadline_values(self), **self.refusals.values()})

    def _publish_diagnostics(self) -> None:
        self.diag.publish([self._planning_status(), *self.fleet.statuses()])


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point: `scheduler_node --ros-args -p model_card:=...`."""
    from tta_ros.bringup import node_main

    return node_main(SchedulerNode, argv)


if __name__ == "__main__":
    sys.exit(main())
