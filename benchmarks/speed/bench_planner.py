"""Planner solve time on ResNet-50-sized problems (goal: <= 5 ms median at N_T = 500).

The unit list and stage structure come from tta_core.model.units.decompose(torchvision resnet50)
(107 units); per-unit times follow a roofline model t = MACs/F + bytes/b_cache, scaled so
the forward pass takes --forward-ms. Each solve draws fresh random importances (some zero).
Also reports the optimality gap of the DP vs brute force on 12-unit sub-problems.
Usage: python benchmarks/speed/bench_planner.py [--solves 200] [--sigma 0.5]
Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, results
import harness
import numpy as np
import torch

from tta_core.adashadow.planner import PlanProblem, brute_force, solve


def _resnet50_problem(forward_ms: float, sigma: float) -> tuple[PlanProblem, str]:
    try:
        from torchvision.models import resnet50

        from tta_core.model.units import decompose
    except ImportError:  # units.py not available: synthetic 107 units in 18 stages
        n = 107
        rng = np.random.default_rng(0)
        macs = rng.uniform(1e6, 2e8, n)
        ss = np.repeat(np.arange(0, n, 6), 6)[:n]
        fwd = macs / macs.sum() * forward_ms
        return PlanProblem(fwd, fwd, fwd, ss, np.ones(n), forward_ms, sigma), "synthetic"
    staged = decompose(resnet50(), (3, 224, 224), "resnet50")
    units = staged.units
    f, bw = 1e11, 2e10
    def roofline(macs: list[int]) -> np.ndarray:
        return np.array([m / f for m in macs]) + np.array([u.bytes_moved / bw for u in units])
    fwd = roofline([u.macs_fwd for u in units])
    scale = forward_ms / fwd.sum()
    w = roofline([u.macs_dw for u in units]) * scale
    x = roofline([u.macs_dx for u in units]) * scale
    problem = PlanProblem(w, x, fwd * scale, staged.stage_start(), np.ones(len(units)),
                          forward_ms, sigma)
    return problem, "resnet50 via tta_core.model.units.decompose"


def _random_importance(rng: np.random.Generator, n: int) -> np.ndarray:
    a = rng.exponential(0.05, n)
    a[rng.random(n) < 0.2] = 0.0
    return a


def _time_solves(problem: PlanProblem, n_solves: int, n_t: int) -> dict:
    rng = np.random.default_rng(1)
    times, n_sel, used = [], [], []
    for _ in range(n_solves):
        problem.importance = _random_importance(rng, len(problem.w))
        ms, plan = harness.timed(lambda: solve(problem, n_t=n_t))
        times.append(ms)
        n_sel.append(int(plan.update.sum()))
        used.append(plan.predicted_total_ms / plan.budget_ms)
    t = np.array(times)
    return {
        "solve_ms_median": float(np.median(t)), "solve_ms_p90": float(np.percentile(t, 90)),
        "solve_ms_min": float(t.min()), "units_selected_median": float(np.median(n_sel)),
        "budget_used_median": float(np.median(used)),
    }


def _gap_vs_brute_force(problem: PlanProblem, trials: int, n_t: int) -> dict:
    rng = np.random.default_rng(2)
    n = len(problem.w)
    gaps, dp_ms, bf_ms = [], [], []
    for _ in range(trials):
        lo = int(rng.integers(0, n - 12))
        sub = slice(lo, lo + 12)
        ss = np.maximum(problem.stage_start[sub] - lo, 0)
        p = PlanProblem(problem.w[sub], problem.x[sub], problem.r[sub], ss,
                        _random_importance(rng, 12), problem.forward_ms * 0.1, problem.sigma)
        dp, bf = solve(p, n_t=n_t), brute_force(p, n_t=n_t)
        gaps.append(bf.objective - dp.objective)
        dp_ms.append(dp.solve_ms)
        bf_ms.append(bf.solve_ms)
    return {"subproblems": trials, "max_gap": float(np.max(np.abs(gaps))),
            "dp_ms_median": float(np.median(dp_ms)), "brute_ms_median": float(np.median(bf_ms))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--solves", type=int, default=200)
    ap.add_argument("--sigma", type=float, default=0.5)
    ap.add_argument("--n-t", type=int, default=500)
    ap.add_argument("--forward-ms", type=float, default=100.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    problem, source = _resnet50_problem(args.forward_ms, args.sigma)
    solve(problem, n_t=args.n_t)  # warm-up
    result = {"units": len(problem.w), "source": source, "n_t": args.n_t, "sigma": args.sigma}
    result.update(_time_solves(problem, args.solves, args.n_t))
    result["vs_brute_force_n12"] = _gap_vs_brute_force(problem, 20, args.n_t)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
