"""The planning service: one AdaShadow planning loop for the engine and the ROS scheduler.

Per batch: the per-unit cost model (offline profile or MAC shape, Eq. 4 expansion from
telemetry, forward feedback from the batch's measured forward, backward feedback from
past plans), the fixed costs outside it (plan phase, update overhead), the DP under
sigma*T, the no-room rule (no candidate unit fits at all) and the lowest unit any plan can
reach (where the engine starts recording the autograd graph). After the batch, `observe`
feeds what was measured back into the feedback loops.

The engine plans inline with it; `tta_ros`'s scheduler node wraps the same service in ROS
wiring, so a topic plan and an inline plan for the same importance, forward time and
telemetry are the same plan. Pure Python + numpy; no torch model is needed at plan time.

Which feedback needs what (see also docs/concepts.md):
- forward feedback "uniform": the batch's measured forward only (works offline);
- forward feedback "memory": a live telemetry pi1 (`set_expansion`); without one it falls
  back to "uniform" (pi1 = 1 would read unseen compute sharing as memory contention);
- MAC-shaped times (no profile) are unitless and always scaled "uniform";
- backward feedback / fixed costs: measured backward, reforward and plan-phase times of
  the plans this service made (`observe`).

Deadline modes (`deadline`, tta_core.runtime.deadline): with `deadline_mode` other than
"sigma" the budget of a batch is its deadline (deadline.batch_deadline_ms: fixed, from
the camera rate or from the vehicle's speed, `set_speed`) instead of sigma*T, and it
covers the whole batch:
forward + plan phase + update (with its fixed cost) + reforward. When the forward and the
plan phase alone leave no time (`no_time`), the batch is served without update and
without planning (`empty_outcome`, the reason in `no_room`; `forward_misses` when the
forward alone is over the deadline).
"""

from __future__ import annotations

__all__ = ["DEADLINE_MODES", "DEADLINE_PER", "FEEDBACK_MODES", "TRAINABLE", "CardSaveCosts",
           "DeadlineConfig", "Measured", "MemoryCosts", "Plan", "PlanOutcome",
           "PlanningConfig", "PlanningService", "UnitLayout", "UnitProfile", "budget_from_free",
           "layout_from_card", "mac_profile", "telemetry_pis"]

import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from tta_core.adashadow import planner, predictor
from tta_core.adashadow.memory_budget import (
    CardSaveCosts,
    budget_from_free,
    check_budget_mib,
    memory_no_room,
    solve_plan,
)
from tta_core.adashadow.memory_planner import MemoryCosts, MemoryPlan
from tta_core.adashadow.predictor import FEEDBACK_MODES, UnitProfile
from tta_core.api import Plan
from tta_core.model.source import build_card_model, load_card
from tta_core.model.units import NORM_UNIT_KINDS, StagedModel, decompose
from tta_core.runtime.backward_feedback import BackwardFeedback
from tta_core.runtime.deadline import (
    DEADLINE_MODES,
    DEADLINE_PER,
    DeadlineBudget,
    DeadlineConfig,
    late_text,
)
from tta_core.runtime.fixed_costs import FixedCosts
from tta_core.runtime.options import option

TRAINABLE = ("norm", "all")


@dataclass
class PlanningConfig(DeadlineConfig):
    """Settings of the planning loop (EngineConfig and the scheduler node extend it); the
    deadline_* fields (DeadlineConfig) choose between sigma*T and a deadline."""

    sigma: float = option(0.33, "latency budget as a fraction of a full update (sigma*T, "
                          "deadline_mode sigma; in (0, 1]: T is the full update)", low=0.0,
                          high=1.0)
    n_t: int = option(planner.DEFAULT_N_T, "planner budget discretisation steps", low=1)
    forward_feedback: str = option(
        "uniform", "correct the predicted unit times by the batch's measured forward, on top "
        "of pi1/pi2: uniform, memory (needs live telemetry) or off", choices=FEEDBACK_MODES)
    # Off by default in the library so `tta bench` plans never depend on how fast a run
    # was; the ROS nodes use 0.2
    backward_feedback: float = option(0.0, "EMA weight of the correction of predicted "
                                      "backward times by measured ones (0: off)",
                                      low=0.0, high=1.0)
    fixed_cost_feedback: float = option(
        0.2, "EMA weight of the measured plan phase and fixed update cost the planner "
        "leaves room for (0: the per-unit model alone, repeatable accuracies)",
        low=0.0, high=1.0)
    pi1: float = option(1.0, "offline compute expansion, used until live telemetry arrives "
                        "(> 0)", low=0.0)
    pi2: float = option(1.0, "offline memory expansion, used until live telemetry arrives "
                        "(> 0)", low=0.0)
    # the deadline modes always leave this room (DeadlineBudget.budget_ms); in sigma*T
    # mode a plan that fills sigma*T to the last percent is over it on every other batch
    # from timing scatter alone
    sigma_margin: bool = option(False, "sigma*T mode: plans leave room for the scatter of "
                                "the batch's time around their prediction (learnt, "
                                "FixedCosts.margin_ms)")
    memory_budget_mb: float | None = option(
        None, "saved-activation budget of an update, MiB (2**20 bytes; None: off): plans "
        "meet sigma*T (or the deadline) and this at once; not with activation_bits",
        low=0.0)

    def validate(self) -> None:
        """Raise ValueError naming the first bad value."""
        super().validate()
        if self.forward_feedback not in predictor.FEEDBACK_MODES:
            raise ValueError(f"forward_feedback {self.forward_feedback!r} not in "
                             f"{predictor.FEEDBACK_MODES}")
        if not 0.0 < self.sigma <= 1.0 or math.isnan(self.sigma):
            raise ValueError(f"sigma {self.sigma} outside (0, 1]: the budget is a share of "
                             f"the full update's time T")
        if isinstance(self.n_t, bool) or not isinstance(self.n_t, int) or self.n_t < 1:
            raise ValueError(f"n_t must be a positive integer, got {self.n_t!r}")
        if not (self.pi1 > 0 and self.pi2 > 0):
            raise ValueError(f"expansion coefficients must be > 0, got {self.pi1}, {self.pi2}")
        check_budget_mib("memory_budget_mb", self.memory_budget_mb)
        BackwardFeedback(alpha=self.backward_feedback)  # raises on a bad alpha
        FixedCosts(alpha=self.fixed_cost_feedback)


@dataclass
class UnitLayout:
    """What planning needs of a model: unit names, stages, MAC counts (no weights)."""

    model_name: str
    arch: str
    unit_names: list[str]
    stage_start: np.ndarray  # per unit: where a reforward from it starts (reuse boundary)
    stage_of_unit: np.ndarray
    stage_first_unit: np.ndarray  # per stage
    macs_fwd: np.ndarray
    macs_dx: np.ndarray
    macs_dw: np.ndarray
    eta: np.ndarray
    input_shape: tuple[int, ...]
    kinds: tuple[str, ...] = ()  # per unit: conv, linear, bn, ln, attn

    @classmethod
    def from_staged(cls, staged: StagedModel, model_name: str = "",
                    restart: bool = True) -> UnitLayout:
        """The layout of a decomposed model. `restart`: a reforward from unit d replays
        the outputs of its stage's units before d (StagedModel.restart_start), so the cost
        model's reuse boundary of d is d itself where that holds; False: the first unit
        of d's stage (what an engine that keeps no unit outputs runs)."""
        units = staged.units
        starts = staged.restart_start() if restart else staged.stage_start()
        return cls(model_name or staged.arch, staged.arch, [u.name for u in units],
                   starts, np.array([u.stage for u in units]),
                   np.array([s.first_unit for s in staged.stages]),
                   np.array([u.macs_fwd for u in units], dtype=np.float64),
                   np.array([u.macs_dx for u in units], dtype=np.float64),
                   np.array([u.macs_dw for u in units], dtype=np.float64),
                   np.array([u.eta for u in units], dtype=np.float64),
                   tuple(staged.input_shape), tuple(u.kind for u in units))

    @property
    def n_units(self) -> int:
        return len(self.unit_names)

    def trainable(self, which: str) -> np.ndarray:
        """Units a plan may update: "norm" (BN/LayerNorm/GroupNorm, their affine, as
        Tent) or "all" (every unit, the paper's layer-wise reading)."""
        if which not in TRAINABLE:
            raise ValueError(f"trainable {which!r} not in {TRAINABLE}")
        return np.array([which == "all" or k in NORM_UNIT_KINDS for k in self.kinds], dtype=bool)

    @property
    def n_stages(self) -> int:
        return len(self.stage_first_unit)


def mac_profile(layout: UnitLayout, forward_ms: float, batch_size: int) -> predictor.UnitProfile:
    """Default profile: per-unit times proportional to MACs, scaled so sum(r) = forward_ms."""
    scale = forward_ms / max(layout.macs_fwd.sum(), 1.0)
    return predictor.UnitProfile(
        model=layout.arch, device="mac-estimate", batch_size=batch_size,
        input_shape=tuple(layout.input_shape), unit_names=list(layout.unit_names),
        w_ms=layout.macs_dw * scale, x_ms=layout.macs_dx * scale,
        r_ms=layout.macs_fwd * scale, eta=layout.eta.copy(), forward_ms=float(forward_ms))


@dataclass
class PlanOutcome:
    """A plan and what the cost model predicted for it (what `observe` checks)."""

    plan: planner.Plan
    unit_ms: np.ndarray  # predicted backward cost per unit (w + x), ms
    predicted_backward_ms: float  # T_b' of the plan without the fixed overhead; 0 if empty
    predicted_reforward_ms: float  # T_re' of the plan; 0 if empty
    forward_ms: float  # T_f the plan was made with (measured forward + plan phase)
    overhead_ms: float  # the fixed update cost the plan left room for
    no_room: str  # why no candidate unit fits the budget; "" when one does
    deadline_ms: float = math.nan  # the batch's deadline (NaN: sigma*T mode)
    forward_misses: bool = False  # the measured forward alone is over the deadline
    skipped: bool = False  # no plan could fit: not solved, the plan phase was skipped
    margin_ms: float = 0.0  # deadline modes: room left for the batch time's scatter
    memory: MemoryPlan | None = None  # with a memory budget: keeps, predicted saved bytes
    batch_size: int = 0  # the batch size it was made for
    made_for_ms: float = math.nan  # the measured (or expected) forward it was made with
    importance: np.ndarray | None = None  # plan ahead: the importance it was made from

    @property
    def updates(self) -> bool:
        return bool(np.asarray(self.plan.update).any())

    @property
    def budget_share(self) -> float:
        """The budget as a share of the full update, budget_ms / T (sigma in sigma*T
        mode; what a deadline amounts to otherwise); 0 when T is not > 0."""
        full = self.plan.full_ms
        return float(self.plan.budget_ms / full) if full > 0 and math.isfinite(full) else 0.0


@dataclass
class Measured:
    """What a batch that followed a plan measured, ms. `reforward_ms` None: no reforward
    ran (parallel mode), so the plan's predicted reforward is not part of the check."""

    forward_ms: float
    plan_ms: float
    adapted: bool
    backward_ms: float = math.nan
    reforward_ms: float | None = 0.0
    planned: bool = True  # False: the plan phase was skipped (no plan could fit)
    total_ms: float = math.nan  # the whole batch (sequential mode): the deadline margin


class _TimesCache:
    """Unit times of a profile, cached (a profile is replaced, never changed in place):
    Eq. 4 times per expansion; "uniform" planning times per ms of forward."""

    def __init__(self) -> None:
        self._rt: tuple = (None, None, ())  # (profile, pis, (w, x, r))
        self._ut: tuple = (None, None, ())  # (profile, key, (w, x, r, w + x, rest of T))

    def runtime(self, prof: UnitProfile, pis: tuple[float, float]) -> tuple[np.ndarray, ...]:
        if self._rt[0] is not prof or self._rt[1] != pis:
            self._rt = (prof, pis, predictor.runtime_times(prof, *pis))
        return self._rt[2]

    def per_forward_ms(self, prof: UnitProfile, pis: tuple[float, float], grad_from: int,
                       factor: float, reforward_twice: bool) -> tuple:
        key = (pis, grad_from, factor, reforward_twice)
        if self._ut[0] is not prof or self._ut[1] != key:
            w, x, r = predictor.planning_times(prof, *pis, 1.0, "uniform", grad_from, factor)
            r = 2.0 * r if reforward_twice else r
            self._ut = (prof, key, (w, x, r, w + x, planner.full_ms(w, x, r, 0.0, 0.0)))
        return self._ut[2]


class PlanningService(DeadlineBudget):
    """Cost model + planner + fixed costs + feedback loops, shared by engine and node; the
    batch's deadline comes from the runtime's DeadlineBudget."""

    def __init__(self, layout: UnitLayout, config: PlanningConfig | None = None,
                 profile: predictor.UnitProfile | None = None,
                 reforward_twice: bool = False) -> None:
        """`reforward_twice`: the engine's lazy graph mode re-runs the tail once more for
        the backward, so every unit's reforward time counts twice and the backward it
        measures is not comparable with the prediction (no backward/fixed-cost learning)."""
        self.layout, self.config = layout, config or PlanningConfig()
        self.config.validate()
        if profile is not None:
            profile.check_units(layout.unit_names)
        self.profile = profile
        self.reforward_twice = reforward_twice
        self.backward_fb = BackwardFeedback(alpha=self.config.backward_feedback)
        self.fixed = FixedCosts(alpha=self.config.fixed_cost_feedback)
        self._pis: tuple[float, float] | None = None  # live telemetry (pi1, pi2)
        self._mac = mac_profile(layout, 1.0, 1)  # unitless shape, scaled per batch
        self._floor_cache: tuple = (None, 0)
        self._floor_least = ""  # the least sigma at which the floor's cheapest unit fits
        self._zeros = np.zeros(layout.n_units)
        self._times = _TimesCache()

    # ------------------------------------------------------------ expansion
    def set_expansion(self, pi1: float, pi2: float) -> None:
        """Live expansion factors from telemetry (AdaShadow §3.2 runtime calibration)."""
        if not (math.isfinite(pi1) and math.isfinite(pi2) and pi1 > 0 and pi2 > 0):
            raise ValueError(f"expansion coefficients must be finite and > 0, got {pi1}, {pi2}")
        self._pis = (float(pi1), float(pi2))

    def clear_expansion(self) -> None:
        """Telemetry went stale: back to the offline factors of the config."""
        self._pis = None

    @property
    def expansion(self) -> tuple[float, float, bool]:
        """(pi1, pi2, live)."""
        if self._pis is not None:
            return self._pis[0], self._pis[1], True
        return self.config.pi1, self.config.pi2, False

    def feedback_mode(self) -> str:
        """The forward feedback actually applied (module docstring)."""
        mode = self.config.forward_feedback
        if self.profile is None or (mode == "memory" and self._pis is None):
            return "uniform"
        return mode

    # ------------------------------------------------------------ cost model
    def unit_times(self, forward_ms: float, grad_from: int = 0) -> tuple[np.ndarray, ...]:
        """Predicted (w, x, r) in ms for a batch whose forward took `forward_ms` and
        recorded the autograd graph from unit `grad_from` on."""
        per = self._per_forward_ms(forward_ms, grad_from)
        if per is not None:
            return tuple(forward_ms * t for t in per[:3])
        pi1, pi2, _ = self.expansion
        w, x, r = predictor.planning_times(self.profile or self._mac, pi1, pi2, forward_ms,
                                           self.feedback_mode(), grad_from,
                                           self.backward_fb.factor)
        return w, x, (2.0 * r if self.reforward_twice else r)

    def _per_forward_ms(self, forward_ms: float, grad_from: int) -> tuple | None:
        """"uniform" feedback scales every time by the forward: (w, x, r, w + x, T - T_f -
        overhead) per ms of forward (_TimesCache); None for the other modes or a forward
        that is not > 0."""
        if not (self.feedback_mode() == "uniform" and math.isfinite(forward_ms)
                and forward_ms > 0):
            return None
        return self._times.per_forward_ms(self.profile or self._mac, self.expansion[:2],
                                          grad_from, self.backward_fb.factor,
                                          self.reforward_twice)

    def _problem(self, w, x, r, importance, forward_ms: float, overhead_ms: float,
                 deadline_ms: float = math.nan) -> planner.PlanProblem:
        return planner.PlanProblem(w=w, x=x, r=r, stage_start=self.layout.stage_start,
                                   importance=importance, forward_ms=forward_ms,
                                   sigma=float(self.config.sigma), overhead_ms=overhead_ms,
                                   budget_ms=None if math.isnan(deadline_ms) else deadline_ms)

    def _importance(self, importance, candidates, reachable_from: int) -> np.ndarray:
        a = np.asarray(importance, dtype=np.float64)
        if a.shape != (self.layout.n_units,):
            raise ValueError(f"importance has shape {a.shape}, the model has "
                             f"{self.layout.n_units} units")
        a = np.maximum(np.nan_to_num(a, nan=0.0, posinf=0.0, neginf=0.0), 0.0)
        if candidates is not None:
            a = np.where(np.asarray(candidates, dtype=bool), a, 0.0)
        a[:reachable_from] = 0.0
        return a

    # ------------------------------------------------------------ planning
    def plan(self, importance: np.ndarray, forward_ms: float, *, grad_from: int = 0,
             candidates: np.ndarray | None = None, batch_size: int = 1,
             memory: MemoryCosts | None = None) -> PlanOutcome:
        """The optimal plan within the budget of this batch of `batch_size` frames: sigma*T,
        or its deadline, and the memory budget (on `memory`, the batch's costs) if set.
        `candidates`: units that may be updated (None: those with importance > 0); units
        below `grad_from` cannot be updated (no graph was recorded there)."""
        if not (math.isfinite(forward_ms) and forward_ms >= 0):
            raise ValueError(f"forward_ms={forward_ms} is not a valid time")
        a = self._importance(importance, candidates, 0 if self.reforward_twice else grad_from)
        w, x, r = self.unit_times(forward_ms, grad_from)
        deadline, margin = self.budget_ms(batch_size)
        tf, oh = forward_ms + self.fixed.plan_phase_ms, self.fixed.overhead_ms
        sigma_t = math.nan  # sigma*T, when a margin is planned into below it
        if math.isnan(deadline) and self.config.sigma_margin and self.fixed.margin_ms > 0:
            margin = self.fixed.margin_ms
            sigma_t = float(self.config.sigma) * planner.full_ms(w, x, r, tf, oh)
        problem = self._problem(w, x, r, a, tf, oh, deadline - margin if math.isnan(sigma_t)
                                else max(sigma_t - margin, 0.0))
        mib = self.config.memory_budget_mb
        plan, mem = solve_plan(problem, int(self.config.n_t), mib, memory)
        if not math.isnan(sigma_t):  # the batch's budget is sigma*T; the margin is inside it
            plan = replace(plan, budget_ms=sigma_t)
        bwd = planner.backward_cost(w, x, plan.update)
        refwd = (float(r[self.layout.stage_start[plan.first_updated]:].sum())
                 if plan.first_updated < self.layout.n_units else 0.0)
        cand = candidates if candidates is not None else (a > 0 if a.any() else None)
        no_room = "" if plan.update.any() else self._no_room(problem, plan, cand, forward_ms)
        if not (no_room or plan.update.any()) and memory is not None and mib is not None:
            no_room = memory_no_room(memory, cand, mib)
        return PlanOutcome(plan, w + x, bwd, refwd, problem.forward_ms, problem.overhead_ms,
                           no_room, deadline, forward_ms > deadline, margin_ms=margin,
                           memory=mem, batch_size=batch_size, made_for_ms=forward_ms)

    def empty_outcome(self, forward_ms: float, batch_size: int = 1, reason: str = "", *,
                      grad_from: int | None = None) -> PlanOutcome:
        """The empty plan of a batch that no plan can fit, not solved (the batch skipped
        its plan phase): budget, full time and `reason` (default: why no unit fits, as
        the graph floor predicted from the last forward). `grad_from`: where its forward
        recorded the graph (None: nowhere). Scalar work only under "uniform" feedback
        (the hot path of a batch served without update)."""
        if not (math.isfinite(forward_ms) and forward_ms >= 0):
            raise ValueError(f"forward_ms={forward_ms} is not a valid time")
        n = self.layout.n_units
        g = n if grad_from is None else grad_from
        per = self._per_forward_ms(forward_ms, g)
        if per is not None:
            unit_ms, rest = forward_ms * per[3], forward_ms * per[4]
        else:
            w, x, r = self.unit_times(forward_ms, g)
            unit_ms, rest = w + x, planner.full_ms(w, x, r, 0.0, 0.0)
        tf, oh = forward_ms + self.fixed.plan_phase_ms, self.fixed.overhead_ms
        full = tf + oh + rest
        deadline = self.deadline_ms(batch_size)
        budget = float(self.config.sigma) * full if math.isnan(deadline) else deadline
        plan = planner.Plan(update=np.zeros(n, dtype=bool), first_updated=n, objective=0.0,
                            predicted_total_ms=tf, budget_ms=budget, full_ms=full, solve_ms=0.0)
        reason = reason or no_room_text(tf, oh, budget, not math.isnan(deadline), forward_ms,
                                        self.fixed.plan_phase_ms, self.describe_deadline()
                                        ) + (self._floor_least if math.isnan(deadline) else "")
        return PlanOutcome(plan, unit_ms, 0.0, 0.0, tf, oh, reason, deadline,
                           forward_ms > deadline, skipped=True, batch_size=batch_size,
                           made_for_ms=forward_ms)

    def refit(self, outcome: PlanOutcome, forward_ms: float, batch_size: int) -> PlanOutcome:
        """`outcome`, made before its batch's forward (plan ahead, from the forwards before),
        for the forward the batch measured: under "uniform" feedback every per-unit time
        scales with the forward, so the plan's predicted times and sigma*T do too (its
        units stay); a deadline plan that no longer fits with its margin is emptied and
        says why. An empty plan is re-made for the measured forward."""
        if not (math.isfinite(forward_ms) and forward_ms >= 0):
            raise ValueError(f"forward_ms={forward_ms} is not a valid time")
        if not outcome.updates:
            return self.empty_outcome(forward_ms, batch_size)
        made = outcome.made_for_ms
        k = forward_ms / made if (self.feedback_mode() == "uniform" and math.isfinite(made)
                                  and made > 0) else 1.0
        plan = outcome.plan
        phase = outcome.forward_ms - made  # the plan phase the plan left room for
        tf = forward_ms + phase
        total = tf + (plan.predicted_total_ms - outcome.forward_ms) * k
        full = tf + (plan.full_ms - outcome.forward_ms) * k
        deadline, margin = self.budget_ms(batch_size)
        if not math.isnan(deadline) and total > deadline - margin:
            late = (f"the forward took {forward_ms:.3g} ms where the plan made before it "
                    f"expected {made:.3g} ms: with it the plan ({total:.3g} ms) no longer "
                    f"fits the deadline {deadline:.3g} ms ({self.describe_deadline()})")
            return self.empty_outcome(forward_ms, batch_size, late)
        budget = float(self.config.sigma) * full if math.isnan(deadline) else deadline
        plan = replace(plan, predicted_total_ms=total, full_ms=full, budget_ms=budget)
        return replace(outcome, plan=plan, unit_ms=outcome.unit_ms * k,
                       predicted_backward_ms=outcome.predicted_backward_ms * k,
                       predicted_reforward_ms=outcome.predicted_reforward_ms * k,
                       forward_ms=tf, made_for_ms=forward_ms, deadline_ms=deadline,
                       forward_misses=forward_ms > deadline, margin_ms=margin)

    def no_time(self, forward_ms: float, batch_size: int = 1, *, grad_from: int = 0,
                candidates: np.ndarray | None = None) -> str:
        """Why no plan can fit a batch whose forward took `forward_ms` ("" when one may),
        known before its plan phase, which is then skipped: the forward and the expected
        plan phase already reach the deadline, or (with `candidates`, the units a plan may
        update) not even the cheapest one-unit plan fits the budget."""
        deadline, margin = self.budget_ms(batch_size)
        plan_ms = self.fixed.plan_phase_ms
        if not math.isnan(deadline) and forward_ms + plan_ms >= deadline:
            return late_text(forward_ms, plan_ms, deadline, self.describe_deadline())
        if candidates is None:
            return ""
        w, x, r = self.unit_times(forward_ms, grad_from)
        problem = self._problem(w, x, r, self._zeros, forward_ms + plan_ms,
                                self.fixed.overhead_ms, deadline - margin)
        reach = np.asarray(candidates, dtype=bool)
        if grad_from > 0 and not self.reforward_twice:
            reach = reach & (np.arange(len(reach)) >= grad_from)
        if planner.lowest_feasible_unit(problem, reach, validated=True) < len(reach):
            return ""
        outcome = self.empty_outcome(forward_ms, batch_size, grad_from=grad_from)
        return outcome.no_room + least_text(problem, reach, outcome.plan.budget_ms)

    def _no_room(self, problem: planner.PlanProblem, plan: planner.Plan,
                 candidates: np.ndarray | None, forward_ms: float) -> str:
        """Why no candidate unit fits the budget at all, or ""."""
        if planner.lowest_feasible_unit(problem, candidates, validated=True) < len(problem.w):
            return ""
        return no_room_text(problem.forward_ms, problem.overhead_ms, plan.budget_ms,
                            problem.budget_ms is not None, forward_ms, self.fixed.plan_phase_ms,
                            self.describe_deadline()) + least_text(problem, candidates,
                                                                   plan.budget_ms)

    def graph_floor(self, last_forward_ms: float, candidates: np.ndarray,
                    batch_size: int = 1) -> int:
        """Lowest unit that any plan within the budget of a batch of `batch_size` frames
        can update (n_units: none), from the last forward (`last_forward_ms`, of a batch
        that size); the engine records the autograd graph from its stage on."""
        c = self.config
        k = round(self.backward_fb.factor, 2)  # the floor moves little with it
        scaled = self.profile is None or c.forward_feedback != "off"
        last = last_forward_ms
        known = math.isfinite(last) and last > 0
        # fixed costs in forwards (unitless, so a scaled floor does not depend on the
        # forward's speed), rounded down to 1/20: recomputed only when they move by 5 %
        share = tuple(math.floor(20.0 * v / last) / 20.0 if known else 0.0
                      for v in (self.fixed.plan_phase_ms, self.fixed.overhead_ms))
        deadline = self.deadline_ms(batch_size)
        budget = None  # sigma*T; a deadline: in forwards (scaled) rounded up to 1/20, or ms
        if not math.isnan(deadline):
            if not known:
                return 0  # no forward measured yet: record the whole graph
            if last + self.fixed.plan_phase_ms >= deadline:
                return self.layout.n_units  # the forward and plan phase alone reach it
            budget = math.ceil(20.0 * deadline / last) / 20.0 if scaled else deadline
        elif not 0 < c.sigma <= 1:
            return 0
        key = (self.expansion, c.sigma, id(self.profile), scaled or last, k, share, budget)
        if self._floor_cache[0] != key:
            w, x, r = self._times.runtime(self.profile or self._mac, self.expansion[:2])
            # scaled times: the budget is proportional to the forward, so the floor does
            # not depend on it; unscaled: a faster forward than the last only lowers it
            tf = float(r.sum()) if scaled else 0.8 * last
            if not math.isfinite(tf):
                return 0
            absolute = math.nan if budget is None else budget * (tf if scaled else 1.0)
            problem = self._problem(k * w, k * x, r, self._zeros, tf * (1.0 + share[0]),
                                    tf * share[1], absolute)
            d = planner.lowest_feasible_unit(problem, candidates, validated=True)
            # sigma*T: what would let a unit fit, for the served batches' no-room reason
            self._floor_least = least_text(problem, candidates) \
                if d >= self.layout.n_units and budget is None else ""
            self._floor_cache = (key, d)
        return self._floor_cache[1]

    # ------------------------------------------------------------ feedback
    def observe(self, outcome: PlanOutcome | None, measured: Measured) -> None:
        """Learn from a batch: its plan phase always; when it followed `outcome` (a plan
        of this service) and updated, the backward correction and the update's fixed cost.
        An external plan (outcome None) teaches only the plan phase; a batch that skipped
        its plan phase (`measured.planned` False) forgets a share of it instead. A planned
        sequential batch teaches the deadline margin and the retry backoff (total_ms)."""
        if measured.planned:
            self.fixed.update_plan(measured.plan_ms, measured.forward_ms)
        else:
            self.fixed.skip_plan()
        if outcome is not None and not outcome.skipped and measured.reforward_ms is not None:
            self.fixed.update_total(outcome.plan.predicted_total_ms, measured.total_ms,
                                    measured.forward_ms)
            self.fixed.update_deadline(measured.adapted, measured.total_ms, outcome.deadline_ms)
        if not measured.adapted:
            self.fixed.idle()
            return
        if outcome is None or self.reforward_twice:
            return  # no prediction to check (lazy: the backward re-runs the tail)
        self.backward_fb.update(outcome.predicted_backward_ms, measured.backward_ms)
        predicted = outcome.predicted_backward_ms
        spent = measured.backward_ms
        if measured.reforward_ms is not None:
            predicted += outcome.predicted_reforward_ms
            spent += measured.reforward_ms
        self.fixed.update_adapt(predicted, spent, measured.forward_ms)


    # ------------------------------------------------------------ what the loops learnt
    @property
    def backward_factor(self) -> float:
        """The closed-loop correction of predicted backward times."""
        return self.backward_fb.factor

    @property
    def plan_phase_ms(self) -> float:
        """The learnt plan phase the budget leaves room for."""
        return self.fixed.plan_phase_ms

    @property
    def overhead_ms(self) -> float:
        """The learnt fixed cost of any update."""
        return self.fixed.overhead_ms


def no_room_text(tf_ms: float, overhead_ms: float, budget_ms: float, deadline: bool,
                 forward_ms: float, plan_phase_ms: float, deadline_what: str) -> str:
    """Why no unit fits the budget `budget_ms` (sigma*T, or a deadline described by
    `deadline_what`) of a batch whose forward took `forward_ms` (T_f with the plan phase:
    `tf_ms`; `overhead_ms`: the update's fixed cost)."""
    if deadline and tf_ms >= budget_ms:
        return late_text(forward_ms, plan_phase_ms, budget_ms, deadline_what)
    fixed = (f"after the forward and plan phase ({tf_ms:.3g} ms) and the update's fixed "
             f"cost ({overhead_ms:.3g} ms)")
    if deadline:
        return (f"no unit fits the deadline {budget_ms:.3g} ms ({deadline_what}) {fixed}: "
                f"plans stay empty")
    return (f"no unit fits the budget sigma*T = {budget_ms:.3g} ms {fixed}: plans stay "
            f"empty, raise sigma to adapt")


def least_text(problem: planner.PlanProblem, candidates: np.ndarray | None,
               budget_ms: float = math.inf) -> str:
    """What would let the cheapest candidate unit fit (the no-room diagnostic's second
    half): the least sigma (sigma*T mode) or the least deadline, ms; "" when the forward
    and plan phase alone already reach `budget_ms` (the reason says so)."""
    cost = planner.cheapest_unit_ms(problem, candidates)
    if not math.isfinite(cost) or problem.forward_ms >= budget_ms:
        return ""
    if problem.budget_ms is not None:
        return f"; the cheapest unit fits a deadline >= {cost:.3g} ms"
    full = planner.full_ms(np.asarray(problem.w), np.asarray(problem.x),
                           np.asarray(problem.r), problem.forward_ms, problem.overhead_ms)
    least = cost / full if full > 0 else math.inf
    if least > 1.0:
        return "; no sigma <= 1 fits a unit"
    return f"; the cheapest unit fits at sigma >= {math.ceil(least * 1000) / 1000:.3f}"


def telemetry_pis(compute_expansion: float, memory_expansion: float) -> tuple[float, float]:
    """(pi1, pi2) from a telemetry reading; unknown (NaN) or non-positive values count as
    1 (offline conditions), as ResourceTelemetry marks unknown values NaN."""
    return tuple(float(v) if math.isfinite(v) and v > 0 else 1.0  # type: ignore[return-value]
                 for v in (compute_expansion, memory_expansion))


def layout_from_card(card_path: str | Path, restart: bool = True) -> UnitLayout:
    """The unit layout of a model card's architecture (random weights: only the structure
    is used), named as perception names it (card name, else arch); `restart`: as
    UnitLayout.from_staged (what the engine with its default settings plans with)."""
    card = load_card(card_path)
    size = card.image_size
    staged = decompose(build_card_model(card), (3, size, size), arch=card.arch)
    return UnitLayout.from_staged(staged, card.name or card.arch, restart=restart)
