"""tta_core.elasticdnn.fleet: the multi-app size search equals brute force and respects every
deadline and the shared capacity, under the confidence objective and the paper's Eq. 8-11;
equal split; infeasible instances; the confidence proxy."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tta_core.elasticdnn.fleet import (
    MAX_COMBINATIONS,
    App,
    AppOption,
    ConfidenceCalibration,
    Objective,
    SizeProxy,
    equal_split,
    mean_confidence,
    plan_fleet,
    retrain_shares,
    window_accuracy,
)


def brute_force(apps: list[App], capacity: float) -> tuple[float, list[tuple[AppOption, ...]]]:
    """Best objective and every feasible combination, by plain enumeration."""
    feasible = []
    for combo in itertools.product(*(a.options for a in apps)):
        pairs = list(zip(apps, combo, strict=True))
        if all(o.forward_ms <= a.deadline_ms for a, o in pairs) and \
                sum(a.hz / a.batch_size * o.forward_ms / 1000 for a, o in pairs) <= capacity:
            feasible.append(combo)
    best = max((sum(o.accuracy for o in c) for c in feasible), default=-math.inf)
    return best, feasible


def _load(apps: list[App], sizes) -> float:
    return sum(a.load(next(o for o in a.options if o.keep == sizes[a.name])) for a in apps)


def _acc(apps: list[App], sizes) -> float:
    return sum(next(o for o in a.options if o.keep == sizes[a.name]).accuracy for a in apps)


KEEPS = (1.0, 0.7, 0.5, 0.3, 0.2)


@st.composite
def instances(draw):
    n = draw(st.integers(1, 4))
    apps = []
    for i in range(n):
        c = draw(st.integers(1, 5))
        keeps = sorted(draw(st.permutations(KEEPS))[:c], reverse=True)
        options = [AppOption(k, draw(st.floats(0.5, 40.0)), draw(st.floats(0.0, 1.0)))
                   for k in keeps]
        apps.append(App(f"cam{i}", draw(st.floats(1.0, 60.0)), draw(st.floats(1.0, 60.0)),
                        options, batch_size=draw(st.integers(1, 4))))
    return apps, draw(st.floats(0.05, 2.0))


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(instances())
def test_plan_equals_brute_force_and_respects_every_limit(inst) -> None:
    apps, capacity = inst
    best, feasible = brute_force(apps, capacity)
    plan = plan_fleet(apps, capacity)
    assert plan.feasible == bool(feasible)
    if not feasible:
        return
    assert plan.accuracy == pytest.approx(best, abs=1e-9)
    assert _acc(apps, plan) == pytest.approx(best, abs=1e-9)
    assert _load(apps, plan) <= capacity + 1e-9
    assert plan.load == pytest.approx(_load(apps, plan))
    for a in apps:
        opt = next(o for o in a.options if o.keep == plan[a.name])
        assert opt.forward_ms <= a.deadline_ms
    # among equally good combinations (exact ties), the least loaded
    for c in feasible:
        if abs(sum(o.accuracy for o in c) - plan.accuracy) <= 1e-12:
            assert sum(a.load(o) for a, o in zip(apps, c, strict=True)) >= plan.load - 1e-12


@settings(max_examples=100, deadline=None)
@given(instances())
def test_equal_split_fits_each_share_and_never_beats_the_plan(inst) -> None:
    apps, capacity = inst
    base = equal_split(apps, capacity)
    for a in apps:
        opt = next(o for o in a.options if o.keep == base[a.name])
        fits = [o for o in a.options if o.forward_ms <= a.deadline_ms
                and a.load(o) <= capacity / len(apps) + 1e-9]
        if fits:  # the largest size fitting the share and the deadline
            assert opt.keep == max(o.keep for o in fits)
        else:
            assert not base.feasible and a.name in base.reason
    if base.feasible:  # the split is one feasible combination of the search
        assert plan_fleet(apps, capacity).accuracy >= base.accuracy - 1e-9


def test_scheduler_moves_capacity_to_the_app_that_gains() -> None:
    """Two 30 Hz cameras; the hard one gains 25 points from the full model, the easy one 2:
    the split gives both the middle size, the plan the full model to the hard one."""
    def opts(gain: float) -> list[AppOption]:
        return [AppOption(1.0, 20.0, 0.6 + gain), AppOption(0.5, 15.0, 0.6 + gain / 3),
                AppOption(0.3, 4.0, 0.6)]

    apps = [App("easy", 30, 33, opts(0.02)), App("hard", 30, 33, opts(0.25))]
    assert dict(equal_split(apps, 1.0)) == {"easy": 0.5, "hard": 0.5}
    plan = plan_fleet(apps, 1.0)
    assert plan == {"easy": 0.3, "hard": 1.0} and plan.feasible
    assert plan.shares == pytest.approx({"easy": 0.12, "hard": 0.6})


def test_infeasible_gives_the_smallest_sizes_and_says_why() -> None:
    opts = [AppOption(1.0, 30.0, 0.9), AppOption(0.3, 10.0, 0.7)]
    plan = plan_fleet([App("a", 60, 100, opts), App("b", 60, 100, opts)], 1.0)
    assert not plan.feasible and dict(plan) == {"a": 0.3, "b": 0.3}
    assert "1.2 > capacity 1" in plan.reason
    late = plan_fleet([App("a", 1, 5, opts)], 1.0)
    assert not late.feasible and "'a'" in late.reason and "deadline 5 ms" in late.reason
    assert not equal_split([App("a", 60, 100, opts), App("b", 60, 100, opts)]).feasible


def test_too_many_combinations_and_bad_input_are_refused() -> None:
    opts = [AppOption(k, 1.0, 0.5) for k in (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1)]
    apps = [App(f"c{i}", 1, 10, opts) for i in range(5)]  # 10^5
    with pytest.raises(ValueError, match="100000 size combinations"):
        plan_fleet(apps)
    assert len(plan_fleet(apps[:4])) == 4  # 10^4 = MAX_COMBINATIONS still runs
    assert MAX_COMBINATIONS == 10_000
    with pytest.raises(ValueError, match="capacity"):
        plan_fleet(apps[:1], 0.0)
    with pytest.raises(ValueError, match="'c0' appears twice"):
        plan_fleet([apps[0], apps[0]])
    with pytest.raises(ValueError, match="hz"):
        plan_fleet([App("x", math.nan, 10, opts)])
    with pytest.raises(ValueError, match="no size options"):
        plan_fleet([App("x", 1, 10, [])])


def test_mean_confidence_and_calibration() -> None:
    logits = np.log(np.array([[0.7, 0.2, 0.1], [0.25, 0.25, 0.5]]))
    assert mean_confidence(logits) == pytest.approx(0.6)
    cal = ConfidenceCalibration.fit([0.9, 0.5, 0.7, 0.95], [0.8, 0.3, 0.6, 0.7])
    assert cal.accuracy == pytest.approx((0.3, 0.6, 0.75))  # 0.8 / 0.7 pooled
    assert cal.confidence == pytest.approx((0.5, 0.7, 0.925))  # at the block's mean
    assert cal(0.6) == pytest.approx(0.45) and cal(0.1) == 0.3 and cal(1.0) == 0.75
    assert cal(0.8) == pytest.approx(0.6 + 0.15 * 0.1 / 0.225)  # rises between blocks
    assert ConfidenceCalibration.from_dict(cal.to_dict()) == cal
    with pytest.raises(ValueError, match="non-decreasing"):
        ConfidenceCalibration((0.0, 1.0), (1.0, 0.0))


def test_size_proxy_interpolates_unseen_sizes() -> None:
    proxy = SizeProxy((1.0, 0.5, 0.3), alpha=0.5)
    assert all(math.isnan(v) for v in proxy.accuracy().values())
    proxy.observe(1.0, 0.9)
    assert proxy.accuracy() == pytest.approx({1.0: 0.9, 0.5: 0.9, 0.3: 0.9})
    proxy.observe(0.3, 0.5)
    proxy.observe(0.3, 0.7)  # EMA: 0.6
    assert proxy.accuracy() == pytest.approx({1.0: 0.9, 0.5: 0.6 + 0.3 * 0.2 / 0.7, 0.3: 0.6})


def test_size_proxy_shifts_unseen_sizes_by_the_source_gap() -> None:
    proxy = SizeProxy((1.0, 0.5, 0.3), prior={1.0: 0.95, 0.5: 0.9, 0.3: 0.8})
    proxy.observe(1.0, 0.7)
    assert proxy.accuracy() == pytest.approx({1.0: 0.7, 0.5: 0.65, 0.3: 0.55})
    proxy.observe(0.3, 0.6)  # observed sizes keep their own estimate; 0.5: nearest is 0.3
    assert proxy.accuracy() == pytest.approx({1.0: 0.7, 0.5: 0.7, 0.3: 0.6})


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1)), min_size=1, max_size=30))
def test_calibration_fit_equals_scipy_isotonic_regression(pairs) -> None:
    from scipy.optimize import isotonic_regression

    pairs = sorted(pairs, key=lambda p: p[0])
    c, a = (np.array(v) for v in zip(*pairs, strict=True))
    cal = ConfidenceCalibration.fit(c, a)
    assert all(np.diff(cal.accuracy) >= 0) and all(np.diff(cal.confidence) >= 0)
    ref = isotonic_regression(a).x  # least squares, non-decreasing, in confidence order
    # each pooled block's value at its knot; the points of a block share its value
    assert sorted(set(np.round(ref, 9))) == sorted(set(np.round(cal.accuracy, 9)))
    assert np.mean(a) == pytest.approx(np.mean(ref))


# ------------------------------------------------------------ the paper's objective, Eq. 8-11
def paper_brute_force(apps: list[App], capacity: float, t_max: float, slack: float
                      ) -> float:
    """Best Eq. 8 / t_max by plain enumeration, written from the equations: lambda_i =
    s_i / sum s (Eq. 10), tau_i = T_i / lambda_i <= t_max (Eq. 11, times 1 + slack),
    accuracy A during tau, Ã after; the serving limits as in brute_force."""
    best = -math.inf
    for combo in itertools.product(*(a.options for a in apps)):
        pairs = list(zip(apps, combo, strict=True))
        if not (all(o.forward_ms <= a.deadline_ms for a, o in pairs) and
                sum(a.hz / a.batch_size * o.forward_ms / 1000 for a, o in pairs) <= capacity):
            continue
        total_s = sum(o.keep for o in combo)
        taus = [o.retrain_s / (o.keep / total_s) for o in combo]
        if any(tau > t_max * (1 + slack) for tau in taus):
            continue
        value = sum((o.accuracy * tau + o.accuracy_after * (t_max - tau)) / t_max
                    for o, tau in zip(combo, taus, strict=True))
        best = max(best, value)
    return best


@st.composite
def retrain_instances(draw):
    apps, capacity = draw(instances())
    apps = [App(a.name, a.hz, a.deadline_ms, [
        AppOption(o.keep, o.forward_ms, o.accuracy, draw(st.floats(0.0, 1.0)),
                  draw(st.floats(0.0, 10.0))) for o in a.options], a.batch_size)
        for a in apps]
    return apps, capacity, draw(st.floats(0.5, 60.0))


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(retrain_instances())
def test_paper_objective_equals_brute_force(inst) -> None:
    apps, capacity, t_max = inst
    plan = plan_fleet(apps, capacity, Objective("paper", t_max))
    strict = paper_brute_force(apps, capacity, t_max, -1e-9)  # feasible beyond rounding
    loose = paper_brute_force(apps, capacity, t_max, 1e-6)
    if strict > -math.inf:  # some combination is feasible beyond any rounding
        assert plan.feasible
    if loose == -math.inf:
        assert not plan.feasible
    if not plan.feasible:
        return
    assert strict - 1e-9 <= plan.accuracy <= loose + 1e-9
    chosen = [next(o for o in a.options if o.keep == plan[a.name]) for a in apps]
    lam = retrain_shares([o.keep for o in chosen])
    assert sum(lam) == pytest.approx(1.0)
    assert plan.retrain_shares == pytest.approx(dict(zip(plan, lam, strict=True)))
    for o, x in zip(chosen, lam, strict=True):  # Eq. 11 holds for the chosen sizes
        assert o.retrain_s / x <= t_max * (1 + 1e-6)
    assert plan.accuracy == pytest.approx(sum(
        window_accuracy(o, x, t_max) for o, x in zip(chosen, lam, strict=True)))


def _two_apps() -> list[App]:
    """a gains 0.4 (full) / 0.3 (half) from retraining, b 0.2 / 0.05; retraining takes 2 s
    at full size, 1 s at half with the whole retraining resource."""
    def opts(full: tuple[float, float], half: tuple[float, float]) -> list[AppOption]:
        return [AppOption(1.0, 1.0, full[0], full[1], 2.0),
                AppOption(0.5, 1.0, half[0], half[1], 1.0)]

    return [App("a", 10, 100, opts((0.5, 0.9), (0.4, 0.7))),
            App("b", 10, 100, opts((0.6, 0.8), (0.62, 0.6)))]


def test_paper_objective_by_hand() -> None:
    apps = _two_apps()
    # confidence objective: A only, b's half size (0.62) beats its full one (0.6)
    assert dict(plan_fleet(apps, 1.0)) == {"a": 1.0, "b": 0.5}
    # t_max 10 s. (1, 1): lambda 1/2 each, tau 4 s: a 0.5*0.4 + 0.9*0.6 = 0.74, b 0.6*0.4
    # + 0.8*0.6 = 0.72, 1.46. (1, 0.5): lambda 2/3, 1/3, tau 3 s each: a 0.5*0.3 + 0.9*0.7
    # = 0.78, b 0.62*0.3 + 0.6*0.7 = 0.606, 1.386. (0.5, 1): 0.61 + 0.74 = 1.35.
    # (0.5, 0.5): tau 2 s: 0.64 + 0.604 = 1.244.
    plan = plan_fleet(apps, 1.0, Objective("paper", 10.0))
    assert dict(plan) == {"a": 1.0, "b": 1.0} and plan.accuracy == pytest.approx(1.46)
    assert plan.retrain_shares == pytest.approx({"a": 0.5, "b": 0.5})
    # t_max 3.5 s: tau 4 s breaks Eq. 11; (1, 0.5): a 0.5*3/3.5 + 0.9*0.5/3.5, b 0.62*3/3.5
    # + 0.6*0.5/3.5; (0.5, 1): 0.4*3/3.5 + 0.7*0.5/3.5 + 0.6*3/3.5 + 0.8*0.5/3.5 (less)
    plan = plan_fleet(apps, 1.0, Objective("paper", 3.5))
    assert dict(plan) == {"a": 1.0, "b": 0.5}
    assert plan.accuracy == pytest.approx((1.5 + 0.45 + 1.86 + 0.3) / 3.5)
    assert plan.retrain_shares == pytest.approx({"a": 2 / 3, "b": 1 / 3})
    # t_max 2.5 s: only (0.5, 0.5) retrains in time (tau 2 s)
    assert dict(plan_fleet(apps, 1.0, Objective("paper", 2.5))) == {"a": 0.5, "b": 0.5}
    # t_max 1.5 s: nothing does; the smallest sizes, and why
    late = plan_fleet(apps, 1.0, Objective("paper", 1.5))
    assert not late.feasible and "Eq. 11" in late.reason and dict(late) == {"a": 0.5, "b": 0.5}
    # without retraining times (T = 0) or gains (Ã = A) the objective is the confidence sum
    flat = [App(a.name, a.hz, a.deadline_ms, [AppOption(o.keep, o.forward_ms, o.accuracy)
                                              for o in a.options]) for a in apps]
    assert dict(plan_fleet(flat, 1.0, Objective("paper", 3.5))) == {"a": 1.0, "b": 0.5}


def test_paper_objective_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="t_max_s"):
        Objective("paper")
    with pytest.raises(ValueError, match="'accuracy'"):
        Objective("accuracy")
    bad = [App("a", 1, 10, [AppOption(1.0, 1.0, 0.5, 0.6, -1.0)])]
    with pytest.raises(ValueError, match="retrain_s of keep=1 must be"):
        plan_fleet(bad, 1.0, Objective("paper", 5.0))
    bad = [App("a", 1, 10, [AppOption(1.0, 1.0, 0.5, math.inf, 1.0)])]
    with pytest.raises(ValueError, match="not finite"):
        plan_fleet(bad, 1.0, Objective("paper", 5.0))
