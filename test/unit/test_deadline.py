"""Deadline budgets (issue #18): the arithmetic of tta_core.runtime.deadline, the planning
service budgeting the whole batch against a deadline, the engine serving a batch without
planning when nothing can fit, and the streaming bench's deadline share. Exact numbers, no
wall clock: the flat profile's times are used unscaled (forward feedback "off")."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import CARD
from torch import nn

from tta_core.adashadow import planner
from tta_core.adashadow.engine import AdaShadowEngine, EngineConfig
from tta_core.adashadow.planning import (
    Measured,
    PlanningConfig,
    PlanningService,
    UnitLayout,
    layout_from_card,
)
from tta_core.adashadow.predictor import UnitProfile
from tta_core.api import DeadlineTunable
from tta_core.eval.bench_config import BenchConfig
from tta_core.eval.bench_stream import stream_options
from tta_core.eval.streaming import recorded_step, simulate_stream
from tta_core.model.norms import set_bn_mode
from tta_core.model.source import load_source
from tta_core.model.units import decompose
from tta_core.model.zoo import build_model
from tta_core.registry import build_method
from tta_core.runtime.deadline import DeadlineConfig, batch_deadline_ms, describe


# ---------------------------------------------------------------- deadline arithmetic
@pytest.mark.parametrize(("settings", "batch", "speed", "want"), [
    ({"deadline_mode": "fixed", "deadline_ms": 40.0}, 16, None, 40.0),
    ({"deadline_mode": "fixed", "deadline_ms": 5.0, "deadline_per": "frame"}, 16, None, 80.0),
    ({"deadline_mode": "camera", "camera_hz": 20.0}, 1, None, 50.0),
    ({"deadline_mode": "camera", "camera_hz": 20.0}, 8, None, 400.0),
    ({"deadline_mode": "speed", "distance_per_decision_m": 2.0}, 8, 5.0, 400.0),
    ({"deadline_mode": "speed", "distance_per_decision_m": 2.0}, 8, 20.0, 100.0),
    ({"deadline_mode": "speed", "distance_per_decision_m": 2.0}, 8, -20.0, 100.0),  # reverse
    ({"deadline_mode": "speed", "distance_per_decision_m": 2.0}, 1, 200.0, 20.0),  # min
    ({"deadline_mode": "speed", "distance_per_decision_m": 2.0}, 1, 0.5, 1000.0),  # max
    ({"deadline_mode": "speed"}, 1, 0.0, 1000.0),  # standing still: the longest
    ({"deadline_mode": "speed"}, 1, 0.005, 1000.0),
    ({"deadline_mode": "speed"}, 1, None, 20.0),  # unknown speed: the shortest
    ({"deadline_mode": "speed"}, 1, math.nan, 20.0),
])
def test_batch_deadline_per_mode(settings: dict, batch: int, speed: float | None,
                                 want: float) -> None:
    cfg = DeadlineConfig(**settings)
    cfg.validate()
    assert batch_deadline_ms(cfg, batch, speed) == pytest.approx(want, rel=1e-12)


def test_sigma_mode_has_no_deadline() -> None:
    assert math.isnan(batch_deadline_ms(DeadlineConfig(), 4, 10.0))
    assert not DeadlineConfig().has_deadline and DeadlineConfig("camera").has_deadline


@pytest.mark.parametrize(("settings", "named"), [
    ({"deadline_mode": "soon"}, "'soon'"),
    ({"deadline_per": "minute"}, "'minute'"),
    ({"deadline_ms": 0.0}, "deadline_ms=0.0"),
    ({"camera_hz": -30.0}, "camera_hz=-30.0"),
    ({"camera_hz": math.inf}, "camera_hz=inf"),
    ({"distance_per_decision_m": math.nan}, "distance_per_decision_m=nan"),
    ({"min_deadline_ms": True}, "min_deadline_ms=True"),
    ({"max_deadline_ms": "fast"}, "max_deadline_ms='fast'"),
    ({"min_deadline_ms": 300.0, "max_deadline_ms": 200.0}, "min_deadline_ms=300.0"),
])
def test_bad_deadline_settings_are_named_in_one_line(settings: dict, named: str) -> None:
    with pytest.raises(ValueError) as err:
        PlanningConfig(**settings).validate()
    assert named in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="batch_size"):
        batch_deadline_ms(DeadlineConfig("camera"), 0)


def test_describe_names_what_sets_the_deadline() -> None:
    assert describe(DeadlineConfig("camera", camera_hz=25.0)) == "camera 25 Hz (40 ms per frame)"
    assert "5 m/s" in describe(DeadlineConfig("speed"), -5.0)
    assert "unknown speed" in describe(DeadlineConfig("speed"), None)


# ---------------------------------------------------------------- planning service
@pytest.fixture(scope="module")
def layout() -> UnitLayout:
    return layout_from_card(CARD, restart=False)  # reuse boundaries at stage starts


def _flat(layout: UnitLayout) -> UnitProfile:
    """w 0.2, x 0.1, r 0.3 ms per unit. On the card's 19 units (stages start at 0, 2, 6,
    12, 18; BN units odd) a plan {17} costs 0.2 + 0.1 + 7 * 0.3 = 2.4 ms after the forward,
    {15, 17} 2.8, {13, 15, 17} 3.2, anything from unit 11 on at least 4.8."""
    n = layout.n_units
    return UnitProfile(model="small_resnet", device="cpu", batch_size=4,
                       input_shape=(3, 32, 32), unit_names=list(layout.unit_names),
                       w_ms=np.full(n, 0.2), x_ms=np.full(n, 0.1), r_ms=np.full(n, 0.3),
                       eta=np.ones(n), forward_ms=0.3 * n)


def _service(layout: UnitLayout, fixed: float = 0.0, **cfg) -> PlanningService:
    return PlanningService(layout, PlanningConfig(**{
        "forward_feedback": "off", "fixed_cost_feedback": fixed, **cfg}), _flat(layout))


def _plan(svc: PlanningService, layout: UnitLayout, forward_ms: float, batch: int = 1):
    return svc.plan(np.ones(layout.n_units), forward_ms, candidates=layout.trainable("norm"),
                    batch_size=batch)


@pytest.mark.parametrize(("deadline", "units"), [(7.5, [17]), (8.3, [13, 15, 17]),
                                                 (7.3, [])])
def test_a_fixed_deadline_is_the_budget_of_the_whole_batch(layout: UnitLayout,
                                                           deadline: float,
                                                           units: list[int]) -> None:
    """Forward 5 ms: 2.5 ms left fit {17} (2.4) but not {15, 17} (2.8); 3.3 ms fit three
    BN units; 2.3 ms fit none (and sigma plays no part)."""
    svc = _service(layout, deadline_mode="fixed", deadline_ms=deadline, sigma=0.01)
    out = _plan(svc, layout, 5.0)
    assert list(np.flatnonzero(out.plan.update)) == units
    assert out.plan.budget_ms == out.deadline_ms == deadline
    assert out.plan.predicted_total_ms <= deadline
    if units:
        assert out.plan.predicted_total_ms == pytest.approx(5.0 + 2.0 + 0.4 * len(units))
        assert out.no_room == ""
    else:
        assert out.no_room.startswith("no unit fits the deadline 7.3 ms (fixed 7.3 ms per batch)")
        assert not out.forward_misses


def test_a_late_batch_plans_into_what_is_left_of_its_deadline(layout: UnitLayout) -> None:
    """Deadline 8.3 ms, forward 5: on time {13, 15, 17} (3.2 ms after the forward); 0.8 ms
    late leaves 7.5 ms: {17} only; 3.4 ms late leaves 4.9 < the forward: served without
    update. Lateness 0 again restores the full plan; sigma*T ignores lateness."""
    svc = _service(layout, deadline_mode="fixed", deadline_ms=8.3)
    for late, units, misses in ((0.0, [13, 15, 17], False), (0.8, [17], False),
                                (3.4, [], True), (0.0, [13, 15, 17], False)):
        svc.set_lateness(late)
        out = _plan(svc, layout, 5.0)
        assert list(np.flatnonzero(out.plan.update)) == units, late
        assert out.deadline_ms == pytest.approx(8.3 - late) and out.forward_misses == misses
    svc.set_lateness(100.0)
    assert svc.deadline_ms() == 0.0  # never below 0
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match=f"lateness.*{bad}"):
            svc.set_lateness(bad)
    sigma = _service(layout, sigma=0.5)
    sigma.set_lateness(50.0)
    assert math.isnan(sigma.deadline_ms()) and _plan(sigma, layout, 5.0).plan.update.any()


def test_the_deadline_leaves_room_for_the_plan_phase_and_the_update_overhead(
        layout: UnitLayout) -> None:
    """Deadline 9 ms, forward 5, learnt plan phase 1 and fixed update cost 0.5: 2.5 ms are
    left for the units, so {17} (2.4) only; the per-unit model alone would fit 3 units."""
    svc = _service(layout, fixed=0.5, deadline_mode="fixed", deadline_ms=9.0)
    svc.fixed.plan_ms, svc.fixed.adapt_ms = 1.0, 0.5
    out = _plan(svc, layout, 5.0)
    assert list(np.flatnonzero(out.plan.update)) == [17]
    assert out.forward_ms == 6.0 and out.overhead_ms == 0.5
    assert out.plan.predicted_total_ms == pytest.approx(8.9)


def test_deadline_plans_leave_a_margin_for_the_scatter_of_the_batch_time(
        layout: UnitLayout) -> None:
    """Batches that took 0.2, 0.4 and 0.0 ms longer than their plans predicted (EMA 0.5):
    mean 0.15, variance 0.0275, margin 0.15 + 2.33 * 0.1658 = 0.536 ms. The 8.3 ms deadline
    then leaves 2.76 ms after the 5 ms forward: {17} alone instead of {13, 15, 17}."""
    svc = _service(layout, fixed=0.5, deadline_mode="fixed", deadline_ms=8.3)
    assert list(np.flatnonzero(_plan(svc, layout, 5.0).plan.update)) == [13, 15, 17]
    outcome = _plan(svc, layout, 5.0)
    predicted = outcome.plan.predicted_total_ms
    warm = svc.fixed.warmup  # the first batches (one-time allocations) teach nothing
    for i, extra in enumerate((4.0,) * warm + (0.2, 0.4, 0.0)):
        assert svc.fixed.margin_ms == 0.0  # not before three batches after the warm-up
        svc.observe(outcome, Measured(5.0, 0.0, True, 0.0, 0.0, total_ms=predicted + extra))
        assert svc.fixed.total_updates == i + 1
    assert svc.fixed.total_mean_ms == pytest.approx(0.15)
    assert svc.fixed.total_var_ms2 == pytest.approx(0.0275)
    margin = 0.15 + 2.33 * math.sqrt(0.0275)
    assert svc.fixed.margin_ms == pytest.approx(margin)
    out = _plan(svc, layout, 5.0)
    assert list(np.flatnonzero(out.plan.update)) == [17]
    assert out.margin_ms == pytest.approx(margin) and out.deadline_ms == 8.3
    assert out.plan.budget_ms == pytest.approx(8.3 - margin)
    # parallel mode (no reforward: the total is not the batch's) and sigma*T learn/use none
    svc.observe(out, Measured(5.0, 0.0, True, 0.0, None, total_ms=50.0))
    assert svc.fixed.total_updates == warm + 3
    svc.config.deadline_mode = "sigma"
    assert _plan(svc, layout, 5.0).margin_ms == 0.0


def test_per_frame_and_camera_deadlines_grow_with_the_batch(layout: UnitLayout) -> None:
    svc = _service(layout, deadline_mode="camera", camera_hz=100.0)
    assert _plan(svc, layout, 5.0, batch=4).plan.budget_ms == pytest.approx(40.0)
    assert _plan(svc, layout, 5.0, batch=1).plan.budget_ms == pytest.approx(10.0)
    svc.config.deadline_mode, svc.config.deadline_per, svc.config.deadline_ms = \
        "fixed", "frame", 2.0
    assert _plan(svc, layout, 5.0, batch=4).plan.budget_ms == pytest.approx(8.0)


def test_when_the_forward_alone_misses_the_deadline_the_batch_is_not_updated(
        layout: UnitLayout) -> None:
    svc = _service(layout, fixed=0.5, deadline_mode="fixed", deadline_ms=10.0)
    svc.fixed.plan_ms = 1.0
    out = _plan(svc, layout, 12.0)
    assert not out.plan.update.any() and out.forward_misses
    assert out.no_room == ("the forward alone (12 ms) misses the deadline 10 ms (fixed 10 ms "
                           "per batch): served without update")
    assert svc.no_time(12.0) == out.no_room
    # the forward fits, the plan phase does not: no time either, but not the forward's fault
    late = svc.no_time(9.5)
    assert late.startswith("the forward (9.5 ms) and the plan phase (1 ms) leave no time")
    empty = svc.empty_outcome(9.5, 1, late)
    assert empty.skipped and not empty.forward_misses and empty.no_room == late
    assert empty.plan.budget_ms == 10.0 and not empty.plan.update.any()
    assert svc.no_time(8.9) == ""
    assert _service(layout).no_time(1e9) == ""  # sigma*T: decided by the planner


def test_no_time_knows_before_the_plan_phase_when_no_unit_can_fit(layout: UnitLayout) -> None:
    """After a 5 ms forward a 7.3 ms deadline leaves 2.3 ms: the cheapest plan {17} takes
    2.4, so the plan phase is skipped, with the planner's own reason; 7.5 ms leave room.
    Units below the recorded graph do not count; sigma*T works alike."""
    bn = layout.trainable("norm")
    svc = _service(layout, deadline_mode="fixed", deadline_ms=7.3)
    assert svc.no_time(5.0) == ""  # without candidates: only the deadline itself
    assert svc.no_time(5.0, candidates=bn) == _plan(svc, layout, 5.0).no_room != ""
    svc.config.deadline_ms = 7.5
    assert svc.no_time(5.0, candidates=bn) == ""
    only_13 = np.arange(layout.n_units) == 13  # {13} alone takes 2.8 ms
    assert svc.no_time(5.0, candidates=only_13) != ""
    svc.config.deadline_ms = 7.9
    assert svc.no_time(5.0, candidates=only_13) == ""
    assert svc.no_time(5.0, candidates=only_13, grad_from=14) != ""  # 13 has no graph
    tiny = _service(layout, sigma=0.01)
    assert tiny.no_time(5.0, candidates=bn).startswith("no unit fits the budget sigma*T")


def test_speed_deadline_follows_the_speed(layout: UnitLayout) -> None:
    """2 m per decision: 5 m/s gives 400 ms, 20 m/s 100 ms (4x); unknown: the minimum."""
    svc = _service(layout, deadline_mode="speed", distance_per_decision_m=2.0,
                   min_deadline_ms=20.0, max_deadline_ms=1000.0)
    budgets = {}
    for speed in (5.0, 20.0, None):
        svc.set_speed(speed)
        budgets[speed] = _plan(svc, layout, 5.0).plan.budget_ms
    assert budgets[5.0] == pytest.approx(4 * budgets[20.0]) == pytest.approx(400.0)
    assert budgets[None] == 20.0
    svc.set_speed(math.nan)
    assert svc.speed_mps is None
    with pytest.raises(ValueError, match="inf"):
        svc.set_speed(math.inf)


def test_graph_floor_in_deadline_mode(layout: UnitLayout) -> None:
    """Unscaled times: the floor takes 0.8x the last forward; with a 7.5 ms deadline after
    a 5 ms forward every plan starts at or above unit 13 ({13}: 2.8 ms of 3.5 left); a
    deadline below the last forward: no unit; no forward measured yet: the whole graph."""
    svc = _service(layout, deadline_mode="fixed", deadline_ms=7.5)
    bn = layout.trainable("norm")
    assert svc.graph_floor(5.0, bn) == 13
    assert svc.graph_floor(5.0, bn) <= _plan(svc, layout, 5.0).plan.first_updated
    svc.config.deadline_ms = 3.0
    assert svc.graph_floor(5.0, bn) == layout.n_units
    assert svc.graph_floor(math.nan, bn) == 0
    scaled = PlanningService(layout, PlanningConfig(deadline_mode="fixed", deadline_ms=3.0))
    assert scaled.graph_floor(5.0, bn) == layout.n_units
    scaled.config.deadline_ms = 500.0
    assert scaled.graph_floor(5.0, bn) < layout.n_units


def test_a_skipped_plan_phase_is_forgotten_not_learnt(layout: UnitLayout) -> None:
    svc = _service(layout, fixed=0.5)
    svc.fixed.plan_ms, svc.fixed.plan_updates = 2.0, 5
    svc.observe(None, Measured(5.0, 0.01, False, planned=False))
    assert svc.fixed.plan_ms == pytest.approx(2.0 * (1 - svc.fixed.forget))
    svc.observe(None, Measured(5.0, 1.0, False))
    assert svc.fixed.plan_ms == pytest.approx(0.5 * 1.96 + 0.5 * 1.0)


def test_planner_absolute_budget_replaces_sigma() -> None:
    n = 4
    p = planner.PlanProblem(w=np.ones(n), x=np.zeros(n), r=np.zeros(n),
                            stage_start=np.arange(n), importance=np.ones(n), forward_ms=1.0,
                            sigma=0.0, budget_ms=3.0)
    plan = planner.solve(p)
    assert plan.budget_ms == 3.0 and int(plan.update.sum()) == 2
    assert planner.lowest_feasible_unit(p) == 0
    assert planner.full_ms(p.w, p.x, p.r, p.forward_ms, 0.0) == 5.0
    with pytest.raises(ValueError, match="budget_ms must be finite"):
        planner.solve(planner.PlanProblem(**{**p.__dict__, "budget_ms": -1.0}))
    with pytest.raises(ValueError, match="sigma"):
        planner.solve(planner.PlanProblem(**{**p.__dict__, "budget_ms": None}))


# ---------------------------------------------------------------- engine
def _engine(**cfg) -> AdaShadowEngine:
    torch.manual_seed(0)
    model = build_model("small_resnet", 10)
    set_bn_mode(model, "batch")
    return AdaShadowEngine(decompose(model, (3, 32, 32)),
                           EngineConfig(**{"fixed_cost_feedback": 0.0, **cfg}))


def _count_calls(monkeypatch, eng: AdaShadowEngine) -> dict[str, int]:
    calls = {"assessor": 0, "solve": 0}
    step, solve = eng.assessor.step, planner.solve

    def count_step(stats):
        calls["assessor"] += 1
        return step(stats)

    def count_solve(problem, n_t=planner.DEFAULT_N_T):
        calls["solve"] += 1
        return solve(problem, n_t)
    monkeypatch.setattr(eng.assessor, "step", count_step)
    monkeypatch.setattr(planner, "solve", count_solve)
    return calls


def test_engine_serves_without_planning_when_the_forward_misses_the_deadline(
        monkeypatch) -> None:
    """A deadline no forward can meet: the first batch (no forward measured yet) records
    the graph and is then served without assessor or planner; from the second on the graph
    floor knows that no plan fits and the forward runs plain. Nothing is updated."""
    eng = _engine(deadline_mode="fixed", deadline_ms=1e-3)
    calls = _count_calls(monkeypatch, eng)
    weights = [p.detach().clone() for p in eng.params]
    captures = []
    original = eng._forward
    monkeypatch.setattr(eng, "_forward",
                        lambda x, g, phases: captures.append(g) or original(x, g, phases))
    results = [eng.step(torch.randn(4, 3, 32, 32)) for _ in range(3)]
    assert captures == [0]  # only the first batch ran the engine's forward (whole graph)
    assert calls == {"assessor": 0, "solve": 0} and eng.assessor.history is None
    for res in results:
        assert not res.adapted and res.planning.forward_misses and res.planning.skipped
        assert res.planning.no_room.startswith("the forward alone (")
        assert "misses the deadline 0.001 ms (fixed 0.001 ms per batch)" in res.planning.no_room
        assert res.budget_ms == 1e-3 and res.planning.deadline_ms == 1e-3
        assert res.importance.shape == (len(eng.staged.units),) and not res.importance.any()
        assert math.isnan(res.loss) and res.logits.shape == (4, 10)
    for a, b in zip(weights, eng.params, strict=True):
        assert torch.equal(a, b)


def test_engine_with_a_tiny_sigma_skips_graph_assessor_and_planner(monkeypatch) -> None:
    """sigma so small that no unit fits: every batch is a plain forward (the graph floor
    is known before the forward), served with the no-room reason; the same logits as the
    engine's full pipeline with an empty plan."""
    eng = _engine(sigma=1e-4)
    calls = _count_calls(monkeypatch, eng)
    x = torch.randn(4, 3, 32, 32)
    res = eng.step(x)
    assert calls == {"assessor": 0, "solve": 0}
    assert not res.adapted and not res.planning.forward_misses and res.planning.skipped
    assert res.planning.no_room.startswith("no unit fits the budget sigma*T")
    assert math.isnan(res.planning.deadline_ms)
    assert res.budget_ms == pytest.approx(1e-4 * res.plan.full_ms)
    ref = _engine(sigma=1.0)
    empty = planner.Plan(np.zeros(len(ref.staged.units), bool), len(ref.staged.units), 0.0,
                         0.0, 0.0, 0.0, 0.0)
    torch.testing.assert_close(res.logits, ref.step(x, plan=empty).logits)


def test_served_batches_call_no_unit_hooks_and_planned_ones_collect_again() -> None:
    """A served batch suspends the unit-statistics hooks (PyTorch's fast call path); the
    next planned batch puts them back and its statistics are collected."""
    eng = _engine(sigma=1e-4)
    x = torch.randn(4, 3, 32, 32)
    eng.step(x)
    eng.step(x)  # served (no unit fits sigma*T)
    units = {id(u.module): u.module for u in eng.staged.units}.values()
    assert not any(m._forward_hooks for m in units if not isinstance(m, nn.BatchNorm2d))
    empty = planner.Plan(np.zeros(len(eng.staged.units), bool), len(eng.staged.units), 0.0,
                         0.0, 0.0, 0.0, 0.0)
    res = eng.step(x, plan=empty)  # an external plan: a planned forward, stats captured
    assert any(m._forward_hooks for m in units)
    assert len(res.importance) == len(eng.staged.units)
    eng.close()
    assert not any(m._forward_hooks for m in units)
    eng._collector.resume()  # closed for good
    assert not any(m._forward_hooks for m in units)


def test_engine_adapts_within_a_generous_camera_deadline() -> None:
    eng = _engine(deadline_mode="camera", camera_hz=0.5)  # 2 s per frame
    eng.step(torch.randn(4, 3, 32, 32))  # the assessor's history
    res = eng.step(torch.randn(4, 3, 32, 32) * 2 + 1)
    assert res.adapted and res.budget_ms == pytest.approx(8000.0)
    assert res.planning.no_room == "" and not res.planning.forward_misses
    assert not res.planning.skipped and res.importance.any()


def test_adashadow_method_takes_deadline_settings_and_speed() -> None:
    meth = build_method("adashadow", load_source(CARD)[0], input_shape=(3, 32, 32))
    try:
        assert isinstance(meth, DeadlineTunable)
        meth.set_deadline(deadline_mode="speed", distance_per_decision_m=3.0)
        meth.set_speed(10.0)
        assert meth.engine.planning.deadline_ms(8) == pytest.approx(300.0)
        with pytest.raises(ValueError, match="camera_hz=0"):
            meth.set_deadline(deadline_mode="camera", camera_hz=0)
        assert meth.config.deadline_mode == "speed"  # a refused change changes nothing
        with pytest.raises(ValueError, match="unknown deadline setting"):
            meth.set_deadline(speed=3)
    finally:
        meth.close()


# ---------------------------------------------------------------- streaming
def test_streaming_counts_the_batches_that_met_their_deadline() -> None:
    """10 Hz, batches of 2: each batch's deadline is 200 ms; steps of 150, 250, 200 ms
    (the third just in time) meet it 2 times out of 3."""
    r = simulate_stream([0] * 6, 10.0, recorded_step([0] * 6, [150.0, 250.0, 200.0]),
                        batch_size=2, queue_size=8, batch_wait_ms=1000.0)
    assert [b.frames for b in r.batches] == [(0, 1), (2, 3), (4, 5)]
    assert r.summary.deadline_met == pytest.approx(2 / 3) and r.summary.batches == 3


def test_stream_options_put_adashadow_on_the_camera_deadline() -> None:
    cfg = BenchConfig(methods=("adashadow", "tent"))
    opts = stream_options("adashadow", cfg, (3, 32, 32), 25.0)
    assert opts["deadline_mode"] == "camera" and opts["camera_hz"] == 25.0
    assert "deadline_mode" not in stream_options("tent", cfg, (3, 32, 32), 25.0)
    cfg.method_options = {"adashadow": {"deadline_mode": "sigma"}}
    assert stream_options("adashadow", cfg, (3, 32, 32), 25.0)["deadline_mode"] == "sigma"


def test_warm_up_learns_fixed_costs_and_leaves_the_state_as_it_was() -> None:
    """AdaShadow.warm_up: planned updates at sigma 1 on a sample batch teach the planning
    its fixed costs (the first deadline batch then plans with them), while weights, BN
    statistics, optimizer, deadline settings and lateness come back unchanged."""
    import copy

    from tta_core.api import WarmsUp
    from tta_core.model.zoo import build_model
    from tta_core.registry import build_method

    torch.manual_seed(0)
    meth = build_method("adashadow", build_model("small_resnet", 10), input_shape=(3, 32, 32),
                        deadline_mode="camera", camera_hz=500.0)
    assert isinstance(meth, WarmsUp)
    meth.set_lateness(1.5)
    before = copy.deepcopy(meth.model.state_dict())
    fixed = meth.engine.planning.fixed
    assert fixed.adapt_updates == 0 and fixed.overhead_ms == 0.0
    meth.warm_up(torch.randn(4, 3, 32, 32))
    after = meth.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert fixed.adapt_updates >= 2 and fixed.total_updates >= 2 and fixed.plan_phase_ms > 0
    assert meth.config.deadline_mode == "camera" and meth.config.sigma == 0.33
    assert meth.engine.planning.late_ms == 1.5
    assert not meth.engine.optimizer.state  # momentum forgotten
    meth.close()
