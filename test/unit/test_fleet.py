"""tta_core.elasticdnn.fleet: the multi-app size search equals brute force and respects every
deadline and the shared capacity; equal split; infeasible instances; the confidence proxy."""

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
    SizeProxy,
    equal_split,
    mean_confidence,
    plan_fleet,
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
