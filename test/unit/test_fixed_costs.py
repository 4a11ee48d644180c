"""Fixed costs outside the per-unit model (tta_core.runtime.fixed_costs): the EMAs, and how the
engine plans with them (plan phase in T_f, the update's fixed cost in every plan)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tta_core.adashadow import planner
from tta_core.adashadow.engine import AdaShadowEngine, EngineConfig
from tta_core.adashadow.planning import UnitLayout, mac_profile
from tta_core.model.norms import set_bn_mode
from tta_core.model.units import decompose
from tta_core.model.zoo import build_model
from tta_core.runtime import fixed_costs as fc_mod
from tta_core.runtime.fixed_costs import FixedCosts


def test_emas_skip_the_warmup_start_at_the_next_sample_and_converge() -> None:
    fc = FixedCosts(alpha=0.5)
    fc.update_plan(9.0, 10.0)  # warm-up batch: ignored
    assert fc.plan_phase_ms == 0.0 and fc.plan_updates == 1
    fc.update_plan(2.0, 10.0)
    assert fc.plan_phase_ms == 2.0
    fc.update_plan(4.0, 10.0)
    assert fc.plan_phase_ms == pytest.approx(3.0)
    fc.update_adapt(1.0, 8.0, 10.0)  # warm-up
    for _ in range(30):  # the update always takes 0.7 ms more than the per-unit model says
        fc.update_adapt(1.0, 1.7, 10.0)
    assert fc.overhead_ms == pytest.approx(0.7, abs=1e-6)


def test_samples_are_clipped_to_the_forward_and_bad_pairs_ignored() -> None:
    fc = FixedCosts(alpha=1.0, warmup=0)
    fc.update_adapt(1.0, 500.0, 10.0)  # a preempted batch: at most one forward
    assert fc.overhead_ms == 10.0
    fc.update_adapt(5.0, 1.0, 10.0)  # faster than predicted: negative residual...
    assert fc.adapt_ms == -4.0 and fc.overhead_ms == 0.0  # ...never a negative cost
    n = fc.adapt_updates
    for pred, meas in ((float("nan"), 1.0), (1.0, float("inf")), (1.0, 0.0)):
        fc.update_adapt(pred, meas, 10.0)
    fc.update_plan(float("nan"), 10.0)
    assert fc.adapt_updates == n and fc.plan_updates == 0
    fc.reset()
    assert (fc.adapt_ms, fc.plan_ms, fc.adapt_updates) == (0.0, 0.0, 0)


def test_one_preempted_update_moves_the_estimate_by_little_a_lasting_rise_gets_through(
) -> None:
    """A 1.4 ms fixed cost, then one update preempted to 8 ms (forward 5 ms): the sample
    counts as twice the window's median, not as the whole forward; a cost that really rose
    to 3 ms is learnt as the window fills with it. The plan phase likewise."""
    fc = FixedCosts(alpha=0.2)
    fc.update_adapt(0.0, 9.0, 5.0)  # warm-up
    for _ in range(10):
        fc.update_adapt(0.1, 1.5, 5.0)
    assert fc.overhead_ms == pytest.approx(1.4)
    fc.update_adapt(0.1, 8.1, 5.0)  # residual 8 ms, clipped to the forward (5), then to 2.8
    assert fc.overhead_ms == pytest.approx(0.8 * 1.4 + 0.2 * 2.8)
    for _ in range(30):
        fc.update_adapt(0.1, 3.1, 5.0)
    assert fc.overhead_ms == pytest.approx(3.0, abs=0.01)
    fc.update_plan(9.0, 5.0)  # warm-up
    for _ in range(5):
        fc.update_plan(0.3, 5.0)
    fc.update_plan(4.0, 5.0)  # at most the median + a quarter forward: 1.55 ms
    assert fc.plan_phase_ms == pytest.approx(0.8 * 0.3 + 0.2 * 1.55)
    fresh = FixedCosts(alpha=0.2, warmup=0)  # fewer than OUTLIER_MIN samples: unbounded
    fresh.update_adapt(0.0, 1.0, 5.0)
    fresh.update_adapt(0.0, 4.0, 5.0)
    assert fresh.overhead_ms == pytest.approx(0.8 * 1.0 + 0.2 * 4.0)


def test_the_deadline_margin_keeps_a_rare_tail_the_ema_forgets() -> None:
    """Residuals 0 ms except a 3 ms one every 50 batches (a preempted thread): 40 batches
    after a spike the EMA (alpha 0.2) has forgotten it (margin < 0.05 ms) but the window's
    99th percentile still holds about 3 ms; 128 batches on, it has left the window."""
    fc = FixedCosts()
    for i in range(300):
        fc.update_total(5.0, 5.0 + (3.0 if i % 50 == 0 else 0.0), 10.0)
    ema = fc.total_mean_ms + fc_mod.MARGIN_Z * np.sqrt(fc.total_var_ms2)
    assert ema < 0.05  # 299 - 250 = 49 batches after the last spike
    # window of the last 128: spikes at 200 and 250 -> sorted [0] * 126 + [3, 3]
    want = np.quantile([0.0] * 126 + [3.0, 3.0], fc_mod.MARGIN_QUANTILE)
    assert fc.margin_ms == pytest.approx(want) and want > 2.0
    for _ in range(128):
        fc.update_total(5.0, 5.0, 10.0)
    assert fc.margin_ms < 0.01
    fc.update_total(5.0, 8.0, 10.0)
    fc.skip_plan()  # forgotten like the rest while no plan is tried
    assert max(fc.recent_ms) == pytest.approx(3.0 * (1 - fc.forget))
    fc.reset()
    assert fc.margin_ms == 0.0 and not fc.recent_ms


def test_updates_that_keep_missing_their_deadline_are_retried_ever_more_rarely() -> None:
    """Each update in a row that missed its deadline halves the share forgotten per
    skipped batch (at most 2**MAX_BACKOFF-fold); an update in time restores it."""
    fc = FixedCosts(forget=0.04)
    for k in range(1, 9):
        fc.update_deadline(True, 5.0, 4.0)
        assert fc.forget_now == pytest.approx(0.04 / 2 ** min(k, fc_mod.MAX_BACKOFF))
    fc.recent_ms.extend([1.0, 2.0])
    fc.adapt_ms = 1.0
    fc.skip_plan()
    keep = 1 - 0.04 / 2 ** fc_mod.MAX_BACKOFF
    assert list(fc.recent_ms) == pytest.approx([keep, 2 * keep])
    fc.idle()  # a batch without update forgets the margin too
    assert list(fc.recent_ms) == pytest.approx([keep ** 2, 2 * keep ** 2])
    assert fc.adapt_ms == keep
    fc.update_deadline(False, 5.0, 4.0)  # no update: nothing learnt
    fc.update_deadline(True, 5.0, float('nan'))  # sigma*T: no deadline
    assert fc.backoff == fc_mod.MAX_BACKOFF
    fc.update_deadline(True, 3.0, 4.0)
    assert fc.forget_now == 0.04 and fc.backoff == 0
    fc.update_deadline(True, 5.0, 4.0)
    fc.reset()
    assert fc.backoff == 0


def test_alpha_zero_is_off_and_bad_settings_are_refused() -> None:
    fc = FixedCosts(alpha=0.0)
    fc.update_plan(3.0, 10.0)
    fc.update_plan(3.0, 10.0)
    fc.update_adapt(0.0, 3.0, 10.0)
    assert fc.plan_phase_ms == 0.0 and fc.overhead_ms == 0.0
    for bad in (-0.1, 1.1, float("nan")):
        with pytest.raises(ValueError, match="alpha must be in"):
            FixedCosts(alpha=bad)
    with pytest.raises(ValueError, match="warmup"):
        FixedCosts(warmup=-1)
    with pytest.raises(ValueError, match="alpha must be in"):
        EngineConfig(fixed_cost_feedback=2.0).validate()


def _engine(alpha: float) -> AdaShadowEngine:
    torch.manual_seed(0)
    model = build_model("small_resnet", 10)
    set_bn_mode(model, "batch")
    staged = decompose(model, (3, 32, 32))
    prof = mac_profile(UnitLayout.from_staged(staged), 10.0, 4)
    # the inline plan phase, sigma*T without a scatter margin: what the feedback checks
    return AdaShadowEngine(staged, EngineConfig(sigma=0.6, fixed_cost_feedback=alpha,
                                                forward_feedback="off", plan_ahead=False,
                                                sigma_margin=False), profile=prof)


def test_engine_plans_with_the_learnt_costs_and_feeds_back_its_own_prediction() -> None:
    """The planner sees T_f + plan phase and the update's fixed cost; the sample fed back
    is measured backward + reforward minus exactly the per-unit part of the plan's cost."""
    # batches until two were adapted (a loaded machine leaves some no room: the profile's
    # times are absolute here), at most 16
    xs = [torch.randn(4, 3, 32, 32) * (1 + i % 4) for i in range(16)]
    eng = _engine(0.5)
    problems, samples = [], []
    solve, update = planner.solve, eng.planning.fixed.update_adapt

    def spy_solve(problem, n_t=planner.DEFAULT_N_T):
        problems.append(problem)
        return solve(problem, n_t)

    def spy_update(predicted, measured, scale):
        samples.append((predicted, measured))
        update(predicted, measured, scale)

    eng.planning.fixed.update_adapt = spy_update
    planner_solve = planner.solve
    planner.solve = spy_solve
    try:
        results = []
        for x in xs:
            plan_phase, overhead = eng.planning.fixed.plan_phase_ms, eng.planning.fixed.overhead_ms
            res = eng.step(x)
            results.append((res, plan_phase, overhead))
            if len(samples) >= 2:
                break
    finally:
        planner.solve = planner_solve
    # a batch whose forward leaves no room for any plan skips its plan phase (a loaded
    # machine: the profile's times are absolute here); every other one was planned
    planned = [r for r in results if not r[0].planning.skipped]
    assert len(problems) == len(planned) == eng.planning.fixed.plan_updates
    adapted = 0
    for prob, (res, plan_phase, overhead) in zip(problems, planned, strict=True):
        assert prob.forward_ms == pytest.approx(res.times.forward_ms + plan_phase)
        assert prob.overhead_ms == overhead
        if res.adapted:
            per_unit = res.predicted_total_ms - prob.forward_ms - prob.overhead_ms
            predicted, measured = samples[adapted]
            assert predicted == pytest.approx(per_unit)
            assert measured == pytest.approx(res.times.backward_ms + res.times.reforward_ms,
                                              rel=0.05, abs=0.05)
            adapted += 1
    assert adapted == len(samples) >= 2


def test_a_large_fixed_cost_empties_the_plan_and_off_ignores_it() -> None:
    x0, x1 = torch.randn(4, 3, 32, 32), torch.randn(4, 3, 32, 32) * 3 + 1
    plans = {}
    for alpha in (0.0, 0.2):
        eng = _engine(alpha)
        eng.step(x0)  # history
        fixed = eng.planning.fixed
        fixed.adapt_ms, fixed.adapt_updates = 1e4, 5  # an update costs 10 s here
        res = eng.step(x1)
        plans[alpha] = res
    assert plans[0.0].adapted and plans[0.0].units_updated > 0
    assert not plans[0.2].adapted and plans[0.2].planning.overhead_ms == 1e4
    assert plans[0.2].predicted_total_ms <= plans[0.2].budget_ms


def test_planner_overhead_is_a_fixed_cost_of_non_empty_plans() -> None:
    rng = np.random.default_rng(3)
    n = 6
    p = planner.PlanProblem(w=rng.uniform(0, 1, n), x=rng.uniform(0, 1, n),
                            r=rng.uniform(0, 1, n), stage_start=np.array([0, 0, 2, 2, 4, 5]),
                            importance=np.ones(n), forward_ms=3.0, sigma=0.5, overhead_ms=0.8)
    base = planner.PlanProblem(**{**p.__dict__, "overhead_ms": 0.0})
    one = np.zeros(n, dtype=bool)
    one[4] = True
    assert planner.plan_cost(p, one) == pytest.approx(planner.plan_cost(base, one) + 0.8)
    assert planner.plan_cost(p, np.zeros(n, bool)) == 3.0  # an empty plan pays nothing
    full = planner.solve(p).full_ms
    assert full == pytest.approx(planner.solve(base).full_ms + 0.8)  # a full update pays it
    with pytest.raises(ValueError, match="overhead_ms"):
        planner.solve(planner.PlanProblem(**{**p.__dict__, "overhead_ms": -1.0}))


@pytest.mark.slow
def test_an_estimate_that_blocks_every_update_is_forgotten_slowly() -> None:
    """Batches without an update cannot re-measure the update's cost: its excess over the
    least cost measured lately decays by `forget` per batch, and that floor FLOOR_AGING
    times slower, so the engine tries a plan again instead of freezing, but does not
    retry a plan predicted below every cost it has seen."""
    fc = FixedCosts(alpha=0.5, warmup=0, forget=0.1)
    fc.update_adapt(0.0, 0.8, 10.0)
    fc.update_adapt(0.0, 0.2, 10.0)  # EMA 0.5, floor 0.2
    for _ in range(5):
        fc.idle()
    aged = 1 - 0.1 / fc_mod.FLOOR_AGING
    assert 0.2 * aged**5 < fc.overhead_ms < 0.2 + 0.3 * 0.9**5
    assert fc.overhead_ms > 0.5 * 0.9**5  # plain forgetting toward 0 would be below
    assert fc.plan_phase_ms == 0.0  # the plan phase is measured every batch: not decayed
    for _ in range(3000):
        fc.idle()
    assert fc.overhead_ms < 0.01  # the floor ages too: never frozen
    fc.update_plan(0.3, 10.0)
    fc.update_plan(0.9, 10.0)
    fc.skip_plan()
    assert 0.3 < fc.plan_phase_ms < 0.6  # EMA 0.6, forgotten toward 0.3
    fc.reset()
    assert not fc.adapt_seen and not fc.plan_seen
    with pytest.raises(ValueError, match="forget"):
        FixedCosts(forget=1.5)
    eng = _engine(0.2)
    eng.step(torch.randn(4, 3, 32, 32))  # history
    eng.planning.fixed.adapt_ms, eng.planning.fixed.adapt_updates = 100.0, 5  # 100 ms: nothing fits
    updated = [eng.step(torch.randn(4, 3, 32, 32) * 3 + 1).adapted for _ in range(300)]
    assert not updated[0] and any(updated)  # blocked at first, adapting again later
    assert eng.planning.fixed.overhead_ms < 50.0


def test_engine_says_when_no_unit_has_room() -> None:
    eng = _engine(0.2)
    eng.step(torch.randn(4, 3, 32, 32))
    assert not eng.step(torch.randn(4, 3, 32, 32) * 2).planning.no_room
    eng.planning.fixed.adapt_ms, eng.planning.fixed.adapt_updates = 1e4, 5
    res = eng.step(torch.randn(4, 3, 32, 32) * 3)
    assert res.planning.no_room and not res.adapted


def test_a_cold_first_batch_teaches_no_margin_and_a_margin_without_plans_fades() -> None:
    """The first `warmup` residuals (one-time allocations) are ignored; a later one far
    above the recent ones is bounded; batches that do not update forget the margin, so
    a margin that leaves no plan does not freeze adaptation for good."""
    fc = FixedCosts(warmup=1)
    fc.update_total(3.0, 9.0, 6.0)  # cold start: 6 ms over, ignored
    for _ in range(fc_mod.MARGIN_WARMUP - 1):
        fc.update_total(3.0, 3.1, 6.0)
    assert fc.margin_ms == 0.0  # MARGIN_WARMUP samples after the warm-up: not yet
    fc.update_total(3.0, 3.1, 6.0)
    assert fc.margin_ms == pytest.approx(0.1)
    fc.update_total(3.0, 6.0, 6.0)  # one preempted batch: 3 ms over
    bounded = max(fc_mod.OUTLIER_FACTOR * 0.1, 0.1 + fc_mod.OUTLIER_SLACK * 6.0)
    assert fc.total_mean_ms == pytest.approx(0.1 + fc.alpha * (bounded - 0.1))
    before = fc.margin_ms
    for _ in range(200):
        fc.idle()
    assert fc.margin_ms < 0.05 * before
