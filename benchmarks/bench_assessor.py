"""Assessor overhead in % of the forward pass (goal: <= 5 %).

torchvision resnet50 (random weights, eval mode, no_grad), batch 4 at 224 px, CPU threads
fixed. Variants, each timed interleaved with the plain forward (median over --runs):
  * var_mean:  hooks on every Conv2d/BatchNorm2d/Linear, one torch.var_mean per output;
  * bn_kernel: the same hooks, tta_core.assessor.channel_stats (BN statistics kernel);
  * fused:     one statistics pass per Conv->BN pair (see tta_core.assessor.StatsRecorder);
each followed by Assessor.step (importance + EMA). Also: per-unit vs flat KL cost.
Usage: python benchmarks/bench_assessor.py [--runs 10] [--threads 2]
Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn
from torchvision.models import resnet50

from tta_core.assessor import Assessor, StatsRecorder, channel_stats, gaussian_kl

_UNIT_TYPES = (nn.Conv2d, nn.BatchNorm2d, nn.Linear)


def _var_mean_stats(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    var, mean = torch.var_mean(out, dim=[d for d in range(out.ndim) if d != 1], correction=0)
    return mean, var


class _NaiveHooks:
    """A forward hook per unit computing `stats_fn(output)`."""

    def __init__(self, model: nn.Module, stats_fn: Callable) -> None:
        self.units = [m for m in model.modules() if isinstance(m, _UNIT_TYPES)]
        self.stats: list = [None] * len(self.units)
        self._handles = [m.register_forward_hook(self._hook(i, stats_fn))
                         for i, m in enumerate(self.units)]

    def _hook(self, i: int, stats_fn: Callable) -> Callable:
        def hook(_m: nn.Module, _args: tuple, out: torch.Tensor) -> None:
            self.stats[i] = stats_fn(out)
        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _overheads(model: nn.Module, x: torch.Tensor, runs: int) -> dict:
    units = [m for m in model.modules() if isinstance(m, _UNIT_TYPES)]
    variants: dict[str, tuple[Callable, Callable]] = {}
    for name, fn in (("var_mean", _var_mean_stats), ("bn_kernel", channel_stats)):
        hooks, assessor = _NaiveHooks(model, fn), Assessor(len(units))
        variants[name] = (hooks, assessor)
        hooks.remove()
    recorder, fused_assessor = StatsRecorder(units), Assessor(len(units))
    times: dict[str, list[float]] = {"plain": [], **{k: [] for k in (*variants, "fused")}}
    with torch.no_grad():
        for rep in range(runs + 1):
            plain = _timed(lambda: model(x))
            for name, (hooks, assessor) in variants.items():
                hooks.__init__(model, _var_mean_stats if name == "var_mean" else channel_stats)
                ms = _timed(lambda h=hooks, a=assessor: (model(x), a.step(h.stats)))
                hooks.remove()
                times[name].append(ms)
            with recorder.attach():
                ms = _timed(lambda: (model(x), fused_assessor.step(recorder.stats())))
            times["fused"].append(ms)
            if rep > 0:  # first round is warm-up
                times["plain"].append(plain)
            else:
                for v in times.values():
                    v.clear()
    plain_med = statistics.median(times["plain"])
    out = {"forward_ms_median": plain_med, "units": len(units)}
    for name in (*variants, "fused"):
        med = statistics.median(times[name])
        out[f"{name}_ms_median"] = med
        out[f"{name}_overhead_pct"] = 100.0 * (med - plain_med) / plain_med
    return out


def _kl_layouts(model: nn.Module, x: torch.Tensor, reps: int = 50) -> dict:
    """Per-unit KL loop vs one flat KL + segment sum (Assessor's layout), same stats."""
    units = [m for m in model.modules() if isinstance(m, _UNIT_TYPES)]
    hooks = _NaiveHooks(model, channel_stats)
    with torch.no_grad():
        model(x)
        hist = [(m.clone(), v.clone()) for m, v in hooks.stats]
        model(x * 1.1)
    hooks.remove()
    cur = hooks.stats
    assessor = Assessor(len(units))
    assessor.update_history(hist)

    def per_unit() -> np.ndarray:
        return np.array([gaussian_kl(h[0], h[1], c[0], c[1]).mean().item()
                         for h, c in zip(hist, cur, strict=True)])

    loop = [_timed(per_unit) for _ in range(reps)]
    flat = [_timed(lambda: assessor.importance(cur)) for _ in range(reps)]
    same = np.allclose(per_unit(), assessor.importance(cur), rtol=1e-4)
    return {"per_unit_loop_ms": statistics.median(loop), "flat_ms": statistics.median(flat),
            "agree": bool(same), "channels": int(sum(m.numel() for m, _ in cur))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = resnet50().eval()
    x = torch.randn(args.batch, 3, 224, 224)
    result = {"model": "resnet50", "batch": args.batch, "threads": args.threads,
              "runs": args.runs}
    result.update(_overheads(model, x, args.runs))
    result["importance_layout"] = _kl_layouts(model, x)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
