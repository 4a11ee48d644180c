"""scheduler node: layer importance + telemetry -> `layer_plan` and RViz `layer_markers`.

For every LayerImportance it scales the offline per-unit profile by the latest telemetry's
pi_1/pi_2 (tta_core.adashadow.predictor.runtime_times; NaN or no telemetry -> 1) and solves the
AdaShadow DP (tta_core.adashadow.planner.solve). Without a profile file the per-unit times are the
MAC-proportional default of tta_core.adashadow.engine.mac_profile, scaled to the batch's measured
forward_ms. The unit structure (names, stage starts) comes from decomposing the model
described by the model card, so plans and perception agree on units by construction; a
LayerImportance whose unit_names differ is refused with a diagnostic. The AdaptationStatus
perception publishes for each plan it followed (plan_id echoed) closes the loop: its
measured backward_ms against the plan's predicted backward drives the backward correction
(tta_core.adashadow.backward_feedback) of the next plans, and its plan_ms and backward_ms +
reforward_ms against the per-unit model teach the fixed costs (tta_core.adashadow.fixed_costs) that
the next plans leave room for.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from geometry_msgs.msg import Point, Vector3
from rclpy.context import Context
from rclpy.node import Node
from rclpy.parameter import Parameter
from rclpy.qos import QoSProfile, ReliabilityPolicy
from std_msgs.msg import ColorRGBA
from tta_msgs.msg import AdaptationStatus, LayerImportance, LayerPlan, ResourceTelemetry
from visualization_msgs.msg import Marker, MarkerArray

from tta_core.adashadow import engine, planner, predictor
from tta_core.adashadow.backward_feedback import BackwardFeedback
from tta_core.adashadow.fixed_costs import FixedCosts
from tta_core.model.source import load_card
from tta_core.model.units import decompose
from tta_core.model.zoo import build_model
from tta_ros import ros_params
from tta_ros.ros_params import ParamSpec, check_initial, declare_all, validate, values

PARAMS: tuple[ParamSpec, ...] = (
    ParamSpec("model_card", "", "model card JSON (arch, num_classes, image_size) of the "
              "perception model", read_only=True),
    ParamSpec("profile", "", "offline UnitProfile JSON; empty: MAC-proportional default "
              "scaled to the measured forward time", read_only=True),
    ParamSpec("sigma", 0.33, "latency budget as a fraction of a full update", 0.0, 1.0),
    ParamSpec("n_t", 500, "planner budget discretisation steps", 10, 100000),
    ParamSpec("forward_feedback", "uniform", "correct the telemetry-scaled times by the "
              "forward measured on the batch (predictor.feedback_pis): memory = keep the "
              "telemetry's pi1 and solve pi2 from the forward (uniform while telemetry is "
              "stale), uniform = scale every time alike, off = telemetry only",
              choices=predictor.FEEDBACK_MODES),
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
)

UPDATED = ColorRGBA(r=0.1, g=0.8, b=0.2, a=0.9)
FROZEN = ColorRGBA(r=0.55, g=0.55, b=0.55, a=0.6)
WHITE = ColorRGBA(r=1.0, g=1.0, b=1.0, a=1.0)


@dataclass
class UnitLayout:
    """What the scheduler knows about the model: unit names, stage starts, MAC profile."""

    model_name: str
    unit_names: list[str]
    stage_start: np.ndarray
    input_shape: tuple[int, int, int]
    staged: object  # tta_core.model.units.StagedModel (for the MAC default profile)


def load_layout(card_path: str) -> UnitLayout:
    """Decompose the card's architecture (random weights: only the structure is used)."""
    card = load_card(card_path)
    size = card.image_size
    staged = decompose(build_model(card.arch, card.num_classes), (3, size, size),
                       arch=card.arch)
    return UnitLayout(card.name or card.arch, [u.name for u in staged.units],
                      staged.stage_start(), (3, size, size), staged)


def expansion(tel: ResourceTelemetry | None) -> tuple[float, float]:
    """(pi1, pi2) from telemetry; unknown / non-positive values count as 1 (offline)."""
    if tel is None:
        return 1.0, 1.0
    vals = []
    for v in (tel.compute_expansion, tel.memory_expansion):
        vals.append(float(v) if math.isfinite(v) and v > 0 else 1.0)
    return vals[0], vals[1]


def plan_to_msg(plan: planner.Plan, imp: LayerImportance, plan_id: int, sigma: float,
                unit_ms: np.ndarray) -> LayerPlan:
    """planner.Plan -> LayerPlan answering `imp`."""
    msg = LayerPlan(plan_id=plan_id, based_on_batch_id=imp.batch_id, model_name=imp.model_name,
                    unit_names=list(imp.unit_names),
                    update=[bool(u) for u in plan.update],
                    importance=[float(a) for a in imp.importance],
                    predicted_unit_ms=[float(t) for t in unit_ms],
                    first_updated_index=int(plan.first_updated), sigma=float(sigma),
                    budget_ms=float(plan.budget_ms),
                    predicted_total_ms=float(plan.predicted_total_ms),
                    solve_ms=float(plan.solve_ms))
    msg.header = imp.header
    return msg


def plan_markers(plan: LayerPlan, frame_id: str, spacing: float,
                 max_height: float) -> MarkerArray:
    """DELETEALL, then one CUBE bar per unit (height ∝ importance, green = updated), a label."""
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
                        f"budget {plan.budget_ms:.1f} ms, predicted "
                        f"{plan.predicted_total_ms:.1f} ms")
    label.pose.position = Point(x=0.0, y=0.0, z=max_height + 0.5)
    label.pose.orientation.w = 1.0
    label.header.frame_id, label.header.stamp = frame_id, plan.header.stamp
    arr.markers.append(label)
    return arr


class SchedulerNode(Node):
    """Plans layer updates for every importance message and draws them for RViz."""

    def __init__(self, node_name: str = "scheduler", *, context: Context | None = None,
                 parameter_overrides: Sequence[Parameter] | None = None,
                 cli_args: Sequence[str] | None = None) -> None:
        super().__init__(node_name, context=context, parameter_overrides=parameter_overrides,
                         cli_args=list(cli_args) if cli_args else None)
        declare_all(self, PARAMS)
        p = values(self, PARAMS)
        check_initial(PARAMS, p)
        self.add_on_set_parameters_callback(lambda ps: validate(PARAMS, ps))
        if not p["model_card"]:
            raise ValueError("parameter model_card is empty: the scheduler needs the model")
        self.layout = load_layout(ros_params.resolve_data_path(p["model_card"]))
        self.profile = (predictor.UnitProfile.load(ros_params.resolve_data_path(p["profile"]))
                        if p["profile"] else None)
        if self.profile is not None:
            self.profile.check_units(self.layout.unit_names)
        self.telemetry: ResourceTelemetry | None = None
        self._tel_time = -math.inf
        self.plans_published = 0
        # perception records the autograd graph from the stage of the plan it follows: the
        # forward it reports is compared with that kind of forward (predictor.forward_reference)
        self._grad_from = 0
        self.backward_fb = BackwardFeedback(alpha=p["backward_feedback"])
        self.fixed = FixedCosts(alpha=p["fixed_cost_feedback"])
        # plan_id -> predicted backward ms, predicted backward + reforward ms (per-unit model)
        self._predicted: dict[int, tuple[float, float]] = {}
        self.last_error = ""
        self.no_room = ""  # why no update fits the budget (empty: some unit does)
        reliable = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
        self.pub_plan = self.create_publisher(LayerPlan, "layer_plan", reliable)
        self.pub_markers = self.create_publisher(MarkerArray, "layer_markers", 10)
        self.pub_diag = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
        self.create_subscription(LayerImportance, "layer_importance", self._on_importance,
                                 reliable)
        self.create_subscription(ResourceTelemetry, "telemetry", self._on_telemetry, 10)
        self.create_subscription(AdaptationStatus, "adaptation_status", self._on_status,
                                 reliable)
        self.create_timer(1.0, self._publish_diagnostics)

    def _on_telemetry(self, msg: ResourceTelemetry) -> None:
        self.telemetry, self._tel_time = msg, self._now()

    def _on_status(self, msg: AdaptationStatus) -> None:
        """Perception followed one of our plans: check its predicted backward and learn the
        costs outside the per-unit model."""
        predicted = self._predicted.pop(int(msg.plan_id), None)
        if predicted is None:
            return
        fwd = float(msg.forward_ms)
        self.fixed.update_plan(float(msg.plan_ms), fwd)
        if msg.adapted:
            self.backward_fb.update(predicted[0], float(msg.backward_ms))
            self.fixed.update_adapt(predicted[1], float(msg.backward_ms + msg.reforward_ms), fwd)
        else:
            self.fixed.idle()

    def _now(self) -> float:
        return self.get_clock().now().nanoseconds * 1e-9

    def _unit_times(self, imp: LayerImportance) -> tuple[np.ndarray, ...]:
        fresh = self._now() - self._tel_time <= self.get_parameter("telemetry_timeout_s").value
        pi1, pi2 = expansion(self.telemetry if fresh else None)
        prof = self.profile or engine.mac_profile(self.layout.staged, float(imp.forward_ms),
                                                  max(int(imp.batch_size), 1),
                                                  self.layout.input_shape)
        feedback = str(self.get_parameter("forward_feedback").value)
        if self.profile is None or (feedback == "memory" and not fresh):
            # MAC times are unitless shapes: always scaled to the measured forward; without
            # live telemetry pi1 = 1 means "unknown", which "memory" would misread
            feedback = "uniform"
        return predictor.planning_times(prof, pi1, pi2, float(imp.forward_ms), feedback,
                                        self._grad_from, self.backward_fb.factor)

    def _on_importance(self, imp: LayerImportance) -> None:
        try:
            plan, unit_ms, predicted = self._solve(imp)
        except ValueError as exc:
            self.last_error = str(exc)
            self.get_logger().warning(f"no plan for batch {imp.batch_id}: {exc}",
                                      throttle_duration_sec=5.0)
            self._publish_diagnostics()
            return
        self.last_error = ""
        self.plans_published += 1
        n = len(self.layout.unit_names)
        self._grad_from = (int(self.layout.stage_start[plan.first_updated])
                           if plan.first_updated < n else n)
        sigma = self.get_parameter("sigma").value
        msg = plan_to_msg(plan, imp, self.plans_published, sigma, unit_ms)
        self._predicted[self.plans_published] = predicted
        while len(self._predicted) > 64:  # plans perception never followed
            del self._predicted[next(iter(self._predicted))]
        self.pub_plan.publish(msg)
        self.pub_markers.publish(plan_markers(
            msg, self.get_parameter("marker_frame_id").value,
            self.get_parameter("bar_spacing").value, self.get_parameter("bar_max_height").value))

    def _solve(self, imp: LayerImportance
               ) -> tuple[planner.Plan, np.ndarray, tuple[float, float]]:
        """The plan, the predicted per-unit backward ms and the plan's predicted backward
        and backward + reforward by the per-unit model."""
        if list(imp.unit_names) != self.layout.unit_names:
            raise ValueError(f"importance of model {imp.model_name!r} has "
                             f"{len(imp.unit_names)} units that do not match the card's "
                             f"{len(self.layout.unit_names)} units")
        if not (math.isfinite(imp.forward_ms) and imp.forward_ms >= 0):
            raise ValueError(f"forward_ms={imp.forward_ms} is not a valid time")
        w, x, r = self._unit_times(imp)
        a = np.nan_to_num(np.asarray(imp.importance, dtype=np.float64), nan=0.0)
        problem = planner.PlanProblem(w=w, x=x, r=r, stage_start=self.layout.stage_start,
                                      importance=np.maximum(a, 0.0),
                                      forward_ms=float(imp.forward_ms) + self.fixed.plan_phase_ms,
                                      sigma=float(self.get_parameter("sigma").value),
                                      overhead_ms=self.fixed.overhead_ms)
        plan = planner.solve(problem, n_t=int(self.get_parameter("n_t").value))
        self.no_room = self._no_room(problem, plan, a)
        bwd = planner.backward_cost(w, x, plan.update)
        per_unit = plan.predicted_total_ms - problem.forward_ms - problem.overhead_ms
        return plan, w + x, (bwd, per_unit if plan.update.any() else 0.0)

    @staticmethod
    def _no_room(problem: planner.PlanProblem, plan: planner.Plan, importance: np.ndarray
                 ) -> str:
        """Why no unit that perception may update (importance > 0) fits the budget, or ""."""
        candidates = importance > 0 if (importance > 0).any() else None
        if planner.lowest_feasible_unit(problem, candidates) < len(importance):
            return ""
        return (f"no unit fits the budget sigma*T = {plan.budget_ms:.3g} ms after the forward "
                f"and plan phase ({problem.forward_ms:.3g} ms) and the update's fixed cost "
                f"({problem.overhead_ms:.3g} ms): plans stay empty, raise sigma to adapt")

    def _planning_status(self) -> DiagnosticStatus:
        st = DiagnosticStatus(name="tta scheduler: planning", hardware_id="")
        warn = self.last_error or self.no_room
        st.level = DiagnosticStatus.WARN if warn else DiagnosticStatus.OK
        st.message = warn or f"{self.plans_published} plans"
        pi1, pi2 = expansion(self.telemetry)
        st.values = [KeyValue(key="plans", value=str(self.plans_published)),
                     KeyValue(key="profile", value=self.profile.device if self.profile
                              else "mac-estimate"),
                     KeyValue(key="pi1", value=f"{pi1:.4g}"),
                     KeyValue(key="pi2", value=f"{pi2:.4g}"),
                     KeyValue(key="backward_factor", value=f"{self.backward_fb.factor:.4g}"),
                     KeyValue(key="plan_phase_ms", value=f"{self.fixed.plan_phase_ms:.4g}"),
                     KeyValue(key="update_overhead_ms", value=f"{self.fixed.overhead_ms:.4g}")]
        return st

    def _publish_diagnostics(self) -> None:
        arr = DiagnosticArray(status=[self._planning_status()])
        arr.header.stamp = self.get_clock().now().to_msg()
        self.pub_diag.publish(arr)


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point: `scheduler_node --ros-args -p model_card:=...`."""
    from tta_ros.bringup import node_main

    return node_main(SchedulerNode, argv)


if __name__ == "__main__":
    sys.exit(main())
