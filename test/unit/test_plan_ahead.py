"""AdaShadow where the forward is fast: the reforward restarts at the first updated unit
(its stage-mates before it replayed), and the plan is made between batches (plan_ahead),
so neither the assessor nor the DP is on the answer's path. Timing runs on an injected
clock: the regime forward ~ plan phase, with no wall-clock assertion."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers.models import assert_replay_skips_units

from tta_core.adashadow import planner
from tta_core.adashadow.engine import AdaShadowEngine, EngineConfig
from tta_core.adashadow.planning import PlanningService, UnitLayout
from tta_core.model.norms import set_bn_mode
from tta_core.model.units import StagedModel, decompose
from tta_core.model.zoo import build_model

torch.set_num_threads(2)


def _staged(arch: str, size: int) -> StagedModel:
    torch.manual_seed(0)
    model = build_model(arch, 10)
    set_bn_mode(model, "batch")
    return decompose(model, (3, size, size))


class FakeClock:
    """A PhaseClock on a counter the test advances (ms)."""

    cuda = False

    def __init__(self) -> None:
        self.t = [0.0]
        self._last = 0.0

    def now(self) -> float:
        return self.t[0] / 1e3

    def mark(self) -> float:
        ms, self._last = self.t[0] - self._last, self.t[0]
        return ms

    def advance(self, ms: float) -> None:
        self.t[0] += ms


@pytest.mark.parametrize("arch,size", [("resnet18", 64), ("small_resnet", 32),
                                       ("mobilenet_v2", 64)])
def test_restart_inside_a_stage_equals_the_full_forward_and_skips_the_replayed(
        arch: str, size: int) -> None:
    """forward_from(stage of d, its input, outputs of the units before d) == model(x), and
    the replayed units' modules do not run; torchvision's in-place ReLU after a BN makes
    that BN not replayable (its kept output was overwritten), and d's restart falls back
    to the stage start only where a non-norm unit before it cannot replay."""
    staged = _staged(arch, size)
    staged.model.eval()
    x = torch.randn(2, 3, size, size)
    outs, ins = {}, {}
    hooks = [u.module.register_forward_hook(
        lambda _m, _a, o, i=u.index: outs.__setitem__(i, o)) for u in staged.units]
    hooks += [st.module.register_forward_pre_hook(
        lambda _m, a, s=st.index: ins.__setitem__(s, a[0])) for st in staged.stages[1:]]
    with torch.no_grad():
        full = staged.model(x)
    for h in hooks:
        h.remove()
    ins[0] = x
    restart, stage_start = staged.restart_start(), staged.stage_start()
    inside = [d for d in range(len(staged.units)) if restart[d] > stage_start[d]]
    assert inside, "no unit restarts inside its stage"
    if arch == "resnet18":  # BasicBlock: relu(bn1(.)) in place, out += identity on bn2's
        bn1 = next(u for u in staged.units if u.name == "layer1.0.bn1")
        assert not bn1.replayable
    for d in inside:
        unit = staged.units[d]
        first = staged.stages[unit.stage].first_unit
        replay = {u: outs[u] for u in range(first, d) if staged.units[u].replayable}
        assert_replay_skips_units(staged, unit.stage, ins[unit.stage], replay, full)


def test_the_planner_counts_the_reforward_from_the_unit_when_it_replays() -> None:
    """The cost model's reuse boundary: with restart a late unit's plan costs the
    reforward from it, without it from its stage's first unit (the engine keeps no unit
    outputs under a codec)."""
    staged = _staged("small_resnet", 32)
    fine, coarse = (UnitLayout.from_staged(staged, restart=r) for r in (True, False))
    d = len(staged.units) - 2  # the last BN of the last block
    assert coarse.stage_start[d] < d == fine.stage_start[d]
    eng = AdaShadowEngine(staged, EngineConfig(activation_bits=4))
    assert not eng.replays and np.array_equal(eng.planning.layout.stage_start,
                                              coarse.stage_start)
    eng.close()


def _engine(plan_ahead: bool, clock: FakeClock, forward_ms: float, plan_ms: float,
            sigma: float = 0.33) -> AdaShadowEngine:
    """small_resnet whose forward costs `forward_ms` and whose assessor + DP cost
    `plan_ms` on the fake clock, per-unit times MAC-shaped and scaled by the forward."""
    staged = _staged("small_resnet", 32)
    eng = AdaShadowEngine(staged, EngineConfig(sigma=sigma, plan_ahead=plan_ahead,
                                               sigma_margin=False, bn_mode="batch"))
    eng.clock = clock
    staged.model.register_forward_hook(lambda *_a: clock.advance(forward_ms)
                                       if eng._collector.capture else None)
    step, solve = eng.assessor.step, eng.planning.plan

    def slow_step(stats):
        clock.advance(plan_ms / 2)
        return step(stats)

    def slow_plan(*a, **k):
        clock.advance(plan_ms / 2)
        return solve(*a, **k)
    eng.assessor.step, eng.planning.plan = slow_step, slow_plan
    return eng


def test_plan_ahead_takes_the_plan_phase_off_the_answers_path() -> None:
    """Forward 1 ms, assessor + DP 1 ms (the fast-forward regime, P > 0.46 F): planned
    inline, the plan phase is on the path and no unit fits sigma*T; planned ahead, the
    answer's plan phase is the loss alone, the assessor and DP run in `idle` (post_ms of
    the batch before), and batches adapt."""
    xs = [torch.randn(4, 3, 32, 32) * (1 + 0.2 * i) for i in range(12)]
    adapted, phase = {}, {}
    for ahead in (False, True):
        clock = FakeClock()
        eng = _engine(ahead, clock, forward_ms=1.0, plan_ms=1.0)
        results = []
        for x in xs:
            results.append(eng.step(x))
            eng.idle()
        adapted[ahead] = sum(r.adapted for r in results[2:])
        phase[ahead] = eng.planning.fixed.plan_phase_ms
        if ahead:
            # between batches: the assessor and the DP (1 ms), or the DP alone after a
            # batch served without statistics (batch 0 has no history: batch 1 is inline)
            posts = [r.times.post_ms for r in results[3:]]
            assert all(p == pytest.approx(1.0) or p == pytest.approx(0.5) for p in posts)
            assert sum(p == pytest.approx(1.0) for p in posts) >= 6
            assert all(r.times.plan_ms < 0.5 for r in results[2:])
            for r in results[2:]:  # the answer's time excludes the work between batches
                assert r.times.total_ms == pytest.approx(
                    r.times.forward_ms + r.times.plan_ms + r.times.backward_ms
                    + r.times.reforward_ms)
        eng.close()
    assert adapted[False] == 0 and phase[False] == pytest.approx(1.0, rel=0.05)
    assert adapted[True] >= 8 and phase[True] < 0.5


def test_a_plan_made_ahead_is_the_one_the_next_batch_runs() -> None:
    """The plan a batch runs is the DP's solution from the importance after the batch
    before (no solve during the step), and its forward records the autograd graph from
    the plan's first stage only."""
    clock = FakeClock()
    eng = _engine(True, clock, forward_ms=10.0, plan_ms=0.1, sigma=0.6)
    xs = [torch.randn(4, 3, 32, 32) * (1 + 0.3 * i) for i in range(7)]
    eng.step(xs[0])  # no history yet: planned inline, as is the next one
    eng.idle()
    eng.step(xs[1])
    xs = xs[1:]
    solves: list[planner.Plan] = []
    solve = planner.solve
    try:
        planner.solve = lambda problem, n_t=planner.DEFAULT_N_T: solves.append(
            solve(problem, n_t)) or solves[-1]
        for x in xs[1:]:
            eng.idle()  # the next batch's plan: one solve
            assert len(solves) == 1
            made = solves.pop()
            grad: dict[int, bool] = {}
            hs = [st.module.register_forward_pre_hook(
                lambda _m, a, s=st.index, grad=grad: grad.__setitem__(s, a[0].requires_grad)
                if eng._collector.capture else None) for st in eng.staged.stages[1:]]
            res = eng.step(x)
            for h in hs:
                h.remove()
            assert not solves  # nothing solved on the answer's path
            assert np.array_equal(res.plan.update, made.update)
            if res.adapted:
                first = eng.staged.units[res.plan.first_updated].stage
                assert all(not g for s, g in grad.items() if s <= first)
                assert grad.get(first + 1, True)  # recorded from the plan's stage on
    finally:
        planner.solve = solve
    eng.close()


def test_refit_scales_sigma_t_with_the_measured_forward_and_empties_a_late_deadline() -> None:
    staged = _staged("small_resnet", 32)
    svc = PlanningService(UnitLayout.from_staged(staged))
    imp = np.where(svc.layout.trainable("norm"), 1.0, 0.0)
    out = svc.plan(imp, 4.0, batch_size=4)
    assert out.updates
    slow = svc.refit(out, 6.0, 4)
    assert np.array_equal(slow.plan.update, out.plan.update)
    assert slow.plan.full_ms == pytest.approx(out.plan.full_ms * 1.5)
    assert slow.plan.budget_ms == pytest.approx(0.33 * slow.plan.full_ms)
    svc.config.deadline_mode, svc.config.deadline_ms = "fixed", out.plan.predicted_total_ms * 1.1
    dl = svc.plan(imp, 4.0, batch_size=4)
    assert dl.updates and dl.plan.predicted_total_ms <= svc.config.deadline_ms
    late = svc.refit(dl, 8.0, 4)
    assert not late.updates and "no longer fits" in late.no_room
    assert math.isfinite(late.plan.budget_ms)


def test_no_room_names_the_sigma_at_which_a_unit_fits() -> None:
    """Where no unit fits, the diagnostic names the least sigma that fits the cheapest
    one-unit plan, and planning at that sigma does update."""
    staged = _staged("small_resnet", 32)
    svc = PlanningService(UnitLayout.from_staged(staged, restart=False))
    svc.fixed.plan_ms = svc.fixed.adapt_ms = 1.5  # a plan phase and update cost ~ forward
    svc.fixed.plan_updates = svc.fixed.adapt_updates = 5
    imp = np.where(svc.layout.trainable("norm"), 1.0, 0.0)
    out = svc.plan(imp, 2.0, batch_size=4)
    assert not out.updates and "sigma >=" in out.no_room
    least = float(out.no_room.split("sigma >= ")[1].split()[0].rstrip(","))
    svc.config.sigma = min(1.0, least * 1.02)
    assert svc.plan(imp, 2.0, batch_size=4).updates
