"""Memory-budgeted planner (adashadow.memory_planner, memory_costs): DP = brute force on both
budgets, real-valued feasibility, B_m = inf reproduces planner.solve, tight budgets shrink
plans, input checks; profile-built costs against the codec's measured bytes."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from torch import nn

from tta_core.adashadow import planner
from tta_core.adashadow.memory_costs import (
    DEFAULT_FROZEN_KEEP,
    codec_plan,
    memory_costs,
    replay_bytes,
)
from tta_core.adashadow.memory_planner import (
    DEFAULT_FIDELITY,
    DEFAULT_KEEPS,
    MemoryCosts,
    MemoryPlan,
    brute_force_with_memory,
    plan_bytes,
    solve_with_memory,
)
from tta_core.memory import ActivationCodec, CodecPlan, predicted_bytes, profile_saves
from tta_core.model.zoo import SmallResNet

PLAIN = {"keeps": (1.0,), "fidelity": (1.0,), "frozen_keep": 1.0, "act_masks": False}


pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------ random instances
def _stage_start(rng: np.random.Generator, n: int) -> np.ndarray:
    starts = np.zeros(n, dtype=np.int64)
    for u in range(1, n):
        starts[u] = u if rng.random() < 0.3 else starts[u - 1]
    return starts


def _problem(rng: np.random.Generator, n: int) -> planner.PlanProblem:
    scale = rng.uniform(0.1, 10.0, size=3)
    importance = rng.exponential(1.0, size=n)
    importance[rng.random(n) < 0.2] = 0.0
    return planner.PlanProblem(
        w=rng.uniform(0, 1, n) * scale[0], x=rng.uniform(0, 1, n) * scale[1],
        r=rng.uniform(0, 1, n) * scale[2], stage_start=_stage_start(rng, n),
        importance=importance, forward_ms=float(rng.uniform(0.0, 20.0)),
        sigma=float(rng.uniform(0.3, 1.0)),
        overhead_ms=float(rng.uniform(0.0, 3.0)) if rng.random() < 0.3 else 0.0)


def _costs(rng: np.random.Generator, n: int, k: int, stage_start: np.ndarray) -> MemoryCosts:
    keeps = np.sort(rng.choice([1.0, 0.7, 0.5, 0.3, 0.1], size=k, replace=False))[::-1]
    fid = np.sort(rng.uniform(0.6, 1.0, size=(n, k)), axis=1)[:, ::-1]
    fid[:, 0] = np.where(rng.random(n) < 0.5, 1.0, fid[:, 0])
    w = rng.uniform(0, 15, (n, 1)) * np.asarray(keeps)[None, :]  # cheaper at lower keep
    w[rng.random(n) < 0.3] = 0.0                                 # BN-like units
    return MemoryCosts(
        x_bytes=rng.uniform(0, 10, n) * (rng.random(n) < 0.9), w_bytes=w, keeps=keeps,
        fidelity=fid, record_start=None if rng.random() < 0.5 else stage_start,
        entry_bytes=None if rng.random() < 0.5 else rng.uniform(0, 4, n))


def _instance(rng: np.random.Generator, max_rows: int = 60_000
              ) -> tuple[planner.PlanProblem, MemoryCosts, float]:
    n = int(rng.integers(1, 11))
    k = int(rng.integers(1, 4))
    while k > 1 and (k + 1) ** n > max_rows:
        k -= 1
    p = _problem(rng, n)
    c = _costs(rng, n, k, p.stage_start)
    full = _exact_bytes(c, np.ones(n, dtype=bool), np.zeros(n, dtype=np.int64))
    return p, c, float(rng.uniform(0.2, 1.0) * full)


# ------------------------------------------------------------------ independent contract
def _exact_ms(p: planner.PlanProblem, sel: np.ndarray) -> float:
    """T_f + T_b'(S) + T_re'(S), written out (planner.py's contract)."""
    if not sel.any():
        return float(p.forward_ms)
    d = int(np.flatnonzero(sel)[0])
    return float(p.forward_ms + p.overhead_ms + p.w[sel].sum() + p.x[d + 1:].sum()
                 + p.r[p.stage_start[d]:].sum())


def _exact_bytes(c: MemoryCosts, sel: np.ndarray, opt: np.ndarray) -> float:
    """M(S, j) = e[g(d)] + sum_{l >= g(d)} mx[l] + sum_{l in S} mw[l, j_l], written out."""
    if not sel.any():
        return 0.0
    d = int(np.flatnonzero(sel)[0])
    g = d if c.record_start is None else int(c.record_start[d])
    entry = 0.0 if c.entry_bytes is None else float(c.entry_bytes[g])
    return entry + float(np.sum(c.x_bytes[g:])) + sum(
        float(c.w_bytes[u, opt[u]]) for u in np.flatnonzero(sel))


def _value(p: planner.PlanProblem, c: MemoryCosts, sel: np.ndarray, opt: np.ndarray) -> float:
    fid = np.broadcast_to(np.asarray(c.fidelity, dtype=float), np.shape(c.w_bytes))
    return sum(float(p.importance[u] * fid[u, opt[u]]) for u in np.flatnonzero(sel))


def _full_ms(p: planner.PlanProblem) -> float:
    return float(p.forward_ms + p.overhead_ms + p.w.sum() + p.x[1:].sum() + p.r.sum())


def _check(p: planner.PlanProblem, c: MemoryCosts, plan: MemoryPlan, budget: float) -> None:
    """Exact real-valued feasibility on both budgets and consistent fields."""
    sel = plan.update
    assert np.array_equal(sel, plan.option >= 0)
    assert plan.predicted_total_ms == pytest.approx(_exact_ms(p, sel), rel=1e-12, abs=1e-12)
    assert plan.predicted_bytes == pytest.approx(_exact_bytes(c, sel, plan.option),
                                                 rel=1e-12, abs=1e-9)
    assert plan.objective == pytest.approx(_value(p, c, sel, plan.option), abs=1e-12)
    if sel.any():
        assert plan.predicted_total_ms <= p.sigma * _full_ms(p) * (1 + 1e-12)
        assert plan.predicted_bytes <= budget * (1 + 1e-12)
        assert plan.first_updated == int(np.flatnonzero(sel)[0])
        assert np.array_equal(plan.keep[sel], np.asarray(c.keeps)[plan.option[sel]])
    assert np.isnan(plan.keep[~sel]).all()


def test_dp_matches_brute_force_on_random_instances() -> None:
    rng = np.random.default_rng(19)
    nonempty = binding = multi = 0
    for _ in range(250):
        p, c, budget = _instance(rng)
        n_m = int(rng.choice([4, 16, 128]))
        n_t = int(rng.choice([20, 500]))
        dp = solve_with_memory(p, c, budget, n_t=n_t, n_m=n_m)
        bf = brute_force_with_memory(p, c, budget, n_t=n_t, n_m=n_m)
        assert dp.objective == pytest.approx(bf.objective, abs=1e-9)
        _check(p, c, dp, budget)
        _check(p, c, bf, budget)
        nonempty += int(dp.update.any())
        binding += int(dp.objective < solve_with_memory(p, c, math.inf, n_t=n_t).objective
                       - 1e-9)
        multi += int(np.any(dp.option > 0))
    # the instances exercise real choices: non-empty plans, a binding memory budget, and
    # keep options other than the first
    assert nonempty > 120 and binding > 60 and multi > 12, (nonempty, binding, multi)


def _exhaustive(p: planner.PlanProblem, c: MemoryCosts, budget_ms: float,
                budget_bytes: float) -> float:
    """Best value over every (S, options) with undiscretised costs (plain Python)."""
    n, k = np.shape(c.w_bytes)
    best = 0.0
    for digits in itertools.product(range(k + 1), repeat=n):
        opt = np.array(digits) - 1
        sel = opt >= 0
        if (sel.any() and _exact_ms(p, sel) <= budget_ms
                and _exact_bytes(c, sel, opt) <= budget_bytes):
            best = max(best, _value(p, c, sel, opt))
    return best


def test_dp_brackets_the_undiscretised_optimum() -> None:
    # Rounding loses < 1 step per item plus one for each fixed part, on each axis: the DP
    # lies between the exact optima at budgets shrunk by (n + 1) steps and at full budgets.
    rng = np.random.default_rng(7)
    for _ in range(40):
        p, c, budget = _instance(rng, max_rows=800)
        n, n_t, n_m = len(p.w), 60, 40
        plan = solve_with_memory(p, c, budget, n_t=n_t, n_m=n_m)
        fixed = [_exact_bytes(c, np.eye(n, dtype=bool)[d], np.zeros(n, dtype=np.int64))
                 - float(c.w_bytes[d, 0]) for d in range(n)]
        step_m = (budget - min(fixed)) / n_m
        step_t = (plan.budget_ms - p.forward_ms) / n_t
        upper = _exhaustive(p, c, plan.budget_ms, budget)
        assert plan.objective <= upper + 1e-9
        if step_m > 0 and step_t > 0:
            lower = _exhaustive(p, c, plan.budget_ms - (n + 1) * step_t,
                                budget - (n + 1) * step_m)
            assert plan.objective >= lower - 1e-9


def test_infinite_memory_budget_reproduces_the_latency_planner() -> None:
    rng = np.random.default_rng(23)
    nonempty = 0
    for i in range(200):
        n = int(rng.integers(1, 40))
        p = _problem(rng, n)
        if i % 2:  # integer importance: many ties, which both must break the same way
            p.importance = rng.integers(0, 3, n).astype(float)
        c = _costs(rng, n, int(rng.integers(1, 5)), p.stage_start)
        c.fidelity = np.broadcast_to(np.asarray(c.fidelity), c.w_bytes.shape).copy()
        c.fidelity[:, 0] = 1.0  # the dense option is exact: the latency planner's value
        n_t = int(rng.choice([7, 50, 500]))
        ref = planner.solve(p, n_t=n_t)
        got = solve_with_memory(p, c, math.inf, n_t=n_t)
        assert np.array_equal(got.update, ref.update), i
        assert got.first_updated == ref.first_updated
        assert got.objective == ref.objective
        assert got.predicted_total_ms == ref.predicted_total_ms
        assert (got.budget_ms, got.full_ms) == (ref.budget_ms, ref.full_ms)
        assert np.all(got.option[got.update] == 0)
        _check(p, c, got, math.inf)
        assert got.as_plan().update is got.update
        nonempty += int(ref.update.any())
    assert nonempty > 100


def _layered() -> tuple[planner.PlanProblem, MemoryCosts]:
    """12 units (conv/bn pairs), time budget loose, memory the binding constraint."""
    rng = np.random.default_rng(3)
    n = 12
    conv = np.arange(n) % 2 == 0
    p = planner.PlanProblem(w=np.full(n, 1.0), x=np.full(n, 1.0), r=np.full(n, 0.5),
                            stage_start=np.repeat(np.arange(0, n, 4), 4),
                            importance=rng.uniform(0.5, 1.5, n), forward_ms=5.0, sigma=1.0)
    size = np.linspace(8.0, 2.0, n)  # activations shrink with depth
    keeps = np.asarray(DEFAULT_KEEPS)
    w = np.where(conv[:, None], size[:, None] * keeps[None, :], 0.0)
    return p, MemoryCosts(1.5 * size, w, keeps, np.asarray(DEFAULT_FIDELITY), p.stage_start)


def test_tight_memory_budget_shrinks_the_plan() -> None:
    p, c = _layered()
    n = len(p.w)
    full = _exact_bytes(c, np.ones(n, dtype=bool), np.zeros(n, dtype=np.int64))
    plans = [(b, solve_with_memory(p, c, b)) for b in np.linspace(1.05, 0.02, 40) * full]
    for b, plan in plans:
        _check(p, c, plan, b)
    objectives = [plan.objective for _b, plan in plans]
    # discretised feasible sets are nested in B_m (steps only grow, capacities only rise)
    assert all(a >= b - 1e-12 for a, b in itertools.pairwise(objectives))
    unbounded = solve_with_memory(p, c, math.inf)
    first = plans[0][1]  # memory does not bind: the latency plan, all dense
    assert np.array_equal(first.update, unbounded.update) and np.all(first.option <= 0)
    sizes = [int(plan.update.sum()) for _b, plan in plans]
    assert sizes[0] >= n - 1 and 0 < min(s for s in sizes if s) < sizes[0]
    lowest = [plan.first_updated for _b, plan in plans if plan.update.any()]
    assert lowest[-1] > lowest[0]  # tight budgets stop recording the head of the net
    # keep ratios go down before the first unit is dropped (cheaper than losing a unit)
    drop = next(i for i, (_b, plan) in enumerate(plans) if plan.update.sum() < sizes[0])
    assert np.any(plans[drop - 1][1].option > 0)
    assert any(np.any(plan.option > 0) for _b, plan in plans)  # lower keeps used on the way
    assert not plans[-1][1].update.any()  # below the last unit's own saves: nothing fits
    assert plans[-1][1].predicted_bytes == 0.0


def test_a_lower_keep_is_chosen_only_when_dense_does_not_fit() -> None:
    p = planner.PlanProblem(w=np.ones(2), x=np.ones(2), r=np.ones(2),
                            stage_start=np.zeros(2, dtype=np.int64),
                            importance=np.array([0.0, 2.0]), forward_ms=1.0, sigma=1.0)
    c = MemoryCosts(x_bytes=np.array([50.0, 10.0]), w_bytes=np.array([[0, 0, 0], [40, 20, 8]]),
                    keeps=np.array([1.0, 0.5, 0.1]), fidelity=np.array([1.0, 0.9, 0.5]))
    for budget, keep, value in ((60, 1.0, 2.0), (35, 0.5, 1.8), (20, 0.1, 1.0), (15, None, 0)):
        plan = solve_with_memory(p, c, budget, n_m=200)
        assert plan.update.tolist() == [False, keep is not None]
        if keep is not None:
            assert plan.keep[1] == keep and plan.objective == pytest.approx(value)
            assert plan.predicted_bytes == 10 + {1.0: 40, 0.5: 20, 0.1: 8}[keep]
            assert plan.record_from == 1


def test_plan_bytes_follows_the_contract_formula() -> None:
    c = MemoryCosts(x_bytes=np.array([1.0, 2.0, 4.0, 8.0]),
                    w_bytes=np.array([[16.0, 1.0], [32.0, 2.0], [64.0, 3.0], [128.0, 4.0]]),
                    keeps=np.array([1.0, 0.2]), fidelity=np.array([1.0, 0.5]),
                    record_start=np.array([0, 0, 2, 2]),
                    entry_bytes=np.array([0.0, 100.0, 200.0, 300.0]))
    upd = np.array([False, False, True, True])
    # d = 2 records from g(2) = 2: e[2] + mx[2] + mx[3] + mw[2, 1] + mw[3, 0]
    assert plan_bytes(c, upd, np.array([-1, -1, 1, 0])) == 200 + 4 + 8 + 3 + 128
    upd[1] = True  # d = 1 records from g(1) = 0: the whole net, entry e[0] = 0
    assert plan_bytes(c, upd, np.array([-1, 0, 1, 0])) == 15 + 32 + 3 + 128
    assert plan_bytes(c, np.zeros(4, dtype=bool), np.full(4, -1)) == 0.0


def _valid_costs() -> MemoryCosts:
    return MemoryCosts(np.ones(3), np.ones((3, 2)), np.array([1.0, 0.5]), np.array([1.0, 0.9]))


@pytest.mark.parametrize(("field", "value", "match"), [
    ("x_bytes", np.array([1.0, -1.0, 1.0]), "x_bytes must be >= 0"),
    ("x_bytes", np.array([1.0, np.nan, 1.0]), "x_bytes contains NaN"),
    ("x_bytes", np.ones(4), "x_bytes has length 4, expected 3"),
    ("w_bytes", np.ones((3, 3)), r"w_bytes must have shape \(3, 2\)"),
    ("w_bytes", -np.ones((3, 2)), "w_bytes must be finite and >= 0"),
    ("w_bytes", np.full((3, 2), np.inf), "w_bytes must be finite"),
    ("keeps", np.array([1.0, 0.0]), r"keeps must be .* in \(0, 1\]"),
    ("keeps", np.array([1.5, 0.5]), r"keeps must be .* in \(0, 1\]"),
    ("fidelity", np.array([1.0, 1.2]), "fidelity must be in"),
    ("fidelity", np.array([1.0]), r"fidelity must have shape \(3, 2\)"),
    ("record_start", np.array([0, 2, 2]), "stage_start"),
    ("entry_bytes", np.array([0.0, -1.0, 0.0]), "entry_bytes must be >= 0"),
])
def test_invalid_costs_raise(field: str, value: object, match: str) -> None:
    p = planner.PlanProblem(w=np.ones(3), x=np.ones(3), r=np.ones(3),
                            stage_start=np.zeros(3, dtype=np.int64), importance=np.ones(3),
                            forward_ms=1.0, sigma=0.5)
    c = _valid_costs()
    setattr(c, field, value)
    with pytest.raises(ValueError, match=match):
        solve_with_memory(p, c, 10.0)


def test_invalid_budget_n_m_and_problem_raise() -> None:
    p = planner.PlanProblem(w=np.ones(3), x=np.ones(3), r=np.ones(3),
                            stage_start=np.zeros(3, dtype=np.int64), importance=np.ones(3),
                            forward_ms=1.0, sigma=0.5)
    for budget in (-1.0, float("nan")):
        with pytest.raises(ValueError, match=f"memory budget must be >= 0 bytes.*got {budget}"):
            solve_with_memory(p, _valid_costs(), budget)
    with pytest.raises(ValueError, match="n_m must be a positive integer, got 0"):
        solve_with_memory(p, _valid_costs(), 10.0, n_m=0)
    p.importance = np.ones(2)
    with pytest.raises(ValueError, match="importance has length 2, expected 3"):
        solve_with_memory(p, _valid_costs(), 10.0)
    with pytest.raises(ValueError, match=r"update .* and option .* must be equal"):
        plan_bytes(_valid_costs(), np.ones(3, dtype=bool), np.zeros(2, dtype=np.int64))
    with pytest.raises(ValueError, match="too large"):
        brute_force_with_memory(_problem(np.random.default_rng(0), 12),
                                _costs(np.random.default_rng(0), 12, 4, np.zeros(12, int)),
                                10.0)


# ------------------------------------------------------------------ measured bytes (torch)
def _entropy(logits: torch.Tensor) -> torch.Tensor:
    p = logits.softmax(1)
    return -(p * logits.log_softmax(1)).sum(1).mean()


def _plain_net() -> tuple[nn.Module, torch.Tensor]:
    """A small conv net without shared saves (no residual read by two convs)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    chans = [3, 16, 16, 32, 32, 64]
    for i in range(5):
        layers += [nn.Conv2d(chans[i], chans[i + 1], 3, 2 if i in (1, 3) else 1, 1),
                   nn.BatchNorm2d(chans[i + 1]), nn.ReLU()]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)]
    return nn.Sequential(*layers).train(), torch.randn(8, 3, 32, 32)


def _small_resnet() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return SmallResNet(num_classes=10, blocks=2).train(), torch.randn(8, 3, 32, 32)


def _units(model: nn.Module) -> list[nn.Module]:
    return [m for _n, m in model.named_modules() if next(m.parameters(False), None) is not None]


def _problem_for(n: int, sigma: float, seed: int) -> planner.PlanProblem:
    rng = np.random.default_rng(seed)
    return planner.PlanProblem(w=rng.uniform(0.5, 1.5, n), x=rng.uniform(0.5, 1.5, n),
                               r=rng.uniform(0.2, 0.6, n), stage_start=np.arange(n),
                               importance=rng.exponential(1.0, n), forward_ms=8.0, sigma=sigma)


def _run_plan(model: nn.Module, x: torch.Tensor, plan: MemoryPlan, codec: CodecPlan) -> int:
    """Measured bytes of running `plan`: the engine records the graph from the lowest unit a
    plan reaches, emulated here by a no_grad forward that turns grad on at unit record_from.
    The updated units' gradients must then be computable."""
    units = _units(model)

    def record_from_here(_m: nn.Module, _args: tuple) -> None:
        torch.set_grad_enabled(True)  # the surrounding no_grad restores the mode on exit

    hook = units[plan.record_from].register_forward_pre_hook(record_from_here)
    ctx = ActivationCodec(model, codec)
    try:
        with torch.no_grad(), ctx:
            loss = _entropy(model(x))
    finally:
        hook.remove()
    params = [q for i, m in enumerate(units) if plan.update[i] for q in m.parameters(False)]
    grads = torch.autograd.grad(loss, params)
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    return ctx.result.total


def _plans(model: nn.Module, x: torch.Tensor, options: dict) -> list[tuple]:
    """(profile, costs, plan) for a few time and memory budgets."""
    profile = profile_saves(model, x, _entropy)
    costs = memory_costs(profile, **options)
    n = len(costs.x_bytes)
    full = plan_bytes(costs, np.ones(n, dtype=bool), np.zeros(n, dtype=np.int64))
    out = []
    for seed, (sigma, frac) in enumerate([(1.0, 0.3), (1.0, 0.6), (0.6, 0.5), (1.0, 1.0)]):
        plan = solve_with_memory(_problem_for(n, sigma, seed), costs, frac * full)
        assert plan.update.any() and plan.predicted_bytes <= frac * full
        out.append((profile, costs, plan))
    return out


@pytest.mark.parametrize("options", [{}, PLAIN], ids=["codec", "no-codec"])
def test_planned_bytes_match_measured_bytes_on_a_small_net(options: dict) -> None:
    model, x = _plain_net()
    frozen = options.get("frozen_keep", DEFAULT_FROZEN_KEEP)
    masks = options.get("act_masks", True)
    pruned = 0
    for profile, costs, plan in _plans(model, x, options):
        assert costs.x_bytes.sum() + costs.entry_bytes[0] == predicted_bytes(
            profile, CodecPlan({}, frozen, masks)).total
        names = profile.unit_names
        measured = _run_plan(model, x, plan,
                             codec_plan(plan.update, plan.keep, names, frozen, masks))
        assert abs(plan.predicted_bytes - measured) <= 0.05 * measured, (plan.predicted_bytes,
                                                                        measured)
        if not options:
            assert plan.predicted_bytes == replay_bytes(profile, plan.update, plan.keep,
                                                        plan.record_from)
        else:
            assert plan.predicted_bytes == measured  # no pruning: exact
        pruned += int(np.any(plan.keep[plan.update] < 1))
    assert pruned or options  # the codec cases really choose pruned inputs somewhere


def test_shared_inputs_make_the_resnet_prediction_an_upper_bound() -> None:
    """A ResNet block input is read by conv1 and the downsample conv: two updated readers at
    one keep share one stored form, which the additive cost counts twice (never fewer)."""
    model, x = _small_resnet()
    for profile, _cost, plan in _plans(model, x, {}):
        exact = replay_bytes(profile, plan.update, plan.keep, plan.record_from)
        measured = _run_plan(model, x, plan, codec_plan(plan.update, plan.keep,
                                                        profile.unit_names))
        assert abs(measured - exact) <= 0.05 * exact  # pruning threshold is sampled
        assert plan.predicted_bytes >= exact
        assert plan.predicted_bytes <= 1.15 * measured
    rng = np.random.default_rng(0)
    costs, plain = memory_costs(profile), memory_costs(profile, **PLAIN)
    n = len(plain.x_bytes)
    for _ in range(50):  # without pruning nothing is shared per plan: exact for any plan
        upd = rng.random(n) < rng.uniform(0.05, 1.0)
        if upd.any():
            opt = np.where(upd, 0, -1)
            keep = np.where(upd, 1.0, np.nan)
            assert plan_bytes(plain, upd, opt) == replay_bytes(
                profile, upd, keep, int(np.argmax(upd)), 1.0, False)
    for _ in range(50):  # with pruning: an upper bound for any plan
        upd = rng.random(n) < rng.uniform(0.05, 1.0)
        if upd.any():
            opt = np.where(upd, rng.integers(0, len(DEFAULT_KEEPS), n), -1)
            keep = np.where(upd, costs.keeps[np.maximum(opt, 0)], np.nan)
            assert plan_bytes(costs, upd, opt) >= replay_bytes(profile, upd, keep,
                                                               int(np.argmax(upd)))
