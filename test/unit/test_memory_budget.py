"""AdaShadow under a saved-activation memory budget (adashadow.memory_budget, issue #19):
the planning service never predicts over the budget, the engine's measured saved bytes
match the exact prediction of its plan, no budget = today's plans, bad values give
one-line errors, and `tta bench --memory-budget-mb` end to end on the shipped net."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from tta_core.adashadow import planner
from tta_core.adashadow.memory_budget import MIB, SaveCosts, profile_stages
from tta_core.adashadow.memory_costs import DEFAULT_FROZEN_KEEP, codec_plan, replay_bytes
from tta_core.adashadow.planning import PlanningConfig, PlanningService, UnitLayout
from tta_core.eval.bench_config import BenchConfig
from tta_core.eval.bench_inputs import build_stream
from tta_core.eval.bench_run import run_bench
from tta_core.memory import CodecPlan, predicted_bytes, profile_saves
from tta_core.model.source import load_card, load_model
from tta_core.model.units import decompose
from tta_core.registry import build_method

CARD = Path("checkpoints/small_resnet_signs32.json")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def stream() -> list:
    """Twelve batches of 16 of the shipped stream (a few domains)."""
    return build_stream(BenchConfig(batch_size=16, samples_per_domain=16), load_card(CARD))[:12]


def _model() -> torch.nn.Module:
    return load_model(load_card(CARD), CARD.parent)


def _staged(trainable_all: bool = True):
    model = _model()
    model.eval()
    model.requires_grad_(trainable_all)
    return decompose(model, (3, 32, 32))


# ------------------------------------------------------------------ planning service
def test_planner_under_a_budget_never_predicts_over_it() -> None:
    """Random importances and forward times, budgets from tight to loose: the plan's
    predicted bytes (the DP's additive M) are within the budget, and the exact codec
    replay of the same plan is never above M; a loose budget gives bigger plans."""
    staged = _staged()
    layout = UnitLayout.from_staged(staged)
    x, save_costs = torch.randn(8, 3, 32, 32), SaveCosts(staged)
    costs, profile = save_costs.costs(x), save_costs.profile(x)
    rng = np.random.default_rng(0)
    sizes: dict[float, list[int]] = {}
    for budget in (0.9, 1.5, 3.0, 50.0):
        svc = PlanningService(layout, PlanningConfig(sigma=1.0, memory_budget_mb=budget,
                                                     fixed_cost_feedback=0.0))
        for _ in range(20):
            a = rng.random(layout.n_units) * (rng.random(layout.n_units) < 0.6)
            out = svc.plan(a, float(rng.uniform(1, 20)), memory=costs, batch_size=8)
            mem = out.memory
            assert mem is not None and mem.predicted_bytes <= budget * MIB
            sizes.setdefault(budget, []).append(int(out.plan.update.sum()))
            if out.updates:
                rep = replay_bytes(profile, mem.update, mem.keep, mem.record_from)
                assert rep <= mem.predicted_bytes + 1
    assert np.mean(sizes[0.9]) < np.mean(sizes[50.0])


def test_no_budget_plans_are_the_latency_planners() -> None:
    """memory_budget_mb None: planner.solve's plan (costs passed or not), no memory plan."""
    staged = _staged()
    layout = UnitLayout.from_staged(staged)
    costs = SaveCosts(staged).costs(torch.randn(4, 3, 32, 32))
    svc = PlanningService(layout, PlanningConfig(fixed_cost_feedback=0.0))
    rng = np.random.default_rng(1)
    for _ in range(20):
        a, fwd = rng.random(layout.n_units), float(rng.uniform(1, 20))
        with_costs = svc.plan(a, fwd, memory=costs)
        plain = svc.plan(a, fwd)
        w, x, r = svc.unit_times(fwd)
        ref = planner.solve(svc._problem(w, x, r, a, fwd, 0.0))
        assert with_costs.memory is None and plain.memory is None
        np.testing.assert_array_equal(plain.plan.update, ref.update)
        np.testing.assert_array_equal(with_costs.plan.update, ref.update)


def test_too_small_a_budget_says_why_plans_stay_empty() -> None:
    staged = _staged()
    costs = SaveCosts(staged).costs(torch.randn(4, 3, 32, 32))
    svc = PlanningService(UnitLayout.from_staged(staged),
                          PlanningConfig(sigma=1.0, memory_budget_mb=1e-5))
    out = svc.plan(np.ones(len(staged.units)), 10.0, memory=costs)
    assert not out.updates and "memory budget 1e-05 MiB" in out.no_room
    with pytest.raises(ValueError, match="needs the model's memory costs"):
        svc.plan(np.ones(len(staged.units)), 10.0)


def test_stage_profile_equals_the_whole_forward_profile() -> None:
    """Profiling stage by stage (graphs freed in between) predicts the bytes of the one
    whole forward for any codec plan (all parameters trainable: every input is saved)."""
    staged = _staged(trainable_all=True)
    x = torch.randn(8, 3, 32, 32)
    whole, stages = profile_saves(staged, x, lambda o: o.logsumexp(1).mean()), \
        profile_stages(staged, x)
    assert {e.unit for e in stages.events} == {e.unit for e in whole.events}
    names = [u.name for u in staged.units]
    for plan in (CodecPlan(), CodecPlan.uniform(DEFAULT_FROZEN_KEEP),
                 codec_plan(np.arange(len(names)) % 3 == 0, np.full(len(names), 0.3), names)):
        a, b = predicted_bytes(whole, plan), predicted_bytes(stages, plan)
        # the losses differ (entropy vs logsumexp): compare everything but the last unit
        last = names[-1]
        assert {u: v for u, v in a.per_unit.items() if u != last} == \
            {u: v for u, v in b.per_unit.items() if u != last}


# ------------------------------------------------------------------ engine
@pytest.mark.parametrize("graph,trainable,budget", [
    ("lazy", "norm", 1.5), ("lazy", "all", 1.5), ("lazy", "all", 3.0),
    ("full", "norm", 1.5), ("full", "all", 3.0)])
def test_measured_bytes_match_the_plans_prediction(stream, graph: str, trainable: str,
                                                   budget: float) -> None:
    """Every batch: measured saved bytes (the codec's, in StepResult.stats) within 5 % of
    the exact prediction of what was recorded (replay_bytes on the profiled batch: lazy,
    the plan's units at their keeps from their stage on; full, every candidate dense from
    the graph floor on), at most 5 % over the predicted M (sparsity is profiled on one
    batch), and within the budget, as M is."""
    meth = build_method("adashadow", _model(), input_shape=(3, 32, 32), graph=graph,
                        sigma=1.0, trainable=trainable, memory_budget_mb=budget)
    names, start = meth.unit_names, meth.engine.staged.stage_start()
    recorded = adapted = 0
    for b in stream:
        res = meth.step(b.x)
        stats = res.stats
        assert stats["within_memory_budget"] and stats["memory_budget_mib"] == budget
        adapted += res.adapted
        keep = np.array([stats.get(f"keep:{n}", math.nan) for n in names])
        kept = np.isfinite(keep)
        if graph == "lazy":
            np.testing.assert_array_equal(kept, np.asarray(res.plan.update) & res.adapted)
        if not kept.any():
            assert stats["saved_bytes"] == 0
            continue
        recorded += 1
        rep = replay_bytes(meth.engine.tail.costs.profile(b.x), kept, keep,
                           int(start[np.argmax(kept)]))
        measured = stats["saved_bytes"]
        assert abs(measured - rep) <= 0.05 * rep, (measured, rep)
        # M is an upper bound up to the data: a pruned input's nonzero share is profiled on
        # the first batch of a shape (measured up to 0.5 % over M with robust BN)
        assert measured <= 1.05 * stats["predicted_saved_mib"] * MIB
        assert stats["predicted_saved_mib"] <= budget and measured <= budget * MIB
    assert adapted >= len(stream) // 2 and recorded >= adapted


@pytest.mark.parametrize("graph", ["lazy", "full"])
def test_the_codec_leaves_bn_updates_bit_identical(stream, graph: str) -> None:
    """Updated BN units under the codec (exact masks, dense BN inputs, frozen conv
    inputs compressed) get the very gradients of the plain recording: same weights
    (a budget that binds nowhere: the same plans)."""
    runs = []
    for budget in (None, 100.0):
        meth = build_method("adashadow", _model(), input_shape=(3, 32, 32), graph=graph,
                            sigma=1.0, memory_budget_mb=budget, backward_feedback=0.0,
                            fixed_cost_feedback=0.0,  # plans from the cost model only
                            memory_format="contiguous")  # "auto" times formats: may differ
        for b in stream[:4]:
            meth.step(b.x)
        runs.append([p.detach().clone() for p in meth.collect_params()])
    assert all(torch.equal(p, q) for p, q in zip(*runs, strict=True))


@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf, "10", True])
def test_bad_memory_budget_values_raise_one_line(value: object) -> None:
    with pytest.raises(ValueError, match="memory_budget_mb must be") as err:
        build_method("adashadow", _model(), input_shape=(3, 32, 32), graph="lazy",
                     memory_budget_mb=value)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="memory_budget_mb must be"):
        PlanningConfig(memory_budget_mb=value).validate()  # type: ignore[arg-type]


# ------------------------------------------------------------------ bench
@pytest.mark.slow
def test_bench_memory_budget_end_to_end(tmp_path: Path) -> None:
    """`tta bench --memory-budget-mb` on the shipped net: adashadow (lazy and full graph)
    holds the budget on every batch; tent (no budget option) is metered against it. At
    sigma 1 (the whole update's time): plans that time leaves empty would save nothing."""
    cfg = BenchConfig(methods=("tent", "adashadow", "adashadow@lazy"), batch_size=8,
                      samples_per_domain=8, memory_budget_mb=1.5,
                      method_options={"adashadow": {"sigma": 1.0},
                                      "adashadow@lazy": {"graph": "lazy", "sigma": 1.0}})
    res = run_bench(cfg, tmp_path, progress=False)
    runs = {r.method: r for r in res.runs}
    assert "memory_budget_mb" not in runs["tent"].meta["options"]
    for name in ("adashadow", "adashadow@lazy"):
        ada = runs[name].meta
        assert ada["options"]["memory_budget_mb"] == 1.5
        saved = ada["saved_activations"]
        assert saved["budget_mib"] == 1.5 and saved["within_budget_share"] == 1.0
        assert max(saved["saved_mib"]) <= 1.5 and saved["reported_mib_mean"] > 0
    tent = runs["tent"].meta["saved_activations"]
    assert tent["saved_mib_mean"] > 1.5 and tent["within_budget_share"] == 0.0
    assert "in mem budget %" in res.markdown
    report = json.loads((tmp_path / "report.json").read_text())
    assert report


def test_bench_rejects_a_bad_budget() -> None:
    with pytest.raises(ValueError, match="memory_budget_mb must be"):
        BenchConfig(memory_budget_mb=-2).validate()


def test_budget_from_free_memory() -> None:
    from tta_core.adashadow.memory_budget import budget_from_free

    assert budget_from_free(None, 0.0, 500.0) is None  # share 0: off
    assert budget_from_free(2.0, 0.0, 500.0) == 2.0
    assert budget_from_free(None, 0.5, 500.0) == 250.0
    assert budget_from_free(100.0, 0.5, 500.0) == 100.0  # the tighter of the two
    assert budget_from_free(100.0, 0.5, math.nan) == 100.0  # no (fresh) telemetry
    assert budget_from_free(None, 0.5, -20.0) == 1e-3  # nothing free: nothing fits
    with pytest.raises(ValueError, match="free share must be in"):
        budget_from_free(None, 1.5, 500.0)


