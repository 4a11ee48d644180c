"""The planning service (no rclpy): cost model, feedback loops, fixed costs, no-room rule.

The scheduler node and the engine both plan through it; these tests pin its numbers
without any ROS context (the node's wiring is tested over DDS in test_ros_nodes.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import CARD

from tta_core.adashadow import planner
from tta_core.adashadow.planning import (
    Measured,
    PlanningConfig,
    PlanningService,
    UnitLayout,
    layout_from_card,
    mac_profile,
    telemetry_pis,
)
from tta_core.adashadow.predictor import UnitProfile, planning_times
from tta_core.model.source import load_source
from tta_core.registry import build_method


@pytest.fixture(scope="module")
def layout() -> UnitLayout:
    return layout_from_card(CARD)


def _flat(layout: UnitLayout, eta: np.ndarray | None = None, g: float | None = None
          ) -> UnitProfile:
    """A flat profile on the card's units: w 0.2, x 0.1, r 0.3 ms (g: graph forward)."""
    n = layout.n_units
    return UnitProfile(model="small_resnet", device="cpu", batch_size=4,
                       input_shape=(3, 32, 32), unit_names=list(layout.unit_names),
                       w_ms=np.full(n, 0.2), x_ms=np.full(n, 0.1), r_ms=np.full(n, 0.3),
                       eta=np.ones(n) if eta is None else eta,
                       forward_ms=0.3 * n if g is None else g * n,
                       g_ms=None if g is None else np.full(n, g))


def _service(layout: UnitLayout, profile: UnitProfile | None = None, **cfg) -> PlanningService:
    return PlanningService(layout, PlanningConfig(**{"fixed_cost_feedback": 0.0, **cfg}),
                           profile)


@pytest.mark.parametrize("feedback", ["memory", "uniform", "off"])
def test_forward_feedback_rescales_the_profile(layout: UnitLayout, feedback: str) -> None:
    """A batch whose forward ran twice as slow as the profile: "uniform" doubles every
    time; "off" keeps the profile; "memory" without live telemetry degrades to "uniform"
    (pi1 = 1 is unknown, not measured). T = T_f + sum w + sum_{l>=2} x + sum r."""
    n = layout.n_units
    svc = _service(layout, _flat(layout), sigma=0.8, forward_feedback=feedback)
    out = svc.plan(np.ones(n), 2 * 0.3 * n)
    k = 1.0 if feedback == "off" else 2.0
    np.testing.assert_allclose(out.unit_ms, np.full(n, 0.3 * k), rtol=1e-6)
    full = 2 * 0.3 * n + k * (0.2 * n + 0.1 * (n - 1) + 0.3 * n)
    assert out.plan.full_ms == pytest.approx(full, rel=1e-6)


def test_memory_feedback_uses_live_telemetry_pi1(layout: UnitLayout) -> None:
    """With live telemetry, "memory" keeps its pi1 and solves pi2 from the forward: units of
    low eta (memory-bound) slow more than the forward did, unlike "uniform"; stale again
    (clear_expansion) it is "uniform"."""
    n = layout.n_units
    eta = np.where(np.arange(n) % 2 == 0, 4.0, 0.25)
    prof = _flat(layout, eta=eta)
    svc = _service(layout, prof, forward_feedback="memory")
    svc.set_expansion(1.5, 1.5)
    out = svc.plan(np.ones(n), 2 * 0.3 * n)
    want = planning_times(prof, 1.5, 1.5, 2 * 0.3 * n, "memory")
    np.testing.assert_allclose(out.unit_ms, want[0] + want[1], rtol=1e-6)
    slow = svc.unit_times(2 * 0.3 * n)[2] / 0.3
    assert slow[eta < 1].min() > 2.0 > slow[eta > 1].max()  # the forward slowed 2x
    svc.clear_expansion()
    np.testing.assert_allclose(svc.unit_times(2 * 0.3 * n)[2], 0.6, rtol=1e-6)


def test_forward_is_compared_with_the_graph_it_recorded(layout: UnitLayout) -> None:
    """A forward that recorded the graph from unit d on is compared with that kind of
    forward: as fast as it should be -> times unscaled."""
    n = layout.n_units
    prof = _flat(layout, g=0.45)  # recording the graph: +50 % forward
    svc = _service(layout, prof, sigma=0.8)
    d = int(layout.stage_first_unit[2])
    fwd = 0.3 * d + 0.45 * (n - d)
    np.testing.assert_allclose(svc.plan(np.ones(n), fwd, grad_from=d).unit_ms, 0.3, rtol=1e-6)
    assert svc.plan(np.ones(n), fwd, grad_from=0).unit_ms[0] < 0.3  # misread as faster


def test_units_below_the_graph_are_never_planned(layout: UnitLayout) -> None:
    n = layout.n_units
    d = int(layout.stage_first_unit[2])
    out = _service(layout, _flat(layout), sigma=1.0).plan(np.ones(n), 0.3 * n, grad_from=d)
    assert out.plan.update.any() and not out.plan.update[:d].any()


def test_observe_corrects_backward_times(layout: UnitLayout) -> None:
    """A plan whose backward measured 4x its prediction: with alpha 0.5 the next plans'
    w and x are scaled by exp(0.5 ln 4) = 2; an external plan (no outcome) teaches nothing."""
    n = layout.n_units
    svc = _service(layout, _flat(layout), sigma=0.8, backward_feedback=0.5)
    out = svc.plan(np.ones(n), 0.3 * n)
    assert out.predicted_backward_ms > 0
    svc.observe(None, Measured(0.3 * n, 0.0, True, 1e6, 0.0))
    assert svc.backward_factor == 1.0
    svc.observe(out, Measured(0.3 * n, 0.0, True, 4.0 * out.predicted_backward_ms, 0.0))
    assert svc.backward_factor == pytest.approx(2.0)
    np.testing.assert_allclose(svc.plan(np.ones(n), 0.3 * n).unit_ms, 0.6, rtol=1e-6)


def test_observe_learns_the_fixed_costs_and_leaves_room_for_them(layout: UnitLayout) -> None:
    """Measured plan phase 2 ms and 1.5 ms beyond the per-unit prediction: T grows by
    exactly their sum and the next plan still fits its budget."""
    n = layout.n_units
    svc = _service(layout, _flat(layout), sigma=0.8, fixed_cost_feedback=1.0)
    before = svc.plan(np.ones(n), 0.3 * n)
    assert before.updates
    per_unit = before.predicted_backward_ms + before.predicted_reforward_ms
    assert per_unit == pytest.approx(before.plan.predicted_total_ms - 0.3 * n)
    for _ in range(2):  # the first sample of each kind is the warm-up
        svc.observe(before, Measured(0.3 * n, 2.0, True, before.predicted_backward_ms,
                                     before.predicted_reforward_ms + 1.5))
    assert (svc.plan_phase_ms, svc.overhead_ms) == (pytest.approx(2.0), pytest.approx(1.5))
    after = svc.plan(np.ones(n), 0.3 * n)
    assert after.plan.full_ms == pytest.approx(before.plan.full_ms + 2.0 + 1.5)
    assert after.plan.predicted_total_ms <= after.plan.budget_ms


def test_observe_in_parallel_mode_checks_the_backward_only(layout: UnitLayout) -> None:
    """No reforward ran (reforward_ms None): measured backward + 1 ms against the predicted
    backward alone is 1 ms of fixed cost, not (1 ms - predicted reforward)."""
    n = layout.n_units
    svc = _service(layout, _flat(layout), sigma=0.8, fixed_cost_feedback=1.0)
    out = svc.plan(np.ones(n), 0.3 * n)
    for _ in range(2):
        svc.observe(out, Measured(0.3 * n, 0.0, True, out.predicted_backward_ms + 1.0, None))
    assert svc.overhead_ms == pytest.approx(1.0)


def test_no_room_says_why_and_clears(layout: UnitLayout) -> None:
    n = layout.n_units
    svc = _service(layout, _flat(layout), sigma=0.05)
    out = svc.plan(np.ones(n), 0.3 * n)
    assert not out.updates and "raise sigma" in out.no_room
    svc.config.sigma = 0.8
    assert svc.plan(np.ones(n), 0.3 * n).no_room == ""


def test_bad_inputs_are_named(layout: UnitLayout) -> None:
    svc = _service(layout)
    with pytest.raises(ValueError, match="forward_ms=nan"):
        svc.plan(np.ones(layout.n_units), float("nan"))
    with pytest.raises(ValueError, match="importance has shape"):
        svc.plan(np.ones(3), 1.0)
    with pytest.raises(ValueError, match="finite and > 0"):
        svc.set_expansion(float("inf"), 1.0)
    with pytest.raises(ValueError, match="forward_feedback 'x'"):
        PlanningService(layout, PlanningConfig(forward_feedback="x"))
    assert telemetry_pis(float("nan"), -1.0) == (1.0, 1.0)
    assert telemetry_pis(2.0, 1.5) == (2.0, 1.5)


def test_graph_floor_bounds_every_plan(layout: UnitLayout) -> None:
    """No plan reaches below the graph floor, and the floor is the lowest unit whose
    one-unit plan fits (MAC times scale with the forward, so the floor does not)."""
    rng = np.random.default_rng(0)
    n = layout.n_units
    for sigma in (0.3, 0.5, 0.8):
        svc = _service(layout, None, sigma=sigma)
        floor = svc.graph_floor(10.0, np.ones(n, dtype=bool))
        for _ in range(20):
            assert not svc.plan(rng.random(n), 10.0).plan.update[:floor].any()
        w, x, r = svc.unit_times(10.0)
        exact = planner.lowest_feasible_unit(planner.PlanProblem(
            w=w, x=x, r=r, stage_start=layout.stage_start, importance=np.zeros(n),
            forward_ms=10.0, sigma=sigma))
        assert floor == exact


def test_inline_plans_follow_telemetry_exactly_as_the_service(layout: UnitLayout) -> None:
    """The engine's inline plan with live pi1 = 2 equals a standalone service's plan for
    the same importance and forward (what the scheduler node runs), and unit times grow by
    Eq. 4's factor (2 eta + 1) / (eta + 1) over pi1 = 1."""
    model, _card = load_source(CARD)
    prof = mac_profile(layout, 5.0, 4)
    meth = build_method("adashadow", model, input_shape=(3, 32, 32), sigma=0.9,
                        forward_feedback="off", fixed_cost_feedback=0.0, profile=prof)
    torch.manual_seed(0)
    x = torch.randn(4, 3, 32, 32)
    meth.step(x)  # assessor history
    plans = {}
    for pi1 in (1.0, 2.0):
        meth.set_expansion(pi1, 1.0)
        svc = _service(layout, prof, sigma=0.9, forward_feedback="off")
        svc.set_expansion(pi1, 1.0)
        res = meth.step(x)
        out = svc.plan(res.importance, res.times.forward_ms)
        np.testing.assert_array_equal(res.plan.update, out.plan.update)
        assert res.plan.budget_ms == pytest.approx(out.plan.budget_ms)
        plans[pi1] = out
    k = (2 * layout.eta + 1) / (layout.eta + 1)
    np.testing.assert_allclose(plans[2.0].unit_ms, k * plans[1.0].unit_ms, rtol=1e-9)
    meth.close()
