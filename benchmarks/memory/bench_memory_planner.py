"""Solve time and discretisation loss of the latency + memory planner on ResNet-50.

Memory costs come from a measured save profile of torchvision ResNet-50 (random weights,
train-mode BN, entropy loss, every parameter trainable; --px, --batch) through
adashadow.memory_costs (codec: exact ReLU masks, frozen conv inputs at keep 0.01, keep
options 1/0.5/0.3/0.1); per-unit times are MAC-proportional (planning.mac_profile), forward
40 ms. "synthetic-160" tiles the same units to 160 (the size the issue names). Per
(sigma, memory budget as a fraction of the all-units-dense bytes, n_m): median solve ms over
--repeats random importances, and the objective relative to an n_m = 1024 solve of the same
instance (rounding loses < 1 memory step per updated unit). Latency-only planner.solve
timed for reference. Usage: python benchmarks/memory/bench_memory_planner.py [--repeats 5]
Prints JSON. Timings on a shared machine are contended: compare within one run.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

import numpy as np
import torch

from tta_core.adashadow import planner
from tta_core.adashadow.memory_costs import memory_costs
from tta_core.adashadow.memory_planner import MemoryCosts, plan_bytes, solve_with_memory
from tta_core.adashadow.planning import UnitLayout, mac_profile
from tta_core.memory import profile_saves
from tta_core.model.units import decompose
from tta_core.model.zoo import build_model


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    """Mean prediction entropy (the adaptation loss whose saves the profile includes)."""
    p = logits.softmax(1)
    return -(p * logits.log_softmax(1)).sum(1).mean()


def _resnet50(px: int, batch: int) -> tuple[planner.PlanProblem, MemoryCosts]:
    """ResNet-50 plan problem (MAC times) and profile-measured memory costs."""
    torch.manual_seed(0)
    model = build_model("resnet50", 10).train()
    staged = decompose(model, (3, px, px), arch="resnet50")
    costs = memory_costs(profile_saves(staged, torch.randn(batch, 3, px, px), _entropy))
    layout = UnitLayout.from_staged(staged)
    prof = mac_profile(layout, 40.0, batch)
    n = layout.n_units
    problem = planner.PlanProblem(prof.w_ms, prof.x_ms, prof.r_ms, layout.stage_start,
                                  np.ones(n), 40.0, 0.5)
    return problem, costs


def _tile(problem: planner.PlanProblem, costs: MemoryCosts, n: int
          ) -> tuple[planner.PlanProblem, MemoryCosts]:
    """The instance's units repeated up to n (stages renumbered, record per unit)."""
    idx = np.arange(n) % len(problem.w)
    ss = np.asarray(problem.stage_start)
    starts = np.concatenate([ss + k * len(ss) for k in range(math.ceil(n / len(ss)))])[:n]
    tiled = planner.PlanProblem(problem.w[idx], problem.x[idx], problem.r[idx], starts,
                                np.ones(n), problem.forward_ms, problem.sigma)
    return tiled, MemoryCosts(costs.x_bytes[idx], costs.w_bytes[idx], costs.keeps,
                              costs.fidelity)


def _rows(name: str, problem: planner.PlanProblem, costs: MemoryCosts, repeats: int,
          n_ms: list[int]) -> list[dict]:
    """Timing and objective-vs-fine-grid rows for every (sigma, budget, n_m)."""
    n = len(problem.w)
    full = plan_bytes(costs, np.ones(n, dtype=bool), np.zeros(n, dtype=np.int64))
    rng = np.random.default_rng(1)
    out = []
    for sigma in (0.33, 1.0):
        problem.sigma = sigma
        for frac in (0.3, 0.5, 0.7):
            imps = [rng.exponential(1.0, n) for _ in range(repeats)]
            ref = []
            for a in imps:
                problem.importance = a
                ref.append(solve_with_memory(problem, costs, frac * full, n_m=1024).objective)
            for n_m in n_ms:
                ms, rel = [], []
                for a, best in zip(imps, ref, strict=True):
                    problem.importance = a
                    plan = solve_with_memory(problem, costs, frac * full, n_m=n_m)
                    ms.append(plan.solve_ms)
                    rel.append(plan.objective / best if best > 0 else 1.0)
                out.append({"instance": name, "units": n, "sigma": sigma, "budget_frac": frac,
                            "n_m": n_m, "median_ms": round(statistics.median(ms), 2),
                            "objective_vs_1024": round(min(rel), 3)})
    lat = [planner.solve(problem).solve_ms for _ in range(repeats)]
    out.append({"instance": name, "units": n, "latency_only_median_ms":
                round(statistics.median(lat), 2)})
    return out


def main() -> None:
    """Parse arguments, run both instances, print JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--px", type=int, default=112)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    problem, costs = _resnet50(args.px, args.batch)
    rows = _rows("resnet50", problem, costs, args.repeats, [32, 64, 128, 256])
    big, big_costs = _tile(problem, costs, 160)
    rows += _rows("synthetic-160", big, big_costs, args.repeats, [64, 128])
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
