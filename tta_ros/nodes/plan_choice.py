"""Which plan each batch of the perception node follows, and what its planning status says.

`PlanChoice` (made at configure, dropped at cleanup; its gate renewed at each activation:
no plan made before a deactivation applies after it) holds the latest LayerPlan checked
against the model (tta_ros.convert.check_plan) and against plausible bounds
(tta_ros.nodes.plausibility; a refused plan is counted and the last good one, or inline
planning, goes on serving), the plan gate (tta_ros.nodes.perception_support.PlanGate),
whether plans went stale (then it plans inline and says so, WARN, until plans resume),
why inline planning found no room for any update (sigma * T or the deadline too short
for the forward), and how many batches each source planned. With `plan_source: inline`,
or a method that follows no plans (not TakesPlan), every batch plans inline. What it
announces at once (stale, resumed, refused, failed, no room) goes to `announce(level,
message)`: the node's planning status on /diagnostics.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from diagnostic_msgs.msg import DiagnosticStatus
from tta_msgs.msg import LayerPlan

from tta_core.adashadow.planning import Plan
from tta_core.api import StepResult, TakesPlan
from tta_ros.convert import check_plan
from tta_ros.diagnostics import OK, WARN, status
from tta_ros.nodes import plausibility
from tta_ros.nodes.method_params import MethodOptions
from tta_ros.nodes.perception_support import PlanGate
from tta_ros.nodes.plausibility import Bounds, Refusals

Chosen = tuple[int, Plan | None]  # (plan_id, plan); (0, None): plan inline


class PlanChoice:
    """The plan of the next batch and the planning status; see the module docstring."""

    def __init__(self, timeout_s: float, source: str, model_name: str, bounds: Bounds,
                 refusals: Refusals, announce: Callable[[int, str], None]) -> None:
        """`timeout_s`: how long an importance waits for its plan before plans count as
        stale; `source`: plan_source (topic or inline); `model_name`: the name plans must
        carry."""
        self.gate = PlanGate(timeout_s)
        self.source = source
        self.accepts = False  # the method follows LayerPlans (TakesPlan); set per method
        self.model_name, self.bounds, self.refusals = model_name, bounds, refusals
        self.announce = announce
        self.fallback = False  # plans from layer_plan went stale: planning inline
        self.no_room = ""  # inline planning: why no trainable unit fits sigma * T
        self.topic_batches = 0
        self.inline_batches = 0

    @property
    def from_topic(self) -> bool:
        """Whether batches follow plans from layer_plan (when fresh)."""
        return self.accepts and self.source == "topic"

    def restart(self) -> None:
        """No plan yet (activation): the first batches plan inline until one arrives."""
        self.gate = PlanGate(self.gate.timeout_s)
        self.fallback = False

    def take(self, msg: LayerPlan, method: object, unit_names: list[str]) -> None:
        """A LayerPlan for the next batches of `method` (whose units are `unit_names`), or
        refused (counted, announced) when it does not fit them or is implausible."""
        if not isinstance(method, TakesPlan):
            return
        try:
            plausibility.check_plan(msg, self.bounds)
            plan = check_plan(msg, self.model_name, unit_names, method.trainable)
        except ValueError as exc:  # the last good plan (or inline) goes on serving
            self.refusals.refuse("LayerPlan", f"plan {msg.plan_id}: {exc}")
            self.announce(WARN, f"plan {msg.plan_id} ignored: {exc}")
            return
        was_stale = self.fallback
        self.gate.on_plan((int(msg.plan_id), plan))
        if was_stale:
            self.fallback = False
            self.announce(OK, f"plans resumed on layer_plan (plan {msg.plan_id})")

    def choose(self, opts: MethodOptions) -> Chosen:
        """(plan_id, plan) for the next batch; (0, None) means plan inline."""
        if not self.from_topic:
            return 0, None
        current = self.gate.current()
        if current is None and self.gate.stale() and not self.fallback:
            self.fallback = True
            self.announce(WARN, self.message(opts))
        return current if current is not None else (0, None)

    def failed(self, chosen: Chosen, exc: Exception) -> None:
        """The plan `chosen` failed in the step: this batch and the next ones plan inline
        until the next plan."""
        self.gate.discard(chosen)
        self.announce(WARN, f"plan {chosen[0]} failed ({type(exc).__name__}: {exc}): "
                            f"planning inline until the next plan")

    def importance_sent(self) -> None:
        """An importance went out (or a batch failed: no plan answers it); a plan is due."""
        if self.from_topic:
            self.gate.on_importance_sent()

    def after_step(self, res: StepResult, opts: MethodOptions, from_topic: bool) -> None:
        """Count the batch by its plan's source; note (announcing the first) whether the
        inline planning found no room for an update."""
        no_room = res.planning.no_room if res.planning is not None else ""
        if no_room and not self.no_room:
            self.no_room = no_room
            self.announce(WARN, self.message(opts))
        self.no_room = no_room
        if from_topic:
            self.topic_batches += 1
        else:
            self.inline_batches += 1

    def message(self, opts: MethodOptions) -> str:
        """What the planning status says: topic, inline (and why), or why nothing fits."""
        if not self.accepts:
            return f"method {opts.method} plans nothing"
        if self.no_room:
            mode = opts.get("deadline_mode", "sigma")
            budget = f"sigma={opts.get('sigma', math.nan):g}" if mode == "sigma" \
                else f"deadline_mode={mode}"
            return f"{budget}: {self.no_room} (adapting BN statistics only)"
        if self.source == "inline":
            return "planning inline (plan_source: inline)"
        if self.fallback:
            return (f"no plan on layer_plan for {self.gate.silent_for():.1f} s "
                    f"(timeout {self.gate.timeout_s:g} s): planning inline")
        return "plans from layer_plan"

    def status(self, opts: MethodOptions, extra: Mapping[str, str]) -> DiagnosticStatus:
        """The planning status (WARN while planning inline for want of plans or of room);
        `extra`: what the deadline adds (the speed, in speed mode)."""
        return status("planning", WARN if self.fallback or self.no_room else OK,
                      self.message(opts), {
                          "plan_source": self.source,
                          "topic_batches": self.topic_batches,
                          "inline_batches": self.inline_batches,
                          "deadline_mode": opts.get("deadline_mode", "-"), **extra})
