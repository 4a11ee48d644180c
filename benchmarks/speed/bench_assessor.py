"""Assessor overhead in % of the forward pass (goal: <= 5 %).

torchvision resnet50 (random weights, eval mode, no_grad), batch 4 at 224 px, CPU threads
fixed (default 1: the machine is shared, so thread CPU time is reported next to wall time).
Variants, each timed interleaved with the plain forward (median over --runs):
  * var_mean:      hooks on every Conv2d/BatchNorm2d/Linear, one torch.var_mean per output;
  * bn_kernel:     the same hooks, aten.batch_norm_update_stats per output;
  * channel_stats: the same hooks, tta_core.adashadow.assessor.channel_stats (guarded one-pass);
  * fused:         channel_stats once per Conv->BN pair (tta_core.adashadow.assessor.StatsRecorder);
each followed by Assessor.step (importance + EMA). Also: per-unit vs flat KL cost, and
  * engine:        what the AdaShadow engine runs (BN on batch statistics, Conv->BN pair
                   stats carried by the BN itself, tta_core.runtime.unit_stats), vs the
                   same forward.
Usage: python benchmarks/speed/bench_assessor.py [--runs 10] [--threads 1]
Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, results
import harness
import numpy as np
import torch
from torch import nn
from torchvision.models import resnet50

from tta_core.adashadow.assessor import Assessor, StatsRecorder
from tta_core.model.norms import set_bn_mode
from tta_core.model.units import decompose
from tta_core.runtime.stats import gaussian_kl
from tta_core.runtime.unit_stats import UnitStatsCollector

_UNIT_TYPES = (nn.Conv2d, nn.BatchNorm2d, nn.Linear)


def _var_mean_stats(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    var, mean = torch.var_mean(out, dim=[d for d in range(out.ndim) if d != 1], correction=0)
    return mean, var


def _bn_kernel_stats(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean, var = torch.ops.aten.batch_norm_update_stats(out, None, None, 0.0)
    return mean, var


class _FnRecorder(StatsRecorder):
    """StatsRecorder without fusion whose statistics come from `fn` (reference variants)."""

    def __init__(self, modules: list[nn.Module], fn: Callable) -> None:
        super().__init__(modules, fuse_bn=False)
        self.fn = fn

    def _hook(self, i: int, mod: nn.Module) -> Callable:
        def hook(_m: nn.Module, _args: tuple, out: torch.Tensor) -> None:
            self._stats[i] = self.fn(out)
        return hook


def _overheads(model: nn.Module, x: torch.Tensor, runs: int) -> dict:
    units = [m for m in model.modules() if isinstance(m, _UNIT_TYPES)]
    recorders = {
        "var_mean": _FnRecorder(units, _var_mean_stats),
        "bn_kernel": _FnRecorder(units, _bn_kernel_stats),
        "channel_stats": StatsRecorder(units, fuse_bn=False),
        "fused": StatsRecorder(units, fuse_bn=True),
    }
    assessors = {name: Assessor(len(units)) for name in recorders}

    def with_assessor(name: str) -> None:
        with recorders[name].attach():
            model(x)
        assessors[name].step(recorders[name].stats())

    cases = {"plain": lambda: model(x),
             **{n: (lambda n=n: with_assessor(n)) for n in recorders}}
    with torch.no_grad():  # one warm-up round
        t = harness.round_robin(cases, runs, clocks=("wall", "cpu"))
    med = {k: (v.stats("wall")["median"], v.stats("cpu")["median"]) for k, v in t.items()}
    out = {"units": len(units), "forward_ms_median": med["plain"][0],
           "forward_cpu_ms_median": med["plain"][1]}
    for name in recorders:
        out[f"{name}_ms_median"] = med[name][0]
        out[f"{name}_overhead_pct"] = 100.0 * (med[name][0] / med["plain"][0] - 1.0)
        out[f"{name}_cpu_overhead_pct"] = 100.0 * (med[name][1] / med["plain"][1] - 1.0)
    return out


def _kl_layouts(model: nn.Module, x: torch.Tensor, reps: int = 50) -> dict:
    """Per-unit KL loop vs one flat KL + segment sum (Assessor's layout), same stats."""
    units = [m for m in model.modules() if isinstance(m, _UNIT_TYPES)]
    rec = StatsRecorder(units, fuse_bn=False)
    with torch.no_grad():
        with rec.attach():
            model(x)
        hist = rec.stats()
        with rec.attach():
            model(x * 1.1)
        cur = rec.stats()
    assessor = Assessor(len(units))
    assessor.update_history(hist)

    def per_unit() -> np.ndarray:
        return np.array([gaussian_kl(h[0], h[1], c[0], c[1]).mean().item()
                         for h, c in zip(hist, cur, strict=True)])

    loop = harness.repeat(per_unit, reps, warmup=0)
    flat = harness.repeat(lambda: assessor.importance(cur), reps, warmup=0)
    same = np.allclose(per_unit(), assessor.importance(cur), rtol=1e-4)
    return {"per_unit_loop_ms": loop.median, "flat_ms": flat.median,
            "agree": bool(same), "channels": int(sum(m.numel() for m, _ in cur))}


def _engine_overhead(x: torch.Tensor, runs: int) -> dict:
    """What AdaShadow's engine pays: BN-carried stats for Conv->BN pairs
    (tta_core.runtime.unit_stats) + hooks on the rest + Assessor.step, vs the same forward
    (BN on batch statistics)."""
    torch.manual_seed(0)
    model = resnet50()
    set_bn_mode(model, "batch")
    staged = decompose(model, tuple(x.shape[1:]), "resnet50")
    collector = UnitStatsCollector(staged, with_grad=False)
    assessor = Assessor(len(staged.units))

    def assessed() -> None:
        collector.capture = True
        model(x)
        collector.capture = False
        assessor.step(collector.collect(x.shape[0]))

    def plain() -> None:
        collector.capture = False
        model(x)

    with torch.no_grad():  # one warm-up round
        t = harness.round_robin({"plain": plain, "engine": assessed}, runs,
                                clocks=("wall", "cpu"))
    pw, pc = t["plain"].stats("wall")["median"], t["plain"].stats("cpu")["median"]
    ew, ec = t["engine"].stats("wall")["median"], t["engine"].stats("cpu")["median"]
    collector.close()
    return {"pairs": len(collector.pairs), "units": len(staged.units),
            "forward_batch_bn_ms_median": pw, "engine_stats_ms_median": ew,
            "engine_overhead_pct": 100.0 * (ew / pw - 1.0),
            "engine_cpu_overhead_pct": 100.0 * (ec / pc - 1.0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
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
    result["engine"] = _engine_overhead(x, args.runs)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
