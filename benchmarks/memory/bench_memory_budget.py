"""Memory-budgeted AdaShadow against tent, surgeon and plain adashadow (issue #19 acceptance).

Per model (torchvision ResNet-50 224 px batch 4, ResNet-18 224 px batch 8; random weights,
1000 classes; one fixed random batch), a fresh model per method config:
  tent              BN affine, entropy, SGD
  surgeon           faithful mode (importance pass, Eqs. 4-7, codec)
  surgeon_robot     robot mode (lagged gradient importance)
  adashadow         defaults (graph "full", sigma 0.33)
  adashadow_budget  + memory_budget_mb = --budget-share x tent's measured MiB (full graph:
                    the graph floor is raised to the lowest stage whose recording fits)
  adashadow_lazy_budget  the same budget in graph "lazy" (units and keep ratios planned
                    on both budgets, the tail re-run under the codec)
  adashadow_s1*     the same three at sigma 1 (a latency budget of a full update: the
                    memory budget is what binds)
  adashadow_s1_all_lazy_budget  sigma 1, lazy, budget, every unit trainable (conv and fc
                    weights too: the DP picks keep ratios of their dW inputs; keep_min)
Figures, from one run:
  saved_mib   what autograd held for backward during one step (after warm-up steps):
              a SavedActivationCounter around the step (storages deduplicated, parameters
              excluded) + what a method's own codec reports (surgeon, adashadow with a
              budget: stats["saved_bytes"]; the innermost hooks win, the two never overlap)
  peak_saved_mib  surgeon: max(adaptation pass, importance pass); else = saved_mib
  peak_rss_over_start_mib  VmHWM of the step minus the RSS at its start (peaks reset before
              it; glibc serves blocks >= 64 KiB by mmap, so freed tensors leave the RSS)
  ms          median step time over round-robin interleaved repeats (every config hit by
              the same contention drifts); ratios to tent from the same run. Timed with
              the runtime's malloc setting (tta_core.runtime.malloc_tuning: freed memory
              kept, no page faults per step, as bench_daf); the 64 KiB mmap threshold of
              the peak-RSS phase made every step page-fault its activations (tent 1593 vs
              ~1060 ms on ResNet-50), charging memory-heavy methods for the measurement
  adapted / units  share of the timed steps that updated, mean units updated (adashadow)
Goal: adashadow_budget saved_ratio <= 0.35 and time_ratio <= 0.5.
Usage: python benchmarks/memory/bench_memory_budget.py [--repeats 5] [--threads 1]
       [--budget-share 0.3] [--quick]   (prints JSON; --quick: 112 px, half the batch)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, results
import harness
import psutil
import torch
from torch import nn
from torchvision.models import resnet18, resnet50

from tta_core.memory import SavedActivationCounter, memory_peaks, reset_peaks
from tta_core.memory.ledger import MIB
from tta_core.registry import build_method
from tta_core.runtime.malloc_tuning import keep_freed_memory

WARMUP = 3  # steps before measuring: AdaShadow learns its forward time, robot its keeps


def _configs(px: int, arch: str, budget_mib: float) -> dict[str, tuple[str, dict]]:
    ada = {"input_shape": (3, px, px), "arch": arch}
    lazy, budget = {"graph": "lazy"}, {"memory_budget_mb": budget_mib}
    s1 = {**ada, "sigma": 1.0}
    return {
        "tent": ("tent", {}),
        "surgeon": ("surgeon", {}),
        "surgeon_robot": ("surgeon", {"mode": "robot"}),
        "adashadow": ("adashadow", ada),
        "adashadow_budget": ("adashadow", {**ada, **budget}),
        "adashadow_lazy_budget": ("adashadow", {**ada, **lazy, **budget}),
        "adashadow_s1": ("adashadow", s1),
        "adashadow_s1_budget": ("adashadow", {**s1, **budget}),
        "adashadow_s1_lazy_budget": ("adashadow", {**s1, **lazy, **budget}),
        "adashadow_s1_all_lazy_budget": ("adashadow", {**s1, **lazy, **budget,
                                                       "trainable": "all"}),
    }


def _make(arch: str) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        torch.manual_seed(0)
        return (resnet18 if arch == "resnet18" else resnet50)(num_classes=1000)
    return make


def _measure(meth, x: torch.Tensor) -> dict:
    """Saved MiB (hooks + the method's codec), peak saved MiB and peak RSS of one step."""
    counter = SavedActivationCounter(meth.model)
    resettable = reset_peaks()
    start = psutil.Process().memory_info().rss
    with counter:
        res = meth.step(x)
    meth.finish()
    rss = memory_peaks().rss_bytes
    stats = res.stats
    saved = (counter.result.total + float(stats.get("saved_bytes", 0))) / MIB
    row = {"saved_mib": round(saved, 2),
           "peak_saved_mib": round(max(saved, stats.get("peak_saved_bytes", 0) / MIB), 2),
           "peak_rss_over_start_mib": round((rss - start) / MIB, 1) if resettable else None}
    if "predicted_saved_mib" in stats:
        row["predicted_saved_mib"] = round(float(stats["predicted_saved_mib"]), 2)
        row["budget_mib"] = round(float(stats["memory_budget_mib"]), 2)
        keeps = [v for k, v in stats.items() if k.startswith("keep:")]
        if keeps:
            row["keep_min"], row["keep_mean"] = min(keeps), round(statistics.mean(keeps), 3)
    return row


def _tent_saved_mib(make: Callable[[], nn.Module], x: torch.Tensor) -> float:
    """Tent's measured saved MiB on this batch (what the budget is a share of)."""
    tent = build_method("tent", make())
    tent.step(x)
    return _measure(tent, x)["saved_mib"]


def _timed(meths: dict, x: torch.Tensor, repeats: int) -> dict[str, list]:
    """Round-robin step times (ms, the step and its finish) and (adapted, units updated)
    per config."""
    seen: dict[str, list] = {k: [] for k in meths}

    def step(meth):
        res = meth.step(x)
        meth.finish()
        return res

    times = harness.round_robin(
        {k: (lambda m=m: step(m)) for k, m in meths.items()}, repeats, warmup=0,
        on_result=lambda k, res, _: seen[k].append((res.adapted, res.units_updated)))
    return {k: [(ms, *s) for ms, s in zip(times[k].ms, seen[k], strict=True)] for k in meths}


def bench_model(arch: str, px: int, batch: int, repeats: int, share: float) -> dict:
    make = _make(arch)
    x = torch.randn((batch, 3, px, px), generator=torch.Generator().manual_seed(0))
    budget = round(share * _tent_saved_mib(make, x), 2)
    meths = {k: build_method(name, make(), **opts)
             for k, (name, opts) in _configs(px, arch, budget).items()}
    rows: dict[str, dict] = {}
    for key, meth in meths.items():
        for _ in range(WARMUP):
            meth.step(x)
        rows[key] = _measure(meth, x)
    keep_freed_memory()  # timing as the runtime runs: freed memory stays in the heap
    times = _timed(meths, x, repeats)
    keep_freed_memory(1 << 16)  # the next model's peaks: freed tensors leave the RSS
    tent_ms = statistics.median(t[0] for t in times["tent"])
    for key, row in rows.items():
        ms = statistics.median(t[0] for t in times[key])
        row.update(ms=round(ms, 1), time_ratio=round(ms / tent_ms, 3),
                   saved_ratio=round(row["saved_mib"] / rows["tent"]["saved_mib"], 3),
                   adapted=statistics.mean(float(t[1]) for t in times[key]),
                   units=statistics.mean(t[2] for t in times[key]))
    ok = rows["adashadow_budget"]["saved_ratio"] <= 0.35 and \
        rows["adashadow_budget"]["time_ratio"] <= 0.5
    return {"arch": arch, "input": [batch, 3, px, px], "budget_mib": budget,
            "goal_met": ok, "configs": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--budget-share", type=float, default=0.3,
                    help="adashadow_budget's memory budget as a share of tent's saved MiB")
    ap.add_argument("--quick", action="store_true", help="112 px, half the batch")
    ap.add_argument("--models", default="resnet50,resnet18")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    mmap = keep_freed_memory(1 << 16)  # freed tensors leave the RSS: peaks track live memory
    scale = 2 if args.quick else 1
    shapes = {"resnet50": (224 // scale, 4 // scale), "resnet18": (224 // scale, 8 // scale)}
    out = {"models": [bench_model(a, *shapes[a], args.repeats, args.budget_share)
                      for a in args.models.split(",")],
           "meta": {"threads": args.threads, "repeats": args.repeats, "warmup": WARMUP,
                    "budget_share": args.budget_share, "torch": torch.__version__,
                    "device": "cpu", "malloc_mmap_64k": mmap, "quick": args.quick}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
